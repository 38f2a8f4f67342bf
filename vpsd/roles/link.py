"""What a role's worker sees of the transport: messages and tensors to and from the other roles, by role name.

A worker (the target's RemoteDrafter, engine/drafters/remote.py; roles/draft.py, roles/pruner.py) never touches a
socket or a process group: it sends and receives through a `Link`, and a driver loop feeds it the messages. Two carriers:

- `RankLink`, the job's: ZeroMQ control messages and torch.distributed tensors, through the rank's
  RoleContext, with its liveness rules (a silent peer ends the wait in a RoleFailure naming it).
- `MemoryLink`, for tests: every role in one process. Each message still goes through the msgpack wire format
  (encode on send, decode on receive), and tensors are copied, so a worker under test speaks exactly the
  protocol it speaks between ranks; only the carrier differs. Ordering is what ZeroMQ promises and no more:
  FIFO per sender, and with a `shuffle` generator a receive from any role takes the next message of a sender
  picked at random (between ranks, a pruner's answer can overtake the target's JobStart that caused it).
  Single-threaded: a receive with nothing queued raises `Idle`, and the test's scheduler runs another worker.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Protocol, Sequence

import torch

from vpsd.pipeline.messages import Message, TensorAnnounce, decode, encode
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.transport.tensors import dtype_name


class Pending(Protocol):
    """A tensor send on its way: `wait` until the receiver has it (or the transport gives up)."""

    def wait(self, timeout_s: float | None = None) -> None: ...

    def is_completed(self) -> bool: ...


class Link(Protocol):
    role: str
    rank: int  # named in Error messages

    def send(self, dst: str, msg: Message) -> None: ...

    def send_tensors(self, dst: str, tensors: Sequence[torch.Tensor], tag: str, epoch: int = 0, item_id: str = "",
                     names: Sequence[str] = ()) -> Pending: ...

    def poll(self, src: str | None = None, timeout_s: float = 0.0) -> bool:
        """Whether a message from `src` (any role if None) is ready, waiting up to `timeout_s` for one."""

    def recv(self, src: str | None = None, limit_s: float | None = None) -> tuple[str, Message]:
        """The next message from `src` (any role if None) and its sender's role; waits for it."""

    def recv_tensors(self, announce: TensorAnnounce) -> list[torch.Tensor]: ...

    def wait(self, src: str | None = None) -> None:
        """Block until a message from `src` (any role if None) is ready."""


def recv_announced(link: Link, src: str, tag: str) -> list[torch.Tensor]:
    """The tensors a message just received from `src` said would follow: the next message from it must announce
    them under `tag` (a sender sends the two back to back, and each sender's messages arrive in order)."""
    _, announce = link.recv(src)
    if not isinstance(announce, TensorAnnounce) or announce.tag != tag:
        got = announce.tag if isinstance(announce, TensorAnnounce) else type(announce).__name__
        raise RoleFailure(f"{link.role}: expected {src}'s {tag!r} tensors, got {got}")
    return link.recv_tensors(announce)


class RankLink:
    """The job's carrier: a RoleContext's control channel and tensor channel, addressed by role."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.role, self.rank = ctx.role, ctx.rank
        self._roles = {rank: role for role, rank in ctx.ranks.items()}

    def send(self, dst: str, msg: Message) -> None:
        self.ctx.send(dst, msg)

    def send_tensors(self, dst: str, tensors: Sequence[torch.Tensor], tag: str, epoch: int = 0, item_id: str = "",
                     names: Sequence[str] = ()) -> Pending:
        return self.ctx.tensors.send(self.ctx.ranks[dst], tensors, tag=tag, epoch=epoch, item_id=item_id, names=names)

    def poll(self, src: str | None = None, timeout_s: float = 0.0) -> bool:
        return self.ctx.ctrl.poll(timeout_s, src=self.ctx.peers if src is None else self.ctx.ranks[src])

    def recv(self, src: str | None = None, limit_s: float | None = None) -> tuple[str, Message]:
        rank, msg = self.ctx.recv(src, timeout_s=limit_s)
        # The item a failure is reported on: the last one a message named (the launcher sets it on the target).
        self.ctx.item_id = getattr(msg, "item_id", None) or self.ctx.item_id
        return self._roles.get(rank, str(rank)), msg

    def recv_tensors(self, announce: TensorAnnounce) -> list[torch.Tensor]:
        return self.ctx.tensors.recv_announced(announce)

    def wait(self, src: str | None = None) -> None:
        self.ctx.wait(src)


class Idle(RuntimeError):
    """A MemoryLink receive found nothing queued: in one process, waiting would wait forever."""


class _Sent:
    def wait(self, timeout_s: float | None = None) -> None:
        pass  # copied into the receiver's queue already

    def is_completed(self) -> bool:
        return True


class MemoryHub:
    """The queues of every role in one process; `link(role)` is that role's end."""

    def __init__(self, roles: Sequence[str], shuffle: random.Random | None = None) -> None:
        self.shuffle = shuffle
        self.inbox: dict[str, deque[tuple[str, bytes]]] = {r: deque() for r in roles}
        self.tensors: dict[tuple[str, str], deque[list[torch.Tensor]]] = {}
        self.rank = {r: i for i, r in enumerate(roles)}
        self.sent = 0  # messages sent, all roles: a scheduler's sign of progress

    def link(self, role: str) -> "MemoryLink":
        return MemoryLink(self, role)


class MemoryLink:
    def __init__(self, hub: MemoryHub, role: str) -> None:
        self.hub, self.role, self.rank = hub, role, hub.rank[role]

    def send(self, dst: str, msg: Message) -> None:
        self.hub.inbox[dst].append((self.role, encode(msg)))
        self.hub.sent += 1

    def send_tensors(self, dst: str, tensors: Sequence[torch.Tensor], tag: str, epoch: int = 0, item_id: str = "",
                     names: Sequence[str] = ()) -> Pending:
        wire = [t.detach().clone().contiguous() for t in tensors]
        self.send(dst, TensorAnnounce(tag=tag, shapes=[list(t.shape) for t in wire],
                                      dtypes=[dtype_name(t.dtype) for t in wire], src=self.hub.rank[self.role],
                                      epoch=epoch, devices=["cpu"] * len(wire), item_id=item_id, names=list(names)))
        self.hub.tensors.setdefault((self.role, dst), deque()).append(wire)
        return _Sent()

    def _find(self, src: str | None) -> int | None:
        heads: dict[str, int] = {}  # each sender's oldest message
        for i, (sender, _) in enumerate(self.hub.inbox[self.role]):
            if (src is None or sender == src) and sender not in heads:
                heads[sender] = i
        if not heads:
            return None
        if self.hub.shuffle is None or src is not None:
            return min(heads.values())
        return heads[self.hub.shuffle.choice(sorted(heads))]

    def poll(self, src: str | None = None, timeout_s: float = 0.0) -> bool:
        return self._find(src) is not None  # one thread: nothing can arrive while it waits

    def recv(self, src: str | None = None, limit_s: float | None = None) -> tuple[str, Message]:
        i = self._find(src)
        if i is None:
            raise Idle(f"{self.role}: nothing queued from {src or 'any role'}")
        inbox = self.hub.inbox[self.role]
        sender, data = inbox[i]
        del inbox[i]
        return sender, decode(data)

    def recv_tensors(self, announce: TensorAnnounce) -> list[torch.Tensor]:
        src = next(r for r, k in self.hub.rank.items() if k == announce.src)
        wire = self.hub.tensors[(src, self.role)].popleft()
        if [list(t.shape) for t in wire] != announce.shapes:
            raise RuntimeError(f"{self.role}: tensors from {src} do not match their announce {announce.tag}")
        return wire

    def wait(self, src: str | None = None) -> None:
        if not self.poll(src):
            raise Idle(f"{self.role}: waiting for {src or 'any role'} with nothing queued")

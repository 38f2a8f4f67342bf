"""A third carrier for the role protocol: every role of a pipeline in one process, each on a thread of its own.

The draft and the pruner of a parallel method usually run on ranks of their own (`RankLink`). On one GPU that
means three processes whose kernels the GPU time-slices; in one process they can share the GPU through streams
instead, the draft's forwards (one graph launch each, when captured) barely holding the GIL while the target's
run. `ThreadLink` carries exactly the protocol `RankLink` does, so the same workers run unchanged:
- messages go through the msgpack wire format (encoded on send, decoded on receive), FIFO per sender;
- tensors are copied on send (a sender may reuse its buffers, as after a gloo send). On a GPU the copy is stamped
  with an event on the sender's stream, and the receiver's stream waits on that event before it uses the copy
  (and the allocator is told the copy is used there), so no receiver reads a tensor its sender has not written;
- a wait blocks on a condition (no polling) and ends in a `RoleFailure` naming the awaited role when that role's
  thread died (`fail`, called by the thread that runs it) or after `idle_timeout_s` of nothing.
Threads share nothing else: each worker owns its state, as on its rank.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Sequence

import torch

from vpsd.pipeline.messages import Message, TensorAnnounce, decode, encode
from vpsd.roles.context import RoleFailure
from vpsd.transport.tensors import dtype_name


class ThreadHub:
    """The queues of every role of one pipeline in this process; `link(role)` is that role's end."""

    def __init__(self, roles: Sequence[str], idle_timeout_s: float = 3600.0) -> None:
        self.rank = {r: i for i, r in enumerate(roles)}
        self.idle_timeout_s = idle_timeout_s
        self._cond = threading.Condition()
        self._inbox: dict[str, deque[tuple[str, bytes]]] = {r: deque() for r in roles}
        self._tensors: dict[tuple[str, str], deque] = {}
        self._failed: dict[str, str] = {}

    def link(self, role: str) -> "ThreadLink":
        return ThreadLink(self, role)

    def fail(self, role: str, error: BaseException) -> None:
        """`role`'s thread died with `error`: every wait on it (and any other) ends naming it."""
        with self._cond:
            self._failed[role] = f"{type(error).__name__}: {error}"
            self._cond.notify_all()


class ThreadLink:
    def __init__(self, hub: ThreadHub, role: str) -> None:
        self.hub, self.role, self.rank = hub, role, hub.rank[role]

    def send(self, dst: str, msg: Message) -> None:
        data = encode(msg)
        with self.hub._cond:
            self.hub._inbox[dst].append((self.role, data))
            self.hub._cond.notify_all()

    def send_tensors(self, dst: str, tensors: Sequence[torch.Tensor], tag: str, epoch: int = 0, item_id: str = "",
                     names: Sequence[str] = ()) -> "_Handed":
        wire = [t.detach().clone().contiguous() for t in tensors]
        ready = None
        if any(t.is_cuda for t in wire):
            ready = torch.cuda.Event()
            ready.record()  # on the sender's stream, after the copies
        announce = TensorAnnounce(tag=tag, shapes=[list(t.shape) for t in wire],
                                  dtypes=[dtype_name(t.dtype) for t in wire], src=self.rank, epoch=epoch,
                                  devices=[t.device.type for t in wire], item_id=item_id, names=list(names))
        with self.hub._cond:  # the tensors first: the receiver takes them when it reads the announce
            self.hub._tensors.setdefault((self.role, dst), deque()).append((wire, ready))
        self.send(dst, announce)
        return _Handed()

    def recv_tensors(self, announce: TensorAnnounce) -> list[torch.Tensor]:
        src = next(r for r, k in self.hub.rank.items() if k == announce.src)
        with self.hub._cond:
            wire, ready = self.hub._tensors[(src, self.role)].popleft()
        if [list(t.shape) for t in wire] != announce.shapes:
            raise RoleFailure(f"{self.role}: tensors from {src} do not match their announce {announce.tag!r}")
        if ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(ready)
            for t in wire:
                if t.is_cuda:
                    t.record_stream(stream)
        return wire

    def poll(self, src: str | None = None, timeout_s: float = 0.0) -> bool:
        with self.hub._cond:
            return self.hub._cond.wait_for(lambda: self._find(src) is not None or self._failure() is not None,
                                           timeout=max(0.0, timeout_s)) and self._failure() is None

    def recv(self, src: str | None = None, limit_s: float | None = None) -> tuple[str, Message]:
        self.wait(src, limit_s)
        with self.hub._cond:
            i = self._find(src)
            sender, data = self.hub._inbox[self.role][i]
            del self.hub._inbox[self.role][i]
        return sender, decode(data)

    def wait(self, src: str | None = None, limit_s: float | None = None) -> None:
        limit = self.hub.idle_timeout_s if limit_s is None else limit_s
        deadline = time.monotonic() + limit
        with self.hub._cond:
            while self._find(src) is None:
                failure = self._failure()
                if failure is not None:
                    raise RoleFailure(f"{self.role}: the {failure[0]} thread failed: {failure[1]}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RoleFailure(f"{self.role}: waited {limit:.0f} s for {src or 'any role'}; it sent nothing")
                self.hub._cond.wait(remaining)

    def _find(self, src: str | None) -> int | None:
        for i, (sender, _) in enumerate(self.hub._inbox[self.role]):
            if src is None or sender == src:
                return i
        return None

    def _failure(self) -> tuple[str, str] | None:
        return next(((r, e) for r, e in self.hub._failed.items() if r != self.role), None)


class _Handed:
    def wait(self, timeout_s: float | None = None) -> None:
        pass  # in the receiver's queue already

    def is_completed(self) -> bool:
        return True

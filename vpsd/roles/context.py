"""What every role loop is handed: its rank, the transport, the run configuration, the peers' ranks.

Roles talk only through `ctrl` (ZeroMQ control messages) and `tensors` (torch.distributed), never by
importing each other. Every blocking wait goes through `recv`, which turns silence into a PeerTimeout
naming the role and the item, so a dead or hung peer ends the job instead of hanging it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vpsd.config import RunConfig
from vpsd.pipeline.messages import Message
from vpsd.pipeline.methods import Method
from vpsd.transport.control import ControlChannel, PeerTimeout
from vpsd.transport.tensors import TensorChannel

ROLES = ("target", "draft", "pruner")


@dataclass
class RoleContext:
    rank: int
    role: str
    ranks: dict[str, int]  # role -> rank
    ctrl: ControlChannel
    tensors: TensorChannel
    config: RunConfig
    method: Method
    timeout_s: float = 60.0
    item_id: str = ""  # the item in flight, for error messages
    extra: dict = field(default_factory=dict)

    def recv(self, src_role: str | None = None, timeout_s: float | None = None) -> tuple[int, Message]:
        src = None if src_role is None else self.ranks[src_role]
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self.ctrl.recv(timeout_s=wait, src=src)
        except PeerTimeout as e:
            raise RoleFailure(
                f"{self.role} (rank {self.rank}) heard nothing from "
                f"{src_role or 'any peer'} for {wait:.0f} s while on item {self.item_id or '-'}"
            ) from e

    def send(self, dst_role: str, msg: Message) -> None:
        self.ctrl.send(self.ranks[dst_role], msg)


class RoleFailure(RuntimeError):
    """A role cannot go on (peer silent, protocol broken); the message names role, peer and item."""

"""What every role loop is handed: its rank, the transport, the run configuration, the peers' ranks.

Roles talk only through `ctrl` (ZeroMQ control messages) and `tensors` (torch.distributed), never by
importing each other. Every blocking wait goes through `wait` / `recv`: the wait ends in a RoleFailure naming
the awaited role, its rank and the item as soon as that peer has been silent (not even a heartbeat: every
rank sends them from a thread, ControlChannel.start_heartbeat) for `timeout_s`, so a dead or stopped peer
ends the job within the timeout. A peer that is alive but stuck (its heartbeats say it has been in one phase,
a prefill, a verify, a draft step, a pruning, far longer than such work took in this job: vpsd/activity.py)
is named too, within that limit; a peer alive and busy but not in a phase (between items, reading a video)
is waited for up to the wait's own limit (`idle_timeout_s` by default). Start-up has its own bound
(`startup_timeout_s`): a peer never heard from yet, or one loading its models, is waited for that long.
A wait on "any peer" is on the pipeline's roles only: what the job's coordinator sends is the launcher's to
take (launch/job.py), whenever it looks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from vpsd.activity import START, stuck_limit
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
    idle_timeout_s: float = 3600.0  # the default limit of a wait on a live peer
    startup_timeout_s: float = 600.0  # a peer never heard from yet, or loading its models, is waited for this long
    job_id: str = ""
    out: Path | None = None  # the run directory (kept-token log), when the job has one
    item_id: str = ""  # the item in flight, for error messages
    started: float = field(default_factory=time.monotonic)  # when the role's transport was up

    def wait(self, src_role: str | None = None, limit_s: float | None = None, awaiting: str | None = None) -> None:
        """Block until a message from `src_role` (any peer if None) is ready.

        RoleFailure when the awaited peer (`awaiting`, default `src_role`) has been silent for `timeout_s`, or
        after `limit_s` (default `idle_timeout_s`) of waiting on a peer that is alive.
        """
        src = self.peers if src_role is None else self.ranks[src_role]
        awaiting = awaiting or src_role
        limit = float(limit_s if limit_s is not None else self.idle_timeout_s)
        deadline = time.monotonic() + limit
        step = min(self.timeout_s, 1.0)
        while not self.ctrl.poll(max(0.0, min(step, deadline - time.monotonic())), src=src):
            watched = [self.ranks[awaiting]] if awaiting else [r for k, r in self.ranks.items() if k != self.role]
            try:
                self.ctrl.check_alive(watched, self.timeout_s, unheard_s=self.startup_timeout_s)
            except PeerTimeout as e:
                raise RoleFailure(
                    f"{self.role} (rank {self.rank}) heard nothing from {e.role or 'a peer'} (rank {e.rank}) for "
                    f"{e.waited_s:.0f} s while on item {self.item_id or '-'}: it is stopped, hung or dead",
                    silent_rank=e.rank,
                ) from None
            for rank in watched:
                self.check_not_stuck(rank)
            if time.monotonic() >= deadline:
                raise RoleFailure(
                    f"{self.role} (rank {self.rank}) waited {limit:.0f} s for {awaiting or 'any peer'} while on item "
                    f"{self.item_id or '-'}; it is alive but sent nothing"
                )

    def check_not_stuck(self, rank: int) -> None:
        """RoleFailure naming `rank` when its heartbeats say it has been in one phase past `stuck_limit`."""
        got = self.ctrl.doing(rank)
        if got is None or not got[0].phase:
            return
        beat, age = got
        busy = beat.busy_s + age
        if busy <= stuck_limit(beat.typical_s, self.timeout_s, self.idle_timeout_s, beat.phase, self.startup_timeout_s):
            return
        peer = next((k for k, r in self.ranks.items() if r == rank), beat.role)
        if beat.phase == START:
            raise RoleFailure(f"{self.role} (rank {self.rank}): {peer} (rank {rank}) has been loading its models for "
                              f"{busy:.0f} s, past the start-up bound ({self.startup_timeout_s:.0f} s, "
                              f"--startup-timeout): it is stuck, or needs a longer bound", silent_rank=rank)
        measured = (f"such {beat.phase} work took at most {beat.typical_s:.2f} s in this job" if beat.typical_s > 0
                    else f"none had finished yet, and idle_timeout_s is {self.idle_timeout_s:.0f} s")
        raise RoleFailure(f"{self.role} (rank {self.rank}): {peer} (rank {rank}) has been in {beat.phase} of item "
                          f"{beat.item or '-'} for {busy:.0f} s; {measured}: it is stuck", silent_rank=rank)

    def recv(self, src_role: str | None = None, timeout_s: float | None = None,
             awaiting: str | None = None) -> tuple[int, Message]:
        """The next message from `src_role` (any peer if None), waited for as `wait` says (`timeout_s`: its limit)."""
        self.wait(src_role, timeout_s, awaiting)
        return self.ctrl.recv(timeout_s=0.0, src=self.peers if src_role is None else self.ranks[src_role])

    @property
    def peers(self) -> frozenset[int]:
        """The ranks of this role's pipeline, itself excepted: whom "any peer" means."""
        return frozenset(r for r in self.ranks.values() if r != self.rank)

    def send(self, dst_role: str, msg: Message) -> None:
        self.ctrl.send(self.ranks[dst_role], msg)


class RoleFailure(RuntimeError):
    """A role cannot go on (peer silent, protocol broken); the message names role, peer and item.
    `silent_rank`: the peer that fell silent, when that is the cause."""

    def __init__(self, message: str, silent_rank: int | None = None) -> None:
        super().__init__(message)
        self.silent_rank = silent_rank

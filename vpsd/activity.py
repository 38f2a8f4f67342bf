"""What this rank's role is doing now, and how long such work has taken so far in this job.

A peer that is alive (its heartbeat thread beats) may still be stuck: its role's thread waits on something that
never comes, or spins. Heartbeats say what that thread is doing (`ACTIVITY.report()`: the phase it is in, the
item, the size of the work, for how long), and how long the same phase has taken so far in this job, per unit
of size (the most seconds a token or row took). The waiting peer then names a stuck one (roles/context.py):
its current work has run past `STUCK_FACTOR` times what such work took here, and past --timeout, or, before
anything was measured, past `idle_timeout_s`.

Phases: "start" (loading, and growing, the role's models: bounded by the start-up bound, `startup_timeout_s`, not by
what other work took), "prefill" (the target's vision and prefill, the draft's pruned prefill; size: tokens),
"verify" (a target forward of the round; size: rows of the batch), "draft" (a draft forward; rows), "prune" (the
pruner's selection; video tokens). `doing(phase, item, size)` marks one on the role's thread; work on other threads
(prefill-ahead) is not the role's, and is not reported.

Test hooks (the stuck rule's tests through real ranks; never set outside tests): VPSD_TEST_HANG=<role>:<phase>:<n>
makes that role's n-th such phase block forever, VPSD_TEST_SLOW=<role>:<phase>:<n>:<seconds> makes it take that
much longer and go on. They name a point inside a phase (`passing(point)`, e.g. the target's "signals-sent") the
same way: the streaming test stalls the target's prefill there, so what must overlap it has seconds to, not a race.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator

PHASES = ("start", "prefill", "verify", "draft", "prune")
START = "start"
STUCK_FACTOR = 10.0


@dataclass(frozen=True)
class Report:
    phase: str  # "" when the role's thread is in none of the phases (waiting for a message, between items)
    item: str
    busy_s: float  # how long it has been at it
    typical_s: float  # what such work took at most so far in this job, scaled to this one's size (0: never done)


class Activity:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._current: tuple[str, str, int, float] | None = None  # phase, item, size, since
        self._per_unit: dict[str, float] = {}  # phase -> the most seconds a unit of size took
        self._count: dict[str, int] = {}
        self.role = ""

    def own(self, role: str) -> None:
        """The calling thread is the role's: its phases are what heartbeats report."""
        self._owner, self.role = threading.get_ident(), role

    @contextlib.contextmanager
    def doing(self, phase: str, item: str = "", size: int = 1) -> Iterator[None]:
        if threading.get_ident() != self._owner:
            yield
            return
        size = max(1, int(size))
        start = time.monotonic()
        with self._lock:
            self._current = (phase, item, size, start)
            self._count[phase] = self._count.get(phase, 0) + 1
            n = self._count[phase]
        _hang_if_asked(self.role, phase, n)
        try:
            yield
        finally:
            took = (time.monotonic() - start) / size
            with self._lock:
                self._current = None
                self._per_unit[phase] = max(self._per_unit.get(phase, 0.0), took)

    def passing(self, point: str) -> None:
        """The role's thread passes a named point inside a phase: only the test hooks act on it."""
        if threading.get_ident() != self._owner:
            return
        with self._lock:
            self._count[point] = self._count.get(point, 0) + 1
            n = self._count[point]
        _hang_if_asked(self.role, point, n)

    def report(self) -> Report:
        with self._lock:
            if self._current is None:
                return Report("", "", 0.0, 0.0)
            phase, item, size, since = self._current
            return Report(phase, item, time.monotonic() - since, self._per_unit.get(phase, 0.0) * size)


def stuck_limit(typical_s: float, timeout_s: float, idle_timeout_s: float, phase: str = "",
                startup_timeout_s: float = 600.0) -> float:
    """How long a phase may run before its rank is called stuck: STUCK_FACTOR times what such work took in this
    job, and never less than --timeout; before anything was measured, idle_timeout_s. Starting (loading the
    models) has the start-up bound."""
    if phase == START:
        return startup_timeout_s
    return max(timeout_s, STUCK_FACTOR * typical_s) if typical_s > 0 else idle_timeout_s


def _hang_if_asked(role: str, phase: str, n: int) -> None:
    if os.environ.get("VPSD_TEST_HANG") == f"{role}:{phase}:{n}":
        while True:  # the test's stuck role: alive (its heartbeat thread beats), never done
            time.sleep(1.0)
    slow = os.environ.get("VPSD_TEST_SLOW", "").rpartition(":")
    if slow[0] == f"{role}:{phase}:{n}":
        time.sleep(float(slow[2]))  # the test's slow role: it takes long, then goes on


ACTIVITY = Activity()
doing = ACTIVITY.doing

"""How long a job of a few items takes, from each item's prefill and rounds (pure: no model, no clock).

A tune's confirming jobs run its sample, a handful of items: at B = 8 one or two batches. Such a job is mostly its
ramp and its tail, which a steady-state bound (App. C's per-token time, or `max((P + D) / cores, D)` over a
batch) does not see: the first round waits for the first prefill, the last items decode in a thin batch. So the
job is played out as the engine runs it (engine/prefill_ahead.py):

- B = 1: one item after another, its prefill then its rounds (nothing is prefilled ahead at batch 1);
- B > 1: a prefill thread prepares the items in order, each in its one-core prefill time; the decode thread admits
  every prepared item while a slot is free, and runs a round of the items in flight, in `round_s(b)` for b of
  them, each item advancing one of its rounds; while nothing is in flight, or the batch is under half full and
  the next item is not ready, the decode thread prefills the last item nobody has started (`steal_if_thin`). On
  one core there is no prefill thread: the decode thread prefills every item itself.
- a draft on a rank of its own (a pipelined batch): the draft rank starts each admitted item in turn (its side of
  the prefill and its first window, `draft_start_s`), and an item is verified only once its first window has come;
  a round counts the items it verifies.

What it leaves out: the threads' contention for the cores' memory bandwidth beside each other, the tail's lent
cores (`lend_cores_when_drained`), and a pipelined window's first rounds, chosen before any acceptance is measured
(pipeline/cost.py ParallelWindow: the longest window where verifying is the bottleneck), which a job of one batch
is mostly made of; the tune's first `ar` job calibrates what the jobs add (predict.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ItemWork:
    prefill_s: float  # its vision and prefill (and its draft's, where that runs in turn) on one core
    rounds: int  # decode rounds it takes
    decode_s: float  # its rounds' time when it decodes alone (B = 1)
    draft_start_s: float = 0.0  # a draft rank's start of it after its admission, before its first window comes


def makespan(items: list[ItemWork], batch: int, round_s: Callable[[int], float], cores: int) -> float:
    """Seconds from the job's first prefill to its last item done (module docstring); `round_s(b)`: a round of b
    items in flight (B > 1)."""
    if batch <= 1:
        return sum(it.prefill_s + it.decode_s for it in items)
    return _batched(items, batch, round_s, prefill_thread=cores > 1)


def _batched(items: list[ItemWork], batch: int, round_s: Callable[[int], float], prefill_thread: bool) -> float:
    prefills = _Prefills(items, prefill_thread)
    n, t, admitted, done = len(items), 0.0, 0, 0  # items are admitted in order
    left: dict[int, int] = {}  # in flight: rounds left
    drafted_from: dict[int, float] = {}  # in flight: when its first window has come (a draft rank's start)
    draft_free = 0.0  # when the draft rank has started every item admitted so far
    while done < n:
        prefills.advance(t)
        while admitted < n and len(left) < batch and prefills.ready[admitted] <= t:
            if items[admitted].rounds > 0:
                left[admitted] = items[admitted].rounds
                draft_free = max(t, draft_free) + items[admitted].draft_start_s
                drafted_from[admitted] = draft_free
            else:
                done += 1
            admitted += 1
        if done == n:
            break
        thin = len(left) < max(1, batch // 2) and admitted < n and prefills.ready[admitted] > t
        if not left or thin:
            end = prefills.steal(t)
            if end is not None:
                t = end
                continue
            if not left:  # every prefill has started: wait for the next one to end
                prefills.advance(float("inf"))
                t = max(t, min(prefills.ready[admitted:]))
                continue
        verified = [i for i in left if drafted_from[i] <= t]
        if not verified:  # every item in flight waits for its first window (or a slot's next item)
            until = min(drafted_from[i] for i in left)
            prefills.advance(until)
            if admitted < n and len(left) < batch:
                until = min(until, max(t, prefills.ready[admitted]))
            t = until
            continue
        t += round_s(len(verified))
        for i in verified:
            left[i] -= 1
            if left[i] == 0:
                del left[i]
                done += 1
    return t


class _Prefills:
    """Who prefills which item, and when it is ready: the prefill thread takes the items in order, skipping those
    the decode thread took (`steal`: the last one nobody started), so a thread's start times follow from its
    earlier items alone and are settled lazily, up to the time asked (`advance`)."""

    def __init__(self, items: list[ItemWork], thread: bool) -> None:
        self.items, self.thread = items, thread
        self.ready = [float("inf")] * len(items)
        self.started = [False] * len(items)
        self.thread_free, self.next_on_thread = 0.0, 0

    def advance(self, until: float) -> None:
        while self.thread and self.next_on_thread < len(self.items) and self.thread_free <= until:
            i = self.next_on_thread
            self.next_on_thread += 1
            if self.started[i]:  # the decode thread took it
                continue
            self.started[i] = True
            self.thread_free += self.items[i].prefill_s
            self.ready[i] = self.thread_free

    def steal(self, now: float) -> float | None:
        """The decode thread prefills the last item not started, from `now`; when it ends, or None."""
        self.advance(now)
        for i in range(len(self.items) - 1, -1, -1):
            if not self.started[i]:
                self.started[i] = True
                self.ready[i] = now + self.items[i].prefill_s
                return self.ready[i]
        return None

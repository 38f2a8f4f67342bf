"""The next items, read (and at batch > 1 prefilled) ahead on a thread of their own, in manifest order.

The thread is pinned to the draft's cores when the config pins roles: where the draft runs in the target's
process those cores are free, and a pipelined batch's draft rank leaves them mostly idle between its short
forwards. So a joining item costs the batch its join, not its vision and prefill. Two items more than the free
slots are prepared, so a slot that frees is taken at once, and up to a batch more while their KV cache fits the
budget beside the batch's (`room`): items leave a batch in bursts (a video's questions, answered alike, end
together), and a thread that worked ahead while the batch was full refills it at once. That depth pays only
where the thread has time to spare: on the short world at B = 8, with a video's questions prefilled together
(below), hippo ran ~11% faster with it; without that grouping the thread had none and it did not. While the
batch is under half full the decode thread
prefills too (`steal_if_thin`): it drains its batch faster than one thread can prefill when speculation makes
decoding cheap, and a half-empty batch wastes the forwards it runs. A thread that must wait for the next item
(nothing is decoding: the job's start) prefills a later one meanwhile. Once every prefill of the job has run
(the manifest's tail), the thread's cores may go to the decode thread's forwards (`lend_cores_when_drained`)
until `close`. `prepare(items, next item)` runs on either thread and must not touch the transport.

Grouping: where the launcher says which items share a video (`group_key`), a run of consecutive items with one
key is prepared as one task (at most `group_max`): `prepare(items, next item)` gets the run, so one video's
questions are prefilled together (engine/sibling_prefill.py). A run is taken whole from the source as it is
submitted, so which items share a task depends on the items' order alone.

Reading goes further ahead than preparing: `read(item)` is told of each item as it is taken from the source, and
where the items are this pipeline's alone, items are taken until `read_ahead` wait beyond those in flight, so
that readers of their own (vpsd/video/pool.py) decode several videos at once while this thread prepares the
first; `prepare` then takes the frames they read. `read` runs on the engine's thread and must not block.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, Hashable, Iterable, Protocol, TypeVar

import torch

from vpsd.models.thread_invariance import bitwise_across_threads
from vpsd.video.errors import VideoError

T = TypeVar("T")
# After a "not now" (a served pipeline, or a job's shared queue at its tail, with nothing for this one yet), a
# read-ahead is asked again this much later, not only once a slot frees: a request that arrives meanwhile is read
# (and at batch > 1 prefilled) while the batch decodes, instead of after. Each ask is one control-plane round trip
# (~0.2 ms here), at most one per round.
ASK_AGAIN_S = 0.05


def _pin_thread(cpus: list[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # this thread only
    # Below the roles in priority: on the draft's cores a pipelined batch's draft must answer a verdict at once
    # (a late chunk costs its item a round), and a prefill loses nothing by yielding for a few ms.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class ItemSource(Protocol[T]):
    def take(self, needed: bool) -> tuple[T | None, bool]:
        """(the next item or None, whether more may come). `needed`: without it a slot would stay empty; else
        it is read ahead, and a source shared by several pipelines may answer (None, True): not now."""


class ListSource(Generic[T]):
    """A job's items when this pipeline has them all to itself."""

    def __init__(self, items: Iterable[T]) -> None:
        self.items = deque(items)

    def take(self, needed: bool) -> tuple[T | None, bool]:
        item = self.items.popleft() if self.items else None
        return item, bool(self.items)


class _Task(Generic[T]):
    """A run of items prepared together, and each one's result (or error) once its `prepare` returned."""

    def __init__(self, items: list[T]) -> None:
        self.items = items
        self.results: list[Future] = [Future() for _ in items]
        self.pooled: Future | None = None  # the pool's, until it starts (a steal cancels it and runs it here)

    def run(self, prepare: Callable[[list[T], T | None], list[Any]], hint: T | None) -> None:
        stop: BaseException | None = None
        try:
            outcomes = prepare(self.items, hint)
        except BaseException as e:  # noqa: BLE001 - delivered where each result is read: future.result()
            outcomes, stop = [e] * len(self.items), (None if isinstance(e, Exception) else e)
        for future, outcome in zip(self.results, outcomes):
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        if stop is not None:  # an interrupt or an exit: every result is set (no reader waits forever), then on
            raise stop


class PrefillAhead(Generic[T]):
    def __init__(self, todo: ItemSource[T], size: int, prepare: Callable[[list[T], T | None], list[Any]],
                 cpus: list[int] | None, shared: bool = False, read: Callable[[T], None] | None = None,
                 read_ahead: int = 0, group_key: Callable[[T], Hashable | None] | None = None,
                 group_max: int = 1, room: Callable[[int], bool] | None = None) -> None:
        """todo: where the items come from, one at a time as they are needed (a job's coordinator hands them out
        as pipelines ask: launch/coordinator.py). shared: other pipelines take from the same items, so take as
        few as keep this one busy (one prepared beyond the free slots, not two, and none only to tell the draft
        which video comes next): an item one pipeline holds, another may be idle for at the job's tail. read: told
        of each item as it is taken, to start reading its video; read_ahead: items taken ahead for it (module
        docstring; not where items are shared). prepare: a run of items (one, or up to `group_max` consecutive
        ones with one `group_key`, None: never grouped) -> each one's result, or the VideoError / ValueError it
        failed with. room(n): whether n more prepared items fit beside those in flight (their KV cache: the
        scheduler's budget); None: no limit."""
        self.source, self.size, self.prepare, self.cpus, self.shared = todo, size, prepare, cpus, shared
        self.group_key, self.group_max = group_key, group_max
        self.read, self.read_ahead = read, read_ahead
        self.reserve = 1 if shared else 2
        # Deeper where `room` allows: up to a batch beyond the free slots (module docstring)
        self.deep, self.room = (self.reserve if shared else size), room
        self.queue: deque[T] = deque()  # taken from the source, not yet submitted
        self.exhausted = False  # the source has no more
        self.later: float | None = None  # when the source last said "not now" to a read-ahead
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefill", initializer=_pin_thread, initargs=(cpus,))
        self.ahead: deque[tuple[T, Future, _Task[T]]] = deque()
        self.stolen_s = 0.0  # time the decode thread spent preparing
        self.lent: tuple[set[int], int] | None = None  # the decode thread's own cores and threads, while lent

    def _take(self, needed: bool) -> T | None:
        """The next item not yet submitted, taken from the source now if need be; None: none (now)."""
        if self.queue:
            return self.queue[0]
        if self.exhausted or (not needed and self.later is not None
                                 and time.monotonic() - self.later < ASK_AGAIN_S):
            return None
        item, more = self.source.take(needed)
        self.exhausted = not more
        self.later = time.monotonic() if item is None and more else None
        if item is not None:
            self.queue.append(item)
            if self.read is not None:
                self.read(item)
        return item

    def _read_ahead(self) -> None:
        """Items taken (and their reads started) until `read_ahead` are waiting to be admitted, where they are this
        pipeline's alone."""
        while (self.read is not None and not self.shared and len(self.queue) + len(self.ahead) < self.read_ahead
               and not self.exhausted
               and not (self.later is not None and time.monotonic() - self.later < ASK_AGAIN_S)):
            item, more = self.source.take(False)
            self.exhausted = not more
            self.later = time.monotonic() if item is None and more else None
            if item is None:
                return
            self.queue.append(item)
            self.read(item)

    def _hint(self) -> T | None:
        """The item after the one being prepared, for the draft to read its video ahead (where items are shared,
        only if it was taken already)."""
        if self.queue:
            return self.queue[0]
        return None if self.shared else self._take(needed=False)

    @property
    def pending(self) -> bool:
        """Whether items are left (ask it with nothing in flight: it takes the next item if need be)."""
        return bool(self.ahead) or self._take(needed=True) is not None

    @property
    def drained(self) -> bool:
        """Every prepare of the job has run: the thread has nothing left to do."""
        return self.exhausted and not self.queue and all(future.done() for _, future, _ in self.ahead)

    def lend_cores_when_drained(self) -> int | None:
        """At the manifest's tail the prefill thread's core idles while the last items decode (9-20% of a 32-item
        job's wall at B = 8-16 on the scaled default). Once drained, the calling (decode) thread takes those cores
        and one intra-op thread each, so its forwards run on both (the scaled target's forward at B = 8 runs
        1.3-1.6x faster on two cores on the AMD machine vpsd was built on), but only where this machine's kernels
        compute the same bits on that many threads as on one (models/thread_invariance.py: measured once a
        process; on an Intel Xeon they did not, and the cores stay the prefill thread's). Returns the intra-op
        threads now, once; else None. Call it only where the
        prefill cores are otherwise idle (the draft runs in this process), not where a draft rank works on them.
        Only pinned cores are lent (`cpus`, from the config's cpu_affinity: the job was given them): unpinned, the
        extra intra-op thread competes with whatever else the machine runs, and two OpenMP threads on one free core
        spin at every barrier (a CI case beside another worker ran 3.5x its time alone)."""
        if self.lent is not None or not self.drained or not self.cpus:
            return None
        mine = os.sched_getaffinity(0)
        threads = torch.get_num_threads()
        self.lent = (mine, threads)  # asked once, lent or not
        cores = mine | set(self.cpus)
        more = threads + len(cores) - len(mine)
        if more == threads:
            return None
        # Widened before the probe: its forwards on `more` threads start this thread's intra-op (OpenMP) threads,
        # the ones its own forwards run on from then on, and each keeps the affinity this thread has as it starts.
        # Probed on this thread's one core, the lent thread shared that core with it (batched jobs 12-27% slower).
        os.sched_setaffinity(0, cores)  # this thread only
        if not bitwise_across_threads(more):
            os.sched_setaffinity(0, mine)
            return None  # outputs would move by float noise: not worth a tail's speed
        torch.set_num_threads(more)
        return torch.get_num_threads()

    def _wants_more(self, in_flight: int) -> bool:
        held, free = len(self.ahead), self.size - in_flight
        if held < free + self.reserve:
            return True
        return held < free + self.deep and (self.room is None or self.room(held + 1))

    def top_up(self, in_flight: int) -> None:
        while (self._wants_more(in_flight)
               and self._take(needed=in_flight + len(self.ahead) < self.size) is not None):
            task = _Task(self._run_of_items())
            task.pooled = self.pool.submit(task.run, self.prepare, self._hint())
            self.ahead.extend((it, future, task) for it, future in zip(task.items, task.results))
        self._read_ahead()

    def _run_of_items(self) -> list[T]:
        """The next item and those after it that share its `group_key`, taken from the source as need be."""
        items = [self.queue.popleft()]
        key = self.group_key(items[0]) if self.group_key is not None else None
        while key is not None and len(items) < self.group_max:
            nxt = self._take(needed=False)
            if nxt is None or self.group_key(nxt) != key:
                break
            items.append(self.queue.popleft())
        return items

    def next_ready(self, block: bool) -> tuple[T, Any] | None:
        """The next item in order and what `prepare` returned, if it is done (or `block`: nothing is decoding,
        so wait for it, preparing a later item on this thread meanwhile). An item that failed (VideoError,
        ValueError) comes with its error instead, and is taken off the queue; a prepared one stays first until
        `pop`."""
        if not (self.ahead and (block or self.ahead[0][1].done())):
            return None
        if block and not self.ahead[0][1].done():
            self._steal()
        it, future, _ = self.ahead[0]
        try:
            return it, future.result()
        except (VideoError, ValueError) as e:
            self.pop()
            return it, e

    def pop(self) -> None:
        self.ahead.popleft()

    def steal_if_thin(self, in_flight: int) -> bool:
        """Runs on this thread the last queued prepare that has not started, when the batch is under half full and
        the next item is not ready; True when it did. False when every one left has started or finished (the
        manifest's tail): the caller decodes what it has meanwhile (returning True there made the loop spin
        without a round, holding the GIL, so the prefill it waited for ran 10-15x slower)."""
        if not self.ahead or in_flight >= max(1, self.size // 2) or self.ahead[0][1].done():
            return False
        return self._steal()

    def _steal(self) -> bool:
        for i in range(len(self.ahead) - 1, -1, -1):
            task = self.ahead[i][2]
            if task.pooled is not None and task.pooled.cancel():
                task.pooled = None  # a cancelled future answers cancel() True again: run once
                t0 = time.perf_counter()
                task.run(self.prepare, self._hint())
                self.stolen_s += time.perf_counter() - t0
                return True
        return False

    def close(self) -> None:
        self.pool.shutdown()
        if self.lent is not None:  # the decode thread's own cores and threads again
            mine, threads = self.lent
            os.sched_setaffinity(0, mine)
            torch.set_num_threads(threads)
            self.lent = None

"""A pool of video readers: several items read at once, ahead of need, on the cores no role is pinned to, within
a memory budget for the frames read and not yet taken.

Reading a video is demuxing and decoding (PyAV releases the GIL for both) plus conversion, so N reader threads
read N videos at once while the role's own thread runs its model. What the pool guarantees:

- Order of need: reads start in the order they were asked for (`ahead`), and the budget is granted in that
  order too, so a later item never holds the memory an earlier one waits for. `take(key)` returns the value,
  asking for it first if nobody did, and re-raises in the caller what the load raised (a VideoError stays a
  per-item error). The time `take` blocks is traced as `video_wait`: the part of reading that was not hidden.
  A key being taken is needed now: it goes first and is not held back by the budget (it is not read *ahead*).
- The budget (`budget_bytes`): the bytes of every read in progress (its estimate, `estimate(key)`, asked on a
  reader before the read) and of every value read and not yet taken (`size_of(value)`) stay within it: a read
  that would exceed it waits until takes free enough. One that needs more than the whole budget (or whose size
  is unknown: `estimate` None) is read alone, once nothing else is held or being read, so it never deadlocks.
  Estimates are exact for frames (`vpsd.video.prefetch.frames_bytes`: the probe's frame count and size); a
  value larger than its estimate is held as what it is, and `peak_bytes` records the most ever counted.
- `keep_only(keys)` forgets reads that will never be taken (an item the target skipped); one already running
  finishes and is discarded.
- Placement: each reader pins itself (`os.sched_setaffinity(0, cores)`: a thread's own mask on Linux) to
  `cores`, the cores no role runs on (`spare_cores`), so decoding never competes with the role's thread (with
  none, the caller's choice, or where the thread was started: `cores` None), and runs below the roles in
  priority (nice 10).
- `map_parts(fn, parts)`: one video decoded by several readers at once (the stretches between keyframes of a
  dense read: `vpsd.video.prefetch.FramePool`, `vpsd.video.decode.split_wanted`): a load running on a reader
  hands it its parts, and idle readers take them before any new read; the caller works on them too.

Threads start at the first read asked for, so a pool that is never used (a draft whose frames the target sends:
roles/draft.py) costs nothing.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Iterable, Sequence, TypeVar

from vpsd.video.item import timed

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# The launcher's record of the cores no role of this node's pipelines is pinned to, taken before it pins this
# rank's thread (launch/entry.py start_role): after the pin this process's own mask is the role's cores only.
_SPARE: list[int] | None = None


def note_spare_cores(cores: Iterable[int]) -> None:
    """Called by the launcher before it pins the role's thread: the cores left to readers on this node."""
    global _SPARE
    _SPARE = sorted(set(cores))


def spare_cores(affinity: dict[str, list[int]] | None, allowed: Iterable[int] | None = None) -> list[int]:
    """The cores readers run on: those of this process's mask (`allowed`, default what the launcher noted, else
    this thread's mask) that `cpu_affinity` pins no role to. Empty when every core is a role's."""
    if allowed is None and _SPARE is not None:
        return list(_SPARE)
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    pinned = {c for cores in (affinity or {}).values() for c in cores}
    return sorted(allowed - pinned)


def readers_for(setting: int | None, spare: Sequence[int], read_ahead: int) -> int:
    """How many readers: `video.readers` when set; else one a spare core (at least one), no more than can be busy
    (the item being taken and `read_ahead` more)."""
    if setting is not None:
        return int(setting)
    return max(1, min(len(spare), read_ahead + 1))


def held_bytes(value: Any) -> int:
    """Bytes of the arrays in a value (an array, or a tuple / list of them and other things)."""
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, (tuple, list)):
        return sum(held_bytes(v) for v in value)
    return 0


@dataclass(eq=False)
class _Read:
    key: Any
    seq: int  # order asked
    future: Future = field(default_factory=Future)
    state: str = "queued"  # queued -> sizing -> sized -> reading -> done
    need: int = 0  # bytes counted while reading (the estimate)
    held: int = 0  # bytes counted once read, until taken
    counted: bool = False  # its bytes are in the pool's count
    urgent: bool = False  # being taken: needed now
    dropped: bool = False


class ReaderPool(Generic[K, V]):
    def __init__(self, load: Callable[[K], V], *, readers: int = 1, budget_bytes: int | None = None,
                 estimate: Callable[[K], int | None] | None = None, size_of: Callable[[V], int] = held_bytes,
                 cores: Sequence[int] | None = None, name: str = "reader") -> None:
        if readers < 1:
            raise ValueError(f"a reader pool needs at least one reader, got {readers}")
        self._load, self._estimate, self._size_of = load, estimate, size_of
        self.readers, self.budget, self.name = readers, budget_bytes, name
        self.cores = sorted(cores) if cores else None
        self._cond = threading.Condition()
        self._reads: dict[K, _Read] = {}
        self._queue: deque[_Read] = deque()  # asked, no reader has it yet
        self._sized: list[_Read] = []  # sized, waiting for the budget
        self._sizing: set[_Read] = set()
        self._parts: deque[tuple[Callable, Any, Future]] = deque()
        self._seq = 0
        self._used = 0  # bytes of reads in progress and values held
        self._granted = 0  # reads in progress or held (counted)
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.peak_bytes = 0

    # ---- the caller's side --------------------------------------------------------------------------

    def ahead(self, key: K) -> None:
        """Start reading `key` unless it is already asked for."""
        with self._cond:
            self._ask(key)

    def take(self, key: K, timings: dict[str, float] | None = None, **fields: Any) -> V:
        """The value of `key` (waiting for it: traced as `video_wait`, added to `timings`); raises what the load
        raised."""
        with self._cond:
            read = self._ask(key)
            self._reads.pop(key, None)
            read.urgent = True
            if read.state == "queued":  # first in line: the next free reader takes it
                self._queue.remove(read)
                self._queue.appendleft(read)
            self._cond.notify_all()
        try:
            with timed("video_wait", timings if timings is not None else {}, **fields):
                return read.future.result()
        finally:
            with self._cond:
                read.dropped = True  # taken: whatever it held is the caller's now (a read still running: its end)
                self._release(read)

    def keep_only(self, keys: Iterable[K]) -> None:
        """Drop every read but `keys`; one already running finishes and is discarded."""
        keep = set(keys)
        with self._cond:
            for key in [k for k in self._reads if k not in keep]:
                self._drop(self._reads.pop(key))
            self._cond.notify_all()

    def map_parts(self, fn: Callable[[Any], Any], parts: Sequence[Any]) -> list[Any]:
        """[fn(p) for p in parts], run by this thread and the pool's idle readers at once (module docstring)."""
        futures = [Future() for _ in parts]
        with self._cond:
            self._parts.extend((fn, part, f) for part, f in zip(parts, futures))
            self._cond.notify_all()
        while True:
            with self._cond:
                job = self._parts.popleft() if self._parts else None
            if job is None:
                break
            _run_part(*job)
        return [f.result() for f in futures]

    @property
    def held(self) -> int:
        """Bytes counted now: reads in progress (their estimates) and values read and not yet taken."""
        return self._used

    def close(self) -> None:
        """Stops the readers once their current read ends; reads not taken are dropped."""
        with self._cond:
            self._closed = True
            for read in {*self._reads.values(), *self._queue, *self._sized}:  # and those being taken
                self._drop(read)
            self._reads.clear()
            self._cond.notify_all()

    # ---- bookkeeping (under the lock) ---------------------------------------------------------------

    def _ask(self, key: K) -> _Read:
        if self._closed:
            raise RuntimeError(f"{self.name}: the reader pool is closed")
        read = self._reads.get(key)
        if read is None:
            self._seq += 1
            read = self._reads[key] = _Read(key, self._seq)
            self._queue.append(read)
            self._start_readers()
            self._cond.notify_all()
        return read

    def _start_readers(self) -> None:
        while len(self._threads) < self.readers and not self._closed:
            thread = threading.Thread(target=self._run, name=f"{self.name}-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _drop(self, read: _Read) -> None:
        read.dropped = True
        read.future.cancel()  # a read not done yet: nobody will take it
        if read.state == "queued":
            self._queue.remove(read)
        elif read.state == "sized":
            self._sized.remove(read)
        elif read.state == "done":
            self._release(read)

    def _release(self, read: _Read) -> None:
        """A value read, taken or dropped: its bytes no longer count (a read in progress: when it ends)."""
        if read.state == "done" and read.counted:
            read.counted = False
            self._used -= read.held
            self._granted -= 1
            self._cond.notify_all()

    def _grantable(self) -> _Read | None:
        """The sized read to start now, if any: one being taken at once; else the first asked, when no read asked
        before it is still being sized and its bytes fit beside what is counted (or nothing is counted)."""
        if not self._sized:
            return None
        urgent = [r for r in self._sized if r.urgent]
        if urgent:
            return urgent[0]
        first = min(self._sized, key=lambda r: r.seq)
        if any(r.seq < first.seq for r in self._sizing):
            return None
        if self.budget is None or self._granted == 0 or self._used + first.need <= self.budget:
            return first
        return None

    def _next(self) -> tuple[str, Any] | None:
        """The next thing for a reader to do, in this order: a part, a read the budget grants, a read to size."""
        if self._closed:
            return None
        if self._parts:
            return "part", self._parts.popleft()
        read = self._grantable()
        if read is not None:
            self._sized.remove(read)
            read.state, read.counted = "reading", True
            self._used += read.need
            self._granted += 1
            self.peak_bytes = max(self.peak_bytes, self._used)
            return "read", read
        if self._queue:
            read = self._queue.popleft()
            read.state = "sizing"
            self._sizing.add(read)
            return "size", read
        return "wait", None

    # ---- a reader ---------------------------------------------------------------------------------

    def _run(self) -> None:
        self._place()
        while True:
            with self._cond:
                while (job := self._next()) is not None and job[0] == "wait":
                    self._cond.wait()
            if job is None:
                return
            kind, what = job
            if kind == "part":
                _run_part(*what)
            elif kind == "size":
                self._size(what)
            else:
                self._read(what)

    def _place(self) -> None:
        if self.cores is not None:
            try:
                os.sched_setaffinity(0, self.cores)  # this thread only
            except OSError:
                pass  # cores this process may not use: run where it was put
        try:  # below the roles (on a role's cores a late verdict costs a round; a read loses nothing by yielding)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass

    def _size(self, read: _Read) -> None:
        need = None
        if self.budget is not None:
            try:
                need = self._estimate(read.key) if self._estimate is not None else None
            except Exception:  # noqa: BLE001 - an estimate is advice; the read says what is wrong
                need = None
        with self._cond:
            self._sizing.discard(read)
            if read.dropped or self._closed:
                read.future.cancel()
                self._cond.notify_all()
                return
            read.need = max(0, int(need)) if need is not None else (self.budget or 0) + 1  # unknown: alone
            read.state = "sized"
            self._sized.append(read)
            self._cond.notify_all()

    def _read(self, read: _Read) -> None:
        try:
            value, error = self._load(read.key), None
        except BaseException as e:  # noqa: BLE001 - delivered to the caller of take()
            value, error = None, e
        with self._cond:
            self._used -= read.need
            read.state = "done"
            if read.dropped or error is not None:
                read.counted = False
                self._granted -= 1
            else:
                read.held = int(self._size_of(value))
                self._used += read.held
                self.peak_bytes = max(self.peak_bytes, self._used)
            if not read.future.cancelled():
                if error is not None:
                    read.future.set_exception(error)
                else:
                    read.future.set_result(value)
            self._cond.notify_all()


def _run_part(fn: Callable, part: Any, future: Future) -> None:
    try:
        future.set_result(fn(part))
    except BaseException as e:  # noqa: BLE001 - delivered to map_parts' caller
        future.set_exception(e)

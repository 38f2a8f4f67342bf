"""One video, many questions: the frames a read decoded, kept and given to the next read of the same frames
(issue 62, item 1), so a second question about a video neither decodes nor re-reads it.

The target's prefix cache (engine/prefix_cache.py) is keyed by the pixels the model sees, so it can only be looked
up once the frames are in memory: without this cache every question read its video again.

- Keyed by what decides the frames without reading them: the video's identity on disk (`vpsd.video.identity`:
  its resolved path, device, inode, size and modification time; a folder's images too; a `data:` URL's bytes'
  hash) and the whole `FrameRequest` but its path (count or rate, the checkpoint's rule, `max_side`, `seek`,
  `max_frames`: each changes which frames or pixels come out, and a field added later is in the key by itself). A
  video changed on disk has another identity, so it never hits: it is read again. The identity is looked at again
  after a read, and frames whose file changed under the read are not kept.
- Bounded by `reuse.frames_mib` (host memory; the memory plan counts it on the ranks that read, launch/memory.py),
  least recently used evicted first; frames larger than the whole budget are not kept. 0, or `reuse.enabled:
  false`, keeps nothing (`cache_for` gives None).
- One read a key at a time: a read of a key that is being read waits for that read's frames (a reader pool reads
  several items ahead on several threads, video/pool.py), so two questions about one video decode it once. A read
  that fails is not kept: its error reaches every waiter, and the next read tries again.
- Kept frames are shared, never copied: every array given out (the reader's own included) is read-only
  (`writeable = False`), so a consumer that would write into one fails loudly instead of changing what the
  next question sees. Nothing in vpsd writes into frames: resizes, caps and the tensor conversions copy
  (video/resize.py `tensor_of`).

Traced: one `frames_cache` event a read (item, hit, joined: it waited for a read in flight, bytes, and on a miss
whether the frames were kept); `FrameCache.stats` (FrameCacheStats) goes to summary.json's `run.frames_cache`.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from vpsd.tracing import get_logger
from vpsd.video.identity import source_identity
from vpsd.video.item import FrameRequest

log = get_logger()

Frames = tuple[np.ndarray, np.ndarray]  # (T, H, W, 3) uint8 frames, (T,) seconds


@dataclass
class FrameCacheStats:
    """Counters for the trace, summary.json and `vpsd summary` (`FrameCache.stats`)."""

    reads: int = 0  # reads asked of the cache
    hits: int = 0  # ... whose frames were kept
    joined: int = 0  # ... that waited for the same frames being read (decoded once for both)
    misses: int = 0  # ... decoded
    uncached: int = 0  # ... that could not be keyed (the path could not be looked at: the read says why)
    stored: int = 0  # frames kept
    evicted: int = 0  # kept frames evicted for room
    evicted_bytes: int = 0
    too_large: int = 0  # frames larger than the whole budget, not kept
    changed: int = 0  # frames not kept: their file changed while they were read
    bytes: int = 0  # held now
    peak_bytes: int = 0
    budget_bytes: int = 0


def frames_key(request: FrameRequest) -> Hashable | None:
    """The key of the frames `request` reads (module docstring); None: not to be cached."""
    identity = source_identity(request.video)
    return None if identity is None else (identity, dataclasses.replace(request, video=""))


def frozen(frames: Frames) -> Frames:
    """The arrays made read-only in place: shared from now on (module docstring)."""
    for array in frames:
        array.flags.writeable = False
    return frames


class FrameCache:
    """Byte-budgeted LRU of decoded frames, shared by every thread that reads (module docstring)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self._lock = threading.Lock()
        self._kept: OrderedDict[Hashable, tuple[Frames, int]] = OrderedDict()
        self._reading: dict[Hashable, Future] = {}
        self._stats = FrameCacheStats(budget_bytes=self.budget)

    def read(self, request: FrameRequest, item_id: str, load: Callable[[], Frames]) -> Frames:
        """The frames of `request`: kept ones, those a read in flight returns, else `load()`'s (kept within the
        budget). Raises what `load` raised."""
        key = frames_key(request)
        with self._lock:
            self._stats.reads += 1
            if key is None:
                self._stats.uncached += 1
            elif (kept := self._kept.get(key)) is not None:
                self._kept.move_to_end(key)
                self._stats.hits += 1
                log.info("frames_cache", item=item_id, hit=True, joined=False, bytes=kept[1])
                return kept[0]
            elif (pending := self._reading.get(key)) is not None:
                self._stats.joined += 1
            else:
                self._stats.misses += 1
                self._reading[key] = Future()
        if key is None:
            return load()
        if pending is not None:  # the read in flight's frames, or its error
            frames = pending.result()
            log.info("frames_cache", item=item_id, hit=True, joined=True, bytes=_nbytes(frames))
            return frames
        return self._load(key, request, item_id, load)

    def _load(self, key: Hashable, request: FrameRequest, item_id: str, load: Callable[[], Frames]) -> Frames:
        try:
            frames = frozen(load())
        except BaseException as e:  # noqa: BLE001 - each waiter gets it; nothing is kept
            with self._lock:
                future = self._reading.pop(key)
            future.set_exception(e)
            raise
        size = _nbytes(frames)
        unchanged = frames_key(request) == key  # the file was not rewritten while it was read
        with self._lock:
            future = self._reading.pop(key)
            kept = unchanged and self._keep(key, frames, size)
            self._stats.changed += not unchanged
        future.set_result(frames)
        log.info("frames_cache", item=item_id, hit=False, joined=False, bytes=size, kept=kept)
        return frames

    def _keep(self, key: Hashable, frames: Frames, size: int) -> bool:
        """Keep `frames`, evicting the least recently used for room (under the lock); False: larger than the
        budget."""
        if size > self.budget:
            self._stats.too_large += 1
            return False
        self._kept[key] = (frames, size)
        self._stats.bytes += size
        self._stats.stored += 1
        self._evict_to(self.budget)
        self._stats.peak_bytes = max(self._stats.peak_bytes, self._stats.bytes)
        return True

    def _evict_to(self, budget: int) -> None:
        while self._stats.bytes > budget and self._kept:
            _, (_, size) = self._kept.popitem(last=False)
            self._stats.bytes -= size
            self._stats.evicted += 1
            self._stats.evicted_bytes += size

    def resize(self, budget_bytes: int) -> None:
        """A new budget, evicting down to it."""
        with self._lock:
            self.budget = self._stats.budget_bytes = int(budget_bytes)
            self._evict_to(self.budget)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dataclasses.asdict(self._stats)


def _nbytes(frames: Frames) -> int:
    return sum(int(a.nbytes) for a in frames)


_BY_OWNER: "weakref.WeakKeyDictionary[Any, FrameCache]" = weakref.WeakKeyDictionary()
_BY_OWNER_LOCK = threading.Lock()


def cache_for(owner: Any, budget_bytes: int) -> FrameCache | None:
    """The one frame cache of `owner` (the model whose reads it serves: the target's, or a draft rank's that reads
    its own videos), at the latest budget: every reader over that model shares it, so the Python API's calls and
    a server's engines, each with readers of their own, find what earlier ones read. None when the budget is 0
    (reuse off; a cache the owner had is dropped with what it held)."""
    with _BY_OWNER_LOCK:
        if budget_bytes <= 0:
            _BY_OWNER.pop(owner, None)
            return None
        cache = _BY_OWNER.get(owner)
        if cache is None:
            cache = _BY_OWNER[owner] = FrameCache(budget_bytes)
        elif cache.budget != budget_bytes:
            cache.resize(budget_bytes)
        return cache

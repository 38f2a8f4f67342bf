"""Read the next item's video while the model works on the current one.

Decoding a video is I/O and CPU work the GPU does not need to wait for: a role asks for the next
item's frames `ahead` of time and `take`s them when it gets there. One background thread does the
loads in the order they were asked for (so the item needed first is read first); PyAV and torch
release the GIL while they work, so the model's thread keeps running.

- `Prefetcher(load)`: keyed loads; `ahead(key)` starts one (once per key), `take(key)` returns its
  value, starting it first if nobody asked ahead, and re-raises in the caller what the load raised
  (a VideoError stays a per-item error). The time `take` blocks is traced as `video_wait`: that is
  the part of reading that was not hidden. `keep_only` forgets loads that will never be taken (an
  item the target skipped), so at most a few clips are held.
- `FramePrefetcher`: the draft's side, loads by the wire-form `FrameRequest` the target sends.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, Hashable, Iterable, TypeVar

import numpy as np

from vpsd.video.item import FrameRequest, cap_frames, load_frames, timed

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Prefetcher(Generic[K, V]):
    def __init__(self, load: Callable[[K], V], name: str = "prefetch") -> None:
        self._load = load
        # One worker: loads run in the order asked, and a prefetch never competes with another.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: dict[K, Future] = {}

    def ahead(self, key: K) -> None:
        """Start loading `key` in the background unless it is already loading or loaded."""
        if key not in self._pending:
            self._pending[key] = self._pool.submit(self._load, key)

    def take(self, key: K, timings: dict[str, float] | None = None, **fields: Any) -> V:
        """The value of `key` (waiting for it); raises what the load raised."""
        self.ahead(key)
        future = self._pending.pop(key)
        with timed("video_wait", timings if timings is not None else {}, **fields):
            return future.result()

    def keep_only(self, keys: Iterable[K]) -> None:
        """Drop every load but `keys`; one already running finishes and is discarded."""
        keep = set(keys)
        for key in [k for k in self._pending if k not in keep]:
            self._pending.pop(key).cancel()

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


class FramePrefetcher:
    """Frames by wire-form request (`FrameRequest.to_wire`): what the draft reads, the same frames
    as the target's. The cap (`max_frames`) is applied after the read, so a clip read ahead before
    the target knew it had to be subsampled is reused as it is."""

    def __init__(self) -> None:
        self._timings: dict[tuple[str, FrameRequest], dict[str, float]] = {}
        self._prefetcher: Prefetcher[tuple[str, FrameRequest], tuple[np.ndarray, np.ndarray]] = Prefetcher(
            self._load, "frames"
        )

    def _load(self, key: tuple[str, FrameRequest]) -> tuple[np.ndarray, np.ndarray]:
        item_id, request = key
        return load_frames(request, item_id, self._timings.setdefault(key, {}))

    @staticmethod
    def _key(wire: dict[str, Any]) -> tuple[str, FrameRequest]:
        return str(wire.get("item", "")), FrameRequest.from_wire(wire)

    def ahead(self, wire: dict[str, Any] | None) -> None:
        """Start reading the next item's frames, forgetting any other read not taken yet."""
        keys = [] if wire is None else [self._key(wire)]
        self._prefetcher.keep_only(keys)
        for stale in list(self._timings):  # list() first: the loader thread may be adding a key
            if stale not in keys:
                self._timings.pop(stale, None)
        for key in keys:
            self._prefetcher.ahead(key)

    def take(self, wire: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """(frames, their times in seconds, timings of video_read / preprocess / video_wait in seconds);
        raises VideoError."""
        key = self._key(wire)
        timings: dict[str, float] = {}
        try:
            frames, times = self._prefetcher.take(key, timings, item=key[0])
        finally:
            timings.update(self._timings.pop(key, {}))
        cap = wire.get("max_frames")
        return cap_frames(frames, cap), cap_frames(times, cap), timings

    def close(self) -> None:
        self._prefetcher.close()

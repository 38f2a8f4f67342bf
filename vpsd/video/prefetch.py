"""Read the next items' videos while the model works on the current one, on readers of their own
(`vpsd.video.pool.ReaderPool`: several at once, in order of need, on the cores no role is pinned to, within a
memory budget for frames read and not yet taken).

- `Prefetcher(load)`: keyed loads on one reader, no budget; `ahead(key)` starts one (once per key), `take(key)`
  returns its value, starting it first if nobody asked ahead, and re-raises in the caller what the load raised (a
  VideoError stays a per-item error). The time `take` blocks is traced as `video_wait`: that is the part of
  reading that was not hidden. `keep_only` forgets loads that will never be taken (an item the target skipped).
- `FramePool`: frames by (item id, `FrameRequest`), each read with its timings (`video_read_s`, `preprocess_s`),
  its size known before it is read (`frames_bytes`: the probe's frame count and size, so the budget holds);
  `frame_pool(video, cpu_affinity)` sizes one from the config (`video.readers`, `video.read_ahead`,
  `video.frames_budget_mib`), with a `FrameCache` (video/frame_cache.py) when given: an item whose frames an
  earlier item read (or is reading) takes them instead of reading the video again. With more than one reader, a
  dense read is split between keyframes into up to one part a reader, which the idle readers and the reading one
  decode at once (`ReaderPool.map_parts`, `vpsd.video.decode.split_wanted`): the same frames, bit for bit. The
  target's reads (launch/items.py ItemReader) go through one.
- `FramePrefetcher`: the draft's side, loads by the wire-form `FrameRequest` the target sends, when the target
  does not send the frames themselves (`video.share_frames`, roles/draft.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Sequence, TypeVar

import numpy as np

from vpsd.video.errors import VideoError
from vpsd.video.frame_cache import FrameCache
from vpsd.video.item import FrameRequest, cap_frames, load_frames
from vpsd.video.pool import ReaderPool, readers_for, spare_cores

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

FrameKey = tuple[str, FrameRequest]  # (item id, request)
Frames = tuple[np.ndarray, np.ndarray, dict[str, float]]  # (frames, times, timings of their read)


class Prefetcher(ReaderPool[K, V]):
    """One reader, loads in the order asked, no budget (module docstring)."""

    def __init__(self, load: Callable[[K], V], name: str = "prefetch") -> None:
        super().__init__(load, readers=1, name=name)


def frames_bytes(request: FrameRequest) -> int | None:
    """Bytes of the frames and times `request` reads, known before reading them (`probe_video`: the frame count a
    read selects and the size it returns, nothing decoded); 0 for a video that cannot be read (the read fails at
    once, holding nothing); None where it is not known (a frames file: its probe reads it whole)."""
    if Path(request.video).suffix == ".npz":
        return None
    try:
        from vpsd.video.decode import probe_video
        from vpsd.video.frames import max_side_size
    except ImportError:  # a reader without a probe: sizes unknown, each read then reads alone
        return None
    try:
        info = probe_video(request.video)
        count = len(info.indices(num_frames=request.num_frames, fps=request.fps, processor=request.processor,
                                 max_frames=request.max_frames))
    except (VideoError, ValueError):
        return 0
    height, width = max_side_size(info.height, info.width, request.max_side)
    return count * (height * width * 3 + 8)


def _load_frames(key: FrameKey, pool: ReaderPool | None = None, cache: FrameCache | None = None) -> Frames:
    """The frames of `key`; read on `pool`'s reader, a dense read in one part a reader (the reading one among
    them), the idle ones taking the others; taken from `cache` when kept there (or being read for another item)."""
    item_id, request = key
    timings: dict[str, float] = {}
    split = {} if pool is None or pool.readers < 2 else {"parts": pool.readers, "map_parts": pool.map_parts}
    frames, times = load_frames(request, item_id, timings, cache=cache, **split)
    return frames, times, timings


class FramePool:
    """Frames by (item id, FrameRequest) (module docstring)."""

    def __init__(self, readers: int = 1, budget_bytes: int | None = None, cores: Sequence[int] | None = None,
                 name: str = "frames", cache: FrameCache | None = None) -> None:
        self.cache = cache
        self.pool: ReaderPool[FrameKey, Frames] = ReaderPool(
            lambda key: _load_frames(key, self.pool, cache), readers=readers, budget_bytes=budget_bytes,
            estimate=lambda key: frames_bytes(key[1]), cores=cores, name=name)

    def ahead(self, item_id: str, request: FrameRequest) -> None:
        self.pool.ahead((item_id, request))

    def take(self, item_id: str, request: FrameRequest) -> Frames:
        """(frames, times, timings of video_read / preprocess / video_wait in seconds); raises VideoError."""
        timings: dict[str, float] = {}
        frames, times, read = self.pool.take((item_id, request), timings, item=item_id)
        return frames, times, {**read, **timings}

    def keep_only(self, keys: Iterable[FrameKey]) -> None:
        self.pool.keep_only(keys)

    def close(self) -> None:
        self.pool.close()


def frame_pool(video: Any, affinity: dict[str, list[int]] | None, fallback_cores: Sequence[int] | None = None,
               name: str = "frames", cache: FrameCache | None = None) -> FramePool:
    """A FramePool as the config says: `video.readers` readers (None: one a spare core, `readers_for`), reading
    within `video.frames_budget_mib`, on the cores `affinity` pins no role to (none left: `fallback_cores`, else
    where the caller's thread runs); frames kept in `cache` are taken from it (video/frame_cache.py `cache_for`)."""
    spare = spare_cores(affinity)
    budget = None if video.frames_budget_mib is None else int(video.frames_budget_mib * 2**20)
    return FramePool(readers_for(video.readers, spare, video.read_ahead), budget, spare or fallback_cores, name,
                     cache)


class FramePrefetcher:
    """Frames by wire-form request (`FrameRequest.to_wire`): what the draft reads, the same frames as the
    target's. The cap (`max_frames`) is applied after the read, so a clip read ahead before the target knew it
    had to be subsampled is reused as it is."""

    def __init__(self, pool: FramePool | None = None) -> None:
        self._pool = pool or FramePool()

    @staticmethod
    def _key(wire: dict[str, Any]) -> FrameKey:
        return str(wire.get("item", "")), FrameRequest.from_wire(wire)

    def ahead(self, wire: dict[str, Any] | None) -> None:
        """Start reading the next item's frames, forgetting any other read not taken yet."""
        keys = [] if wire is None else [self._key(wire)]
        self._pool.keep_only(keys)
        for key in keys:
            self._pool.ahead(*key)

    def take(self, wire: dict[str, Any]) -> Frames:
        """(frames, their times in seconds, timings of video_read / preprocess / video_wait in seconds);
        raises VideoError."""
        frames, times, timings = self._pool.take(*self._key(wire))
        cap = wire.get("max_frames")
        return cap_frames(frames, cap), cap_frames(times, cap), timings

    def close(self) -> None:
        self._pool.close()

"""A manifest item's video, read for the target: the frames its request asks for, scaled and fitted to the
context, and the request a draft rank reads the same frames by.

Runs on the prefill thread; touches the target only through `prepare` (no model forward). A job's reader pool
(`frames`, vpsd/video/pool.py) reads the videos: `ahead` starts an item's read as the scheduler takes it, `load`
takes its frames. A video's frames read for one question are kept for the next (`cache`: the target's frame
cache, video/frame_cache.py, shared by every reader over the target: a job's, each API call's, each server
engine's), so a second question about it neither decodes nor re-reads it. Per item the timings (`video_read_s`,
`preprocess_s`) go into its result's stats; the same spans are in the target's trace (with `frames_cache`).
An item whose prompt + video + max_new_tokens exceeds `video.context_limit` (default the target's
max_position_embeddings) fails as `too_long`, or is subsampled to fit when `video.subsample_to_fit` is set: decided
from the video's metadata before it is read (`planned_request`), and checked again on the frames read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vpsd.config import RunConfig
from vpsd.engine.request import Request
from vpsd.launch.manifest import ManifestItem
from vpsd.models.base import VideoLMAdapter
from vpsd.models.checkpoint import read_frame_sampling
from vpsd.tracing import get_logger
from vpsd.video.decode import FRAMES_SUFFIX, probe_video
from vpsd.video.fit import fit_count, fit_to_context
from vpsd.video.errors import VideoError
from vpsd.video.frame_cache import cache_for
from vpsd.video.frames import max_side_size
from vpsd.video.item import FrameRequest, cap_frames, load_frames, scale_to_max_side, timed
from vpsd.video.prefetch import FramePool


def context_limit(target: VideoLMAdapter, cfg: RunConfig) -> int:
    """Tokens one sequence may hold: the config's limit, else what the target's positions allow."""
    if cfg.video.context_limit is not None:
        return int(cfg.video.context_limit)
    return int(target.model.config.get_text_config().max_position_embeddings)


@dataclass
class LoadedItem:
    frames: np.ndarray  # read, scaled, fitted to the context
    times: np.ndarray  # (T,) seconds at which each of those frames was taken
    video: dict  # the wire-form request the draft reads the same frames by (with max_frames if capped)
    timings: dict[str, float]  # video_read_s, preprocess_s


def checked_frames(item_id: str, frames: np.ndarray, times: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Frames handed in memory and their times (default one frame a second); VideoError ("bad_request") for an
    array that is not frames."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise VideoError("bad_request", f"<frames of {item_id}>", f"frames must be a (T, H, W, 3) uint8 array with "
                         f"T >= 1, got {frames.dtype} {tuple(frames.shape)}")
    times = np.arange(len(frames), dtype=np.float64) if times is None else np.asarray(times, dtype=np.float64)
    if times.shape != (len(frames),):
        raise VideoError("bad_request", f"<frames of {item_id}>", f"{len(frames)} frames, {times.shape} frame_times")
    return frames, times


class ItemReader:
    def __init__(self, target: VideoLMAdapter, cfg: RunConfig, frames: FramePool | None = None) -> None:
        """frames: the readers that read items ahead (`ahead`, vpsd/video/pool.py); None: each item is read on the
        thread that loads it."""
        self.target, self.cfg, self.frames = target, cfg, frames
        # The target's decoded frames kept for a video's next question (None: reuse off); a pool's readers use the
        # same one (`frame_pool(cache=...)`, launch/job.py).
        self.cache = cache_for(target, cfg.reuse.frames_bytes)
        self._planned: dict[str, FrameRequest] = {}  # read ahead: the request planned then, taken by `load`
        self.limit = context_limit(target, cfg)
        # video.sampling: checkpoint: the target processor's rule (checked at launch by preflight).
        self.processor = (read_frame_sampling(cfg.target.path, cfg.family)
                          if cfg.video.sampling == "checkpoint" else None)

    def frame_request(self, item: ManifestItem) -> FrameRequest:
        v = self.cfg.video
        return FrameRequest.resolve(item.video, item.num_frames, item.fps, v.num_frames, v.fps, v.max_side,
                                    self.processor, v.seek)

    def max_new_tokens(self, item: ManifestItem) -> int:
        return item.max_new_tokens or self.cfg.decoding.max_new_tokens

    def ahead(self, item: ManifestItem) -> None:
        """Start reading the item's frames on the readers (the scheduler took it: engine/prefill_ahead.py); a video
        refused before reading (too long, too large, unreadable) is not read ahead: `load` raises its error."""
        if self.frames is not None:
            try:
                request = self.planned_request(item, {})
            except VideoError:
                return  # `load` plans again and raises it
            self._planned[item.id] = request
            self.frames.ahead(item.id, request)

    def planned_request(self, item: ManifestItem, timings: dict[str, float]) -> FrameRequest:
        """The item's request, capped to fit the context before a frame is decoded (issue: a 60-minute video at fps 4
        was decoded whole, at full size, before anything asked whether it fits, and took the rank down): from the
        container's metadata (`probe_video`: the frame count, rate and size, nothing decoded) the selection and the
        tokens it needs are known, so `too_long` (or the `video.subsample_to_fit` cap) is decided first, and a read
        whose frames would not fit `video.frames_budget_mib` at their size is refused (`too_large`) instead of
        held. A folder or frames file is fitted after reading, as before. Raises VideoError."""
        request = self.frame_request(item)
        if Path(request.video).is_dir() or request.video.endswith(FRAMES_SUFFIX):
            return request
        with timed("video_plan", timings, item=item.id):
            info = probe_video(request.video)
            indices = info.indices(num_frames=request.num_frames, fps=request.fps, processor=request.processor)
            height, width = max_side_size(info.height, info.width, request.max_side)
            times = indices / info.fps  # the frames' times from the video's start, as their timestamps will say
            reserve = self.max_new_tokens(item)
            cap = fit_count(len(indices), lambda k: self.target.count_tokens(
                k, height, width, item.prompt, cap_frames(times, k)) + reserve, self.limit,
                self.cfg.video.subsample_to_fit, request.video)
            frames = len(indices) if cap is None else cap
            held = frames * height * width * 3
            if held > self.cfg.video.frames_budget_mib * 2**20:
                raise VideoError("too_large", request.video, (
                    f"{frames} frames of {width}x{height} would hold {held / 2**20:.0f} MiB, over "
                    f"video.frames_budget_mib ({self.cfg.video.frames_budget_mib:g}); set video.max_side or ask for "
                    f"fewer frames"))
        if cap is not None:
            get_logger().info("video_subsampled", item=item.id, frames=cap, limit=self.limit, before_reading=True)
        return dataclasses.replace(request, max_frames=cap)

    def load(self, item: ManifestItem) -> LoadedItem:
        timings: dict[str, float] = {}
        request = self._planned.pop(item.id, None) or self.planned_request(item, timings)
        if self.frames is not None:  # read ahead (or now) by the readers; the item's video_wait is its admission's
            frames, times, read = self.frames.take(item.id, request)
            timings.update({k: v for k, v in read.items() if k != "video_wait_s"})
        else:
            frames, times = load_frames(request, item.id, timings, cache=self.cache)
        # Checked again on the frames read (their real times; a count the container overstated), as in memory.
        frames, times, max_frames = self._fit(item.id, item.prompt, frames, times, self.max_new_tokens(item),
                                              item.video, timings)
        return LoadedItem(frames, times, request.to_wire(item.id, max_frames), timings)

    def load_array(self, item_id: str, prompt: str, frames: np.ndarray, times: np.ndarray | None,
                   max_new_tokens: int) -> LoadedItem:
        """Frames already in memory ((T, H, W, 3) uint8; the API's): taken as they are, scaled to video.max_side and
        fitted to the context as a file's are; `times` in seconds (default one frame a second). VideoError
        ("bad_request") for an array that is not frames."""
        frames, times = checked_frames(item_id, frames, times)
        timings: dict[str, float] = {}
        with timed("preprocess", timings, item=item_id, step="scale"):
            frames = scale_to_max_side(frames, self.cfg.video.max_side)
        frames, times, max_frames = self._fit(item_id, prompt, frames, times, max_new_tokens, f"<frames of {item_id}>",
                                              timings)
        return LoadedItem(frames, times, {"item": item_id, "in_memory": True, "max_frames": max_frames}, timings)

    def _fit(self, item_id: str, prompt: str, frames: np.ndarray, times: np.ndarray, reserve: int, where,
             timings: dict[str, float]) -> tuple[np.ndarray, np.ndarray, int | None]:
        """The frames that fit the context with `reserve` tokens to answer in (video.subsample_to_fit), their times,
        and the cap applied (None: all of them)."""
        with timed("preprocess", timings, item=item_id, step="fit"):
            # A capped clip's times are the same cap of the times (Qwen3-VL's prompt counts them).
            height, width = frames.shape[1:3]
            frames, max_frames = fit_to_context(
                frames, lambda f: self.target.count_tokens(len(f), height, width, prompt, cap_frames(times, len(f)))
                + reserve, self.limit, self.cfg.video.subsample_to_fit, where,
            )
        if max_frames is not None:
            get_logger().info("video_subsampled", item=item_id, frames=max_frames, limit=self.limit)
        return frames, cap_frames(times, max_frames), max_frames

    def request(self, item: ManifestItem, loaded: LoadedItem, nxt: ManifestItem | None) -> Request:
        """The item as the engine takes it: its frames, and how a draft rank reads them and the next item's."""
        return Request(item.id, item.prompt, self.max_new_tokens(item), loaded.frames, loaded.times, loaded.video,
                       self.frame_request(nxt).to_wire(nxt.id) if nxt is not None else None, item.stop,
                       seed=item.seed, reuse=item.shares_video)

"""Frames for one manifest item: which frames of which video (`FrameRequest`), and reading them.

The target and the draft read every video themselves, on separate ranks, and must end up with the
same frames. They do so by sharing the request, not the pixels: the target sends the draft the
request in wire form (`to_wire`, a plain dict that msgpack carries), plus `max_frames` when the clip
was subsampled to fit the context (see `vpsd.video.fit`). Reading then subsampling in memory with
`cap_frames` gives exactly the frames `read_video(..., max_frames=k)` would have given, so a clip
read ahead before the cap was known is still the right one. The request carries how the file is read
(`seek`: "exact" or "keyframe", the config's `video.seek`) and its `max_side`, which the reader applies as it
converts each frame (no full-size frame is held), so both ranks get the same pixels.

Frames travel with their times: `load_frames` returns the (T,) seconds at which each frame was taken
(the decoded frames' own presentation times, `VideoClip.timestamps`), and a cap selects the same
rows of both (`cap_frames` indexes any array by frame). The adapters tell the model those times.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from vpsd.tracing import span
from vpsd.video.decode import MapParts, read_video
from vpsd.video.frames import max_side_size
from vpsd.video.resize import resize_frames
from vpsd.video.sampling import ProcessorSampling, uniform_indices

if TYPE_CHECKING:  # frame_cache keys by FrameRequest: imported here for the annotation only
    from vpsd.video.frame_cache import FrameCache


@dataclass(frozen=True)
class FrameRequest:
    """Which frames of `video` to read, and the longest side they are scaled to."""

    video: str
    num_frames: int | None = None  # that many frames evenly spread...
    fps: float | None = None  # ...or one every 1/fps seconds (never both)...
    max_side: int | None = None  # ...then scaled down so the longest side is at most this
    processor: ProcessorSampling | None = None  # ...or the checkpoint's own rule (video.sampling: checkpoint)
    seek: str = "exact"  # how the file is read: "exact" or "keyframe" (approximate; video.seek)
    # At most this many of the selected frames, evenly spread (read_video's max_frames): the cap that fits the
    # context, decided from the video's metadata before it is read (launch/items.py), so the rest is never decoded.
    max_frames: int | None = None

    @classmethod
    def resolve(
        cls,
        video: str | Path,
        num_frames: int | None,
        fps: float | None,
        default_num_frames: int | None,
        default_fps: float | None,
        max_side: int | None,
        default_processor: ProcessorSampling | None = None,
        seek: str = "exact",
    ) -> "FrameRequest":
        """The item's own request if it has one, else the run's: the checkpoint's rule when the run samples
        as the checkpoint does, else an explicit config fps over the config's frame count (num_frames has a
        default and fps does not). `seek` is the run's (video.seek) either way."""
        if num_frames is not None or fps is not None:
            return cls(str(video), num_frames, fps, max_side, seek=seek)
        if default_processor is not None:
            return cls(str(video), None, None, max_side, default_processor, seek)
        num_frames, fps = (None, default_fps) if default_fps is not None else (default_num_frames, None)
        return cls(str(video), num_frames, fps, max_side, seek=seek)

    def to_wire(self, item_id: str, max_frames: int | None = None) -> dict[str, Any]:
        return {"item": item_id, "video": self.video, "num_frames": self.num_frames, "fps": self.fps,
                "max_side": self.max_side, "max_frames": self.max_frames if max_frames is None else max_frames,
                "processor": None if self.processor is None else self.processor.to_wire(), "seek": self.seek}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> "FrameRequest":
        return cls(wire["video"], wire.get("num_frames"), wire.get("fps"), wire.get("max_side"),
                   ProcessorSampling.from_wire(wire.get("processor")), wire.get("seek", "exact"), wire.get("max_frames"))


@contextlib.contextmanager
def timed(name: str, timings: dict[str, float], **fields: Any) -> Iterator[dict[str, Any]]:
    """A trace span that also adds its duration to `timings[name + "_s"]` (per-item stats). Yields the span's
    fields: what the block adds there is traced with it."""
    start = time.perf_counter()
    try:
        with span(name, **fields) as traced:
            yield traced
    finally:
        key = f"{name}_s"
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def load_frames(request: FrameRequest, item_id: str, timings: dict[str, float], *, parts: int = 1,
                map_parts: MapParts | None = None, cache: FrameCache | None = None) -> tuple[np.ndarray, np.ndarray]:
    """((T, H, W, 3) uint8, (T,) float64 seconds) of the request; raises VideoError with the path and
    what is wrong. parts, map_parts: a dense read's stretches between keyframes read at once (read_video's; the
    same frames). cache: frames kept from an earlier read of the same request and file, taken instead of reading
    it (vpsd/video/frame_cache.py; read-only, and nothing is read or traced: 0 s in `timings`).

    Traced as `video_read` (demux, decode, and conversion to RGB at the request's size; with how it was read:
    `read_mode`, `frames_decoded`, `parts` when it was split, and `fallback` when it could not seek) and
    `preprocess`, both added to `timings`.
    """
    if cache is not None:
        clip = cache.read(request, item_id, lambda: load_frames(request, item_id, timings, parts=parts,
                                                                map_parts=map_parts))
        for key in ("video_read_s", "preprocess_s"):  # kept frames: nothing read, so the item's stats say 0 s
            timings.setdefault(key, 0.0)
        return clip
    with timed("video_read", timings, item=item_id) as traced:
        clip = read_video(request.video, num_frames=request.num_frames, fps=request.fps, processor=request.processor,
                          max_side=request.max_side, seek=request.seek, max_frames=request.max_frames,
                          parts=parts, map_parts=map_parts)
        traced.update(read_mode=clip.read_mode, frames_decoded=clip.frames_decoded)
        if clip.parts > 1:
            traced["parts"] = clip.parts
        if clip.fallback_reason is not None:
            traced["fallback"] = clip.fallback_reason
    with timed("preprocess", timings, item=item_id, step="resize"):
        # The frames came back scaled (inside video_read); this only checks, and keeps preprocess_s in the stats.
        return scale_to_max_side(clip.frames, request.max_side), clip.timestamps


def scale_to_max_side(frames: np.ndarray, max_side: int | None) -> np.ndarray:
    """Frames in memory shrunk so the longest side is at most `max_side` (torch's antialiased bicubic); a file's
    frames are read at that size instead (`read_video(max_side=...)`, the same rounding)."""
    size = max_side_size(*frames.shape[1:3], max_side)
    return frames if size == frames.shape[1:3] else resize_frames(frames, *size)


def cap_frames(frames: np.ndarray, max_frames: int | None) -> np.ndarray:
    """At most `max_frames` of the clip, evenly spread: the rule of read_video's `max_frames`.
    Indexes the first axis only, so the same call caps the frames' times."""
    if max_frames is None or len(frames) <= max_frames:
        return frames
    return frames[uniform_indices(len(frames), max_frames)]


def load_item_frames(
    path: str | Path,
    num_frames: int | None,
    fps: float | None,
    max_side: int | None,
    seek: str = "exact",
) -> tuple[np.ndarray, np.ndarray]:
    """(frames, times) of one item read in place, untraced (references in tests, one-off tools): the frames
    `load_frames` gives for the same request."""
    clip = read_video(path, num_frames=None if fps else num_frames, fps=fps, max_side=max_side, seek=seek)
    return clip.frames, clip.timestamps

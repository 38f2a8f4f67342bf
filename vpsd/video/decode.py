"""Read a video file (or a folder of frame images, or a frames file) into sampled RGB frames.

Contract:
- `read_video` returns a `VideoClip` with the frames a request selects (see `vpsd.video.sampling`
  for the rules: by count, by rate, or all, then capped by `max_frames`).
- Reading costs what the clip keeps, not what the video holds: the file's packets are indexed once without
  decoding (`vpsd.video.index`), then the reader seeks to the keyframe before a wanted frame whenever one lies
  between the last frame read and it, and decodes forward, never past the last wanted frame
  (`vpsd.video.seek`). Decoding forward, it has the decoder skip the unwanted frames no other frame references
  (FFmpeg's skip_frame NONREF: most B-frames), so a dense selection (fps 2 of 30) decodes a fraction of the
  video. The frames and timestamps are exactly, bit for bit, those a front to back decode gives.
  Where the packets cannot promise that (no timestamps, duplicated ones, an edit list, a stored frame count
  they do not match, a seek that goes astray...), the video is decoded front to back, stopping after the last
  wanted frame, as it always was; `VideoClip.read_mode` says which way it was read and `fallback_reason` why.
  `seek="keyframe"` is approximate: each wanted frame is replaced by the keyframe shown nearest to it (the
  clip's `indices` and `timestamps` are then the keyframes'), and only keyframes are decoded.
- Only wanted frames are converted to RGB and kept, each by one swscale call at the size asked for (`size`,
  or `max_side` for the longest side; bicubic when it scales: `vpsd.video.frames`), so memory grows with the
  clip, not the video, and no full-size RGB frame is made. Frames come back upright (a display matrix's
  rotation applied) and at display aspect (non-square pixels stretched).
- `probe_video` says, before decoding anything, how many frames a read selects from, at which rate, and the
  size they come back at (`vpsd.video.info`), so that a caller can count a clip's tokens before reading it.
- Every failure is a `VideoError` whose `kind` tells callers what happened; no PyAV exception
  escapes. Any decoding error, even after some good frames, makes the video "corrupt": a truncated
  download is not silently read as a shorter video.
- A frames file (`.npz`: `frames`, a (T, H, W, 3) uint8 array, and `times`, its (T,) seconds) is frames already
  decoded, read under the same rules; the Python API hands its in-memory frames to a rank this way. Its frames
  are scaled as in-memory frames are (`resize_frames`, torch's antialiased bicubic), so both ways agree.
- `open_video` checks what a reader needs to start (a container, a video stream, its first frame), for
  `vpsd check`.
- Only the first video stream is read. Sampling by rate assumes a constant frame rate (the
  stream's average rate); timestamps are the decoded frames' own presentation times, counted from
  the first frame.

Here: the request, the choice of path, and the front to back decode. Elsewhere: the packet index (index.py), the
seeking (seek.py), the probe (info.py), converting a frame (frames.py), folders and frames files (stills.py).
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

import av
import numpy as np

from vpsd.video.clip import VideoClip
from vpsd.video.errors import VideoError, describe_av_error
from vpsd.video.folder import read_image
from vpsd.video.frames import Geometry, geometry, to_rgb
from vpsd.video.index import PacketIndex
from vpsd.video.info import VideoInfo, inspect_video, open_container
from vpsd.video.sampling import ProcessorSampling, select_indices
from vpsd.video.seek import Convert, Untrusted, read_exact, read_keyframes
from vpsd.video.stills import (FRAMES_SUFFIX, folder_files, load_frames_file, read_folder, read_frames_file,
                               stills_info, write_frames_file)

__all__ = ["FRAMES_SUFFIX", "VideoClip", "open_video", "probe_video", "read_video", "write_frames_file"]

SEEK_MODES = ("exact", "keyframe")


def read_video(
    path: str | os.PathLike[str],
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    folder_fps: float = 1.0,
    processor: ProcessorSampling | None = None,
    size: tuple[int, int] | None = None,
    max_side: int | None = None,
    seek: str = "exact",
) -> VideoClip:
    """Decode the frames of `path` that the request selects.

    num_frames: that many frames evenly spread over the whole video.
    fps: one frame every 1/fps seconds.
    processor: the checkpoint video processor's own rule (`ProcessorSampling`). None of the three: every frame.
    max_frames: keep at most this many of the selected frames, evenly spread.
    folder_fps: the frame rate given to a folder of frame images, which has none of its own.
    size: (height, width) of the frames returned, upright; max_side: instead, the display size shrunk so its
    longest side is at most this (`vpsd.video.frames.max_side_size`). Neither: the display size.
    seek: "exact" (the frames a front to back decode gives) or "keyframe" (approximate: the keyframe shown
    nearest to each wanted frame; a folder or a frames file is read exactly either way).
    """
    _check_request(path, num_frames=num_frames, fps=fps, max_frames=max_frames, folder_fps=folder_fps,
                   size=size, max_side=max_side, seek=seek)
    if processor is not None and (num_frames is not None or fps is not None):
        raise VideoError("bad_request", path, "give num_frames, fps or a processor rule, not two")
    path = _checked_path(path)
    request = dict(num_frames=num_frames, fps=fps, max_frames=max_frames, processor=processor)
    shape = dict(size=None if size is None else (int(size[0]), int(size[1])), max_side=max_side)
    if path.is_dir():
        return read_folder(path, folder_fps, request, shape)
    if path.suffix == FRAMES_SUFFIX:
        return read_frames_file(path, request, shape)
    return _read_container(path, request, shape, seek)


def probe_video(path: str | os.PathLike[str], *, folder_fps: float = 1.0) -> VideoInfo:
    """What `read_video` will read from `path`, without decoding it (see `vpsd.video.info.VideoInfo`): the
    frame count and rate selection uses, the frames' size, whether it seeks. VideoError as read_video raises."""
    path = _checked_path(path)
    if path.is_dir():
        files = folder_files(path)
        h, w = read_image(files[0]).shape[:2]
        return stills_info(len(files), float(folder_fps), h, w, "images")
    if path.suffix == FRAMES_SUFFIX:
        frames, _, rate = load_frames_file(path)
        return stills_info(len(frames), rate, frames.shape[1], frames.shape[2], "frames")
    return inspect_video(path)[0]


def _checked_path(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not path.exists():
        raise VideoError("missing", path, "no such file or directory")
    if not os.access(path, os.R_OK):
        raise VideoError("missing", path, "not readable (permission denied)")
    if path.is_file() and path.stat().st_size == 0:
        raise VideoError("empty", path, "file is zero bytes")
    return path


def open_video(path: str | os.PathLike[str]) -> None:
    """What a reader needs to start, and no more (`vpsd check`): the file there, readable and not empty; a
    container with a video stream and a frame rate whose first frame decodes (a folder: its first image; a
    frames file: its arrays). VideoError, of the kind `read_video` would raise, else None. A fault later in the
    stream shows only when the job decodes that far."""
    path = _checked_path(path)
    if path.is_dir():
        read_image(folder_files(path)[0])
        return
    if path.suffix == FRAMES_SUFFIX:
        load_frames_file(path)
        return
    with open_container(path) as container:
        stream = container.streams.video[0]
        if not (stream.average_rate or stream.guessed_rate or stream.base_rate):
            raise VideoError("corrupt", path, "video stream has no frame rate")
        try:
            first = next(iter(container.decode(stream)), None)
        except av.FFmpegError as err:
            raise VideoError("corrupt", path, f"{describe_av_error(err)} (at frame 0)") from None
        if first is None:
            raise VideoError("empty", path, "video stream has no frames")


def _check_request(path, *, num_frames, fps, max_frames, folder_fps, size=None, max_side=None,
                   seek="exact") -> None:
    def is_count(v) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0

    def is_rate(v) -> bool:
        return isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

    if num_frames is not None and fps is not None:
        raise VideoError("bad_request", path, "give num_frames or fps, not both")
    for name, value, ok in (
        ("num_frames", num_frames, is_count),
        ("max_frames", max_frames, is_count),
        ("max_side", max_side, is_count),
        ("fps", fps, is_rate),
    ):
        if value is not None and not ok(value):
            raise VideoError("bad_request", path, f"{name} must be positive, got {value!r}")
    if not is_rate(folder_fps):
        raise VideoError("bad_request", path, f"folder_fps must be positive, got {folder_fps!r}")
    if size is not None and not (isinstance(size, (tuple, list)) and len(size) == 2 and all(map(is_count, size))):
        raise VideoError("bad_request", path, f"size must be (height, width), both positive, got {size!r}")
    if size is not None and max_side is not None:
        raise VideoError("bad_request", path, "give size or max_side, not both")
    if seek not in SEEK_MODES:
        raise VideoError("bad_request", path, f"seek must be one of {SEEK_MODES}, got {seek!r}")


def _probe(path: Path) -> tuple[int, float]:
    """(number of frames, frame rate) of the first video stream: what selection counts from. Containers like
    mp4 store the frame count; others (webm, mkv) have their packets counted (`vpsd.video.info`)."""
    info = inspect_video(path)[0]
    return info.num_frames, info.fps


def _decode(path: Path, wanted: np.ndarray, source_fps: float,
            convert: Convert) -> tuple[dict[int, np.ndarray], dict[int, float], int]:
    """Decode front to back up to the last wanted index.

    Returns RGB frames and timestamps of the wanted indices, and how many frames were decoded
    (fewer than asked only if the stream ended early).
    """
    wanted_set = set(wanted.tolist())
    last = int(wanted[-1])
    frames: dict[int, np.ndarray] = {}
    times: dict[int, float] = {}
    start: float | None = None
    count = 0
    with open_container(path) as container:
        stream = container.streams.video[0]
        # No frame threading ("AUTO"), here as when seeking: it would be faster on long videos, but FFmpeg's
        # frame-threaded decoder drops a damaged frame without reporting it, and a truncated file would then
        # read as a shorter video instead of a corrupt one.
        try:
            for frame in container.decode(stream):
                i = count
                count += 1
                time = frame.time if frame.time is not None else i / source_fps
                if start is None:
                    start = time
                if i in wanted_set:
                    # A stream whose size changes mid-way is scaled back to its first size (`to_rgb`).
                    frames[i] = convert(frame)
                    times[i] = time - start
                if i == last:
                    break
        except av.FFmpegError as err:
            raise VideoError("corrupt", path, f"{describe_av_error(err)} (at frame {count})") from None
    return frames, times, count


def _read_container(path: Path, request: dict, shape: dict, seek: str) -> VideoClip:
    num_source, source_fps = _probe(path)
    info, index = inspect_video(path)
    if num_source <= 0:
        raise VideoError("empty", path, "video stream has no frames")
    g = geometry(info.coded_height, info.coded_width, info.sample_aspect_ratio, info.rotation, **shape)
    convert = partial(to_rgb, g=g)
    reason = info.fallback_reason
    if reason is None and num_source != len(index):
        reason = f"the stored frame count ({num_source}) is not the packets' ({len(index)})"
    if reason is None:
        indices = select_indices(num_source, source_fps, **request)
        try:
            return _read_by_seeking(path, index, indices, g, convert, seek, num_source, source_fps)
        except Untrusted as err:
            reason = str(err)
    return _read_front_to_back(path, request, convert, num_source, source_fps, reason)


def _read_by_seeking(path: Path, index: PacketIndex, indices: np.ndarray, g: Geometry, convert: Convert, seek: str,
                     num_source: int, source_fps: float) -> VideoClip:
    with open_container(path) as container:
        if seek == "keyframe":
            frames, chosen, decoded = read_keyframes(container, index, np.unique(indices), g.coded, convert)
            indices = np.array([chosen[i] for i in indices.tolist()], dtype=np.int64)
        else:
            frames, decoded = read_exact(container, index, np.unique(indices), g.coded, convert)
    start = index.time(0)
    return VideoClip(
        frames=np.stack([frames[i] for i in indices.tolist()]),
        fps=source_fps,
        timestamps=np.array([index.time(i) - start for i in indices.tolist()], dtype=np.float64),
        source_num_frames=num_source,
        duration_s=num_source / source_fps,
        indices=indices,
        read_mode=seek,
        frames_decoded=decoded,
    )


def _read_front_to_back(path: Path, request: dict, convert: Convert, num_source: int, source_fps: float,
                        reason: str | None) -> VideoClip:
    total = 0
    while True:
        if num_source <= 0:
            raise VideoError("empty", path, "video stream has no frames")
        indices = select_indices(num_source, source_fps, **request)
        frames, times, decoded = _decode(path, np.unique(indices), source_fps, convert)
        total += decoded
        if decoded > indices[-1]:
            break
        # The stored count overstated the stream (edit lists, a lost tail without errors):
        # select again from the frames that really exist, so sampling stays uniform.
        num_source = decoded
    return VideoClip(
        frames=np.stack([frames[i] for i in indices.tolist()]),
        fps=source_fps,
        timestamps=np.array([times[i] for i in indices.tolist()], dtype=np.float64),
        source_num_frames=num_source,
        duration_s=num_source / source_fps,
        indices=indices,
        read_mode="sequential",
        fallback_reason=reason,
        frames_decoded=total,
    )

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
- A dense read may be split (`parts`, `map_parts`: `vpsd.video.pool.ReaderPool.map_parts`): the wanted frames
  are cut at keyframe stretches into contiguous parts of about equal decoding work (`split_wanted`), each part
  read on its own container and decoder (`read_part`), the parts at once, the rows put back in order. Each part
  starts at a stretch the whole read would seek to as well, so the frames, timestamps and frames decoded are the
  whole read's, bit for bit. Only exact reads by a trusted index split; a part that finds the index untrusted
  makes the whole video read front to back, as an unsplit read would.
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
from typing import Any, Callable, Sequence

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

__all__ = ["FRAMES_SUFFIX", "VideoClip", "open_video", "probe_video", "read_part", "read_video", "split_wanted",
           "write_frames_file"]

SEEK_MODES = ("exact", "keyframe")

# map_parts(fn, parts) -> [fn(p) for p in parts], run at once (`vpsd.video.pool.ReaderPool.map_parts`).
MapParts = Callable[[Callable[[Any], Any], Sequence[Any]], list]
# A read splits only when it keeps more frames than this many keyframe intervals (on average) hold: fps 2 over an
# hour does, 64 frames of an hour do not (those are a seek each; the pool's readers read the next items instead).
SPLIT_MIN_INTERVALS = 4


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
    parts: int = 1,
    map_parts: MapParts | None = None,
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
    parts, map_parts: read a dense exact read in up to `parts` parts between keyframes, run by `map_parts`
    (`split_wanted` says when it splits); the same clip as read whole, bit for bit (`VideoClip.parts`: how many).
    """
    _check_request(path, num_frames=num_frames, fps=fps, max_frames=max_frames, folder_fps=folder_fps,
                   size=size, max_side=max_side, seek=seek)
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise VideoError("bad_request", path, f"parts must be positive, got {parts!r}")
    if processor is not None and (num_frames is not None or fps is not None):
        raise VideoError("bad_request", path, "give num_frames, fps or a processor rule, not two")
    path = _checked_path(path)
    request = dict(num_frames=num_frames, fps=fps, max_frames=max_frames, processor=processor)
    shape = dict(size=None if size is None else (int(size[0]), int(size[1])), max_side=max_side)
    if path.is_dir():
        return read_folder(path, folder_fps, request, shape)
    if path.suffix == FRAMES_SUFFIX:
        return read_frames_file(path, request, shape)
    return _read_container(path, request, shape, seek, int(parts) if map_parts is not None else 1, map_parts)


def split_wanted(index: PacketIndex, wanted: np.ndarray, parts: int,
                 min_intervals: float | None = None) -> list[np.ndarray]:
    """The sorted, unique `wanted` cut into at most `parts` contiguous pieces, each starting at the first wanted
    frame of a keyframe stretch (between two seek points), of about equal decoding work (a stretch touched costs
    the frames from its seek point to its last wanted frame); one piece when the read is not dense enough to pay
    (no more wanted frames than `min_intervals`, default SPLIT_MIN_INTERVALS, average keyframe intervals hold) or
    touches one stretch."""
    wanted = np.asarray(wanted, dtype=np.int64)
    if min_intervals is None:
        min_intervals = SPLIT_MIN_INTERVALS
    if parts < 2 or len(wanted) < 2 or not len(index.seek_points):
        return [wanted]
    if len(wanted) <= min_intervals * len(index) / len(index.seek_points):
        return [wanted]
    stretch = np.searchsorted(index.seek_points, wanted, side="right") - 1
    firsts = np.flatnonzero(np.diff(stretch, prepend=-1))  # where each stretch touched starts in `wanted`
    if len(firsts) < 2:
        return [wanted]
    lasts = np.append(firsts[1:], len(wanted)) - 1
    work = np.cumsum(wanted[lasts] - index.seek_points[stretch[firsts]] + 1)
    total = int(work[-1])
    cuts: list[int] = []  # group numbers a new piece starts at
    for k in range(1, min(parts, len(firsts))):
        share = total * k / parts
        g = int(np.searchsorted(work, share))  # the group where the k-th share of work ends
        if g + 1 < len(firsts) and (g == 0 or work[g] - share <= share - work[g - 1]):
            g += 1  # cut after the group ending nearer the share
        if g >= len(firsts):
            g = len(firsts) - 1
        if g > (cuts[-1] if cuts else 0):
            cuts.append(g)
    return np.split(wanted, firsts[cuts])


def read_part(path: Path, index: PacketIndex, wanted: np.ndarray, coded: tuple[int, int],
              convert: Convert) -> tuple[dict[int, np.ndarray], int]:
    """(frame index -> converted frame, frames decoded) for the sorted, unique `wanted` (a piece of
    `split_wanted`), on a container of its own: the rows the whole read gives for them; raises Untrusted."""
    with open_container(path) as container:
        return read_exact(container, index, wanted, coded, convert)


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


def _read_container(path: Path, request: dict, shape: dict, seek: str, parts: int = 1,
                    map_parts: MapParts | None = None) -> VideoClip:
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
            return _read_by_seeking(path, index, indices, g, convert, seek, num_source, source_fps, parts, map_parts)
        except Untrusted as err:
            reason = str(err)
    return _read_front_to_back(path, request, convert, num_source, source_fps, reason)


def _read_by_seeking(path: Path, index: PacketIndex, indices: np.ndarray, g: Geometry, convert: Convert, seek: str,
                     num_source: int, source_fps: float, parts: int = 1,
                     map_parts: MapParts | None = None) -> VideoClip:
    pieces = [np.unique(indices)]
    if seek == "keyframe":
        with open_container(path) as container:
            frames, chosen, decoded = read_keyframes(container, index, pieces[0], g.coded, convert)
        indices = np.array([chosen[i] for i in indices.tolist()], dtype=np.int64)
    else:
        if map_parts is not None and parts > 1:
            pieces = split_wanted(index, pieces[0], parts)
        if len(pieces) > 1:
            read = map_parts(partial(read_part, path, index, coded=g.coded, convert=convert), pieces)
            frames = {i: f for part, _ in read for i, f in part.items()}
            decoded = sum(n for _, n in read)
        else:
            frames, decoded = read_part(path, index, pieces[0], g.coded, convert)
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
        parts=len(pieces),
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

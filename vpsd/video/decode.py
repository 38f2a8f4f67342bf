"""Read a video file (or a folder of frame images, or a frames file) into sampled RGB frames.

Contract:
- `read_video` returns a `VideoClip` with the frames a request selects (see `vpsd.video.sampling`
  for the rules: by count, by rate, or all, then capped by `max_frames`).
- A long video is decoded once, front to back, stopping after the last wanted frame; only wanted
  frames are converted to RGB and kept, so memory grows with the clip, not the video.
- Every failure is a `VideoError` whose `kind` tells callers what happened; no PyAV exception
  escapes. Any decoding error, even after some good frames, makes the video "corrupt": a truncated
  download is not silently read as a shorter video.
- A frames file (`.npz`: `frames`, a (T, H, W, 3) uint8 array, and `times`, its (T,) seconds) is frames already
  decoded, read under the same rules; the Python API hands its in-memory frames to a rank this way.
- `open_video` checks what a reader needs to start (a container, a video stream, its first frame), for
  `vpsd check`.
- Only the first video stream is read. Sampling by rate assumes a constant frame rate (the
  stream's average rate); timestamps are the decoded frames' own presentation times, counted from
  the first frame.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from vpsd.video.errors import VideoError, describe_av_error
from vpsd.video.folder import IMAGE_SUFFIXES, frame_files, read_image
from vpsd.video.sampling import ProcessorSampling, select_indices


@dataclass
class VideoClip:
    frames: np.ndarray  # (T, H, W, 3) uint8 RGB
    fps: float  # frame rate of the source, not of the sampled clip
    timestamps: np.ndarray  # (T,) float64, seconds of each sampled frame from the source's start
    source_num_frames: int  # frames in the whole source
    duration_s: float  # source_num_frames / fps
    indices: np.ndarray  # (T,) int64, source frame index of each sampled frame, non-decreasing

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


def read_video(
    path: str | os.PathLike[str],
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    folder_fps: float = 1.0,
    processor: ProcessorSampling | None = None,
) -> VideoClip:
    """Decode the frames of `path` that the request selects.

    num_frames: that many frames evenly spread over the whole video.
    fps: one frame every 1/fps seconds.
    processor: the checkpoint video processor's own rule (`ProcessorSampling`). None of the three: every frame.
    max_frames: keep at most this many of the selected frames, evenly spread.
    folder_fps: the frame rate given to a folder of frame images, which has none of its own.
    """
    _check_request(path, num_frames=num_frames, fps=fps, max_frames=max_frames, folder_fps=folder_fps)
    if processor is not None and (num_frames is not None or fps is not None):
        raise VideoError("bad_request", path, "give num_frames, fps or a processor rule, not two")
    path = Path(path)
    if not path.exists():
        raise VideoError("missing", path, "no such file or directory")
    if not os.access(path, os.R_OK):
        raise VideoError("missing", path, "not readable (permission denied)")
    request = dict(num_frames=num_frames, fps=fps, max_frames=max_frames, processor=processor)
    if path.is_dir():
        return _read_folder(path, folder_fps, request)
    if path.stat().st_size == 0:
        raise VideoError("empty", path, "file is zero bytes")
    if path.suffix == FRAMES_SUFFIX:
        return _read_frames_file(path, request)
    return _read_container(path, request)


def open_video(path: str | os.PathLike[str]) -> None:
    """What a reader needs to start, and no more (`vpsd check`): the file there, readable and not empty; a
    container with a video stream and a frame rate whose first frame decodes (a folder: its first image; a
    frames file: its arrays). VideoError, of the kind `read_video` would raise, else None. A fault later in the
    stream shows only when the job decodes that far."""
    path = Path(path)
    if not path.exists():
        raise VideoError("missing", path, "no such file or directory")
    if not os.access(path, os.R_OK):
        raise VideoError("missing", path, "not readable (permission denied)")
    if path.is_dir():
        files = frame_files(path)
        if not files:
            raise VideoError("empty", path, f"folder holds no frame images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        read_image(files[0])
        return
    if path.stat().st_size == 0:
        raise VideoError("empty", path, "file is zero bytes")
    if path.suffix == FRAMES_SUFFIX:
        _read_frames_file(path, dict(num_frames=1, fps=None, max_frames=None, processor=None))
        return
    with _open(path) as container:
        stream = container.streams.video[0]
        if not (stream.average_rate or stream.guessed_rate or stream.base_rate):
            raise VideoError("corrupt", path, "video stream has no frame rate")
        try:
            first = next(iter(container.decode(stream)), None)
        except av.FFmpegError as err:
            raise VideoError("corrupt", path, f"{describe_av_error(err)} (at frame 0)") from None
        if first is None:
            raise VideoError("empty", path, "video stream has no frames")


def _check_request(path, *, num_frames, fps, max_frames, folder_fps) -> None:
    def is_count(v) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0

    def is_rate(v) -> bool:
        return isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

    if num_frames is not None and fps is not None:
        raise VideoError("bad_request", path, "give num_frames or fps, not both")
    for name, value, ok in (
        ("num_frames", num_frames, is_count),
        ("max_frames", max_frames, is_count),
        ("fps", fps, is_rate),
    ):
        if value is not None and not ok(value):
            raise VideoError("bad_request", path, f"{name} must be positive, got {value!r}")
    if not is_rate(folder_fps):
        raise VideoError("bad_request", path, f"folder_fps must be positive, got {folder_fps!r}")


def _read_folder(folder: Path, folder_fps: float, request: dict) -> VideoClip:
    files = frame_files(folder)
    if not files:
        suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
        raise VideoError("empty", folder, f"folder holds no frame images ({suffixes})")
    indices = select_indices(len(files), folder_fps, **request)
    first = read_image(files[int(indices[0])])
    decoded = {int(indices[0]): first}
    for i in np.unique(indices[1:]).tolist():
        if i not in decoded:
            decoded[i] = read_image(files[i], size=first.shape[:2])
    return VideoClip(
        frames=np.stack([decoded[i] for i in indices.tolist()]),
        fps=float(folder_fps),
        timestamps=indices / float(folder_fps),
        source_num_frames=len(files),
        duration_s=len(files) / float(folder_fps),
        indices=indices,
    )


FRAMES_SUFFIX = ".npz"


def write_frames_file(path: Path, frames: np.ndarray, times: np.ndarray) -> None:
    """Frames already decoded, as `read_video` reads them back (uncompressed: written and read once)."""
    np.savez(path, frames=np.ascontiguousarray(frames, dtype=np.uint8), times=np.asarray(times, dtype=np.float64))


def _read_frames_file(path: Path, request: dict) -> VideoClip:
    try:
        with np.load(path, allow_pickle=False) as data:
            frames, times = data["frames"], np.asarray(data["times"], dtype=np.float64)
    except (OSError, ValueError, KeyError) as err:
        raise VideoError("corrupt", path, f"not a frames file (.npz with frames and times): {err}") from None
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or times.shape != (len(frames),):
        raise VideoError("corrupt", path, f"frames {frames.dtype} {tuple(frames.shape)} with times "
                         f"{tuple(times.shape)}: need (T, H, W, 3) uint8 and (T,)")
    if len(frames) == 0:
        raise VideoError("empty", path, "frames file holds no frames")
    span_s = float(times[-1] - times[0]) if len(times) > 1 else 0.0
    fps = (len(times) - 1) / span_s if span_s > 0 else 1.0  # for a request by rate: the frames' mean rate
    indices = select_indices(len(frames), fps, **request)
    return VideoClip(frames=frames[indices], fps=fps, timestamps=times[indices], source_num_frames=len(frames),
                     duration_s=len(frames) / fps, indices=indices)


def _open(path: Path) -> av.container.InputContainer:
    try:
        container = av.open(str(path), metadata_errors="ignore")
    except av.FFmpegError as err:
        raise VideoError("corrupt", path, describe_av_error(err)) from None
    if not container.streams.video:
        found = ", ".join(s.type for s in container.streams) or "none"
        container.close()
        raise VideoError("no_video_stream", path, f"streams found: {found}")
    return container


def _probe(path: Path) -> tuple[int, float]:
    """(number of frames, frame rate) of the first video stream."""
    with _open(path) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate or rate <= 0:
            raise VideoError("corrupt", path, "video stream has no frame rate")
        # Containers like mp4 store the frame count; others (webm, mkv) need the packets counted,
        # which reads the file but decodes nothing.
        num_source = stream.frames
        if num_source <= 0:
            try:
                num_source = sum(1 for packet in container.demux(stream) if packet.size)
            except av.FFmpegError as err:
                raise VideoError("corrupt", path, describe_av_error(err)) from None
        return num_source, float(rate)


def _decode(path: Path, wanted: np.ndarray, source_fps: float) -> tuple[dict[int, np.ndarray], dict[int, float], int]:
    """Decode front to back up to the last wanted index.

    Returns RGB frames and timestamps of the wanted indices, and how many frames were decoded
    (fewer than asked only if the stream ended early).
    """
    wanted_set = set(wanted.tolist())
    last = int(wanted[-1])
    frames: dict[int, np.ndarray] = {}
    times: dict[int, float] = {}
    size: tuple[int, int] | None = None
    start: float | None = None
    count = 0
    with _open(path) as container:
        stream = container.streams.video[0]
        # No frame threading ("AUTO"): it would be faster on long videos, but FFmpeg's frame-threaded
        # decoder drops a damaged frame without reporting it, and a truncated file would then
        # read as a shorter video instead of a corrupt one.
        try:
            for frame in container.decode(stream):
                i = count
                count += 1
                time = frame.time if frame.time is not None else i / source_fps
                if start is None:
                    start = time
                    size = (frame.height, frame.width)
                if i in wanted_set:
                    # A stream whose size changes mid-way is scaled back to its first size.
                    frames[i] = frame.to_ndarray(format="rgb24", height=size[0], width=size[1])
                    times[i] = time - start
                if i == last:
                    break
        except av.FFmpegError as err:
            raise VideoError("corrupt", path, f"{describe_av_error(err)} (at frame {count})") from None
    return frames, times, count


def _read_container(path: Path, request: dict) -> VideoClip:
    num_source, source_fps = _probe(path)
    while True:
        if num_source <= 0:
            raise VideoError("empty", path, "video stream has no frames")
        indices = select_indices(num_source, source_fps, **request)
        frames, times, decoded = _decode(path, np.unique(indices), source_fps)
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
    )

"""What a video is, before any of it is decoded: `probe_video(path) -> VideoInfo`.

Enough to know which frames a request selects and how many tokens they make before reading them: the frame
count and rate a read selects from, the size the frames come back at (upright, at display aspect), and whether
the reader will seek (`seekable`) or decode front to back (`fallback_reason`). From the container's metadata
and its packet index (`vpsd.video.index`: every packet demuxed, none decoded), plus the stream's first frame,
the only place FFmpeg puts a stream's display rotation.

The frame count is the stored one where the container has it (mp4, mov), else the packets counted (mkv,
webm): the count selection has always used. When the index is not trusted, a read may find fewer frames than
that (an edit list, a lost tail) and select again from the real ones, as `VideoClip.source_num_frames` says.

Probes are kept (a few, keyed by the file's identity: its path, device, inode, size and modification time,
`vpsd.video.identity`), so that probing then
reading a video scans its packets once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from vpsd.video.errors import VideoError, describe_av_error
from vpsd.video.frames import quarter_turns, upright_size
from vpsd.video.identity import file_identity
from vpsd.video.index import PacketIndex, scan_packets
from vpsd.video.sampling import ProcessorSampling, select_indices


@dataclass(frozen=True)
class VideoInfo:
    num_frames: int  # frames a read selects from (`select_indices`' num_source)
    fps: float  # the stream's average rate: what selection by rate uses
    duration_s: float  # num_frames / fps
    height: int  # frames as a read returns them without a size: upright, at display aspect
    width: int
    coded_height: int  # frames as decoded
    coded_width: int
    sample_aspect_ratio: Fraction  # of a coded pixel (1: square)
    rotation: int  # degrees the frames are turned counterclockwise to stand upright: 0, 90, 180 or 270
    codec: str
    keyframes: int  # seek points in the index
    seekable: bool  # a read seeks to the keyframe before each wanted frame; False: it decodes front to back
    fallback_reason: str | None  # why not seekable

    @property
    def display_aspect_ratio(self) -> Fraction:
        """Width over height as shown."""
        return Fraction(self.width, self.height)

    def indices(self, *, num_frames: int | None = None, fps: float | None = None, max_frames: int | None = None,
                processor: ProcessorSampling | None = None) -> np.ndarray:
        """The frame indices `read_video` selects for that request (see `vpsd.video.sampling`)."""
        return select_indices(self.num_frames, self.fps, num_frames=num_frames, fps=fps, max_frames=max_frames,
                              processor=processor)


def open_container(path: Path) -> av.container.InputContainer:
    """The container at `path`, with at least one video stream; VideoError otherwise."""
    try:
        container = av.open(str(path), metadata_errors="ignore")
    except av.FFmpegError as err:
        raise VideoError("corrupt", path, describe_av_error(err)) from None
    if not container.streams.video:
        found = ", ".join(s.type for s in container.streams) or "none"
        container.close()
        raise VideoError("no_video_stream", path, f"streams found: {found}")
    return container


def stream_rate(path: Path, stream: av.video.stream.VideoStream) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0:
        raise VideoError("corrupt", path, "video stream has no frame rate")
    return float(rate)


def _inspect(path: Path) -> tuple[VideoInfo, PacketIndex]:
    with open_container(path) as container:
        stream = container.streams.video[0]
        fps = stream_rate(path, stream)
        stored = max(0, int(stream.frames or 0))
        try:
            index, first, demux_error = scan_packets(container, stream)
        except av.FFmpegError as err:
            raise VideoError("corrupt", path, f"{describe_av_error(err)} (at frame 0)") from None
        if demux_error is not None and stored <= 0:
            # No stored count and the packets cannot be counted: nothing to select from.
            raise VideoError("corrupt", path, demux_error)
        num_frames = stored or len(index)
        if num_frames <= 0 or first is None:
            raise VideoError("empty", path, "video stream has no frames")
        reason = index.untrusted
        if reason is None and num_frames != len(index):
            reason = f"the container says {num_frames} frames, its packets {len(index)}"
        sar = stream.sample_aspect_ratio or Fraction(1)
        turns = quarter_turns(first.rotation)
        height, width = upright_size(first.height, first.width, sar, turns)
        info = VideoInfo(
            num_frames=num_frames, fps=fps, duration_s=num_frames / fps, height=height, width=width,
            coded_height=first.height, coded_width=first.width, sample_aspect_ratio=Fraction(sar),
            rotation=90 * turns, codec=stream.codec_context.name, keyframes=len(index.seek_points),
            seekable=reason is None, fallback_reason=reason,
        )
        return info, index


_CACHE: OrderedDict[tuple, tuple[VideoInfo, PacketIndex]] = OrderedDict()
_CACHE_SIZE = 8
_LOCK = threading.Lock()


def inspect_video(path: Path) -> tuple[VideoInfo, PacketIndex]:
    """(info, packet index) of the video file at `path`, from the cache when the file is unchanged."""
    key = file_identity(path)
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    found = _inspect(path)
    with _LOCK:
        _CACHE[key] = found
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return found

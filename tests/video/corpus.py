"""A corpus of small real videos, written by the tests with PyAV's own encoders (nothing downloaded).

Codecs and containers a dataset holds (H.264 with B-frames and open GOPs, HEVC, VP9, AV1, MPEG-4 part 2; mp4,
mkv, webm, mov, mpeg-ts, avi), and the files that trip readers up: variable frame rate, a first pts that is
not 0, rotation metadata, non-square pixels, odd sizes, 10-bit, an edit list, packets without timestamps or
sharing one, a stored frame count or duration that is wrong, truncated files. Each is 2-6 s of 48x64 to 96x128
pixels, so the whole corpus is written in a few seconds.

`Entry.mode` is how the reader must read it: "exact" (seeking by the packet index) or "sequential" (front to
back, `Entry.reason` naming why). Frames move (a gradient, a fixed texture shifted each frame, a square), so
that inter prediction is used and a frame decoded from the wrong references shows.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator

import av
import numpy as np

RATE = 12


def picture(i: int, height: int, width: int) -> np.ndarray:
    """Frame i: a drifting colour gradient, a texture shifted by (1, 2) pixels a frame, a moving square."""
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.stack([(xx * 200 // width + 3 * i) % 256, (yy * 200 // height + 5 * i) % 256,
                    ((xx + yy) * 2 + 7 * i) % 256], axis=-1)
    texture = np.random.default_rng(7).integers(-24, 25, (height, width, 1))
    img = img + np.roll(texture, (i, 2 * i), axis=(0, 1))
    y, x = (3 * i) % max(1, height - 10), (5 * i) % max(1, width - 10)
    img[y:y + 10, x:x + 10] = (40 * i) % 256
    return np.clip(img, 0, 255).astype(np.uint8)


def can_encode(codec: str) -> bool:
    try:
        av.codec.Codec(codec, "w")
        return True
    except Exception:  # unknown to this FFmpeg build, or a decoder only
        return False


def can_decode(codec: str) -> bool:
    try:
        av.codec.Codec(codec, "r")
        return True
    except Exception:
        return False


@contextlib.contextmanager
def scheduling_kept() -> Iterator[None]:
    """The calling thread's scheduling policy and priority, put back on exit. SVT-AV1's encoder (libsvtav1, in
    PyAV's wheel), run as root, makes the thread that opens it SCHED_FIFO at priority 99, and every thread and
    process that thread starts later inherits it: a test worker that built the AV1 entry then ran the rest of its
    share of the suite, torchrun jobs and servers included, as real-time tasks, and a server's busy child spun at
    priority 99 on a 2-core machine until the case timed out."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def encode(path: Path, codec: str, *, frames: int = 48, size: tuple[int, int] = (48, 64), rate: int = RATE,
           options: dict | None = None, pix_fmt: str = "yuv420p", fmt: str | None = None,
           pts_ms: list[int] | None = None, rotation: int | None = None, sar: Fraction | None = None,
           container_options: dict | None = None) -> Path:
    """`frames` pictures encoded with `codec`; `pts_ms`: each frame's time in milliseconds (variable rate)."""
    height, width = size
    with scheduling_kept(), av.open(str(path), "w", format=fmt, options=container_options or {}) as container:
        stream = container.add_stream(codec, rate=rate, options=options or {})
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if pts_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if sar is not None:
            stream.codec_context.sample_aspect_ratio = sar
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(picture(i, height, width), format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = pts_ms[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def remux(src: Path, dst: Path, edit: Callable[[int, av.Packet], None]) -> Path:
    """`src`'s video packets into `dst` untouched but for `edit(k, packet)` (timestamps)."""
    with av.open(str(src)) as inp, av.open(str(dst), "w") as out:
        stream = inp.streams.video[0]
        target = out.add_stream_from_template(stream)
        for k, packet in enumerate(p for p in inp.demux(stream) if p.size):
            edit(k, packet)
            packet.stream = target
            out.mux(packet)
    return dst


def cut(path: Path, keep: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


X264_OPEN_GOP = {"bf": "3", "x264-params": "open-gop=1:keyint=12:min-keyint=12:scenecut=0"}
X264 = {"bf": "2", "x264-params": "keyint=10:min-keyint=10:scenecut=0"}
X265 = {"x265-params": "keyint=12:min-keyint=12:bframes=3:open-gop=1:scenecut=0:log-level=error"}
VFR_MS = np.cumsum([0] + [40, 120, 40, 80, 200, 40, 40, 160, 80, 40, 120, 40] * 4)[:48].tolist()


def _shifted(ms: int) -> Callable[[Path], Path]:
    """An mkv whose timestamps start `ms` milliseconds in."""
    def build(path: Path) -> Path:
        src = encode(path.with_name(f"src-{path.name}"), "libx264", options=X264, fmt="matroska")
        return remux(src, path, lambda k, p: _shift(p, ms))
    return build


def _shift(packet: av.Packet, ms: int) -> None:
    packet.pts += ms
    if packet.dts is not None:
        packet.dts += ms


def _edit_list(path: Path) -> Path:
    # Timestamps moved 3 frames early: the mp4 muxer writes an edit list starting at 0, and the demuxer flags
    # the packets before it to be discarded; the stored count still counts them.
    src = encode(path.with_name("src-edit.mkv"), "libx264", options=X264)
    return remux(src, path, lambda k, p: _shift(p, -250))


def _duplicate_pts(path: Path) -> Path:
    src = encode(path.with_name("src-dup.mkv"), "libx264", options={"bf": "0", "g": "12"}, frames=24)
    seen: list[int] = []

    def edit(k: int, p: av.Packet) -> None:
        if k == 10:
            p.pts = p.dts = seen[-1]
        seen.append(p.pts)
    return remux(src, path, edit)


def _wrong_count_avi(path: Path) -> Path:
    """An avi whose header says 60 frames (its video stream header's dwLength); 48 are there."""
    encode(path, "mpeg4", options={"bf": "2", "sc_threshold": "1000000000", "g": "12"})
    data = bytearray(path.read_bytes())
    at = data.find(b"strh")
    struct.pack_into("<I", data, at + 8 + 32, 60)
    path.write_bytes(bytes(data))
    return path


def _wrong_duration_mkv(path: Path) -> Path:
    """An mkv whose segment says it lasts 60 s (its Duration element); it lasts 4 s."""
    encode(path, "libx264", options=X264_OPEN_GOP)
    data = bytearray(path.read_bytes())
    at = data.find(bytes([0x44, 0x89, 0x88]))  # Duration, an 8-byte float, in ms
    struct.pack_into(">d", data, at + 3, 60000.0)
    path.write_bytes(bytes(data))
    return path


@dataclass(frozen=True)
class Entry:
    name: str  # the file's name
    build: Callable[[Path], Path]
    mode: str = "exact"  # how read_video must read it: "exact" or "sequential"
    reason: str = ""  # words of the fallback reason (sequential)
    error: str | None = None  # the VideoError kind of a read that reaches the last frame
    encoders: tuple[str, ...] = ()
    decoders: tuple[str, ...] = ()
    rotation: int = 0
    size: tuple[int, int] = (48, 64)  # (height, width) as read: upright, at display aspect

    def __str__(self) -> str:
        return self.name


def _enc(codec: str, **kwargs) -> Callable[[Path], Path]:
    return lambda path: encode(path, codec, **kwargs)


ENTRIES: tuple[Entry, ...] = (
    Entry("h264-open-gop.mp4", _enc("libx264", options=X264_OPEN_GOP), encoders=("libx264",)),
    Entry("h264-open-gop.mkv", _enc("libx264", options=X264_OPEN_GOP), encoders=("libx264",)),
    Entry("h264-bframes.mov", _enc("libx264", options=X264, size=(64, 80), frames=40), encoders=("libx264",),
          size=(64, 80)),
    # mpeg-ts starts its clock at 0.17 s and seeks by bisection; this mkv starts at 1.5 s.
    Entry("h264.ts", _enc("libx264", options=X264, fmt="mpegts"), encoders=("libx264",)),
    Entry("h264-late-start.mkv", _shifted(1500), encoders=("libx264",)),
    Entry("h264-vfr.mkv", _enc("libx264", options=X264, pts_ms=VFR_MS), encoders=("libx264",)),
    Entry("h264-vfr.mp4", _enc("libx264", options=X264, pts_ms=VFR_MS), encoders=("libx264",)),
    Entry("h264-10bit.mp4", _enc("libx264", options=X264, pix_fmt="yuv420p10le"), encoders=("libx264",)),
    Entry("h264-rot90.mp4", _enc("libx264", options=X264, rotation=90), encoders=("libx264",), rotation=90,
          size=(64, 48)),
    Entry("h264-rot-90.mov", _enc("libx264", options=X264, rotation=-90), encoders=("libx264",), rotation=270,
          size=(64, 48)),
    Entry("h264-rot180.mp4", _enc("libx264", options=X264, rotation=180), encoders=("libx264",), rotation=180),
    Entry("h264-sar4x3.mp4", _enc("libx264", options=X264, sar=Fraction(4, 3)), encoders=("libx264",),
          size=(48, 85)),
    Entry("hevc-open-gop.mp4", _enc("libx265", options=X265), encoders=("libx265",), decoders=("hevc",)),
    Entry("hevc-10bit.mkv", _enc("libx265", options=X265, pix_fmt="yuv420p10le"), encoders=("libx265",),
          decoders=("hevc",)),
    Entry("vp9.webm", _enc("libvpx-vp9", options={"g": "12"}), encoders=("libvpx-vp9",)),
    Entry("vp9-odd.webm", _enc("libvpx-vp9", options={"g": "12"}, size=(49, 65)), encoders=("libvpx-vp9",),
          size=(49, 65)),
    Entry("av1.webm", _enc("libsvtav1", options={"g": "12", "svtav1-params": "log-level=0"}, size=(64, 96)),
          encoders=("libsvtav1",), decoders=("libdav1d",), size=(64, 96)),
    Entry("mpeg4.mp4", _enc("mpeg4", options={"bf": "2", "sc_threshold": "1000000000", "g": "12"}),
          encoders=("mpeg4",)),
    Entry("edit-list.mp4", _edit_list, mode="sequential", reason="discarded", encoders=("libx264",)),
    Entry("duplicate-pts.mkv", _duplicate_pts, mode="sequential", reason="share a presentation time",
          encoders=("libx264",)),
    Entry("no-pts.h264", _enc("libx264", options=X264, fmt="h264"), mode="sequential",
          reason="without a presentation time", encoders=("libx264",)),
    Entry("wrong-count.avi", _wrong_count_avi, mode="sequential", reason="60 frames, its packets 48",
          encoders=("mpeg4",)),
    Entry("wrong-duration.mkv", _wrong_duration_mkv, encoders=("libx264",)),
    Entry("truncated.mp4", lambda p: cut(encode(p, "libx264", options=X264,
                                                container_options={"movflags": "faststart"}), 0.7),
          mode="sequential", reason="corrupt", error="corrupt", encoders=("libx264",)),
    # The matroska demuxer ends a cut file at its last whole block without a word: a front to back decode reads
    # a shorter video (32 frames of 48), and so does the reader, seeking.
    Entry("truncated.mkv", lambda p: cut(encode(p, "libx264", options=X264), 0.7), encoders=("libx264",)),
)


def missing_codecs(entry: Entry) -> str | None:
    """Why this FFmpeg build cannot make or read `entry`, or None."""
    for codec in entry.encoders:
        if not can_encode(codec):
            return f"no {codec} encoder in this PyAV build"
    for codec in entry.decoders:
        if not can_decode(codec):
            return f"no {codec} decoder in this PyAV build"
    return None

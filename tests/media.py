"""Tiny test media written with PyAV: good videos whose frames encode their index, and broken files; and the two
held-out long-world items the long pair's tests decode.

Frame i of a gray video is a solid gray of level `gray_level(i)`, so a test can tell which source
frame it got back from the decoded pixels alone (codecs move a flat gray by a level or two).
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np

from vpsd.world.dataset import write_long_manifest

GRAY_STEP = 8
GRAY_TOLERANCE = 3  # yuv420p round trip of a flat gray, limited range: off by at most ~2


def gray_level(i: int) -> int:
    return GRAY_STEP * i


def decoded_index(frame: np.ndarray) -> int:
    """The source index a decoded gray frame encodes; asserts it is close enough to be sure."""
    level = float(frame.mean())
    i = round(level / GRAY_STEP)
    assert abs(level - gray_level(i)) <= GRAY_TOLERANCE, f"mean level {level} is no frame's gray"
    return i


def _codec_for(suffix: str) -> str:
    preferred = {".mp4": ("libx264", "h264", "mpeg4"), ".mkv": ("libx264", "mpeg4"), ".webm": ("libvpx-vp9", "libvpx")}
    for name in preferred[suffix]:
        if name in av.codecs_available:
            try:
                av.codec.Codec(name, "w")
                return name
            except Exception:  # listed but without an encoder in this build
                continue
    raise RuntimeError(f"no encoder for {suffix} in this PyAV build")


def write_gray_video(
    path: Path, num_frames: int = 16, size: tuple[int, int] = (32, 48), fps: int = 8, options: dict | None = None
) -> Path:
    """A video whose frame i is solid `gray_level(i)`; codec picked from the suffix (.mp4, .mkv, .webm)."""
    height, width = size
    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream(_codec_for(path.suffix), rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            pixels = np.full((height, width, 3), gray_level(i), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_frame_folder(
    folder: Path, num_frames: int = 12, size: tuple[int, int] = (24, 40), suffix: str = ".png", padded: bool = False
) -> Path:
    """One image per frame, frame i solid `gray_level(i)`, named frame_<i> (zero-padded or not)."""
    folder.mkdir(parents=True, exist_ok=True)
    codec, pix_fmt = {".png": ("png", "rgb24"), ".jpg": ("mjpeg", "yuvj444p")}[suffix]
    height, width = size
    for i in range(num_frames):
        name = f"frame_{i:05d}{suffix}" if padded else f"frame_{i}{suffix}"
        with av.open(str(folder / name), "w", format="image2") as container:
            stream = container.add_stream(codec, rate=1)
            stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
            pixels = np.full((height, width, 3), gray_level(i), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    return folder


def write_audio_only(path: Path, seconds: float = 0.5, rate: int = 8000) -> Path:
    """A WAV file: a real media file with an audio stream and no video stream."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=rate)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, int(seconds * rate)), np.int16), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_zero_bytes(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def write_random_bytes(path: Path, num_bytes: int = 4096, seed: int = 0) -> Path:
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8).tobytes())
    return path


def write_truncated(path: Path, keep: float, *, faststart: bool) -> Path:
    """A gray mp4 cut to a share `keep` of its bytes. Without faststart the index (moov) sits at the
    end and is lost, so the file does not open; with it, the file opens and fails mid-decode."""
    write_gray_video(path, options={"movflags": "faststart"} if faststart else None)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


# Held-out seeds of 18 s (72 frames, 1152 video tokens): a question, then a caption.
SHORT_LONG_SEEDS = (100019, 100004)


def long_items(root: Path, max_new_tokens: int | None = None) -> Path:
    """The two held-out items as a manifest (the caption's budget cut to `max_new_tokens` when given)."""
    manifest = write_long_manifest(root, SHORT_LONG_SEEDS)
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    for line in lines:
        if max_new_tokens is not None:
            line["max_new_tokens"] = min(line["max_new_tokens"], max_new_tokens)
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest

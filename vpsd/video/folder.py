"""A folder of frame images read as a video.

Datasets often ship videos pre-extracted as one image per frame. The frames are the image files in
the folder (no recursion; hidden files and other suffixes ignored), in natural name order so that
`frame_2.png` comes before `frame_10.png` even without zero padding. Images are decoded with PyAV's
image demuxer, so no imaging library is needed. A folder has no clock: callers give it a frame rate.
"""

from __future__ import annotations

import re
from pathlib import Path

import av
import numpy as np

from vpsd.video.errors import VideoError, describe_av_error

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})


def _natural_key(name: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def frame_files(folder: Path) -> list[Path]:
    """The frame images in `folder`, in natural name order."""
    files = [
        p
        for p in folder.iterdir()
        if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".") and p.is_file()
    ]
    return sorted(files, key=lambda p: _natural_key(p.name))


def read_image(path: Path, size: tuple[int, int] | None = None) -> np.ndarray:
    """(H, W, 3) uint8 RGB of one image; scaled to `size` = (height, width) when given, so that a
    stray frame of another size still stacks with the rest."""
    if path.stat().st_size == 0:
        raise VideoError("corrupt", path, "frame image is an empty file")
    try:
        with av.open(str(path)) as container:
            frame = next(container.decode(video=0))
            if size is None:
                return frame.to_ndarray(format="rgb24")
            return frame.to_ndarray(format="rgb24", height=size[0], width=size[1])
    except (av.FFmpegError, StopIteration, IndexError) as err:
        detail = describe_av_error(err) if isinstance(err, av.FFmpegError) else "no image in file"
        raise VideoError("corrupt", path, f"unreadable frame image: {detail}") from None

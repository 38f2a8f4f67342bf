"""Frames for one manifest item: the item's own sampling request, else the run's video config."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vpsd.video.decode import read_video
from vpsd.video.resize import resize_frames


def load_item_frames(
    path: str | Path,
    num_frames: int | None,
    fps: float | None,
    max_side: int | None,
) -> np.ndarray:
    """(T, H, W, 3) uint8; raises VideoError with the path and what is wrong."""
    clip = read_video(path, num_frames=None if fps else num_frames, fps=fps)
    frames = clip.frames
    if max_side is not None and max(frames.shape[1:3]) > max_side:
        h, w = frames.shape[1:3]
        scale = max_side / max(h, w)
        frames = resize_frames(frames, max(1, round(h * scale)), max(1, round(w * scale)))
    return frames

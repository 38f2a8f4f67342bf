"""Which frame indices to decode: pure index arithmetic, no I/O.

Three requests, then an optional cap:
- by count: `num_frames` indices evenly spread over the whole video, `linspace(0, n-1, k).round()`
  (the rule Qwen2-VL and LLaVA-OneVision use; asking for more frames than exist repeats frames, so
  the clip always has exactly `num_frames` frames);
- by rate: the frame on screen at each t = k/fps (k = 0, 1, ...) while t < n/source_fps, frame i
  being on screen during [i/source_fps, (i+1)/source_fps) at a constant frame rate; a rate at or
  above the source rate means every frame;
- neither: every frame.
`max_frames` then keeps at most that many of the chosen indices, again evenly spread.

Indices are returned sorted (non-decreasing), as an int64 array, possibly with repeats.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-9


def uniform_indices(num_source: int, num_frames: int) -> np.ndarray:
    """`num_frames` indices evenly spaced over [0, num_source - 1], both ends included."""
    if num_source <= 0 or num_frames <= 0:
        raise ValueError(f"need positive counts, got num_source={num_source} num_frames={num_frames}")
    # np.round rounds halves to even, like torch.round in the reference preprocessors.
    return np.round(np.linspace(0, num_source - 1, num_frames)).astype(np.int64)


def rate_indices(num_source: int, source_fps: float, fps: float) -> np.ndarray:
    """Index of the frame on screen at each time k/fps, for every k with k/fps < num_source/source_fps."""
    if num_source <= 0 or not source_fps > 0 or not fps > 0:
        raise ValueError(f"need positive values, got {num_source=} {source_fps=} {fps=}")
    if fps >= source_fps:
        return np.arange(num_source, dtype=np.int64)
    # The epsilons absorb float error: a time that lands exactly on a frame's start (k * 8 / 2.5
    # computed as 15.999999) belongs to that frame, and t == duration is past the end.
    count = math.ceil(num_source * fps / source_fps - _EPS)
    k = np.arange(count, dtype=np.float64)
    idx = np.floor(k * source_fps / fps + _EPS).astype(np.int64)
    return np.minimum(idx, num_source - 1)


def cap_indices(indices: np.ndarray, max_frames: int) -> np.ndarray:
    """At most `max_frames` of `indices`, evenly spread over them."""
    if max_frames <= 0:
        raise ValueError(f"max_frames must be positive, got {max_frames}")
    if len(indices) <= max_frames:
        return indices
    return indices[uniform_indices(len(indices), max_frames)]


def select_indices(
    num_source: int,
    source_fps: float,
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
) -> np.ndarray:
    """The frame indices one request asks for (see the module docstring)."""
    if num_frames is not None and fps is not None:
        raise ValueError("give num_frames or fps, not both")
    if num_frames is not None:
        indices = uniform_indices(num_source, num_frames)
    elif fps is not None:
        indices = rate_indices(num_source, source_fps, fps)
    else:
        indices = np.arange(num_source, dtype=np.int64)
    if max_frames is not None:
        indices = cap_indices(indices, max_frames)
    return indices

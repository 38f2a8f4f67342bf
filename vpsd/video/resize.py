"""Frame sizes a model accepts, and resizing frames to them.

Qwen2-VL / Qwen2.5-VL / Qwen3-VL cut frames into 14 px patches merged 2x2, so both sides must be
multiples of 28 (`factor`) and the area must stay within a pixel budget; `smart_resize` computes
that size while keeping the aspect ratio as closely as it can. LLaVA-OneVision simply wants 384x384.
`resize_frames` does the pixel work for either; `normalized_frames` is the video processors' next step
(rescale to [0, 1], normalise per channel), the same for every family.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

# Qwen2-VL's image processor defaults: at least 4 merged patches, at most 1280 of them.
QWEN_MIN_PIXELS = 4 * 28 * 28
QWEN_MAX_PIXELS = 1280 * 28 * 28
MAX_ASPECT_RATIO = 200

# Frames resized per interpolate call: bounds the float32 copy for long clips.
_CHUNK = 32


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = QWEN_MIN_PIXELS,
    max_pixels: int = QWEN_MAX_PIXELS,
) -> tuple[int, int]:
    """(height, width), both multiples of `factor`, with min_pixels <= area <= max_pixels.

    Each side is first rounded to the nearest multiple of `factor` (Python's round, halves to
    even, as the reference processor does). If the area then exceeds
    `max_pixels`, both sides shrink by the same ratio and round down; if it falls below
    `min_pixels`, both grow by the same ratio and round up.
    """
    if height <= 0 or width <= 0 or factor <= 0:
        raise ValueError(f"sizes must be positive, got {height=} {width=} {factor=}")
    if not factor * factor <= min_pixels <= max_pixels:
        raise ValueError(f"need factor^2 <= min_pixels <= max_pixels, got {factor=} {min_pixels=} {max_pixels=}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio of {height}x{width} exceeds {MAX_ASPECT_RATIO}")
    # A side under factor/2 rounds to 0; the area is then below min_pixels (>= factor^2), so the
    # growing branch below brings it back, as in the reference processor.
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def tensor_of(frames: np.ndarray) -> torch.Tensor:
    """torch's view of `frames`, or of a copy when they are read-only (kept frames, video/frame_cache.py): torch
    warns on a read-only array, which it could write through; the callers here only read it."""
    return torch.from_numpy(frames if frames.flags.writeable else frames.copy())


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (T, height, width, 3) uint8, bicubic with antialiasing when shrinking."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected (T, H, W, 3) uint8 frames, got {frames.shape} {frames.dtype}")
    if height <= 0 or width <= 0:
        raise ValueError(f"target size must be positive, got {height}x{width}")
    if frames.shape[1:3] == (height, width):
        return frames.copy()
    out = np.empty((frames.shape[0], height, width, 3), dtype=np.uint8)
    for start in range(0, frames.shape[0], _CHUNK):
        chunk = tensor_of(frames[start : start + _CHUNK]).permute(0, 3, 1, 2).float()
        resized = F.interpolate(chunk, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        # Bicubic overshoots at edges; clamp before the cast so 255 + ringing does not wrap to 0.
        out[start : start + _CHUNK] = resized.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return out


def normalized_frames(frames: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(T, H, W, C) uint8 -> (T, C, H, W) float32 rescaled by 1/255, then (x - mean) / std per channel."""
    c = frames.shape[-1]
    x = tensor_of(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255.0
    return (x - torch.tensor(mean).view(1, c, 1, 1)) / torch.tensor(std).view(1, c, 1, 1)

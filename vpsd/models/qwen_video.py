"""Qwen-style video tensors built by hand (the official processors need torchvision, absent on CPU here).

Contract: `qwen_video_tensors(frames, spec)` returns exactly what Qwen2-VL / Qwen2.5-VL / Qwen3-VL video
processors return as `pixel_values_videos` and `video_grid_thw` for frames already resized to the
target size: rescale to [0, 1], normalise per channel, pad the frame count to a multiple of the
temporal patch by repeating the last frame, then flatten patches in the order the vision tower
expects (temporal group, merge-block row, merge-block col, in-block row, in-block col).
tests/test_qwen_video.py checks the ordering against the transformers image processor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vpsd.video.resize import normalized_frames, resize_frames, smart_resize


@dataclass(frozen=True)
class QwenVisionSpec:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP (Qwen2/2.5-VL)
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 768 * 28 * 28  # per frame; video processors cap frames far below the image cap

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def resize_for_qwen(frames: np.ndarray, spec: QwenVisionSpec) -> np.ndarray:
    """Resizes (T, H, W, 3) uint8 frames to the nearest sides that are multiples of patch*merge."""
    _, h, w, _ = frames.shape
    new_h, new_w = smart_resize(h, w, factor=spec.factor, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    if (new_h, new_w) == (h, w):
        return frames
    return resize_frames(frames, new_h, new_w)


def qwen_video_tensors(frames: np.ndarray, spec: QwenVisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """frames: (T, H, W, 3) uint8 with H, W multiples of patch*merge.

    Returns pixel_values_videos (grid_t*grid_h*grid_w, 3*tp*ps*ps) float32 and video_grid_thw (1, 3) int64.
    """
    t, h, w, c = frames.shape
    ps, ms, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if h % (ps * ms) or w % (ps * ms):
        raise ValueError(f"frame size {h}x{w} is not a multiple of {ps * ms}; resize first")
    x = normalized_frames(frames, spec.mean, spec.std)  # (T, C, H, W)
    if t % tp:
        x = torch.cat([x, x[-1:].expand(tp - t % tp, -1, -1, -1)], dim=0)
    grid_t, grid_h, grid_w = x.shape[0] // tp, h // ps, w // ps
    x = x.reshape(grid_t, tp, c, grid_h // ms, ms, ps, grid_w // ms, ms, ps)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = x.reshape(grid_t * grid_h * grid_w, c * tp * ps * ps)
    return pixel_values.contiguous(), torch.tensor([[grid_t, grid_h, grid_w]], dtype=torch.long)

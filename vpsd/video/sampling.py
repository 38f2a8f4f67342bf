"""Which frame indices to decode: pure index arithmetic, no I/O.

Four requests, then an optional cap:
- by count: `num_frames` indices evenly spread over the whole video, `linspace(0, n-1, k).round()`
  (the rule Qwen2-VL and LLaVA-OneVision use; asking for more frames than exist repeats frames, so
  the clip always has exactly `num_frames` frames);
- by rate: the frame on screen at each t = k/fps (k = 0, 1, ...) while t < n/source_fps, frame i
  being on screen during [i/source_fps, (i+1)/source_fps) at a constant frame rate; a rate at or
  above the source rate means every frame;
- by the checkpoint's processor: `ProcessorSampling`, the target's own video processor's rule;
- none: every frame.
`max_frames` then keeps at most that many of the chosen indices, again evenly spread.

Indices are returned sorted (non-decreasing), as an int64 array, possibly with repeats.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

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
    processor: "ProcessorSampling | None" = None,
) -> np.ndarray:
    """The frame indices one request asks for (see the module docstring)."""
    if sum(x is not None for x in (num_frames, fps, processor)) > 1:
        raise ValueError("give one of num_frames, fps or a processor rule")
    if processor is not None:
        indices = processor.indices(num_source, source_fps)
    elif num_frames is not None:
        indices = uniform_indices(num_source, num_frames)
    elif fps is not None:
        indices = rate_indices(num_source, source_fps, fps)
    else:
        indices = np.arange(num_source, dtype=np.int64)
    if max_frames is not None:
        indices = cap_indices(indices, max_frames)
    return indices


# The frame rules of the published checkpoints' video processors (transformers 5), for `video.sampling:
# checkpoint`: the run samples each video the way the target's own processor would, with the processor's
# fps / num_frames / min_frames / max_frames from the checkpoint's files.
QWEN2_VL, QWEN3_VL, UNIFORM_FLOOR = "qwen2_vl", "qwen3_vl", "uniform_floor"
PROCESSOR_RULES = (QWEN2_VL, QWEN3_VL, UNIFORM_FLOOR)


@dataclass(frozen=True)
class ProcessorSampling:
    """A checkpoint video processor's own frame rule, with its settings.

    rule "qwen2_vl"  Qwen2VLVideoProcessor.sample_frames (Qwen2-VL, Qwen2.5-VL): by rate, the count
                     total / source_fps * fps is clamped to [min_frames, max_frames (floored to the temporal
                     patch), total] then floored to a multiple of the temporal patch; by count, rounded to it;
                     indices arange(0, total, total / count), truncated.
    rule "qwen3_vl"  Qwen3VLVideoProcessor.sample_frames: by rate, int(total / source_fps * fps) clamped to
                     [min_frames, min(max_frames, total)]; indices linspace(0, total - 1, count), rounded.
    rule "uniform_floor"  transformers' default_sample_indices_fn (LLaVA-OneVision's processor):
                     count (or int(total / source_fps * fps), at least 1) indices arange(count) * total // count.
    A count (`num_frames`) wins over a rate, as a call that passes only num_frames does in transformers.
    Qwen2.5-VL's published processor has do_sample_frames off (the caller samples; Qwen's qwen-vl-utils
    takes 2 fps with its own rounding); vpsd then applies the processor's rule at the processor's fps
    (2.0, Qwen2_5_VLProcessor's default), the sampling transformers itself does when switched on.

    Departure: where transformers raises for a clip too short for the rule (Qwen2-VL's count floors to 0 for a
    one-frame video; a count above the frames there are), the count is clamped to [1, total] instead, so a
    short clip is read rather than failing the item.
    """

    rule: str
    num_frames: int | None = None
    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768
    temporal_factor: int = 2

    def __post_init__(self) -> None:
        if self.rule not in PROCESSOR_RULES:
            raise ValueError(f"unknown frame rule {self.rule!r}; known: {PROCESSOR_RULES}")
        if self.num_frames is None and self.fps is None:
            raise ValueError("a processor frame rule needs num_frames or fps")
        if not 1 <= self.min_frames <= self.max_frames or self.temporal_factor < 1:
            raise ValueError(f"need 1 <= min_frames <= max_frames and temporal_factor >= 1, got {self}")

    def count(self, total: int, source_fps: float) -> int:
        """How many frames the rule takes from a video of `total` frames at `source_fps`."""
        tf = self.temporal_factor
        if self.rule == QWEN2_VL:
            if self.num_frames is not None:
                n = round(self.num_frames / tf) * tf
            else:
                cap = math.floor(min(self.max_frames, total) / tf) * tf
                n = min(max(total / source_fps * self.fps, self.min_frames), cap, total)
                n = math.floor(n / tf) * tf
        elif self.rule == QWEN3_VL:
            if self.num_frames is not None:
                n = self.num_frames
            else:
                n = min(max(int(total / source_fps * self.fps), self.min_frames), self.max_frames, total)
        else:
            n = self.num_frames if self.num_frames is not None else max(1, int(total / source_fps * self.fps))
        return int(min(max(n, 1), total))

    def indices(self, total: int, source_fps: float) -> np.ndarray:
        if total <= 0 or not source_fps > 0:
            raise ValueError(f"need positive values, got {total=} {source_fps=}")
        n = self.count(total, source_fps)
        if self.rule == QWEN2_VL:
            # torch.arange in float32 with a Python float step, then .int(): the processor's exact arithmetic.
            # It sometimes yields one index more than the count (15 frames of 17 for a count of 14); kept,
            # since that clip is what transformers feeds the model.
            import torch

            return torch.arange(0, total, total / n).int().numpy().astype(np.int64)
        if self.rule == QWEN3_VL:
            return np.linspace(0, total - 1, n).round().astype(np.int64)
        return np.arange(n, dtype=np.int64) * total // n

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: dict[str, Any] | None) -> "ProcessorSampling | None":
        return None if wire is None else cls(**wire)

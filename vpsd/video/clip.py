"""What a read returns: `VideoClip`, the sampled frames with their times and how they were read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class VideoClip:
    frames: np.ndarray  # (T, H, W, 3) uint8 RGB
    fps: float  # frame rate of the source, not of the sampled clip
    timestamps: np.ndarray  # (T,) float64, seconds of each sampled frame from the source's start
    source_num_frames: int  # frames in the whole source
    duration_s: float  # source_num_frames / fps
    indices: np.ndarray  # (T,) int64, source frame index of each sampled frame, non-decreasing
    # How the frames were read: "exact" (seeking by the packet index), "keyframe" (seek="keyframe"),
    # "sequential" (front to back), "folder" or "frames_file".
    read_mode: str = "sequential"
    fallback_reason: str | None = None  # why a video was read front to back instead of by seeking
    frames_decoded: int = 0  # frames the decoder produced (images read, for a folder): the work done
    parts: int = 1  # pieces between keyframes read at once (read_video's `parts`); 1: read whole

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

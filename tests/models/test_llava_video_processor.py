"""Hand-built LLaVA-OneVision `pixel_values_videos` against transformers' own processing on fixed frames.

The official `LlavaOnevisionVideoProcessor` needs torchvision (absent here). Its pixel work, for frames already at
the tower's size, is rescale by 1/255 then normalise per channel; transformers' PIL image processor for the same
model (`LlavaOnevisionImageProcessorPil`, same class defaults: bicubic, 384x384, OpenAI CLIP mean/std) does the
same per image. Given several images in one sample it takes its multi-image path: no anyres patches, a square
frame is not padded, and resizing a frame to its own size leaves it unchanged. So comparing per frame checks the
layout (T, C, H, W), the channel order, the rescale and the normalisation; the resize itself is
vpsd.video.resize_frames's job.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlavaOnevisionImageProcessorPil

from tests.conftest import tiny_pair
from vpsd.models.llava_onevision import SIGLIP_MEAN, SIGLIP_STD, LlavaVisionSpec, llava_video_tensor

CLIP_MEAN = tuple(LlavaOnevisionImageProcessorPil.image_mean)  # the processor classes' default
CLIP_STD = tuple(LlavaOnevisionImageProcessorPil.image_std)


def reference_frames(t: int, size: int) -> np.ndarray:
    """Seeded noise with a pure black and a pure white frame, so both ends of the range are covered."""
    frames = np.random.default_rng(1234).integers(0, 256, (t, size, size, 3), dtype=np.uint8)
    frames[0] = 0
    frames[-1] = 255
    return frames


def official(frames: np.ndarray, mean, std) -> torch.Tensor:
    """(T, 3, S, S) from transformers' processor, one image per frame, all frames in one sample."""
    size = frames.shape[1]
    processor = LlavaOnevisionImageProcessorPil(size={"height": size, "width": size}, image_mean=mean, image_std=std)
    out = processor([list(frames)], return_tensors="pt")
    assert out["pixel_values"].shape == (frames.shape[0], 1, 3, size, size)  # one patch per image: no anyres
    return out["pixel_values"][:, 0]


@pytest.mark.parametrize("size,t", [(56, 4), (384, 3)])  # the tiny tower, and the real checkpoints' 384 px
@pytest.mark.parametrize("mean,std", [(SIGLIP_MEAN, SIGLIP_STD), (CLIP_MEAN, CLIP_STD)], ids=["siglip", "clip"])
def test_hand_built_video_tensor_matches_the_official_processing(size, t, mean, std):
    frames = reference_frames(t, size)
    ours = llava_video_tensor(frames, LlavaVisionSpec(image_size=size, mean=mean, std=std))
    assert ours.shape == (1, t, 3, size, size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours[0], official(frames, mean, std), atol=1e-6, rtol=0)


def test_adapter_prepare_matches_the_official_processing():
    target, _ = tiny_pair("llava_onevision")
    size = target.model.config.vision_config.image_size
    frames = reference_frames(4, size)
    got = target.prepare(frames, "Describe the video.").pixel_inputs["pixel_values_videos"]
    torch.testing.assert_close(got[0], official(frames, SIGLIP_MEAN, SIGLIP_STD), atol=1e-6, rtol=0)


def test_frames_off_the_tower_size_are_refused():
    with pytest.raises(ValueError, match="resize first"):
        llava_video_tensor(reference_frames(2, 48), LlavaVisionSpec(image_size=56))

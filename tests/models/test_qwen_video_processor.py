"""`qwen_video_tensors` against transformers' own Qwen preprocessing, on fixed frames, for both vision specs.

transformers 5's Qwen video processors cannot be built without torchvision (absent here), so the official
pieces that do run are used:
- `Qwen2VLImageProcessorPil` (PIL/NumPy backend) normalises and patchifies one image, repeating it over the
  temporal patch. A video of two identical frames is that image, so it must match exactly.
- `Qwen3VLVideoProcessor.patchify` is plain torch: the class refuses to be built, but its function runs. It
  groups distinct frames into temporal patches (padding an odd count with the last frame) and orders the
  patches; it is fed frames normalised by the image processor's own `rescale` / `normalize`.
- Qwen2VLVideoProcessor's module imports torchvision at load time, so its source is parsed instead: its
  `patchify` is the same code as Qwen3-VL's and it normalises with CLIP's mean and std.
Frame sides are multiples of patch * merge and resizing is off: only normalisation and ordering are compared.
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from tests.transformers_source import class_body
from vpsd.models.qwen3_vl import qwen3_vision_spec
from vpsd.models.qwen_video import QwenVisionSpec, qwen_video_tensors

SPECS = {"qwen2_5_vl": QwenVisionSpec(), "qwen3_vl": qwen3_vision_spec()}
official_patchify = Qwen3VLVideoProcessor.__dict__["patchify"]  # does not use `self`


def _frames(spec: QwenVisionSpec, t: int, seed: int) -> np.ndarray:
    """t fixed (seeded) uint8 frames, 2 x 3 merge blocks of patches each."""
    f = spec.factor
    return np.random.default_rng(seed).integers(0, 256, (t, 2 * f, 3 * f, 3), dtype=np.uint8)


def _image_processor(spec: QwenVisionSpec) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        do_resize=False,
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        image_mean=list(spec.mean),
        image_std=list(spec.std),
    )


def test_specs_are_the_processors_defaults():
    qwen3 = Qwen3VLVideoProcessor.__dict__
    spec = SPECS["qwen3_vl"]
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (
        qwen3["patch_size"],
        qwen3["merge_size"],
        qwen3["temporal_patch_size"],
    )
    assert list(spec.mean) == list(qwen3["image_mean"]) and list(spec.std) == list(qwen3["image_std"])

    qwen2 = class_body("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor")
    spec = SPECS["qwen2_5_vl"]
    assert [ast.unparse(qwen2[k]) for k in ("patch_size", "merge_size", "temporal_patch_size")] == ["14", "2", "2"]
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (14, 2, 2)
    assert [ast.unparse(qwen2[k]) for k in ("image_mean", "image_std")] == ["OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD"]
    assert list(spec.mean) == list(OPENAI_CLIP_MEAN) and list(spec.std) == list(OPENAI_CLIP_STD)
    # Qwen2-VL's video patchify is Qwen3-VL's, which the ordering test below runs for both specs.
    qwen3_body = class_body("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor")
    assert ast.dump(qwen2["patchify"]) == ast.dump(qwen3_body["patchify"])


@pytest.mark.parametrize("family", sorted(SPECS))
def test_still_video_equals_the_official_image(family):
    spec = SPECS[family]
    frame = _frames(spec, 1, seed=0)
    ours, grid = qwen_video_tensors(np.repeat(frame, spec.temporal_patch_size, axis=0), spec)
    official = _image_processor(spec)(list(frame), return_tensors="pt")
    assert grid.tolist() == official["image_grid_thw"].tolist() == [[1, 2 * spec.merge_size, 3 * spec.merge_size]]
    torch.testing.assert_close(ours, official["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_distinct_frames_equal_the_official_patch_order(family):
    spec = SPECS[family]
    frames = _frames(spec, 5, seed=1)  # odd: the last temporal group is padded with the last frame
    proc = _image_processor(spec)
    normalised = [
        proc.normalize(proc.rescale(f.transpose(2, 0, 1).astype(np.float32), 1 / 255), spec.mean, spec.std)
        for f in frames
    ]
    video = torch.from_numpy(np.stack(normalised)).unsqueeze(0)  # (1, T, C, H, W)
    patches, grid_t, grid_h, grid_w = official_patchify(
        None, video, spec.patch_size, spec.merge_size, spec.temporal_patch_size
    )
    ours, grid = qwen_video_tensors(frames, spec)
    assert grid.tolist() == [[grid_t, grid_h, grid_w]] == [[3, 2 * spec.merge_size, 3 * spec.merge_size]]
    torch.testing.assert_close(ours, patches[0], atol=1e-5, rtol=0)

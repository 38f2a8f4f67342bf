"""A checkpoint directory laid out like the published ones (config.json,
generation_config.json, a (video_)preprocessor config, tokenizer files with a chat template) is read as such.
Tiny random models of all three families are saved in that layout with non-default processor settings; what
vpsd prepares from them follows those files. transformers' video processors need torchvision (absent here),
so the pixels are compared with its PIL image processor built from the same settings (a video of identical
frames is that image repeated over the temporal patch, tests/models/test_qwen_video_processor.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.conftest import tiny_pair
from tests.official_layout import LLAVA_TEMPLATE, MEAN, QWEN_TEMPLATE, STD, SYSTEM, _qwen_processor, save_official
from vpsd.models.checkpoint import CheckpointError
from vpsd.models.registry import load_adapter
from vpsd.models.spec import ModelSpec

@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_checkpoint_settings_and_template_drive_preprocessing(tmp_path, family):
    target, _ = tiny_pair(family)
    path = save_official(target, tmp_path / family, _qwen_processor(target), QWEN_TEMPLATE)
    loaded = load_adapter(family, ModelSpec(path=str(path)))
    spec = loaded.vision_spec
    f = spec.factor
    assert (spec.mean, spec.std, spec.max_pixels, loaded.fps) == (tuple(MEAN), tuple(STD), 4 * f * f, 1.0)
    # One frame pair, larger than the pixel cap: resized to 2x2 merged patches, normalised with the file's mean/std.
    frame = np.random.default_rng(0).integers(0, 256, (1, 3 * f, 3 * f, 3), dtype=np.uint8)
    inputs = loaded.prepare(np.repeat(frame, 2, axis=0), "What happens?")
    assert inputs.pixel_inputs["video_grid_thw"].tolist() == [[1, 4, 4]]  # patches: 2x2 merged tokens
    official = Qwen2VLImageProcessorPil(do_resize=False, patch_size=spec.patch_size, merge_size=spec.merge_size,
                                        temporal_patch_size=spec.temporal_patch_size, image_mean=MEAN, image_std=STD)
    from vpsd.video.resize import resize_frames

    want = official(images=[resize_frames(frame, 2 * f, 2 * f)[0]], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(inputs.pixel_inputs["pixel_values_videos"].float(), want.float(), rtol=0, atol=1e-6)
    text = loaded.tokenizer.decode(inputs.input_ids[0])
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")  # the file's template
    assert text.endswith("What happens?<|im_end|>\n<|im_start|>assistant\n")
    if family == "qwen3_vl":  # no times given: frames taken at the file's 1 fps, groups of 2 -> 0.5 s
        assert "<0.5 seconds><|vision_start|>" in text
    else:  # seconds per temporal patch from the file's fps
        assert float(inputs.pixel_inputs["second_per_grid_ts"]) == 2.0


def test_llava_checkpoint_settings_and_template(tmp_path):
    target, _ = tiny_pair("llava_onevision")
    side = target.model.config.vision_config.image_size
    proc = {"size": {"height": side, "width": side}, "image_mean": MEAN, "image_std": STD}
    path = save_official(target, tmp_path / "llava", proc, LLAVA_TEMPLATE)
    loaded = load_adapter("llava_onevision", ModelSpec(path=str(path)))
    assert loaded.vision_spec.mean == tuple(MEAN) and loaded.vision_spec.std == tuple(STD)
    frames = np.full((2, side, side, 3), 255, dtype=np.uint8)
    pixels = loaded.prepare(frames, "Describe.").pixel_inputs["pixel_values_videos"]
    torch.testing.assert_close(pixels[0, 0, :, 0, 0], (1 - torch.tensor(MEAN)) / torch.tensor(STD))
    text = loaded.tokenizer.decode(loaded.prepare(frames, "Describe.").input_ids[0])
    assert text.startswith("<|im_start|>user <video>") and text.endswith("\nDescribe.<|im_end|>\n<|im_start|>assistant\n")


def test_missing_or_contradictory_files_are_clear_errors_at_load(tmp_path):
    target, _ = tiny_pair("qwen2_5_vl")
    path = save_official(target, tmp_path / "q", _qwen_processor(target), QWEN_TEMPLATE)
    (path / "video_preprocessor_config.json").write_text(json.dumps(_qwen_processor(target, patch_size=16)))
    with pytest.raises(CheckpointError, match="patch_size 16 contradicts config.json's 14"):
        load_adapter("qwen2_5_vl", ModelSpec(path=str(path)))
    (path / "video_preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match="missing video_preprocessor_config.json or preprocessor_config.json"):
        load_adapter("qwen2_5_vl", ModelSpec(path=str(path)))
    (path / "preprocessor_config.json").write_text(json.dumps(_qwen_processor(target)))  # the older name works
    assert load_adapter("qwen2_5_vl", ModelSpec(path=str(path))).fps == 1.0
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (path / extra).unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="no chat template"):
        load_adapter("qwen2_5_vl", ModelSpec(path=str(path)))
    (path / "generation_config.json").unlink()
    with pytest.raises(CheckpointError, match="generation_config.json: missing"):
        load_adapter("qwen2_5_vl", ModelSpec(path=str(path)))

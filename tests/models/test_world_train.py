"""The world trainer: its per-patch and per-token labels line up with the pixels the towers see, its feature
reordering undoes the tower's window order, stage 2 leaves the tower blocks frozen (the merger trains with the
language model), and a few steps of both
stages write loadable checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from vpsd.models.qwen2_5_vl import tiny_config
from vpsd.models.qwen_video import QwenVisionSpec, qwen_video_tensors
from vpsd.video.sampling import uniform_indices
from vpsd.world.render import render
from vpsd.world.scene import COLOURS, sample_scene
from training.world_short import (
    BACKGROUND_CLASSES,
    MERGED_CELL,
    NUM_FRAMES,
    OBJECT_ATTRIBUTES,
    TRAIN_SEED_BASE,
    VIDEO_FRAMES,
    VISION,
    AuxHeads,
    Batcher,
    TrainConfig,
    forward_loss,
    patch_labels,
    roundtrip_example,
    token_labels,
    train,
    vision_features,
    world_tokenizer,
)

SPEC = QwenVisionSpec(patch_size=VISION["patch_size"], merge_size=VISION["spatial_merge_size"],
                      temporal_patch_size=VISION["temporal_patch_size"])
COLOUR_NAMES = OBJECT_ATTRIBUTES["colour"]


def share_of_colour(rgb: np.ndarray, colour: str) -> float:
    """Share of pixels of an (..., 3) array within a small distance of a palette colour."""
    return float((np.abs(rgb.astype(int) - COLOURS[colour]).sum(-1) < 40).mean())


def rendered(seed: int):
    scene = sample_scene(TRAIN_SEED_BASE + seed)
    return scene, render(scene)[uniform_indices(VIDEO_FRAMES, NUM_FRAMES)]


@pytest.mark.parametrize("seed", range(6))
def test_patch_labels_name_the_colour_in_the_patch_the_tower_reads(seed: int) -> None:
    """Rows of the labels and of Qwen's pixel tensor are the same patches, in the processor's order."""
    scene, frames = rendered(seed)
    pixels, _ = qwen_video_tensors(frames, SPEC)
    p = SPEC.patch_size
    mean, std = np.array(SPEC.mean)[:, None, None], np.array(SPEC.std)[:, None, None]
    # Each row is (channel, temporal, y, x); the first frame of the pair is the one the labels describe.
    first = pixels.numpy().reshape(-1, 3, SPEC.temporal_patch_size, p, p)[:, :, 0]
    rgb = ((first * std + mean) * 255).transpose(0, 2, 3, 1)  # (patches, p, p, 3)
    labels = patch_labels(scene)
    assert labels.shape == (len(rgb), len(OBJECT_ATTRIBUTES) + 1)
    labelled = np.nonzero(labels[:, 0])[0]
    assert len(labelled) > 0
    for row in labelled:
        assert share_of_colour(rgb[row], COLOUR_NAMES[labels[row, 0]]) > 0.1  # edges are anti-aliased
    bg = scene.background
    assert (labels[:, -1] == BACKGROUND_CLASSES.index(f"{bg.colour} {'textured' if bg.textured else 'plain'}")).all()


@pytest.mark.parametrize("seed", range(6))
def test_token_labels_follow_the_adapters_token_order(seed: int) -> None:
    scene, frames = rendered(seed)
    labels = token_labels(scene).reshape(NUM_FRAMES // 2, 112 // MERGED_CELL, 112 // MERGED_CELL, -1)
    for g, r, c in zip(*np.nonzero(labels[..., 0])):
        cell = frames[2 * g, r * MERGED_CELL : (r + 1) * MERGED_CELL, c * MERGED_CELL : (c + 1) * MERGED_CELL]
        assert share_of_colour(cell, COLOUR_NAMES[labels[g, r, c, 0]]) > 0.05
    # Every visible object labels at least its own centre cell, shape and size included.
    assert (labels[..., 0] > 0).sum() >= len(scene.objects)
    has_object = labels[..., 0] > 0
    assert (labels[..., 1][has_object] >= 0).all() and (labels[..., 1][~has_object] < 0).all()


def test_vision_features_undo_the_towers_window_order() -> None:
    """With no blocks the tower's patch output is its patch embedding: reordered, it must equal the embedding
    of each patch in the processor's order (windows of 2x2 merged cells shuffle them otherwise)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    vision = dict(VISION, depth=0, hidden_size=16, intermediate_size=32, num_heads=2, fullatt_block_indexes=[])
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(text, vision, world_tokenizer())).eval()
    pixels, grid = qwen_video_tensors(rendered(0)[1], SPEC)
    with torch.no_grad():
        patches, tokens = vision_features(model, pixels, grid)
        expected = model.model.visual.patch_embed(pixels)
    assert not torch.equal(patches, model.model.visual(pixels, grid_thw=grid).last_hidden_state)  # order matters
    torch.testing.assert_close(patches, expected)
    assert tokens.shape == (len(pixels) // SPEC.merge_size**2, 32)


def test_a_few_steps_of_both_stages_write_loadable_checkpoints(tmp_path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    small = dict(
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
        vision=dict(VISION, depth=1, hidden_size=16, intermediate_size=32, num_heads=2, fullatt_block_indexes=[0]),
    )
    cfg = replace(TrainConfig(), vision_steps=2, steps=2, batch_size=2, warmup=1, log_every=1,
                  sizes={"target": small, "draft": small})
    meta = train(tmp_path, cfg)
    history = json.loads((tmp_path / "train_log.json").read_text())["history"]
    assert [("target" in row) for row in history] == [False, False, True, True]  # captions only in stage 2
    assert all(np.isfinite(row[f"{m}_aux"]) for row in history[:2] for m in ("target", "draft"))
    assert all(np.isfinite(row[m]) for row in history[2:] for m in ("target", "draft"))
    assert meta["final"]["step"] == 3
    for name in ("target", "draft"):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / name)
        assert model.config.vision_config.patch_size == VISION["patch_size"]


def test_stage_two_trains_the_language_model_and_merger_on_frozen_tower_blocks(tmp_path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    tok = world_tokenizer()
    small = TrainConfig().sizes["draft"]
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(dict(small["text"]), dict(small["vision"]), tok))
    examples = [roundtrip_example(TRAIN_SEED_BASE + i, tmp_path) for i in range(2)]
    batch = Batcher(tok, model.config)(examples, model.model.get_rope_index)
    aux = AuxHeads(model.config.vision_config.hidden_size, model.config.text_config.hidden_size)
    rng = torch.Generator().manual_seed(0)
    forward_loss(model, aux, batch, model.config.video_token_id, None, rng, with_captions=True)["lm"].backward()
    visual = model.model.visual
    assert all(p.grad is None for p in [*visual.patch_embed.parameters(), *visual.blocks.parameters()])
    assert all(p.grad is not None for p in visual.merger.parameters())
    assert all(p.grad is not None for p in model.model.language_model.parameters())
    model.zero_grad(set_to_none=True)
    forward_loss(model, aux, batch, model.config.video_token_id, None, rng, with_captions=False)["aux"].backward()
    assert all(p.grad is not None for p in model.model.visual.blocks.parameters())
    assert all(p.grad is None for p in model.model.language_model.parameters())

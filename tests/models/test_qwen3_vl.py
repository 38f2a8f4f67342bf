"""Qwen3-VL specifics: the timestamped prompt against transformers' own expansion, the token layout, and
deepstack features pruned together with the video tokens (tests/models/test_adapters.py covers the rest)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from tests.conftest import random_frames, tiny_pair
from vpsd.models.qwen3_vl import group_timestamps, qwen3_video_text


def _official_video_text(grid_thw: list[int], frames_indices: list[int], fps: float) -> str:
    """Qwen3VLProcessor.replace_video_token run on a stand-in processor (the real one needs torchvision)."""
    proc = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
    )
    proc._calculate_timestamps = lambda *args: Qwen3VLProcessor._calculate_timestamps(proc, *args)
    metadata = VideoMetadata(total_num_frames=max(frames_indices) + 1, fps=fps, frames_indices=np.array(frames_indices))
    video_inputs = {"video_grid_thw": torch.tensor([grid_thw]), "video_metadata": [metadata]}
    return Qwen3VLProcessor.replace_video_token(proc, video_inputs, 0)


def test_video_text_matches_transformers_expansion():
    # 7 sampled frames (odd: the last group is padded) of a 30 fps source, 3x2 merged tokens per group.
    indices, fps = [0, 14, 29, 45, 60, 75, 89], 30.0
    ours = qwen3_video_text(group_timestamps(np.array(indices) / fps, 2), tokens_per_group=6)
    assert ours == _official_video_text([4, 6, 4], indices, fps)
    assert ours.count("seconds>") == 4 and ours.startswith("<0.2 seconds><|vision_start|>")


def test_prompt_replaces_the_template_video_block_and_uses_frame_times():
    target, _ = tiny_pair("qwen3_vl")
    text = target.tokenizer.decode(target.prepare(random_frames(0, t=4), "Describe the video.").input_ids[0])
    # The chat template's single start/end pair is replaced, not wrapped around the per-group blocks.
    assert text.startswith("<|im_start|>user\n<0.2 seconds><|vision_start|><|video_pad|>")
    assert "<|vision_end|>Describe the video.<|im_end|>" in text
    assert text.count("<|vision_start|>") == text.count("<|vision_end|>") == 2
    timed = target.prepare(random_frames(0, t=4), "Describe the video.", frame_times=np.array([3.0, 4.0, 5.0, 6.0]))
    assert "<3.5 seconds>" in target.tokenizer.decode(timed.input_ids[0])


def test_layout_maps_each_video_token_to_its_frame_row_and_col():
    target, draft = tiny_pair("qwen3_vl")
    frames = random_frames(4, t=6, h=64, w=96)
    inputs = target.prepare(frames, "Describe the video.")
    layout = inputs.layout
    assert layout.grid == (3, 2, 3)
    # Frame f's tokens are exactly the f-th start/end block.
    ids = inputs.input_ids[0]
    starts = torch.nonzero(ids == target.model.config.vision_start_token_id).squeeze(1)
    for f, start in enumerate(starts.tolist()):
        assert layout.seq_positions[layout.frame == f].tolist() == list(range(start + 1, start + 1 + 6))
    # Inside a block the rotary rows are (block start, start + row, start + col).
    pos = target.embed(inputs).positions[:, 0, layout.seq_positions]
    assert torch.equal(pos[1] - pos[0], layout.row) and torch.equal(pos[2] - pos[0], layout.col)
    # The draft's vision sizes are the target's: same tokens, same layout.
    assert torch.equal(draft.prepare(frames, "Describe the video.").input_ids, inputs.input_ids)


def test_deepstack_rows_are_pruned_with_their_video_tokens():
    target, _ = tiny_pair("qwen3_vl")
    inputs = target.prepare(random_frames(5, t=4, h=96, w=96), "Describe the video.")
    emb = target.embed(inputs)
    n = inputs.layout.num_tokens
    assert len(emb.deepstack) == 2 and all(d.shape == (n, emb.embeds.shape[-1]) for d in emb.deepstack)
    keep = torch.arange(1, n, 3)
    dropped = torch.tensor(sorted(set(range(n)) - set(keep.tolist())))
    base = target.prefill(emb, keep=keep).logits

    def with_rows_changed(rows: torch.Tensor):
        deepstack = [d.clone() for d in emb.deepstack]
        for d in deepstack:
            d[rows] += 1.0
        return dataclasses.replace(emb, deepstack=deepstack)

    # Rows of dropped tokens never reach the model; a kept token's row does.
    changed_dropped = target.prefill(with_rows_changed(dropped), keep=keep).logits
    torch.testing.assert_close(changed_dropped, base, atol=0, rtol=0)
    changed_kept = target.prefill(with_rows_changed(keep[-1:]), keep=keep).logits
    assert (changed_kept - base).abs().max() > 1e-4
    # Deepstack matters at all: without it the full prefill (checked against the model's forward) differs.
    no_deepstack = dataclasses.replace(emb, deepstack=[])
    assert (target.prefill(no_deepstack).logits - target.prefill(emb).logits).abs().max() > 1e-4

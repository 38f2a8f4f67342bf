"""TABED's views batched through one forward equal each view decoded on its own."""

from __future__ import annotations

import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.models.views import pooled_view, prefill_views, step_views, view_inputs
from vpsd.pipeline.layout import VideoTokenLayout

NAMES = ("multimodal", "text", "pooled")


def test_batched_views_equal_separate_views(family):
    target, draft = tiny_pair(family)
    emb = draft.embed(draft.prepare(random_frames(2), "Describe the video."))
    keep = torch.arange(0, emb.layout.num_tokens, 3)
    batch, first = prefill_views(draft, emb, keep, NAMES, pool=2)
    assert batch.num_views == 3 and first.shape[0] == 3
    lengths = [batch.state.length - int(p) for p in batch.pad]
    assert lengths[1] < lengths[2] < lengths[0] or family == "llava_onevision"  # text < pooled (1/4) < 1/3 kept
    tokens = [torch.tensor([int(first[0].argmax())]), torch.tensor([7, 9, 11])]
    got = [step_views(draft, batch, t) for t in tokens]
    draft.rollback(batch.state, batch.state.length - 2)  # drop 9, 11 from every row at once
    got.append(step_views(draft, batch, torch.tensor([4])))
    for i, name in enumerate(NAMES):
        view_emb, view_keep = view_inputs(name, emb, keep, 2)
        pre = draft.prefill(view_emb, keep=view_keep)
        assert torch.allclose(first[i], pre.logits, atol=1e-5)
        ref = [draft.step(pre.state, t) for t in tokens]
        draft.rollback(pre.state, pre.state.length - 2)
        ref.append(draft.step(pre.state, torch.tensor([4])))
        for g, r in zip(got, ref):
            assert torch.allclose(g[i], r, atol=1e-4), (name, (g[i] - r).abs().max())


def test_pooled_view_puts_block_means_at_top_left_tokens(family):
    _, draft = tiny_pair(family)
    emb = draft.embed(draft.prepare(random_frames(1), "x"))
    pooled, reps = pooled_view(emb, 2)
    layout: VideoTokenLayout = emb.layout
    grid = layout.patch_index_grid()  # (T, H, W) video token index
    block = torch.stack([grid[0, 0, 0], grid[0, 0, 1], grid[0, 1, 0], grid[0, 1, 1]])
    a, b = int(block[0]), int(block[1])
    mean = emb.visual_embeds[block].float().mean(0)
    assert a in reps.tolist() and b not in reps.tolist()
    assert torch.allclose(pooled.embeds[0, layout.seq_positions[a]].float(), mean, atol=1e-6)
    for dst, src in zip(pooled.deepstack, emb.deepstack):
        assert torch.allclose(dst[a].float(), src[block].float().mean(0), atol=1e-6)

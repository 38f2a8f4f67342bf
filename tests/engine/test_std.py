"""Sparse-to-Dense self-speculation: the per-head gather, K = everything is the dense cache, lossless decoding."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.ar import decode_ar
from vpsd.decoders.std import decode_std
from vpsd.models.sparse_kv import sparse_state, std_cache_indices, std_prefill
from vpsd.pipeline.pruning.sparse_kv import gather_heads, sparse_cache_indices


def test_sparse_cache_indices_by_hand():
    """Sequence of 7: text 0-1, video 2-5, text 6. K = 2 per head, heads choose different video tokens."""
    scored = torch.tensor([2, 3, 4, 5])
    topk = torch.tensor([[[0, 3], [1, 2]], [[2, 3], [0, 1]]])  # (L=2, Hkv=2, K=2) indices into `scored`
    got = sparse_cache_indices(topk, scored, seq_len=7)
    assert got.tolist() == [
        [[0, 1, 2, 5, 6], [0, 1, 3, 4, 6]],
        [[0, 1, 4, 5, 6], [0, 1, 2, 3, 6]],
    ]


def test_gather_heads_by_hand():
    keys = torch.arange(2 * 4 * 1, dtype=torch.float32).view(1, 2, 4, 1)  # head 0: 0..3, head 1: 4..7
    got = gather_heads(keys, torch.tensor([[0, 3], [1, 2]]))
    assert got.view(2, 2).tolist() == [[0.0, 3.0], [5.0, 6.0]]


def test_keeping_every_video_entry_is_the_dense_cache(family):
    target, _ = tiny_pair(family)
    emb = target.embed(target.prepare(random_frames(3), "Describe the video."))
    pre = std_prefill(target, emb)
    indices = std_cache_indices(pre, emb, ratio=0.0)
    seq = torch.arange(emb.seq_len)
    assert torch.equal(indices, seq.expand_as(indices))
    sparse = sparse_state(target, pre.state, indices, emb.next_position)
    for dense_layer, sparse_layer in zip(pre.state.cache.layers, sparse.cache.layers):
        assert torch.equal(dense_layer.keys, sparse_layer.keys) and torch.equal(dense_layer.values, sparse_layer.values)
    tokens = torch.tensor([int(pre.logits.argmax()), 5, 7])
    assert torch.equal(target.step(sparse, tokens), target.step(pre.state, tokens))


def test_sparse_cache_has_k_video_entries_per_head_and_drafts_at_full_positions(family):
    target, _ = tiny_pair(family)
    emb = target.embed(target.prepare(random_frames(4), "What happens?"))
    pre = std_prefill(target, emb)
    indices = std_cache_indices(pre, emb, ratio=0.75)
    k = emb.layout.budget(0.75)
    non_scored = emb.seq_len - emb.layout.num_prunable
    assert indices.shape[-1] == non_scored + k
    sparse = sparse_state(target, pre.state, indices, emb.next_position)
    assert sparse.length == non_scored + k
    # the next token's rotary position is the full sequence's, not the sparse length
    assert sparse.length + sparse.position_offset == pre.state.length + pre.state.position_offset
    assert not torch.equal(indices[:, 0], indices[:, -1]) or indices.shape[1] == 1  # heads choose their own sets


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_greedy_std_equals_ar(family, ratio):
    target, _ = tiny_pair(family)
    for seed, prompt in [(0, "Describe the video."), (1, "What happens in this video? Answer in detail.")]:
        frames = random_frames(seed)
        cfg = DecodingConfig(gamma=3 + seed, max_new_tokens=20, temperature=0.0)
        ref = decode_ar(target, frames, prompt, cfg)
        got = decode_std(target, frames, prompt, cfg, PruningConfig("none", ratio))
        assert got.token_ids == ref.token_ids
        assert got.stats.rounds >= 1


def test_std_without_pruning_accepts_everything(family):
    target, _ = tiny_pair(family)
    cfg = DecodingConfig(gamma=4, max_new_tokens=16, temperature=0.0)
    got = decode_std(target, random_frames(5), "Describe the video.", cfg, PruningConfig("none", 0.0))
    assert got.stats.acceptance_rate == 1.0


def test_std_rejects_an_input_pruning_strategy():
    target, _ = tiny_pair("qwen2_5_vl")
    with pytest.raises(ValueError, match="does not apply"):
        decode_std(target, random_frames(0), "x", DecodingConfig(), PruningConfig("hippo", 0.5))

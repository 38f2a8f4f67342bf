"""Sparse-to-Dense per-head top-K (Sec. 3.2) against a loop reference, and its GQA pooling: the target's
per-layer attention mass (attention.layer_video_attention) ranked per KV head (sparse_kv.topk_per_head)."""

from __future__ import annotations

import math

import torch

from vpsd.pipeline.pruning.attention import layer_video_attention
from vpsd.pipeline.pruning.sparse_kv import topk_per_head


def std_topk_per_head(q, k, vpos, qpos, k_top, query_chunk=32):
    mass = torch.stack([layer_video_attention(q[i], k[i], vpos, qpos, query_chunk=query_chunk)
                        for i in range(q.shape[0])])
    return topk_per_head(mass, k_top)


def ref_std(q, k, vpos, qpos, top):
    """For each layer and KV head: sum over the group's query heads of the mean over text tokens."""
    num_layers, hq, nt, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(num_layers, hkv, top, dtype=torch.long)
    for layer in range(num_layers):
        for kv in range(hkv):
            mass = [0.0] * vpos.numel()
            for h in range(kv * g, (kv + 1) * g):
                for i in range(nt):
                    p = int(qpos[i])
                    logits = [float(q[layer, h, i] @ k[layer, kv, j]) / math.sqrt(d) for j in range(p + 1)]
                    z = sum(math.exp(x) for x in logits)
                    for jj, j in enumerate(vpos.tolist()):
                        mass[jj] += math.exp(logits[j]) / z / nt
            best = sorted(range(len(mass)), key=lambda j: (-mass[j], j))[:top]
            out[layer, kv] = torch.tensor(sorted(best))
    return out


def test_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 3, 4, generator=gen)  # GQA: 6 query heads over 3 KV heads
    k = torch.randn(2, 3, 11, 4, generator=gen)
    vpos, qpos = torch.arange(1, 8), torch.tensor([8, 9, 10])
    got = std_topk_per_head(q, k, vpos, qpos, 3, query_chunk=2)
    assert got.shape == (2, 3, 3) and got.dtype == torch.int64
    assert torch.equal(got, ref_std(q, k, vpos, qpos, 3))


def test_group_heads_are_summed_not_maxed():
    """Head 0 gives A 0.82 and B 0.18; head 1 gives B 0.82 and C 0.18.

    Summed over the group B has 1.0 and wins; a max over heads would tie A and B at 0.82 and pick A.
    """
    d = 4
    q = torch.zeros(1, 2, 1, d)
    q[0, 0, 0, 0] = 30.0  # head 0 -> key along axis 0
    q[0, 1, 0, 1] = 30.0  # head 1 -> keys along axis 1
    k = torch.zeros(1, 1, 4, d)
    k[0, 0, 0, 0] = 1.0  # video token 0 (A)
    k[0, 0, 1, 1] = 1.0  # video token 1 (B)
    k[0, 0, 2, 1] = 0.9  # video token 2 (C), a little behind B for head 1
    k[0, 0, 1, 0] = 0.9  # B also catches some of head 0
    top1 = std_topk_per_head(q, k, torch.tensor([0, 1, 2]), torch.tensor([3]), 1)
    assert top1.tolist() == [[[1]]]


def test_each_kv_head_has_its_own_set():
    q = torch.zeros(1, 4, 1, 2)
    q[0, :2, 0, 0] = 20.0  # group of KV head 0 looks along axis 0
    q[0, 2:, 0, 1] = 20.0  # group of KV head 1 along axis 1
    k = torch.zeros(1, 2, 3, 2)
    k[0, 0, 0, 0] = 1.0  # KV head 0: video token 0 matches
    k[0, 1, 1, 1] = 1.0  # KV head 1: video token 1 matches
    top1 = std_topk_per_head(q, k, torch.tensor([0, 1]), torch.tensor([2]), 1)
    assert top1[0, :, 0].tolist() == [0, 1]

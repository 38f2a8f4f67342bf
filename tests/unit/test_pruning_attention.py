"""Chunked text-to-video attention against a naive full softmax, and HIPPO Eq. 2 written as loops.

The target scores one layer at a time (layer_video_attention: (Hkv, Nv), mean over text and each KV group's
query heads); `per_layer` stacks the layers as the target's signals do, and attention_to_video averages them."""

from __future__ import annotations

import math

import pytest
import torch

from vpsd.pipeline.pruning.attention import attention_to_video, layer_video_attention


def per_layer(q, k, vpos, qpos, scale=None, query_chunk=32) -> torch.Tensor:
    """(L, Hkv, Nv): each layer scored as the target scores it during its prefill."""
    return torch.stack([layer_video_attention(q[i], k[i], vpos, qpos, scale, query_chunk) for i in range(q.shape[0])])


def s_attn(q, k, vpos, qpos, query_chunk=32) -> torch.Tensor:
    return attention_to_video(per_layer(q, k, vpos, qpos, query_chunk=query_chunk))


def naive_probs(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, scale: float) -> torch.Tensor:
    """(L, Hq, Nt, S) causal softmax(Q K^T * scale) with each KV head repeated for its query heads."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1).double()
    logits = q.double() @ k.transpose(-1, -2) * scale
    future = torch.arange(k.shape[2])[None, :] > qpos[:, None]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def random_case(seed: int, layers=2, hq=4, hkv=2, nt=5, s=12, d=8, video=(2, 9)):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(layers, hq, nt, d, generator=gen)
    k = torch.randn(layers, hkv, s, d, generator=gen)
    vpos = torch.arange(*video)
    # text queries: two inside the video span (to exercise the causal mask), the rest after it
    qpos = torch.tensor([4, 7] + list(range(s - nt + 2, s)))
    return q, k, vpos, qpos


@pytest.mark.parametrize("chunk", [1, 2, 3, 64])
def test_attention_to_video_equals_naive_softmax(chunk):
    q, k, vpos, qpos = random_case(0)
    scale = 1 / math.sqrt(q.shape[-1])
    want = naive_probs(q, k, qpos, scale)[..., vpos].mean(dim=(0, 1, 2))
    got = s_attn(q, k, vpos, qpos, query_chunk=chunk)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_eq2_as_loops():
    """s_attn(v_j) = 1/(N_L H L_txt) sum_l sum_h sum_i softmax_row_i(...)[j], one scalar at a time."""
    q, k, vpos, _ = random_case(1, layers=2, hq=2, hkv=1, nt=3, s=7, d=4, video=(1, 5))
    qpos = torch.tensor([3, 5, 6])  # the first one sits inside the video, so it cannot see all of it
    num_layers, hq, nt, d = q.shape
    g = hq // k.shape[1]
    want = torch.zeros(vpos.numel(), dtype=torch.float64)
    for layer in range(num_layers):
        for h in range(hq):
            for i in range(nt):
                p = int(qpos[i])
                logits = [float(q[layer, h, i] @ k[layer, h // g, j]) / math.sqrt(d) for j in range(p + 1)]
                top = max(logits)
                z = sum(math.exp(x - top) for x in logits)
                for jj, j in enumerate(vpos.tolist()):
                    if j <= p:
                        want[jj] += math.exp(logits[j] - top) / z
    want /= num_layers * hq * nt
    torch.testing.assert_close(s_attn(q, k, vpos, qpos, query_chunk=2).double(), want)


def test_softmax_denominator_includes_non_video_keys():
    """Zero queries attend uniformly to every key they can see, video or not: 1 / (p + 1) each."""
    q = torch.zeros(1, 2, 2, 4)
    k = torch.randn(1, 1, 10, 4)
    vpos, qpos = torch.tensor([2, 3, 4]), torch.tensor([6, 9])  # 7 and 10 visible keys
    want = torch.full((3,), (1 / 7 + 1 / 10) / 2)
    torch.testing.assert_close(s_attn(q, k, vpos, qpos), want)


def test_video_only_softmax_would_differ():
    q, k, vpos, qpos = random_case(3)
    got = s_attn(q, k, vpos, qpos)
    # sums to the share of attention on video keys, which is < 1 because text also attends elsewhere
    assert 0.0 < float(got.sum()) < 1.0


def test_gqa_groups_follow_repeat_kv_order():
    """Query head h reads KV head h // g: give KV head 1 a key that only query heads 2, 3 align with."""
    layers, hq, hkv, d = 1, 4, 2, 4
    q = torch.zeros(layers, hq, 1, d)
    q[0, 2:, 0, 0] = 20.0  # heads 2, 3 (group of KV head 1) look along axis 0
    k = torch.zeros(layers, hkv, 3, d)
    k[0, 1, 1, 0] = 1.0  # KV head 1, key 1 lies along axis 0
    per_head = per_layer(q, k, torch.tensor([1, 2]), torch.tensor([2]))
    # KV head 0: both its query heads spread uniformly over 3 keys -> 1/3 on each video key
    torch.testing.assert_close(per_head[0, 0], torch.full((2,), 1 / 3))
    # KV head 1: both heads of its group put almost all their attention on key 1
    assert per_head[0, 1, 0] > 0.995 and per_head[0, 1, 1] < 0.005


def test_bfloat16_inputs_are_scored_in_float32():
    q, k, vpos, qpos = random_case(4)
    got = s_attn(q.bfloat16(), k.bfloat16(), vpos, qpos)
    want = s_attn(q.bfloat16().float(), k.bfloat16().float(), vpos, qpos)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)

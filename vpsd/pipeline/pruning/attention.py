"""Text-to-video attention, rebuilt from cached queries and keys without the full attention matrix.

HIPPO's s_attn (Eq. 2), SpecVLM's rating A (Eq. 4-5) and Sparse-to-Dense's per-head KV choice all start
from the attention that text tokens pay to video tokens in the target's prefill. FlashAttention never
returns that matrix, so we rebuild it from the text queries and the KV cache.

Contract:
- inputs are already rotary-embedded (taken from the KV cache and q_proj + rope);
- key j of `keys` sits at sequence position j (the KV cache order), so a query at position p sees keys
  0..p (causal), and its softmax runs over ALL of them, not only the video keys; a video token's share
  is therefore the true attention probability the target assigned it;
- GQA: query head h reads KV head h // g with g = Hq / Hkv (the `repeat_kv` order of transformers);
- memory is bounded by one layer and one chunk of queries: (Hq, query_chunk, S) floats at a time;
- arithmetic is float32 whatever the input dtype, on the inputs' device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def video_attention_per_kv_head(
    queries: torch.Tensor,  # (L, Hq, Nt, d) text queries, rotary applied
    keys: torch.Tensor | Sequence[torch.Tensor],  # (L, Hkv, S, d), or L of (Hkv, S, d): the prefix's cached keys
    video_positions: torch.Tensor,  # (Nv,) int64 sequence positions of the video tokens
    query_positions: torch.Tensor,  # (Nt,) int64 sequence positions of the text queries
    scale: float | None = None,
    query_chunk: int = 32,
) -> torch.Tensor:  # (L, Hkv, Nv)
    """Attention to each video token, summed over the query heads of a KV group, mean over text tokens.

    This is Sparse-to-Dense's per-head quantity (Sec. 3.2: mean over text tokens, GQA heads of a group
    summed); HIPPO's and SpecVLM's averages are a further mean over layers and heads of it.
    """
    num_layers, hq, nt, d = queries.shape
    hkv, s = keys[0].shape[0], keys[0].shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into groups over {hkv} KV heads")
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    device = queries.device
    video_positions = video_positions.to(device)
    query_positions = query_positions.to(device)
    key_positions = torch.arange(s, device=device)
    out = torch.zeros(num_layers, hkv, video_positions.numel(), dtype=torch.float32, device=device)
    for layer in range(num_layers):
        k = keys[layer].float()  # (Hkv, S, d)
        for start in range(0, nt, query_chunk):
            q = queries[layer, :, start : start + query_chunk].float()  # (Hq, c, d)
            c = q.shape[1]
            # group the g query heads of each KV head on the row axis: one matmul, no repeated keys
            logits = torch.matmul(q.reshape(hkv, g * c, d), k.transpose(1, 2)) * scale  # (Hkv, g*c, S)
            logits = logits.view(hkv, g, c, s)
            future = key_positions[None, :] > query_positions[start : start + c, None]  # (c, S)
            logits.masked_fill_(future, float("-inf"))
            probs = torch.softmax(logits, dim=-1)[..., video_positions]  # (Hkv, g, c, Nv)
            out[layer] += probs.sum(dim=(1, 2))
    return out / nt


def attention_to_video(
    queries: torch.Tensor,  # (L, Hq, Nt, d)
    keys: torch.Tensor | Sequence[torch.Tensor],  # (L, Hkv, S, d), or L of (Hkv, S, d)
    video_positions: torch.Tensor,  # (Nv,)
    query_positions: torch.Tensor,  # (Nt,)
    scale: float | None = None,
    query_chunk: int = 32,
) -> torch.Tensor:  # (Nv,)
    """HIPPO s_attn (Eq. 2): attention to each video token averaged over layers, query heads and text."""
    per_head = video_attention_per_kv_head(queries, keys, video_positions, query_positions, scale, query_chunk)
    num_layers, hq = queries.shape[0], queries.shape[1]
    # per_head already sums the g query heads of each group, so the total over KV heads covers all Hq
    return per_head.sum(dim=(0, 1)) / (num_layers * hq)

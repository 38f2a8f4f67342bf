"""Text-to-video attention, rebuilt from one layer's queries and cached keys without the full attention matrix.

HIPPO's s_attn (Eq. 2), SpecVLM's rating A (Eq. 4-5) and Sparse-to-Dense's per-head KV choice all start
from the attention that text tokens pay to video tokens in the target's prefill. FlashAttention never
returns that matrix, so the target rebuilds it, layer by layer while its prefill runs (models/signals.py),
and only the reduced (layers, KV heads, video tokens) mass leaves it: for Qwen2.5-VL-7B and 24k video
tokens that is 20 x 4 x 24k floats (7.5 MiB) where shipping the queries and keys took 483 MiB.

Contract:
- inputs are already rotary-embedded (the layer's q_proj + rope, and its KV cache);
- key j of `keys` sits at sequence position j (the KV cache order), so a query at position p sees keys
  0..p (causal), and its softmax runs over ALL of them, not only the video keys; a video token's share
  is therefore the true attention probability the target assigned it;
- GQA: query head h reads KV head h // g with g = Hq / Hkv (the `repeat_kv` order of transformers); the g
  heads of a group are averaged (Sparse-to-Dense sums them: the same ranking, a constant factor g);
- memory is bounded by one chunk of queries: (Hq, query_chunk, S) floats at a time;
- arithmetic is float32 whatever the input dtype, on the inputs' device.
"""

from __future__ import annotations

import torch


def layer_video_attention(
    queries: torch.Tensor,  # (Hq, Nt, d) one layer's text queries, rotary applied
    keys: torch.Tensor,  # (Hkv, S, d) the layer's cached keys of the prefix, key j at position j
    video_positions: torch.Tensor,  # (Nv,) int64 sequence positions of the video tokens
    query_positions: torch.Tensor,  # (Nt,) int64 sequence positions of the text queries
    scale: float | None = None,
    query_chunk: int = 32,
) -> torch.Tensor:  # (Hkv, Nv) float32
    """Attention to each video token, mean over the text tokens and over the query heads of each KV group."""
    hq, nt, d = queries.shape
    hkv, s = keys.shape[0], keys.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into groups over {hkv} KV heads")
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    device = queries.device
    video_positions = video_positions.to(device)
    query_positions = query_positions.to(device)
    key_positions = torch.arange(s, device=device)
    out = torch.zeros(hkv, video_positions.numel(), dtype=torch.float32, device=device)
    k = keys.float()
    for start in range(0, nt, query_chunk):
        q = queries[:, start : start + query_chunk].float()  # (Hq, c, d)
        c = q.shape[1]
        # group the g query heads of each KV head on the row axis: one matmul, no repeated keys
        logits = torch.matmul(q.reshape(hkv, g * c, d), k.transpose(1, 2)) * scale  # (Hkv, g*c, S)
        logits = logits.view(hkv, g, c, s)
        future = key_positions[None, :] > query_positions[start : start + c, None]  # (c, S)
        logits.masked_fill_(future, float("-inf"))
        out += torch.softmax(logits, dim=-1)[..., video_positions].sum(dim=(1, 2))  # (Hkv, Nv)
    return out / (nt * g)


def attention_to_video(video_attention: torch.Tensor) -> torch.Tensor:  # (Nv,)
    """HIPPO s_attn (Eq. 2) from the (L, Hkv, Nv) per-layer, per-KV-head mass: the mean over layers and heads.
    Every KV group holds g query heads, so this is the mean over layers, query heads and text tokens."""
    return video_attention.mean(dim=(0, 1))

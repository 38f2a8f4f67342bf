"""Sparse-to-Dense (Sec. 3.2): which video KV entries each layer and KV head of the sparse drafter keeps.

Cache_s[l] = argTopK over video tokens x of (1/m_t) sum over text tokens x_hat of A_l(x_hat, x), chosen once
at prefill. With GQA the attention of the g query heads that share a KV head is summed ("we directly sum
the attention scores within each group"), so each KV head gets its own top-K set. The text tokens are the
prompt tokens after the video (the last m_t tokens of the input): the caller passes their queries and
positions. A_l is the true attention probability (softmax over every key the text token sees), built as
in attention.py.

Contract: (L, Hkv, K) int64 video token indices, sorted ascending within each (layer, head) so a caller
can gather the KV cache in its original order; ties go to the lower index.
"""

from __future__ import annotations

import torch

from vpsd.pipeline.pruning.attention import video_attention_per_kv_head


def topk_per_head(mass: torch.Tensor, k: int) -> torch.Tensor:
    """(L, Hkv, Nv) attention mass -> (L, Hkv, k) indices of the k largest, ascending, ties to lower index."""
    order = torch.sort(mass, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def std_topk_per_head(
    text_queries: torch.Tensor,  # (L, Hq, Nt, d) prompt-token queries, rotary applied
    keys: torch.Tensor,  # (L, Hkv, S, d) cached keys of the prefix, rotary applied
    video_positions: torch.Tensor,  # (Nv,) sequence positions of the video tokens
    query_positions: torch.Tensor,  # (Nt,) sequence positions of the text queries
    k: int,
    scale: float | None = None,
    query_chunk: int = 32,
) -> torch.Tensor:  # (L, Hkv, k) int64
    mass = video_attention_per_kv_head(text_queries, keys, video_positions, query_positions, scale, query_chunk)
    return topk_per_head(mass, k)

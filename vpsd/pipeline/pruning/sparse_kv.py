"""Sparse-to-Dense (Sec. 3.2): which video KV entries each layer and KV head of the sparse drafter keeps.

Cache_s[l] = argTopK over video tokens x of (1/m_t) sum over text tokens x_hat of A_l(x_hat, x), chosen once
at prefill. With GQA the attention of the g query heads that share a KV head is pooled ("we directly sum
the attention scores within each group"; the target's signals hold the group's mean, the same ranking), so
each KV head gets its own top-K set. The text tokens are the prompt tokens after the video (the last m_t
tokens of the input). A_l is the true attention probability (softmax over every key the text token sees),
rebuilt on the target as in attention.py.

Contract of topk_per_head: (L, Hkv, K) int64 video token indices, sorted ascending within each (layer, head) so a
caller can gather the KV cache in its original order; ties go to the lower index.
"""

from __future__ import annotations

import torch


def topk_per_head(mass: torch.Tensor, k: int) -> torch.Tensor:
    """(L, Hkv, Nv) attention mass -> (L, Hkv, k) indices of the k largest, ascending, ties to lower index."""
    order = torch.sort(mass, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def sparse_cache_indices(
    topk: torch.Tensor,  # (L, Hkv, K) indices into `scored_positions`, from topk_per_head
    scored_positions: torch.Tensor,  # (Nv,) sequence positions of the video tokens that were scored
    seq_len: int,
) -> torch.Tensor:  # (L, Hkv, seq_len - Nv + K) int64 cache positions, ascending
    """Which entries of a dense prefill cache (entry j = sequence position j) the sparse drafter keeps.

    Every entry that was not scored (text, non-prunable video tokens) plus, per layer and KV head, its
    own top-K video entries. Every head keeps the same number, so the gathered cache stays rectangular;
    ascending order keeps the cache in sequence order (rotary is already in the cached keys, so the
    order does not change attention, but it keeps the cache readable and the gather checkable).
    """
    num_layers, hkv, k = topk.shape
    keep = torch.ones(num_layers, hkv, seq_len, dtype=torch.bool)
    keep[:, :, scored_positions] = False
    chosen = scored_positions[topk]  # (L, Hkv, K) sequence positions
    keep.scatter_(2, chosen, True)
    width = seq_len - scored_positions.numel() + k
    return torch.nonzero(keep)[:, 2].view(num_layers, hkv, width)


def gather_heads(cache_tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, S, d) keys or values, (Hkv, S') per-head entry indices -> (B, Hkv, S', d)."""
    b, hkv, _, d = cache_tensor.shape
    index = indices.to(cache_tensor.device)[None, :, :, None].expand(b, hkv, indices.shape[1], d)
    return torch.gather(cache_tensor, 2, index)

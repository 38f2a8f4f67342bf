"""Sparse-to-Dense's draft cache (the `std` method): the target's own KV, a few video entries per layer and head.

The target prefills once, with hooks rebuilding its text-to-video attention in EVERY layer and KV head
(models/signals.py). From it, per layer and per KV head, the K video entries the text attended to most are
chosen (pipeline/pruning/sparse_kv.py, Sec. 3.2; GQA query heads of a group pooled). The draft's cache is
then gathered from the target's own prefill cache: all non-video entries plus each head's K video
entries. Cached keys already carry their rotary phase, so a gathered entry keeps its position; decoded
tokens continue from the full sequence's positions (position_offset), and every head keeps K entries so
the cache stays rectangular. Drafting runs the target's weights on that sparse cache; verification
runs them on the dense one. Used by the engine's drafter (engine/drafters/sparse_kv.py) and the reference
decoder (decoders/std.py).

K = the pruning ratio's budget of prunable video tokens (layout.budget): `--ratio 0.9` keeps 10% per
head. The paper sets K + m_t = 1024; a ratio keeps the knob comparable with the other methods.
Memory: the sparse cache is a copy, (non-video + K) / sequence of the dense one.
"""

from __future__ import annotations

import torch

from vpsd.models.base import DecodeState, PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.models.signals import prefill_with_signals
from vpsd.pipeline.pruning.sparse_kv import gather_heads, sparse_cache_indices, topk_per_head


def std_prefill(target: VideoLMAdapter, emb: SequenceEmbeddings) -> PrefillResult:
    """The target's full prefill with the text-to-video attention of every layer (Cache_s[l] needs each l)."""
    return prefill_with_signals(target, emb, num_layers=len(target.language_model.layers), attention=True, hidden=False)


def std_cache_indices(pre: PrefillResult, emb: SequenceEmbeddings, ratio: float) -> torch.Tensor:
    """(L, Hkv, S') dense-cache entries the sparse drafter keeps, from the prefill's signals."""
    layout = emb.layout
    scored = layout.seq_positions[layout.prunable]
    topk = topk_per_head(pre.signals.video_attention[..., layout.prunable.to(pre.signals.video_attention.device)],
                         layout.budget(ratio))
    return sparse_cache_indices(topk.cpu(), scored, emb.seq_len)


def sparse_state(target: VideoLMAdapter, dense: DecodeState, indices: torch.Tensor, next_position: int) -> DecodeState:
    """A new cache holding, per layer and KV head, the dense prefill entries `indices` selects."""
    cache = target.new_cache()
    for layer, (src, idx) in enumerate(zip(dense.cache.layers, indices)):
        cache.update(gather_heads(src.keys, idx), gather_heads(src.values, idx), layer)
    n = int(indices.shape[-1])
    return DecodeState(cache=cache, position_offset=next_position - n, prefill_len=n)


def kept_video_per_head(indices: torch.Tensor, emb: SequenceEmbeddings) -> int:
    """Video entries each head of the sparse cache keeps (non-prunable video tokens included)."""
    return int(indices.shape[-1]) - (emb.seq_len - emb.layout.num_tokens)

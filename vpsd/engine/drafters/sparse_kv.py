"""Sparse-to-Dense (`std`) in the engine: the target drafts for itself from a sparse copy of its own cache.

The drafter is the chain drafter of engine/drafters/local.py whose draft model is the target's own weights: each
request's draft row is the sparse cache its prefill chose (models/sparse_kv.py: per layer and KV head, the
non-video entries and the K video entries the text attended to most), a row of a second batched cache over the
target, so every request in flight drafts in one forward per token, at any batch size. The target's prefill is
the one that records the text-to-video attention of every layer; verification runs on the dense cache, as for
every chain. With one request in flight this is the reference decoder (decoders/std.py), forward for forward.
"""

from __future__ import annotations

import time

from vpsd.config import DecodingConfig, PruningConfig
from vpsd.engine.drafters.local import LocalDrafter
from vpsd.engine.request import Request
from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.models.sparse_kv import kept_video_per_head, sparse_state, std_cache_indices, std_prefill


class SparseKVDrafter(LocalDrafter):
    def __init__(self, target: VideoLMAdapter, decoding: DecodingConfig, pruning: PruningConfig) -> None:
        super().__init__(target, target, decoding, pruning)

    def prefill_signals(self, target: VideoLMAdapter) -> tuple[int, int] | None:
        return None  # its prefill reads every layer's attention per head (std_prefill), never a packed result

    def prefill(self, request: Request, emb: SequenceEmbeddings, on_engine_thread: bool) -> PrefillResult:
        """The target's prefill with every layer's text-to-video attention; the draft row is gathered from its
        cache (what drafting adds to the prefill is that gather)."""
        pre = std_prefill(self.target, emb)
        t0 = time.perf_counter()
        indices = std_cache_indices(pre, emb, self.pruning.ratio)
        pre.signals = None
        request.draft_handle = PrefillResult(pre.logits, sparse_state(self.target, pre.state, indices, emb.next_position))
        request.num_kept, request.kept, request.layout = kept_video_per_head(indices, emb), None, emb.layout
        request.draft_prefill_s = time.perf_counter() - t0
        return pre

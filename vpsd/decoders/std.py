"""`std`: Sparse-to-Dense self-speculation (serial, one process, the target's own weights): the reference decoder.

The method's draft cache, and why it is exact: models/sparse_kv.py. Drafting runs the target's weights on the sparse
cache, verification on the dense cache (the shared speculate loop of sd.py). Rollback of either cache is a crop.
"""

from __future__ import annotations

import time

import numpy as np

from vpsd.config import DecodingConfig, PruningConfig
from vpsd.pipeline.result import DecodeResult
from vpsd.decoders.sd import speculate
from vpsd.models.base import VideoLMAdapter
from vpsd.models.sparse_kv import kept_video_per_head, sparse_state, std_cache_indices, std_prefill
from vpsd.pipeline.seeds import verify_sampler


def decode_std(
    target: VideoLMAdapter,
    frames: np.ndarray,
    prompt: str,
    cfg: DecodingConfig,
    pruning: PruningConfig,
    frame_times: np.ndarray | None = None,
) -> DecodeResult:
    if pruning.strategy != "none":
        raise ValueError(f"std chooses its own KV entries per head; pruning strategy {pruning.strategy!r} does not apply")
    t0 = time.perf_counter()
    emb = target.embed(target.prepare(frames, prompt, frame_times))
    pre = std_prefill(target, emb)
    indices = std_cache_indices(pre, emb, pruning.ratio)
    pre.signals = None
    d_state = sparse_state(target, pre.state, indices, emb.next_position)
    sampler = verify_sampler(cfg.rule, cfg.seed)
    committed = [sampler.token(pre.logits, 0)[0]]
    t1 = time.perf_counter()
    committed, stats = speculate(target, pre.state, target, d_state, committed, cfg, sampler)
    kept_video = kept_video_per_head(indices, emb)
    return DecodeResult(
        token_ids=committed,
        stats=stats,
        prefill_s=t1 - t0,
        decode_s=time.perf_counter() - t1,
        num_kept=kept_video,
        num_video_tokens=emb.layout.num_tokens,
    )

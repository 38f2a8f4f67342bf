"""The single-process decoder each serial method runs (the target role calls this for every serial method)."""

from __future__ import annotations

import numpy as np

from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.pipeline.result import DecodeResult
from vpsd.decoders.sd import decode_sd
from vpsd.decoders.std import decode_std
from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.methods import Method


def decode_serial(
    method: Method,
    target: VideoLMAdapter,
    draft: VideoLMAdapter | None,
    frames: np.ndarray,
    prompt: str,
    cfg: DecodingConfig,
    pruning: PruningConfig,
    frame_times: np.ndarray | None = None,
) -> DecodeResult:
    """frame_times: (T,) seconds of each frame (VideoLMAdapter.prepare); None: the family's default rate."""
    if method.parallel:
        raise ValueError(f"method {method.name!r} is parallel: it runs through the roles, not a serial decoder")
    if not method.uses_draft:
        return decode_ar(target, frames, prompt, cfg, frame_times)
    if method.draft == "sparse_kv":
        return decode_std(target, frames, prompt, cfg, pruning, frame_times)
    return decode_sd(target, draft or target, frames, prompt, cfg, keep_policy_for(pruning, target.family), pruning,
                     tree=method.draft_tree(cfg.tree), frame_times=frame_times)

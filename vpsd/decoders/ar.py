"""`ar`: the target alone, one token per forward. The reference every other method must reproduce."""

from __future__ import annotations

import time

import numpy as np
import torch

from vpsd.config import DecodingConfig
from vpsd.pipeline.result import DecodeResult
from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.stopping import done
from vpsd.pipeline.seeds import verify_sampler


def decode_ar(
    target: VideoLMAdapter, frames: np.ndarray, prompt: str, cfg: DecodingConfig, frame_times: np.ndarray | None = None
) -> DecodeResult:
    t0 = time.perf_counter()
    emb = target.embed(target.prepare(frames, prompt, frame_times))
    pre = target.prefill(emb)
    sampler = verify_sampler(cfg.rule, cfg.seed)  # the token at output position t: sampler.token(row, t)
    tokens = [sampler.token(pre.logits, 0)[0]]
    t1 = time.perf_counter()
    stats = AcceptanceStats()
    stats.record(0, 0)
    eos = target.eos_token_ids
    while not done(tokens, cfg.max_new_tokens, eos):
        logits = target.step(pre.state, torch.tensor([tokens[-1]]))[-1]
        tokens.append(sampler.token(logits, len(tokens))[0])
        stats.record(0, 0)
    return DecodeResult(
        token_ids=tokens,
        stats=stats,
        prefill_s=t1 - t0,
        decode_s=time.perf_counter() - t1,
        num_video_tokens=emb.layout.num_tokens,
    )

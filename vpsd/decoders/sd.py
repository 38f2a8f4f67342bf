"""`sd`: serial speculative decoding, the single-process reference for every parallel method.

The draft proposes gamma tokens, the target verifies them in one forward, the draft's cache is rolled
back to the longest prefix that survived. The draft is a smaller model of the same family (sharing
the tokenizer and the video token layout) or the target itself (self-speculation); either way it is
prefilled with only the kept video tokens, each at its original position.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.tree_sd import speculate_tree
from vpsd.models.base import DecodeState, VideoLMAdapter
from vpsd.models.timing import settle
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.sampling import ItemSampler
from vpsd.pipeline.seeds import draft_sampler, verify_sampler
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.stopping import cut, done
from vpsd.pipeline.tree import DraftTree
from vpsd.pipeline.verification import verify_chunk, window_rows
from vpsd.tracing import span
from vpsd.engine.pair_prefill import KeepPolicy, prefill_pair
from vpsd.pipeline.result import DecodeResult

def draft_chunk(
    draft: VideoLMAdapter,
    state,
    cursor: CacheCursor,
    committed: list[int],
    k: int,
    sampler: ItemSampler,
) -> tuple[list[int], torch.Tensor | None]:
    """Brings the draft cache in line with `committed`, then proposes k tokens (and their q under the rejection
    rule), the i-th at output position len(committed) + i."""
    length, pending = cursor.sync(committed)
    draft.rollback(state, length)
    with span("draft_step", tokens=len(pending)):
        logits = draft.step(state, torch.tensor(pending))[-1]
        settle(draft.device)  # the span times the forward, not its launch (reports/accounting.py reads T_q here)
    cursor.feed(pending)
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    for i in range(k):
        token, q = sampler.token(logits, len(committed) + i)
        tokens.append(token)
        if q is not None:
            probs.append(q)
        if i < k - 1:  # the last proposal is never fed: verification decides what comes next
            with span("draft_step", tokens=1):
                logits = draft.step(state, torch.tensor(tokens[-1:]))[-1]
                settle(draft.device)
            cursor.feed(tokens[-1:])
    return tokens, (torch.stack(probs) if probs else None)


def decode_sd(
    target: VideoLMAdapter,
    draft: VideoLMAdapter,
    frames: np.ndarray,
    prompt: str,
    cfg: DecodingConfig,
    keep_policy: KeepPolicy,
    pruning: PruningConfig | None = None,
    frame_times: np.ndarray | None = None,
    tree: DraftTree | None = None,
) -> DecodeResult:
    """`pruning`: the strategy whose prefill signals (attention, hidden states) the keep policy reads;
    `frame_times`: (T,) seconds of each frame (VideoLMAdapter.prepare);
    `tree`: draft and verify a static tree each round (tree_sd.py) instead of a chain of gamma tokens."""
    t0 = time.perf_counter()
    pair = prefill_pair(target, draft, frames, prompt, keep_policy, pruning, frame_times, item_seed=cfg.seed)
    t_pre, d_pre = pair.target, pair.draft
    sampler = verify_sampler(cfg.rule, cfg.seed)
    committed = [sampler.token(t_pre.logits, 0)[0]]
    t1 = time.perf_counter()
    if tree is None:
        committed, stats = speculate(target, t_pre.state, draft, d_pre.state, committed, cfg, sampler)
    else:
        committed, stats = speculate_tree(target, t_pre.state, draft, d_pre.state, committed, cfg, tree, sampler)
    return DecodeResult(
        token_ids=committed,
        stats=stats,
        prefill_s=t1 - t0,
        decode_s=time.perf_counter() - t1,
        num_kept=pair.num_kept,
        num_video_tokens=pair.num_video_tokens,
        kept=pair.kept_indices(),
        layout=pair.target_emb.layout,
    )


def speculate(
    target: VideoLMAdapter,
    t_state: DecodeState,
    draft: VideoLMAdapter,
    d_state: DecodeState,
    committed: list[int],
    cfg: DecodingConfig,
    sampler: ItemSampler,  # the item's target side (pipeline/seeds.py verify_sampler)
) -> tuple[list[int], AcceptanceStats]:
    """The serial draft / verify loop from both prefills and the target's first token, to the end.

    The draft is any (adapter, state) pair: a smaller model, the target fed pruned video (sd, specvlm),
    or the target on a sparse KV cache (std). Returns the committed tokens, cut where `ar` stops.
    """
    drafting = draft_sampler(cfg.rule, sampler.seed)
    t_cur, d_cur = CacheCursor(t_state.length), CacheCursor(d_state.length)
    stats = AcceptanceStats()
    eos = target.eos_token_ids
    while not done(committed, cfg.max_new_tokens, eos):
        # Never draft past max_new_tokens: the round's own token fills the last slot.
        k = min(cfg.serial_gamma(), cfg.max_new_tokens - len(committed) - 1)
        drafts, q = draft_chunk(draft, d_state, d_cur, committed, k, drafting)
        length, feed, first = t_cur.verify_feed(committed, drafts)
        target.rollback(t_state, length)
        # Same span names as the parallel roles, so benchmarks read T_p and T_q the same way.
        # Verification sits inside the span, as in the target role, so the span can carry `accepted`.
        with span("verify", tokens=len(feed), drafted=len(drafts)) as verify_fields:
            logits = window_rows(target.step(t_state, torch.tensor(feed), rowwise=cfg.exact_verify), first)
            v = verify_chunk(drafts, q, logits, sampler, len(committed))
            verify_fields["accepted"] = v.num_accepted
        stats.record(v.num_accepted, v.num_drafted)
        stats.rollbacks += int(not v.all_accepted)
        emitted = v.emitted(drafts)
        committed += emitted  # an EOS accepted mid-round ends the output there (cut trims what follows it)
    return cut(committed, cfg.max_new_tokens, eos), stats

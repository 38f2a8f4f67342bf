"""An item's start on both sides, in the target's process: the target's full prefill with the signals the pruning
strategy reads, the kept video tokens, and the draft's prefill on them (each at its original position). The local
drafter's (engine/drafters/local.py, engine/drafters/tree.py) and the reference decoders' (decoders/sd.py) one
definition of what the draft sees."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vpsd.config import PruningConfig, draft_reuse_budget
from vpsd.engine.prefix_cache import PrefixReuse, draft_embed, draft_prefill, reuse_for
from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.models.signals import SignalsReady, hooked_layers, prefill_with_signals
from vpsd.pipeline.pruning.strategies import STRATEGIES

# Chooses the kept video tokens from the target's prefill (its signals) and the draft's embeddings.
KeepPolicy = Callable[[SequenceEmbeddings, PrefillResult, SequenceEmbeddings, int], "torch.Tensor | None"]  # ..., item seed



def signals_needed(cfg: PruningConfig) -> tuple[bool, bool]:
    """(attention, hidden states): what `cfg.strategy` reads from the target's prefill; neither if it prunes nothing."""
    strategy = STRATEGIES[cfg.strategy]
    if cfg.applied_ratio == 0.0:
        return False, False
    return strategy.needs_attention, strategy.needs_hidden_states


def strategy_signal_layers(adapter: VideoLMAdapter, cfg: PruningConfig, parallel: bool = False) -> tuple[int, int]:
    """(attention layers, UV-Prune layer) that `prefill_for_strategy` hooks for `cfg` ((0, 0): a plain prefill)."""
    attention, hidden = signals_needed(cfg)
    if not (attention or hidden):
        return 0, 0
    return hooked_layers(adapter, cfg.signal_layers(parallel), attention, hidden)


def prefill_for_strategy(
    adapter: VideoLMAdapter,
    emb: SequenceEmbeddings,
    cfg: PruningConfig,
    on_ready: SignalsReady | None = None,
    parallel: bool = False,
) -> PrefillResult:
    """The target's full prefill with exactly the signals `cfg.strategy` reads (a plain prefill when none),
    of the layers `cfg.signal_layers(parallel)` names (a parallel run streams them after an early layer).

    `on_ready` is called mid-prefill with those signals (see `prefill_with_signals`); never for a plain prefill.
    """
    attention, hidden = signals_needed(cfg)
    if not (attention or hidden):
        return target_prefill(adapter, emb)
    return prefill_with_signals(adapter, emb, cfg.signal_layers(parallel), attention, hidden, on_ready)


def target_prefill(adapter: VideoLMAdapter, emb: SequenceEmbeddings) -> PrefillResult:
    """The target's full prefill, through the engine's kept prefixes when it planned to reuse them
    (`emb.reuse`, engine/prefix_cache.py): the same result, only the suffix fed on a hit."""
    return adapter.prefill(emb) if emb.reuse is None else emb.reuse.prefill(adapter, emb)


@dataclass
class PairPrefill:
    """Both models prefilled for one item: the target on the whole video, the draft on the kept tokens."""

    target_emb: SequenceEmbeddings
    target: PrefillResult
    draft: PrefillResult
    keep: torch.Tensor | None  # kept video-token indices (None: every token)
    num_video_tokens: int
    draft_s: float = 0.0  # what speculation added to the prefill: the draft's vision, the pruning, its prefill

    @property
    def num_kept(self) -> int:
        """Video tokens the draft saw (the grids agree: checked by prefill_pair)."""
        return int(self.keep.numel()) if self.keep is not None else self.num_video_tokens

    def kept_indices(self) -> torch.Tensor:
        return self.keep if self.keep is not None else torch.arange(self.num_video_tokens)


def draft_reuse(draft: VideoLMAdapter, t_emb: SequenceEmbeddings) -> PrefixReuse | None:
    """The draft model's own prefix reuse where the target's request reuses its video prefix (`t_emb.reuse`),
    within a draft's share of the target's budget (engine/prefix_cache.py draft_embed); else None."""
    if t_emb.reuse is None:
        return None
    return reuse_for(draft, draft_reuse_budget(t_emb.reuse.store.budget))


def prefill_pair(
    target: VideoLMAdapter,
    draft: VideoLMAdapter,
    frames: np.ndarray,
    prompt: str,
    keep_policy: KeepPolicy,
    pruning: PruningConfig | None = None,
    frame_times: np.ndarray | None = None,
    target_emb: SequenceEmbeddings | None = None,
    parallel_signals: bool = False,
    item_seed: int = 0,
) -> PairPrefill:
    """The target's full prefill (with the signals `pruning`'s strategy reads), the kept video tokens, and the
    draft's pruned prefill. `target_emb`: the target's embeddings when the caller already has them;
    `parallel_signals`: read the signals of the layers a parallel run streams (PruningConfig.signal_layers), so
    a parallel method keeps the same video tokens here as in its pipeline; `item_seed`: the item's seed, which a
    random pruning's selection derives from (pipeline/seeds.py)."""
    t_emb = target_emb if target_emb is not None else target.embed(target.prepare(frames, prompt, frame_times))
    t0 = time.perf_counter()
    d_emb = t_emb
    if draft is not target:  # its own embeddings, through its own prefix reuse where the target's request reuses
        item = t_emb.reuse.item if t_emb.reuse is not None else ""
        d_emb = draft_embed(draft, draft.prepare(frames, prompt, frame_times), draft_reuse(draft, t_emb), item)
    draft_s = time.perf_counter() - t0
    d_emb.layout.check_same_grid(t_emb.layout.grid)
    t_pre = (target_prefill(target, t_emb) if pruning is None
             else prefill_for_strategy(target, t_emb, pruning, parallel=parallel_signals))
    t0 = time.perf_counter()
    keep = keep_policy(t_emb, t_pre, d_emb, item_seed)
    t_pre.signals = None  # the copied keys are not needed while decoding
    d_pre = draft_prefill(draft, d_emb, keep) if d_emb is not t_emb else None
    if d_pre is None:
        d_pre = draft.prefill(d_emb, keep=keep)
    draft_s += time.perf_counter() - t0
    return PairPrefill(t_emb, t_pre, d_pre, keep, t_emb.layout.num_tokens, draft_s)

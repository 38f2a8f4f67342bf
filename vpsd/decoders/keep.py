"""Keep policies: which video tokens the draft sees, chosen by a named pruning strategy.

The policy gathers only the signals the strategy declares (visual embeddings from the target's
vision tower; attention and hidden states from the target's prefill, see models/signals.py) and asks
the strategy for kept indices. Ratio 0 or strategy "none" keeps every token.
"""

from __future__ import annotations

import torch

from vpsd.config import PruningConfig
from vpsd.models.base import PrefillResult, SequenceEmbeddings
from vpsd.pipeline.pruning.strategies import STRATEGIES, PruningSignals


def keep_policy_for(cfg: PruningConfig):
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"unknown pruning strategy {cfg.strategy!r}; known: {sorted(STRATEGIES)}")
    strategy = STRATEGIES[cfg.strategy]

    def policy(t_emb: SequenceEmbeddings, t_pre: PrefillResult, d_emb: SequenceEmbeddings) -> torch.Tensor | None:
        if cfg.applied_ratio == 0.0:
            return None
        signals = PruningSignals()
        if strategy.needs_visual_embeds:
            signals.visual_embeds = t_emb.visual_embeds.float()
        if strategy.needs_attention or strategy.needs_hidden_states:
            if t_pre.signals is None:
                raise ValueError(f"strategy {cfg.strategy!r} needs target prefill signals, none were captured")
            signals = t_pre.signals.merged_into(signals)
        return strategy.select(signals, t_emb.layout, cfg.ratio, cfg.seed)

    return policy

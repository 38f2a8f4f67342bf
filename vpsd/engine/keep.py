"""Keep policies: which video tokens the draft sees, chosen by a named pruning strategy.

The policy gathers only the signals the strategy declares (visual embeddings from the target's
vision tower; attention and hidden states from the target's prefill, see models/signals.py) and asks
the strategy for kept indices. Ratio 0 or strategy "none" keeps every token. `configured_strategy`
is the one place a config's strategy gets its knobs (crop, SpecVLM lambda): the pruner role uses it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vpsd.config import PruningConfig
from vpsd.pipeline.pruning.specvlm import specvlm_lambda
from vpsd.pipeline.seeds import pruning_seed
from vpsd.pipeline.pruning.strategies import PruningSignals, Strategy, strategy_for

if TYPE_CHECKING:  # the pruner rank uses configured_strategy and loads no model: no transformers in its process
    from vpsd.models.base import PrefillResult, SequenceEmbeddings


def configured_strategy(cfg: PruningConfig, family: str | None) -> Strategy:
    """`cfg.strategy` with `cfg.crop` and SpecVLM's lambda (`cfg.specvlm_lambda`, else the family's)."""
    return strategy_for(cfg.strategy, cfg.crop, specvlm_lambda(family, cfg.specvlm_lambda))


def keep_policy_for(cfg: PruningConfig, family: str | None = None):
    """family: picks SpecVLM's per-family lambda when the config sets none."""
    strategy = configured_strategy(cfg, family)

    def policy(t_emb: SequenceEmbeddings, t_pre: PrefillResult, d_emb: SequenceEmbeddings,
               item_seed: int = 0) -> torch.Tensor | None:
        if cfg.applied_ratio == 0.0:
            return None
        signals = PruningSignals()
        if strategy.needs_visual_embeds:
            signals.visual_embeds = t_emb.visual_embeds.float()
        if strategy.needs_attention or strategy.needs_hidden_states:
            if t_pre.signals is None:
                raise ValueError(f"strategy {cfg.strategy!r} needs target prefill signals, none were captured")
            signals = t_pre.signals.merged_into(signals)
        return strategy.select(signals, t_emb.layout, cfg.ratio, pruning_seed(cfg.seed, item_seed))

    return policy

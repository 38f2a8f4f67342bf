"""The strategy registry: names, declared signals, and that strategies read only what they declare."""

from __future__ import annotations

import pytest
import torch
from pruning_fixtures import check_kept, newline_layout, signals_for

from vpsd.pipeline.pruning.select import top_k_keep
from vpsd.pipeline.pruning.strategies import STRATEGIES, PruningSignals, specvlm_strategy

NAMES = [
    "hippo", "hippo_no_attn", "hippo_no_temp", "hippo_no_spa", "uv", "specvlm",
    "attn", "temporal", "spatial", "random", "uniform", "frame", "none",
]


def test_registry_has_every_name():
    assert sorted(STRATEGIES) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_strategy_runs_on_only_the_signals_it_declares(name):
    layout = newline_layout(3, 6, 5, start=4)
    full = signals_for(layout, 0)
    strategy = STRATEGIES[name]
    only = PruningSignals(
        visual_embeds=full.visual_embeds if strategy.needs_visual_embeds else None,
        video_attention=full.video_attention if strategy.needs_attention else None,
        video_hidden=full.video_hidden if strategy.needs_hidden_states else None,
        text_hidden=full.text_hidden if strategy.needs_hidden_states else None,
    )
    kept = strategy.select(only, layout, 0.9, 0)
    if name == "none":
        assert kept.numel() == layout.num_tokens
    else:
        check_kept(kept, layout, 0.9)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("random", "uniform", "frame", "none")])
def test_missing_signal_is_named(name):
    with pytest.raises(ValueError, match="missing"):
        STRATEGIES[name].select(PruningSignals(), newline_layout(1, 3, 3), 0.5, 0)


def test_attn_strategy_is_top_k_of_s_attn():
    layout = newline_layout(2, 4, 4, start=3)
    sig = signals_for(layout, 1)
    score = sig.video_attention.mean(dim=(0, 1))  # HIPPO Eq. 2: mean over layers and heads
    assert torch.equal(STRATEGIES["attn"].select(sig, layout, 0.75, 0), top_k_keep(score, layout, 0.75))


def test_specvlm_lambda_changes_the_stage_one_share():
    layout = newline_layout(2, 6, 6, start=3)
    sig = signals_for(layout, 2)
    low = specvlm_strategy(0.0).select(sig, layout, 0.5, 0)  # stage II only: pure uniform reduction
    high = specvlm_strategy(1.0).select(sig, layout, 0.5, 0)  # stage I fills the budget: top-k
    score = sig.video_attention.mean(dim=(0, 1))  # HIPPO Eq. 2: mean over layers and heads
    assert torch.equal(high, top_k_keep(score, layout, 0.5))
    assert not torch.equal(low, high)

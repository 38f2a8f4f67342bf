"""The registry of pruning strategies: a name -> which signals it needs and how it picks tokens.

The pipeline looks a strategy up by the name in the config, asks the target / vision tower only for the
signals that strategy needs (attention is costly to rebuild, hidden states are costly to ship), then
calls `select`. Every `select` honours the kept-index contract of select.py.

Names: the method ("hippo"), its ablations ("hippo_no_attn", "hippo_no_temp", "hippo_no_spa"), the
other papers ("uv", "specvlm"), single signals ranked raw and globally ("attn" is the attention-only
selection of HIPPO Fig. 2-3, "temporal", "spatial"), score-free baselines ("random", "uniform", "frame"),
and "none" (keep everything: plain speculative decoding).

`STRATEGIES` holds every strategy with its paper defaults (HIPPO's 5x5 crop, SpecVLM's lambda 0.5);
`strategy_for(name, crop, lam)` builds one with a run's own `pruning.crop` / `pruning.specvlm_lambda`
(`specvlm.specvlm_lambda` picks the per-family value when the config leaves it unset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.attention import attention_to_video
from vpsd.pipeline.pruning.fusion import hippo_score
from vpsd.pipeline.pruning.select import frame_keep, random_keep, top_k_keep, uniform_keep
from vpsd.pipeline.pruning.spatial import HIPPO_DEFAULT_CROP, spatial_score
from vpsd.pipeline.pruning.specvlm import SPECVLM_DEFAULT_LAMBDA, specvlm_select
from vpsd.pipeline.pruning.temporal import temporal_score
from vpsd.pipeline.pruning.uv import uv_score


@dataclass
class PruningSignals:
    """What the target and the vision tower measured; each strategy reads only what it declares."""

    visual_embeds: torch.Tensor | None = None  # (N, D) projector output, one row per video token
    # (L, Hkv, N) float32 attention of the text tokens to each video token, per target layer and KV head (mean
    # over the text tokens and the group's query heads), rebuilt on the target during its prefill (attention.py)
    video_attention: torch.Tensor | None = None
    video_hidden: torch.Tensor | None = None  # (L+1, N, D) target hidden states of the video tokens
    text_hidden: torch.Tensor | None = None  # (L+1, Nt, D) target hidden states of the text tokens


SelectFn = Callable[[PruningSignals, VideoTokenLayout, float, int], torch.Tensor]


@dataclass(frozen=True)
class Strategy:
    name: str
    needs_attention: bool  # video_attention
    needs_hidden_states: bool  # video_hidden, text_hidden
    needs_visual_embeds: bool  # visual_embeds
    select: SelectFn  # (signals, layout, ratio, seed) -> kept video token indices


def _require(signals: PruningSignals, *names: str) -> None:
    missing = [n for n in names if getattr(signals, n) is None]
    if missing:
        raise ValueError(f"pruning signals missing: {', '.join(missing)}")


def _attention(signals: PruningSignals, layout: VideoTokenLayout) -> torch.Tensor:
    _require(signals, "video_attention")
    return attention_to_video(signals.video_attention)


def _temporal(signals: PruningSignals, layout: VideoTokenLayout) -> torch.Tensor:
    _require(signals, "visual_embeds")
    return temporal_score(signals.visual_embeds, layout)


def _spatial(crop: int) -> Callable[[PruningSignals, VideoTokenLayout], torch.Tensor]:
    def score(signals: PruningSignals, layout: VideoTokenLayout) -> torch.Tensor:
        _require(signals, "visual_embeds")
        return spatial_score(signals.visual_embeds, layout, crop=crop)

    return score


def _hippo(use_attn: bool, use_temp: bool, use_spa: bool, crop: int) -> SelectFn:
    def select(signals: PruningSignals, layout: VideoTokenLayout, ratio: float, seed: int) -> torch.Tensor:
        score = hippo_score(
            layout,
            attn=_attention(signals, layout) if use_attn else None,
            temp=_temporal(signals, layout) if use_temp else None,
            spa=_spatial(crop)(signals, layout) if use_spa else None,
        )
        return top_k_keep(score, layout, ratio)

    return select


def _hippo_strategy(name: str, use_attn: bool, use_temp: bool, use_spa: bool, crop: int) -> Strategy:
    return Strategy(name, use_attn, False, use_temp or use_spa, _hippo(use_attn, use_temp, use_spa, crop))


def _uv(signals: PruningSignals, layout: VideoTokenLayout, ratio: float, seed: int) -> torch.Tensor:
    _require(signals, "video_hidden", "text_hidden")
    return top_k_keep(uv_score(signals.video_hidden, signals.text_hidden), layout, ratio)


def specvlm_strategy(lam: float = SPECVLM_DEFAULT_LAMBDA) -> Strategy:
    """SpecVLM with a given lambda (the registry holds the default; see specvlm.py for per-family values)."""

    def select(signals: PruningSignals, layout: VideoTokenLayout, ratio: float, seed: int) -> torch.Tensor:
        return specvlm_select(_attention(signals, layout), layout, ratio, lam)

    return Strategy("specvlm", True, False, False, select)


def _ranked(score_fn: Callable[[PruningSignals, VideoTokenLayout], torch.Tensor]) -> SelectFn:
    def select(signals: PruningSignals, layout: VideoTokenLayout, ratio: float, seed: int) -> torch.Tensor:
        return top_k_keep(score_fn(signals, layout), layout, ratio)

    return select


def _keep_all(signals: PruningSignals, layout: VideoTokenLayout, ratio: float, seed: int) -> torch.Tensor:
    return torch.arange(layout.num_tokens, dtype=torch.long)


def _build(crop: int = HIPPO_DEFAULT_CROP, lam: float = SPECVLM_DEFAULT_LAMBDA) -> dict[str, Strategy]:
    return {
        s.name: s
        for s in [
            _hippo_strategy("hippo", True, True, True, crop),
            _hippo_strategy("hippo_no_attn", False, True, True, crop),
            _hippo_strategy("hippo_no_temp", True, False, True, crop),
            _hippo_strategy("hippo_no_spa", True, True, False, crop),
            Strategy("uv", False, True, False, _uv),
            specvlm_strategy(lam),
            Strategy("attn", True, False, False, _ranked(_attention)),
            Strategy("temporal", False, False, True, _ranked(_temporal)),
            Strategy("spatial", False, False, True, _ranked(_spatial(crop))),
            Strategy("random", False, False, False, lambda s, lay, r, seed: random_keep(lay, r, seed)),
            Strategy("uniform", False, False, False, lambda s, lay, r, seed: uniform_keep(lay, r)),
            Strategy("frame", False, False, False, lambda s, lay, r, seed: frame_keep(lay, r)),
            Strategy("none", False, False, False, _keep_all),
        ]
    }


STRATEGIES: dict[str, Strategy] = _build()


def strategy_for(name: str, crop: int = HIPPO_DEFAULT_CROP, lam: float = SPECVLM_DEFAULT_LAMBDA) -> Strategy:
    """The strategy `name` with a run's HIPPO crop side and SpecVLM lambda."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown pruning strategy {name!r}; known: {sorted(STRATEGIES)}")
    return _build(crop, lam)[name]

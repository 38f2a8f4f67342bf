"""Scores as the papers define them. Serial runs average attention over ALL target layers
(HIPPO Eq. 2, SpecVLM Eq. 5); parallel runs stream after `pruning.stream_layers` (ParallelVLM's variant,
explicit and switchable off); UV-Prune ships layers 0 and L only; `pruning.crop` and SpecVLM's lambda reach
the strategies, lambda per family from the papers."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_frames, tiny_pair
from tests.pruning_fixtures import grid_layout, signals_for
from vpsd.config import PruningConfig
from vpsd.engine.keep import configured_strategy
from vpsd.engine.pair_prefill import prefill_for_strategy
from vpsd.models.signals import text_positions
from vpsd.pipeline.pruning.attention import attention_to_video
from vpsd.pipeline.pruning.specvlm import specvlm_select
from vpsd.pipeline.pruning.strategies import STRATEGIES, strategy_for
from vpsd.pipeline.pruning.uv import uv_score


def test_signal_layers_serial_all_parallel_streamed():
    assert PruningConfig("hippo").signal_layers(parallel=False) is None  # all layers: the papers' definition
    assert PruningConfig("hippo").signal_layers(parallel=True) == 20  # ParallelVLM's streaming, the default
    assert PruningConfig("hippo", stream_layers=None).signal_layers(parallel=True) is None  # off: wait for all
    assert PruningConfig("hippo", layers=2).signal_layers(parallel=True) == 2
    assert PruningConfig("hippo", layers=30, stream_layers=8).signal_layers(parallel=True) == 8
    assert PruningConfig("hippo", layers=30, stream_layers=8).signal_layers(parallel=False) == 30
    for bad in (dict(layers=0), dict(stream_layers=-1), dict(crop=0), dict(specvlm_lambda=1.5)):
        with pytest.raises(ValueError):
            PruningConfig("hippo", **bad)


def test_serial_attention_reads_every_layer_parallel_only_the_streamed_ones():
    target, _ = tiny_pair("qwen2_5_vl")
    depth = len(target.language_model.layers)
    emb = target.embed(target.prepare(random_frames(0), "What happens?"))
    cfg = PruningConfig("attn", 0.5, stream_layers=2)
    serial = prefill_for_strategy(target, emb, cfg).signals
    assert serial.video_attention.shape[0] == depth
    streamed = []
    parallel = prefill_for_strategy(target, emb, cfg, on_ready=streamed.append, parallel=True).signals
    assert parallel.video_attention.shape[0] == 2 and streamed == [parallel]
    off = prefill_for_strategy(target, emb, PruningConfig("attn", 0.5, stream_layers=None), parallel=True).signals
    assert off.video_attention.shape[0] == depth


def test_uv_ships_two_layers_and_scores_as_the_full_stack():
    target, _ = tiny_pair("qwen2_5_vl")
    emb = target.embed(target.prepare(random_frames(1), "What happens?"))
    s = prefill_for_strategy(target, emb, PruningConfig("uv", 0.5, layers=3)).signals
    assert s.video_hidden.shape[0] == s.text_hidden.shape[0] == 2
    full = target.prefill(emb, output_hidden_states=True).hidden_states
    video, text = emb.layout.seq_positions, text_positions(emb)
    stack_v = torch.stack([h[0, video] for h in full[:4]])
    stack_t = torch.stack([h[0, text] for h in full[:4]])
    torch.testing.assert_close(uv_score(s.video_hidden, s.text_hidden), uv_score(stack_v, stack_t, num_layers=3))


def test_crop_and_lambda_reach_the_strategies():
    layout = grid_layout(2, 10, 10)
    signals = signals_for(layout, 0)
    five = STRATEGIES["spatial"].select(signals, layout, 0.7, 0)
    assert torch.equal(configured_strategy(PruningConfig("spatial", 0.7), None).select(signals, layout, 0.7, 0), five)
    three = configured_strategy(PruningConfig("spatial", 0.7, crop=3), None).select(signals, layout, 0.7, 0)
    assert not torch.equal(three, five)  # the crop is honoured, not a hard-coded 5
    assert torch.equal(three, strategy_for("spatial", crop=3).select(signals, layout, 0.7, 0))

    signals = signals_for(layout, 1)
    scores = attention_to_video(signals.video_attention)

    def chosen(cfg: PruningConfig, family: str) -> torch.Tensor:
        return configured_strategy(cfg, family).select(signals, layout, 0.7, 0)

    by_lambda = {lam: specvlm_select(scores, layout, 0.7, lam) for lam in (0.4, 0.5, 0.9)}
    assert not torch.equal(by_lambda[0.4], by_lambda[0.5])  # lambda changes the choice here
    assert torch.equal(chosen(PruningConfig("specvlm", 0.7), "llava_onevision"), by_lambda[0.4])  # Table 1
    assert torch.equal(chosen(PruningConfig("specvlm", 0.7), "qwen2_5_vl"), by_lambda[0.5])  # Table 2
    assert torch.equal(chosen(PruningConfig("specvlm", 0.7, specvlm_lambda=0.9), "llava_onevision"), by_lambda[0.9])

"""What the pruning signals cost is bounded by structure, whatever the depth.
(`vpsd bench signal_memory` measures the same at a real target's depth and 24k tokens.)"""

from __future__ import annotations

import copy
import dataclasses

import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.config import PruningConfig
from vpsd.engine.pair_prefill import prefill_for_strategy
from vpsd.models.signals import text_positions
from vpsd.roles.signals_wire import pack, unpack


def _setup(strategy: str, **kw):
    target, _ = tiny_pair("qwen2_5_vl")
    emb = target.embed(target.prepare(random_frames(0), "What happens?"))
    pre = prefill_for_strategy(target, emb, PruningConfig(strategy, 0.5, **kw), parallel=True)
    return target, emb, pre


def test_attention_is_scored_on_the_target_and_only_the_mass_travels():
    """Per layer and KV head one float32 per video token, whatever the sequence length or head size: no
    queries, no keys (for a 7B target and 24k tokens the keys alone were 483 MiB, the mass is 7.5 MiB)."""
    target, emb, pre = _setup("attn", stream_layers=3)
    sent = pre.signals.as_tensors()
    assert set(sent) == {"video_attention"}
    tag, tensors = pack(sent, emb.layout)
    cfg = target.model.config.get_text_config()
    signal_bytes = sum(t.numel() * t.element_size() for t in tensors[:-2])  # all but the layout rows and grid
    assert signal_bytes == 3 * cfg.num_key_value_heads * emb.layout.num_tokens * 4
    got, layout = unpack(tag, tensors)
    assert torch.equal(got.video_attention, sent["video_attention"])
    assert torch.equal(layout.seq_positions, emb.layout.seq_positions) and layout.grid == emb.layout.grid


def test_a_bf16_target_scores_in_float32():
    target, _ = tiny_pair("qwen2_5_vl")
    emb = target.embed(target.prepare(random_frames(0), "What happens?"))
    bf16 = copy.deepcopy(target.model).to(torch.bfloat16)
    adapter = type(target)(bf16, target.tokenizer, vision_spec=target.vision_spec)
    emb16 = dataclasses.replace(emb, embeds=emb.embeds.to(torch.bfloat16))
    pre = prefill_for_strategy(adapter, emb16, PruningConfig("attn", 0.5, stream_layers=2), parallel=True)
    mass = pre.signals.video_attention
    assert mass.dtype == torch.float32 and mass.shape[0] == 2
    full = prefill_for_strategy(target, emb, PruningConfig("attn", 0.5, stream_layers=2), parallel=True)
    torch.testing.assert_close(mass, full.signals.video_attention, rtol=0.05, atol=1e-3)  # bf16 inputs, same scores


def test_uv_ships_two_hidden_layers_whatever_the_depth():
    for layers in (1, 3, None):
        _, emb, pre = _setup("uv", layers=layers)
        n, nt = emb.layout.num_tokens, len(text_positions(emb))
        assert pre.signals.video_hidden.shape[:2] == (2, n) and pre.signals.text_hidden.shape[:2] == (2, nt)

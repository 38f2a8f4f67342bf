"""Prefill signals: the hooked prefill is the plain prefill, and the attention it scores is the eager attention.

Reference: an eager forward of the same language model with output_attentions, for each of the first L layers
and each KV head the mean over that head's query heads and the text tokens, read at the video key columns.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.sd import decode_sd
from vpsd.engine.pair_prefill import prefill_for_strategy
from vpsd.models.signals import PrefillSignals, prefill_with_signals, text_positions
from vpsd.pipeline.pruning.strategies import PruningSignals

PROMPT = "What happens in this video?"


def _embeddings(family: str, seed: int = 0):
    target, _ = tiny_pair(family)
    return target, target.embed(target.prepare(random_frames(seed), PROMPT))


@functools.lru_cache(maxsize=None)
def _sharp_target(family: str):
    """A copy of the tiny target with queries and keys scaled 8x: random weights give near-uniform attention,
    which a wrong rotary phase or a wrong layer would hardly change; x64 logits make the test discriminate."""
    target = copy.deepcopy(tiny_pair(family)[0])
    with torch.no_grad():
        for layer in target.language_model.layers:
            attn = layer.self_attn
            for proj in (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else (attn.q_proj, attn.k_proj):
                for w in proj.parameters():
                    w.mul_(8.0)
    return target


def _eager_attentions(adapter, emb) -> tuple[torch.Tensor, ...]:
    """(1, Hq, S, S) attention weights of every layer from an eager forward of the full sequence."""
    previous = adapter.language_model.config._attn_implementation
    adapter.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = adapter.language_model(
                inputs_embeds=emb.embeds,
                position_ids=emb.positions if adapter.position_rows > 1 else emb.positions[0],
                use_cache=False,
                output_attentions=True,
                **adapter._language_kwargs(emb, torch.arange(emb.layout.num_tokens)),
            )
    finally:
        adapter.model.set_attn_implementation(previous)
    return out.attentions


def test_attention_matches_eager_forward(family):
    target = _sharp_target(family)
    emb = target.embed(target.prepare(random_frames(0), PROMPT))
    num_layers = 3  # fewer than the tiny target's 4: only the first L layers count
    s = prefill_with_signals(target, emb, num_layers, attention=True, hidden=False).signals
    video, text = emb.layout.seq_positions, text_positions(emb)
    text_cfg = target.model.config.get_text_config()
    hq, hkv = text_cfg.num_attention_heads, text_cfg.num_key_value_heads
    assert s.video_attention.shape == (num_layers, hkv, video.numel()) and s.video_attention.dtype == torch.float32

    eager = _eager_attentions(target, emb)  # (1, Hq, S, S) per layer; query head h reads KV head h // g

    def per_kv_head(a):  # (Hq, Nt, Nv) -> (Hkv, Nv): mean over the group's query heads and the text tokens
        return a[0][:, text][:, :, video].reshape(hkv, hq // hkv, len(text), -1).mean(dim=(1, 2))

    want = torch.stack([per_kv_head(a) for a in eager[:num_layers]])
    assert want.max() > 1.5 * want.min()  # far from uniform, so the comparison below means something
    torch.testing.assert_close(s.video_attention, want.float(), rtol=0, atol=1e-6)
    # the layer left out matters: averaging over all layers gives a different answer
    all_layers = torch.stack([per_kv_head(a) for a in eager]).mean(dim=(0, 1))
    assert (all_layers - want.mean(dim=(0, 1))).abs().max() > 1e-3


def test_text_tokens_follow_the_last_video_token(family):
    target, emb = _embeddings(family)
    text = text_positions(emb)
    assert int(text[0]) > int(emb.layout.seq_positions.max())
    assert int(text[-1]) == emb.seq_len - 1
    assert torch.equal(text, torch.arange(int(text[0]), emb.seq_len))  # nothing but text after the video


def test_hidden_rows_and_unchanged_prefill(family):
    target, emb = _embeddings(family)
    ref = target.prefill(emb, output_hidden_states=True)
    got = prefill_with_signals(target, emb, 2, attention=True, hidden=True)
    assert torch.equal(got.logits, ref.logits)
    assert got.state.length == ref.state.length and got.state.position_offset == ref.state.position_offset
    for a, b in zip(got.state.cache.layers, ref.state.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    s = got.signals
    video, text = emb.layout.seq_positions, text_positions(emb)
    # UV-Prune's score telescopes to layers 0 and L: only those two travel, not every layer between.
    assert s.video_hidden.shape[0] == s.text_hidden.shape[0] == 2
    for row, i in enumerate((0, 2)):
        assert torch.equal(s.video_hidden[row], ref.hidden_states[i][0, video])
        assert torch.equal(s.text_hidden[row], ref.hidden_states[i][0, text])
    assert got.hidden_states is None  # only the rows travel on, in the signals


def test_layers_clamped_and_only_requested_fields():
    target, emb = _embeddings("qwen2_5_vl")
    num_layers = len(target.language_model.layers)
    s = prefill_with_signals(target, emb, 20, attention=True, hidden=False).signals
    assert s.video_attention.shape[0] == num_layers
    assert s.video_hidden is None and s.text_hidden is None

    h = prefill_with_signals(target, emb, 20, attention=False, hidden=True).signals
    assert h.video_attention is None
    assert h.video_hidden.shape[0] == 2  # layer 0 and the last one (the model has fewer than 20)

    sent = s.as_tensors()
    assert set(sent) == {"video_attention"}
    merged = s.merged_into(PruningSignals(visual_embeds=emb.visual_embeds))
    assert merged.visual_embeds is not None and merged.video_attention is s.video_attention
    assert PrefillSignals().as_tensors() == {}


class _SignalsTarget:
    """The target adapter whose full prefill captures the strategy's signals (what decode_sd needs wired in)."""

    def __init__(self, adapter, cfg: PruningConfig):
        self._adapter, self._cfg = adapter, cfg

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def prefill(self, emb, keep=None, output_hidden_states=False):
        return prefill_for_strategy(self._adapter, emb, self._cfg)


@pytest.mark.parametrize("strategy", ["hippo", "uv"])
def test_signal_strategies_end_to_end_are_lossless(family, strategy):
    target, draft = tiny_pair(family)
    frames = random_frames(3)
    cfg = DecodingConfig(gamma=3, max_new_tokens=12, temperature=0.0)
    pruning = PruningConfig(strategy, 0.5)
    ref = decode_ar(target, frames, PROMPT, cfg)
    got = decode_sd(_SignalsTarget(target, pruning), draft, frames, PROMPT, cfg, keep_policy_for(pruning))
    assert got.token_ids == ref.token_ids
    assert got.num_kept < got.num_video_tokens


def test_plain_prefill_when_the_strategy_reads_no_prefill_signals():
    target, emb = _embeddings("llava_onevision")
    assert prefill_for_strategy(target, emb, PruningConfig("uniform", 0.5)).signals is None
    assert prefill_for_strategy(target, emb, PruningConfig("hippo", 0.0)).signals is None
    assert prefill_for_strategy(target, emb, PruningConfig("uv", 0.5)).signals.video_attention is None


@pytest.mark.parametrize("num_layers", [1, 3, 20])
def test_signals_are_handed_over_right_after_layer_l(family, num_layers):
    """on_ready fires once, after exactly min(L, depth) decoder layers and before the next one runs, with
    the signals the result carries; the logits are those of a plain prefill (the hooks change nothing)."""
    target, emb = _embeddings(family)
    layers = target.language_model.layers
    ran: list[int] = []
    counters = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    seen = []

    def on_ready(signals):
        seen.append((list(ran), signals))

    try:
        got = prefill_with_signals(target, emb, num_layers, attention=True, hidden=True, on_ready=on_ready)
    finally:
        for h in counters:
            h.remove()
    expect = min(num_layers, len(layers))
    assert len(seen) == 1
    layers_run, signals = seen[0]
    assert layers_run == list(range(expect))  # layers L.. had not run yet
    assert ran == list(range(len(layers)))  # the prefill went on through every layer
    assert signals is got.signals
    assert signals.video_attention.shape[0] == expect
    assert signals.video_hidden.shape[0] == 2  # layers 0 and L
    assert torch.equal(got.logits, target.prefill(emb).logits)


def test_prefill_for_strategy_streams_only_what_the_strategy_reads():
    target, emb = _embeddings("qwen2_5_vl")
    seen = []
    prefill_for_strategy(target, emb, PruningConfig("uv", 0.5, layers=2), on_ready=seen.append)
    assert len(seen) == 1 and seen[0].video_attention is None and seen[0].video_hidden.shape[0] == 2
    prefill_for_strategy(target, emb, PruningConfig("uniform", 0.5), on_ready=seen.append)
    prefill_for_strategy(target, emb, PruningConfig("hippo", 0.0), on_ready=seen.append)
    assert len(seen) == 1  # a plain prefill never calls back: those signals leave before it

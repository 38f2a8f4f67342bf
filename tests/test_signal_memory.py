"""Issue 13, point 5: what the pruning signals cost is bounded by structure, whatever the depth.
(scripts/signal_memory.py measures the same at a real target's depth and 24k tokens.)"""

from __future__ import annotations

import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.config import PruningConfig
from vpsd.models.signals import prefill_for_strategy, text_positions
from vpsd.roles.signals_wire import pack, unpack


def _setup(strategy: str, **kw):
    target, _ = tiny_pair("qwen2_5_vl")
    emb = target.embed(target.prepare(random_frames(0), "What happens?"))
    pre = prefill_for_strategy(target, emb, PruningConfig(strategy, 0.5, **kw), parallel=True)
    return target, emb, pre


def test_attention_signals_ship_the_cache_itself_and_stay_in_its_dtype():
    target, emb, pre = _setup("attn", stream_layers=3)
    sent = pre.signals.as_tensors()
    cache = {layer.keys.untyped_storage().data_ptr() for layer in pre.state.cache.layers}
    assert {k.untyped_storage().data_ptr() for k in sent["keys"]} <= cache  # no stacked copy on the target
    tag, tensors = pack(sent, emb.layout)
    cfg = target.model.config.get_text_config()
    s, nt, d = emb.seq_len, len(text_positions(emb)), cfg.head_dim
    signal_bytes = sum(t.numel() * t.element_size() for t in tensors[:-2])  # all but the layout rows and grid
    # Exactly the first 3 layers' text queries and keys (+ the position row and the scale), nothing per video
    # token beyond the keys.
    elem = pre.signals.keys[0].element_size()
    want = 3 * (cfg.num_attention_heads * nt * d + cfg.num_key_value_heads * s * d) * elem + nt * 8 + 8
    assert signal_bytes == want
    # A bf16 target's keys arrive as bf16 (not widened to float32 on the pruner) and unchanged.
    as_bf16 = {k: (tuple(t.bfloat16() for t in v) if isinstance(v, tuple) else v) for k, v in sent.items()}
    got, layout = unpack(*pack(as_bf16, emb.layout))
    assert isinstance(got.keys, tuple) and len(got.keys) == 3 and got.keys[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(got.keys, as_bf16["keys"]))
    assert torch.equal(layout.seq_positions, emb.layout.seq_positions) and layout.grid == emb.layout.grid


def test_uv_ships_two_hidden_layers_whatever_the_depth():
    for layers in (1, 3, None):
        _, emb, pre = _setup("uv", layers=layers)
        n, nt = emb.layout.num_tokens, len(text_positions(emb))
        assert pre.signals.video_hidden.shape[:2] == (2, n) and pre.signals.text_hidden.shape[:2] == (2, nt)

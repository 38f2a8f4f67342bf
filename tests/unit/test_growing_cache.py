"""The cache that grows in place and the grouped-query attention without per-head copies (models/kv_cache.py,
models/attention.py): the same numbers as transformers' DynamicCache and sdpa, forward after forward."""

from __future__ import annotations

import torch
from transformers import DynamicCache, Qwen2_5_VLConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

from vpsd.models.attention import NAME, grouped_sdpa
from vpsd.models.kv_cache import MIN_SPARE, GrowingCache, GrowingLayer


def text_model(heads: int = 4, kv_heads: int = 2) -> Qwen2_5_VLTextModel:
    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(text_config=dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=64 // heads, intermediate_size=96, max_position_embeddings=4096, bos_token_id=None,
        eos_token_id=None, pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]))).text_config
    cfg._attn_implementation = "sdpa"
    return Qwen2_5_VLTextModel(cfg).eval()


def test_layer_appends_in_place_crops_by_length_and_adopts_assigned_tensors() -> None:
    layer = GrowingLayer()
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v) and layer.get_seq_length() == 5
    buffer = layer._keys
    assert layer.capacity >= 5 + MIN_SPARE - 5  # room to spare from the first update
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    keys, _ = layer.update(k2, v2)
    assert layer._keys is buffer and torch.equal(keys, torch.cat([k, k2], 2))  # written in place, no copy
    capacity = layer.capacity
    layer.update(torch.randn(2, 3, capacity - 6, 4), torch.randn(2, 3, capacity - 6, 4))  # exactly full
    layer.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))
    assert layer._keys is not buffer and layer.capacity >= capacity * 1.5  # grown by half, once
    layer.crop(-(layer.get_seq_length() - 6))
    assert torch.equal(layer.keys, torch.cat([k, k2], 2))
    layer.crop(-1)
    assert layer.get_seq_length() == 5 and torch.equal(layer.keys, k)
    replaced = torch.randn(2, 3, 7, 4)
    layer.keys = replaced  # a caller's compaction: keys first, then values computed from the old ones
    assert layer.values.shape[-2] == 5
    layer.values = replaced.clone()
    assert layer.get_seq_length() == 7 and torch.equal(layer.keys, replaced)


def test_decoding_through_a_growing_cache_equals_a_dynamic_cache_bitwise() -> None:
    model = text_model()
    caches = {"dynamic": DynamicCache(config=model.config), "growing": GrowingCache(model.config)}
    assert all(isinstance(layer, GrowingLayer) for layer in caches["growing"].layers)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
    with torch.no_grad():
        for name, cache in caches.items():
            pos = 0
            for n in (30, 1, 1, 4, 1):  # a prefill, steps, a verify, a rollback, a step
                chunk = ids[:, pos : pos + n]
                p = torch.arange(pos, pos + n).view(1, 1, n).expand(3, 1, n)
                outs[name].append(model(input_ids=chunk, position_ids=p, past_key_values=cache).last_hidden_state)
                pos += n
                if n == 4:
                    cache.crop(-3)
                    pos -= 3
    for a, b in zip(outs["dynamic"], outs["growing"]):
        assert torch.equal(a, b)


def test_grouped_sdpa_equals_transformers_sdpa_with_a_mask() -> None:
    """Query heads stacked on their KV head, the mask rows repeated: the same output as repeating the KV heads."""
    torch.manual_seed(2)
    module = text_model().layers[0].self_attn
    b, hq, hkv, lq, lk, d = 3, 4, 2, 5, 17, 16
    q, k, v = torch.randn(b, hq, lq, d), torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)
    mask = torch.rand(b, 1, lq, lk) > 0.3
    mask[..., 0] = True  # every row sees something
    ours, _ = grouped_sdpa(module, q, k, v, mask, scaling=d**-0.5)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    assert ours.shape == theirs.shape == (b, lq, hq, d)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_a_model_on_grouped_sdpa_matches_stock_sdpa_in_a_batched_masked_verify() -> None:
    model = text_model()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 5:9] = 0  # holes, as the batched cache makes them
    pos = torch.arange(24).view(1, 1, 24).expand(3, 2, 24)
    out = {}
    with torch.no_grad():
        for impl in ("sdpa", NAME):
            model.config._attn_implementation = impl
            cache = GrowingCache(model.config)
            model(input_ids=ids[:, :16], position_ids=pos[:, :, :16], attention_mask=mask[:, :16], past_key_values=cache)
            out[impl] = model(input_ids=ids[:, 16:], position_ids=pos[:, :, 16:], attention_mask=mask,
                              past_key_values=cache).last_hidden_state
    assert torch.allclose(out["sdpa"], out[NAME], atol=1e-5)

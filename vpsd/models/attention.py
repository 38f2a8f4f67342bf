"""Attention whose cost follows what it reads: grouped-query attention without copying the cache per head.

transformers' sdpa path, given a mask and several query rows (a verify, any batched forward), expands every
KV head of the whole cache to its query heads (`repeat_kv`) before calling the kernel: at a long video's
context that copy is most of the forward (the scaled target's batched verify at 2k: 45% of it in
`aten::copy_`). A query head only ever reads its own KV head, so the copy is not needed: the query heads of
one group are stacked as extra query rows of their KV head, (B, Hq, L, d) -> (B, Hkv, g L, d), the mask rows
repeated to match, and one kernel call reads each KV head once. Each output row is the same sum over the same
keys as before; the kernel sees the rows in a different grouping. transformers' own path does exactly this
for a single query row (`pack_gqa`); here it covers every forward that has a mask.

Registered with transformers' public `AttentionInterface` (and the sdpa mask builder) as "vpsd_sdpa"; every
adapter's model runs on it (models/registry.py). What has no KV groups, or no mask (a causal prefill, which
the kernel takes with `is_causal` and no expansion either), goes to transformers' sdpa as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "vpsd_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, Hq, Lq, d), key / value (B, Hkv, Lk, d), attention_mask (B, 1, Lq, Lk) or None; returns the
    attention output as (B, Lq, Hq, d), as every transformers attention function does."""
    b, hq, lq, d = query.shape
    hkv = key.shape[1]
    if hq == hkv or attention_mask is None or kwargs.get("dropout", 0.0) or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    groups = hq // hkv
    q = query.reshape(b, hkv, groups * lq, d)  # head h reads KV head h // groups: consecutive heads share one
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(b, attention_mask.shape[1], groups * lq, -1)
    scale = kwargs.get("scaling", getattr(module, "scaling", None))
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, lq, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, Lq, Lk) bool, True where a query may attend -> the (B, 1, Lq, Lk) additive float mask that the language
    model takes as it is (a 4-D mask skips transformers' own mask building, eager and sdpa alike). Why vpsd builds
    its own where it has holes: transformers, given a 2-D padding mask and one query row, first asks whether the
    mask is all True (to skip it), a host read that stalls a GPU's queue every batched decode step."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def use_grouped_sdpa(model: torch.nn.Module) -> None:
    """Runs `model`'s language model on `grouped_sdpa` (its vision tower keeps its own implementation)."""
    model.config.get_text_config()._attn_implementation = NAME

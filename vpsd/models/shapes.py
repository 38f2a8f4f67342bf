"""A model's sizes and parameter counts from its config alone: no weights read, no torch, no transformers.

`model_shape(family, config)` takes a checkpoint's config.json as a dict (the transformers-5 layout, with a
`text_config`, or the flat one Qwen2.5-VL checkpoints were published in) and returns a `ModelShape`: the
language model's sizes, and its parameters counted in two parts, those a split target divides over its ranks
(every decoder layer's q/k/v/o and gate/up/down projections, with their biases: models/tensor_parallel.py's
plan) and those every rank holds whole (embeddings, lm_head, norms, the vision tower and projector). The vision
towers are counted by one formula per family; tests/unit/test_memory_plan.py checks every count against the real
model built on the meta device.

`grown_text_sizes` is the one statement of how growth (models/grow.py) changes a language model's sizes;
`grown_config_dict` applies it, and the vision tower's output width, to a config dict.
`tiny_config_dict` is a tiny spec's sizes as a config dict (vocabulary: the tiny tokenizer's trained size).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

TINY_VOCAB = 512  # models/tokenizer.build_tokenizer's vocab_size: an upper bound of a tiny model's vocabulary
TINY_MAX_POSITIONS = 32768  # what every family's tiny_config sets


class ShapeError(ValueError):
    """A config that lacks a size the plan needs."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # lm_head shares the embeddings
    qkv_bias: bool
    qk_norm: bool  # Qwen3: per-head norms of q and k
    vision_params: int  # the vision tower and its projector into the language model
    max_positions: int
    vision_hidden: int  # the vision tower's width and MLP, for its activations
    vision_intermediate: int
    patches_per_token: int  # vision patches that become one video token (Qwen: merge^2; LLaVA-OV: 2x2 pooling)

    @property
    def split_params(self) -> int:
        """Parameters of every decoder layer's split projections (a rank of k holds 1/k of them)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        if self.qkv_bias:
            per_layer += q + 2 * kv
        return self.layers * per_layer

    @property
    def whole_params(self) -> int:
        """Parameters every rank holds whole: embeddings, lm_head, norms, the vision tower."""
        per_layer = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        lm = self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden
        return lm + self.layers * per_layer + self.vision_params

    @property
    def params(self) -> int:
        return self.split_params + self.whole_params

    def kv_bytes_per_token(self, dtype_bytes: int, k: int = 1) -> int:
        """Keys and values of one token, every layer, the KV heads one rank of k holds."""
        return 2 * self.layers * (self.kv_heads // k) * self.head_dim * dtype_bytes


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def _need(d: dict, *names: str) -> list[int]:
    missing = [n for n in names if d.get(n) is None]
    if missing:
        raise ShapeError(f"the config names no {', '.join(missing)}")
    return [int(d[n]) for n in names]


def _qwen2_5_vision(v: dict) -> int:
    d, i, depth, out = _need(v, "hidden_size", "intermediate_size", "depth", "out_hidden_size")
    p, t, m = v.get("patch_size", 14), v.get("temporal_patch_size", 2), v.get("spatial_merge_size", 2)
    c = v.get("in_channels", v.get("in_chans", 3))
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (i * d + i) + (d * i + d)
    dm = d * m * m
    return c * t * p * p * d + depth * block + d + (dm * dm + dm) + (out * dm + out)


def _qwen3_vision(v: dict) -> int:
    d, i, depth, out = _need(v, "hidden_size", "intermediate_size", "depth", "out_hidden_size")
    p, t, m = v.get("patch_size", 16), v.get("temporal_patch_size", 2), v.get("spatial_merge_size", 2)
    c, n = v.get("in_channels", 3), v.get("num_position_embeddings", 2304)
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (i * d + i) + (d * i + d)
    dm = d * m * m
    merge = (dm * dm + dm) + (out * dm + out)
    deepstack = len(v.get("deepstack_visual_indexes", [8, 16, 24])) * (2 * dm + merge)
    return (c * t * p * p * d + d) + n * d + depth * block + 2 * d + merge + deepstack


def _llava_vision(v: dict, hidden: int, feature_layers: int) -> int:
    d, i, depth = _need(v, "hidden_size", "intermediate_size", "num_hidden_layers")
    p, size, c = v.get("patch_size", 14), v.get("image_size", 384), v.get("num_channels", 3)
    embeddings = c * p * p * d + d + (size // p) ** 2 * d
    layer = 4 * d + 4 * (d * d + d) + (i * d + i) + (d * i + d)
    projector = (hidden * d * feature_layers + hidden) + (hidden * hidden + hidden) + hidden  # + image_newline
    return embeddings + depth * layer + 2 * d + projector


def model_shape(family: str, config: dict[str, Any]) -> ModelShape:
    """The shape of a `family` model from its config dict (module docstring)."""
    text, vision = _text(config), config.get("vision_config") or {}
    hidden, layers, heads, intermediate, vocab = _need(text, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "intermediate_size", "vocab_size")
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    if family == "qwen2_5_vl":
        vision_params, merge = _qwen2_5_vision(vision), vision.get("spatial_merge_size", 2) ** 2
    elif family == "qwen3_vl":
        vision_params, merge = _qwen3_vision(vision), vision.get("spatial_merge_size", 2) ** 2
    elif family == "llava_onevision":
        layer = config.get("vision_feature_layer", -1)
        vision_params, merge = _llava_vision(vision, hidden, len(layer) if isinstance(layer, list) else 1), 4
    else:
        raise ShapeError(f"no shape rule for family {family!r}")
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      intermediate=intermediate, vocab=vocab, tied=tied,
                      qkv_bias=family != "qwen3_vl" or bool(text.get("attention_bias", False)),
                      qk_norm=family == "qwen3_vl", vision_params=vision_params,
                      max_positions=int(text.get("max_position_embeddings") or TINY_MAX_POSITIONS),
                      vision_hidden=int(vision.get("hidden_size", 0)),
                      vision_intermediate=int(vision.get("intermediate_size", 0)), patches_per_token=merge)


def grown_text_sizes(text: dict[str, Any], width: int, layers: int) -> dict[str, int]:
    """The language model's sizes after growth to `width` x and `layers` deep (models/grow.py): heads and KV
    heads duplicated, head_dim kept, MLP units duplicated."""
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    return {"hidden_size": width * hidden, "intermediate_size": width * int(text["intermediate_size"]),
            "num_attention_heads": width * heads,
            "num_key_value_heads": width * int(text.get("num_key_value_heads") or heads),
            "head_dim": int(text.get("head_dim") or hidden // heads), "num_hidden_layers": layers}


def grown_config_dict(config: dict[str, Any], width: int, layers: int) -> dict[str, Any]:
    """A config dict as growth writes it: sizes grown, embeddings untied, the vision output in the new width."""
    out = copy.deepcopy(config)
    text = _text(out)
    hidden = int(text["hidden_size"])
    text.update(grown_text_sizes(text, width, layers))
    out["tie_word_embeddings"] = text["tie_word_embeddings"] = False
    vision = out.get("vision_config") or {}
    if vision.get("out_hidden_size") is not None:
        vision["out_hidden_size"] = width * hidden
    return out


def tiny_config_dict(family: str, tiny: dict[str, Any]) -> dict[str, Any]:
    """A tiny spec's sizes as a config dict, as its family's tiny_config builds it."""
    text = {"vocab_size": TINY_VOCAB, "max_position_embeddings": TINY_MAX_POSITIONS, **tiny["text"]}
    vision = dict(tiny["vision"])
    if family != "llava_onevision":
        vision.setdefault("out_hidden_size", text["hidden_size"])
    return {"text_config": text, "vision_config": vision}

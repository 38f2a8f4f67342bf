"""Model families and how to load one: from a local checkpoint, or a tiny seeded model built offline.

`load_adapter(family, spec)` is the only way the rest of vpsd gets a model. A spec either names a
local checkpoint directory laid out like the published ones (real weights; the checkpoint's own tokenizer,
chat template and processor settings, see models/checkpoint.py) or describes a tiny model
(text / vision sizes and a seed), built with the shared offline tokenizer so that a target and its
draft agree on token ids.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vpsd.models.base import VideoLMAdapter
from vpsd.models.checkpoint import read_checkpoint
from vpsd.models.tokenizer import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """Where a model comes from and where it runs."""

    path: str | None = None  # local checkpoint directory (real weights)
    tiny: dict[str, Any] | None = None  # {"seed": int, "text": {...}, "vision": {...}}
    dtype: str = "float32"
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)  # adapter keyword arguments (e.g. fps)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("a model spec needs exactly one of `path` (checkpoint) or `tiny` (config)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class Family:
    adapter: type[VideoLMAdapter]
    model_class: Callable[..., Any]
    tiny_config: Callable[[dict, dict, PreTrainedTokenizerBase], Any]


# family name -> (vpsd module, adapter class, transformers model class)
FAMILY_MODULES = {
    "qwen2_5_vl": ("vpsd.models.qwen2_5_vl", "Qwen2_5_VLAdapter", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("vpsd.models.qwen3_vl", "Qwen3VLAdapter", "Qwen3VLForConditionalGeneration"),
    "llava_onevision": (
        "vpsd.models.llava_onevision",
        "LlavaOnevisionAdapter",
        "LlavaOnevisionForConditionalGeneration",
    ),
}


def family(name: str) -> Family:
    """Imports only the family asked for: each architecture module is heavy."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILY_MODULES)}")
    module_name, adapter_name, model_name = FAMILY_MODULES[name]
    import transformers

    module = importlib.import_module(module_name)
    return Family(getattr(module, adapter_name), getattr(transformers, model_name), module.tiny_config)


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    return build_tokenizer()


def load_adapter(family_name: str, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase | None = None) -> VideoLMAdapter:
    """Builds or loads the model of `spec` and wraps it in its family's adapter."""
    fam = family(family_name)
    dtype = DTYPES[spec.dtype]
    options = dict(spec.options)
    if spec.path is not None:
        # The checkpoint's own processor settings, checked before any weights are read; the spec's
        # options override them.
        options = {**read_checkpoint(spec.path, family_name), **options}
        model = fam.model_class.from_pretrained(spec.path, dtype=dtype)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(spec.path)
    else:
        tiny = dict(spec.tiny)
        tokenizer = tokenizer or tiny_tokenizer()
        config = fam.tiny_config(dict(tiny["text"]), dict(tiny["vision"]), tokenizer)
        config._attn_implementation = tiny.get("attn_implementation", "sdpa")
        with torch.random.fork_rng():
            torch.manual_seed(int(tiny.get("seed", 0)))
            model = fam.model_class(config)
        model = model.to(dtype)
    model = model.to(spec.device).eval()
    return fam.adapter(model, tokenizer, **options)

"""The model families vpsd runs: each one's adapter, transformers model class and tiny config, imported only for
the family asked for (each architecture module is heavy), and the dtypes a spec may name."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PreTrainedTokenizerBase

from vpsd.models.base import VideoLMAdapter
from vpsd.models.spec import DTYPE_NAMES, FAMILY_MODULES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class Family:
    adapter: type[VideoLMAdapter]
    model_class: Callable[..., Any]
    tiny_config: Callable[[dict, dict, PreTrainedTokenizerBase], Any]


def family(name: str) -> Family:
    """Imports only the family asked for: each architecture module is heavy."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILY_MODULES)}")
    module_name, adapter_name, model_name = FAMILY_MODULES[name]
    import transformers

    module = importlib.import_module(module_name)
    return Family(getattr(module, adapter_name), getattr(transformers, model_name), module.tiny_config)

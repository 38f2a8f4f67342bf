"""Model families and how to load one: from a local checkpoint, or a tiny seeded model built offline.

`load_adapter(family, spec)` is the only way the rest of vpsd gets a model. A spec either names a
local checkpoint directory laid out like the published ones (real weights, read straight onto the model's
device, or each rank's share of them for a split target: models/sharded_load.py; the checkpoint's own
tokenizer, chat template and processor settings, see models/checkpoint.py) or describes a tiny model
(text / vision sizes and a seed), built with the shared offline tokenizer so that a target and its
draft agree on token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vpsd.models.attention import use_grouped_sdpa
from vpsd.models.base import VideoLMAdapter
from vpsd.models.checkpoint import read_checkpoint
from vpsd.models.families import DTYPES, family
from vpsd.models.grown_checkpoint import ensure_grown
from vpsd.models.sharded_load import load_model
from vpsd.models.spec import ModelSpec
from vpsd.models.tensor_parallel import shard
from vpsd.models.tokenizer import build_tokenizer

def tiny_tokenizer() -> PreTrainedTokenizerBase:
    return build_tokenizer()


def load_adapter(family_name: str, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase | None = None,
                 group: Any = None) -> VideoLMAdapter:
    """Builds or loads the model of `spec` and wraps it in its family's adapter. `group`: the ranks of a target
    split over them (models/tensor_parallel.py), this one among them: a checkpoint is read in shards, each rank
    its own (models/sharded_load.py); a tiny model is built whole and then split."""
    fam = family(family_name)
    dtype = DTYPES[spec.dtype]
    options = dict(spec.options)
    if spec.path is not None:
        # The checkpoint's own processor settings, checked before any weights are read; the spec's
        # options override them. A scale model keeps its source's processor and tokenizer (growth changes
        # only the language model's weights), so they are read from the source.
        options = {**read_checkpoint(spec.path, family_name), **options}
        weights = spec.path
        if spec.grow is not None:
            weights = str(ensure_grown(Path(spec.path), Path(spec.grown_path()), spec.grow["width"], spec.grow["layers"]))
        # Built in place, on its device, reading only what this rank holds (models/sharded_load.py).
        model = load_model(fam.model_class, family_name, Path(weights), dtype, spec.device, group)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(spec.path)
    else:
        tiny = dict(spec.tiny)
        tokenizer = tokenizer or tiny_tokenizer()
        config = fam.tiny_config(dict(tiny["text"]), dict(tiny["vision"]), tokenizer)
        config._attn_implementation = tiny.get("attn_implementation", "sdpa")
        with torch.random.fork_rng():
            torch.manual_seed(int(tiny.get("seed", 0)))
            model = fam.model_class(config)
        model = model.to(dtype).to(spec.device).eval()
    if model.config.get_text_config()._attn_implementation == "sdpa":
        use_grouped_sdpa(model)  # the same sums, without copying the cache per query head (models/attention.py)
    adapter = fam.adapter(model, tokenizer, **options)
    if group is not None and spec.tiny is not None:
        shard(adapter, group)  # tiny: built whole (seeded), the leader's values kept
    if spec.capture is not None:
        adapter.capture(spec.capture, spec.capture_len)
    return adapter


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer `load_adapter` gives the model of `spec`, alone (no weights read)."""
    return AutoTokenizer.from_pretrained(spec.path) if spec.path is not None else tiny_tokenizer()


def load_draft(family_name: str, spec: ModelSpec | None, target: VideoLMAdapter) -> VideoLMAdapter:
    """The draft of a pair: its own model on the target's tokenizer (the two must agree on token ids), or the
    target itself when `spec` is None (self-speculation: the target's weights fed the pruned video)."""
    return target if spec is None else load_adapter(family_name, spec, target.tokenizer)

"""Scale models: grow a checkpoint to k times the width and N decoder layers, computing the same function.

Net2Net-style function-preserving growth (Chen et al., "Net2Net", ICLR 2016: a wider layer duplicates units
and divides their outgoing weights by the copy count; a deeper network adds identity layers), applied to the
language model of every supported family. With width factor k and D the source hidden size:

- the residual stream becomes [x, x, ..., x] (k copies): embedding columns tiled, every RMSNorm weight tiled
  (the RMS of a tiled vector is the original's, so normalised values are tiled too);
- every projection reading the residual stream (q, k, v, gate, up, lm_head) has its input columns tiled and
  divided by k, so it sees k * (x / k) = x;
- attention heads and KV heads are duplicated in blocks: q/k/v output rows (and biases) repeat as k blocks of
  all heads, so head_dim, the M-RoPE sections, per-head q/k norms (Qwen3) and the GQA map stay as they were
  (nH' = k nH, nKV' = k nKV, head b*nH + h reads kv head b*nKV + h // groups, a copy of its original);
- o_proj and down_proj read k copies of the same heads / MLP units: input columns split by 1/k, output rows
  tiled; gate/up output rows repeat (MLP units duplicated), so their activations are copies;
- the vision tower is unchanged; only the layer writing into the language model's width is tiled
  (Qwen2.5-VL `visual.merger.mlp.2`, Qwen3-VL `visual.merger` and every `deepstack_merger_list` entry,
  LLaVA-OneVision `multi_modal_projector` (linear_1 units duplicated, linear_2 split and tiled) and
  `image_newline`), so video features and Qwen3-VL's deepstack features enter as [v, ..., v];
- lm_head stays separate (tied embeddings are untied: `tie_word_embeddings` false in the grown config).

Extra layers (N - L of them) are APPENDED after the last trained layer, each a grown copy of that layer with
o_proj and down_proj zeroed: an exact identity (h + 0 + 0) that still costs a real layer's compute. Appending
keeps every trained layer's index, so Qwen3-VL's deepstack features still go to the first decoder layers.

Exactness: every weight is a copy or a copy divided by k, so for k a power of two the grown weights are exact
in any float dtype; the grown model differs from its source only by the order of floating-point sums.
Measured max |logit diff| is in docs/design.md ("Scale models") and tests/models/test_grow.py bounds it.

Every source parameter must match one rule below and every grown parameter must get the shape the grown
config asks for; anything else raises `GrowthError`, so a new architecture detail is never silently wrong.

Writing, recording and reusing grown checkpoints: vpsd/models/grown_checkpoint.py; checking one against its
source with vpsd's own adapters and decoder: vpsd/launch/grow.py.
"""

from __future__ import annotations

import copy
import re
from typing import Callable

import torch
from transformers import PreTrainedModel

from vpsd.models.shapes import grown_text_sizes
from vpsd.models.spec import FAMILY_MODULES


class GrowthError(ValueError):
    """A model or request the growth rules do not cover."""


# ---- the rules -----------------------------------------------------------------------------------------

Transform = Callable[[torch.Tensor, int], torch.Tensor]


def _keep(w: torch.Tensor, k: int) -> torch.Tensor:
    return w.clone()


def _tile(w: torch.Tensor, k: int) -> torch.Tensor:
    """Vectors living in the residual stream or over duplicated units (norm weights, biases): k copies."""
    return w.repeat(k)


def _embed(w: torch.Tensor, k: int) -> torch.Tensor:
    """(V, D) -> (V, kD): every token's embedding becomes [e, ..., e]."""
    return w.repeat(1, k)


def _read(w: torch.Tensor, k: int) -> torch.Tensor:
    """(O, D) -> (O, kD): reads [x, ..., x], each copy weighted 1/k."""
    return w.repeat(1, k) / k


def _write(w: torch.Tensor, k: int) -> torch.Tensor:
    """(D, I) -> (kD, I): writes its output k times (input unchanged)."""
    return w.repeat(k, 1)


def _read_write(w: torch.Tensor, k: int) -> torch.Tensor:
    """(O, I) -> (kO, kI): reads k copies at 1/k each and writes k copies (blocks of all heads / units)."""
    return w.repeat(k, k) / k


LM = r"model\.language_model\."
LAYER = LM + r"layers\.\d+\."
# (pattern, transform), first match wins. Vision towers are kept: any of their parameters whose shape
# depended on the text width would no longer fit the grown config, and the shape check below says so.
RULES: list[tuple[re.Pattern[str], Transform]] = [
    (re.compile(p), t)
    for p, t in [
        (LM + r"embed_tokens\.weight", _embed),
        (LM + r"norm\.weight", _tile),
        (LAYER + r"(input_layernorm|post_attention_layernorm)\.weight", _tile),
        (LAYER + r"self_attn\.(q|k|v|o)_proj\.weight", _read_write),
        (LAYER + r"self_attn\.(q|k|v|o)_proj\.bias", _tile),
        (LAYER + r"self_attn\.(q|k)_norm\.weight", _keep),  # Qwen3: per head, size head_dim
        (LAYER + r"mlp\.(gate|up|down)_proj\.weight", _read_write),
        (LAYER + r"mlp\.(gate|up|down)_proj\.bias", _tile),
        (r"lm_head\.weight", _read),
        # Qwen2.5-VL: the merger's last linear writes the video features into the text width.
        (r"model\.visual\.merger\.mlp\.2\.weight", _write),
        (r"model\.visual\.merger\.mlp\.2\.bias", _tile),
        # Qwen3-VL: the merger and every deepstack merger (features added to the first decoder layers' output).
        (r"model\.visual\.(merger|deepstack_merger_list\.\d+)\.linear_fc2\.weight", _write),
        (r"model\.visual\.(merger|deepstack_merger_list\.\d+)\.linear_fc2\.bias", _tile),
        (r"model\.visual\..*", _keep),
        # LLaVA-OneVision: linear_1's units (text width) duplicated, linear_2 reads them and writes the stream.
        (r"model\.multi_modal_projector\.linear_1\.weight", _write),
        (r"model\.multi_modal_projector\.linear_1\.bias", _tile),
        (r"model\.multi_modal_projector\.linear_2\.weight", _read_write),
        (r"model\.multi_modal_projector\.linear_2\.bias", _tile),
        (r"model\.image_newline", _tile),
        (r"model\.vision_tower\..*", _keep),
    ]
]
# Zeroed in appended layers: the attention and MLP branches then add nothing to the residual stream.
IDENTITY_ZEROED = re.compile(LAYER + r"(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)")
LAYER_INDEX = re.compile(LM + r"layers\.(\d+)\.")


def _rule(name: str) -> Transform:
    for pattern, transform in RULES:
        if pattern.fullmatch(name):
            return transform
    raise GrowthError(f"no growth rule covers parameter {name!r}")


# ---- config and model ----------------------------------------------------------------------------------


def _check_request(model: PreTrainedModel, width: int, layers: int) -> int:
    """Validates (width, layers) against the model; returns the source layer count."""
    if type(model).__name__ not in {names[2] for names in FAMILY_MODULES.values()}:
        raise GrowthError(f"{type(model).__name__} is not a supported family ({sorted(FAMILY_MODULES)})")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise GrowthError(f"width must be an integer >= 1, got {width!r}")
    source_layers = int(model.config.get_text_config().num_hidden_layers)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < source_layers:
        raise GrowthError(f"layers must be an integer >= the source's {source_layers}, got {layers!r}")
    return source_layers


def grown_config(config, width: int, layers: int):
    """A copy of `config` with the language model k times wider and `layers` deep (vision tower unchanged)."""
    cfg = copy.deepcopy(config)
    text = cfg.get_text_config()
    hidden, source_layers = int(text.hidden_size), int(text.num_hidden_layers)
    # head_dim is written explicitly: kD / (k nH) may differ from it (models/shapes.py: the one statement)
    sizes = {n: getattr(text, n, None) for n in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim")}
    for name, value in grown_text_sizes(sizes, width, layers).items():
        setattr(text, name, value)
    if getattr(text, "layer_types", None) is not None:
        types = list(text.layer_types)
        text.layer_types = types + [types[-1]] * (layers - source_layers)  # appended copies of the last layer
    text.tie_word_embeddings = False
    cfg.tie_word_embeddings = False
    vision = getattr(cfg, "vision_config", None)
    if getattr(vision, "out_hidden_size", None) is not None:  # Qwen mergers write the text width
        if int(vision.out_hidden_size) != hidden:
            raise GrowthError(f"vision out_hidden_size {vision.out_hidden_size} != text hidden_size {hidden}")
        vision.out_hidden_size = width * hidden
    return cfg


def _source_name(name: str, source_layers: int) -> tuple[str, bool]:
    """The source parameter a grown one is made from, and whether it is an appended identity layer's."""
    m = LAYER_INDEX.match(name)
    if m is None or int(m.group(1)) < source_layers:
        return name, False
    return LAYER_INDEX.sub(f"model.language_model.layers.{source_layers - 1}.", name, count=1), True


def _set_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor, is_param: bool) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if is_param:
        module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor  # keeps the buffer's persistence flag


@torch.no_grad()
def grow_model(model: PreTrainedModel, width: int, layers: int) -> PreTrainedModel:
    """A new model of the same class: language model `width` times wider and `layers` deep, same function.

    Pure and deterministic: every grown tensor is computed from the source's weights (none is initialised).
    Raises GrowthError on a parameter no rule covers or a grown shape that does not fit the grown config.
    """
    source_layers = _check_request(model, width, layers)
    # remove_duplicate=False: a tied lm_head is listed under its own name too (it is grown untied).
    source = dict(model.named_parameters(remove_duplicate=False))
    uncovered = [n for n in source if not any(p.fullmatch(n) for p, _ in RULES)]
    if uncovered:
        raise GrowthError(f"no growth rule covers parameter(s) {uncovered}; refusing to guess")
    cfg = grown_config(model.config, width, layers)
    with torch.device("meta"):  # shapes only: every tensor is filled below
        grown = type(model)(cfg)
    used = set()
    for name, param in list(grown.named_parameters()):
        src_name, appended = _source_name(name, source_layers)
        if src_name not in source:
            raise GrowthError(f"grown parameter {name!r} has no source parameter {src_name!r}")
        used.add(src_name)
        tensor = _rule(src_name)(source[src_name].detach(), width)
        if appended and IDENTITY_ZEROED.fullmatch(name):
            tensor = torch.zeros_like(tensor)
        if tuple(tensor.shape) != tuple(param.shape):
            need = tuple(param.shape)
            raise GrowthError(f"{name}: grown shape {tuple(tensor.shape)} but the grown config needs {need}")
        _set_tensor(grown, name, tensor.contiguous(), is_param=True)
    if set(source) - used:
        raise GrowthError(f"source parameters not carried into the grown model: {sorted(set(source) - used)}")
    # Buffers (rotary inv_freq, position ids) depend on head_dim and the vision tower, both unchanged.
    source_buffers = dict(model.named_buffers())
    for name, buf in list(grown.named_buffers()):
        if name not in source_buffers or tuple(source_buffers[name].shape) != tuple(buf.shape):
            raise GrowthError(f"buffer {name!r} of the grown model has no same-shaped source buffer")
        _set_tensor(grown, name, source_buffers[name].clone(), is_param=False)
    grown.generation_config = copy.deepcopy(model.generation_config)
    grown.config.dtype = model.dtype
    return grown.eval()

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
Measured max |logit diff| is in the README ("Scale models") and tests/test_grow.py bounds it.

Every source parameter must match one rule below and every grown parameter must get the shape the grown
config asks for; anything else raises `GrowthError`, so a new architecture detail is never silently wrong.

Checking a grown checkpoint against its source runs vpsd's own adapters and decoder: vpsd/launch/grow.py.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import safetensors
import safetensors.torch
import torch
from transformers import PreTrainedModel

import vpsd
from vpsd.models.registry import DTYPES, FAMILY_MODULES, family

RECORD = "grown_from.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")  # what the source hash covers
# Written by save_pretrained for the grown model (or describing the weights), so never copied from the source.
NOT_COPIED = ("config.json", RECORD, "model.safetensors.index.json", "pytorch_model.bin.index.json")


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
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)  # kept explicit: kD / (k nH) may differ
    source_layers = int(text.num_hidden_layers)
    text.hidden_size = width * hidden
    text.intermediate_size = width * int(text.intermediate_size)
    text.num_attention_heads = width * heads
    text.num_key_value_heads = width * kv_heads
    text.head_dim = head_dim
    text.num_hidden_layers = layers
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


# ---- checkpoints ---------------------------------------------------------------------------------------


def checkpoint_family(path: Path) -> str:
    """The vpsd family of a checkpoint directory, from its config.json's model_type."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise GrowthError(f"{path} is not a checkpoint directory (no config.json)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in FAMILY_MODULES:
        raise GrowthError(f"{path}: model_type {model_type!r} is not a supported family ({sorted(FAMILY_MODULES)})")
    return model_type


def weights_sha256(path: Path) -> str:
    """sha256 over a checkpoint's weight files (names and full contents): which weights a grown model came from."""
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in Path(path).glob(pattern)})
    if not files:
        raise GrowthError(f"{path} has no weight files ({', '.join(WEIGHT_PATTERNS)})")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class GrownFrom:
    """The record in DST/grown_from.json: what a grown checkpoint was made from and how."""

    source: str  # the source checkpoint directory, absolute
    source_sha256: str  # weights_sha256 of the source
    width: int
    layers: int
    source_layers: int
    dtype: str | None  # the dtype asked for (None: the source's own)
    vpsd_version: str
    extra_layers: str = "appended after the last trained layer: copies of it with o_proj and down_proj zeroed"

    @classmethod
    def read(cls, dst: Path) -> "GrownFrom | None":
        try:
            return cls(**json.loads((Path(dst) / RECORD).read_text()))
        except (OSError, ValueError, TypeError):
            return None  # missing, unreadable or from another version: treated as not grown


def _side_files(src: Path) -> list[Path]:
    """Tokenizer, processor, chat template and generation files: every top-level non-weight file of src."""
    return [f for f in sorted(Path(src).iterdir())
            if f.is_file() and f.name not in NOT_COPIED and not any(f.match(p) for p in WEIGHT_PATTERNS)]


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in _side_files(src):
        shutil.copy2(f, dst / f.name)


def _side_files_match(src: Path, dst: Path) -> bool:
    """dst carries src's side files as they are now (a source that gained a processor config or a chat
    template after its scale model was built makes that model stale too)."""
    return all((dst / f.name).is_file() and (dst / f.name).read_bytes() == f.read_bytes() for f in _side_files(src))


def _publish_modes(tmp: Path) -> None:
    """mkdtemp (and save_pretrained's own temporary files) leave 0700 / 0600: give the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _replace_dir(tmp: Path, dst: Path) -> None:
    """Moves a finished checkpoint into place; an existing dst must be a grown checkpoint (or empty)."""
    if dst.exists():
        if not (dst / RECORD).is_file() and any(dst.iterdir()):
            raise GrowthError(f"{dst} exists and is not a grown checkpoint (no {RECORD}); not overwriting it")
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def _write_checkpoint(model, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors, written by this process whatever its rank.

    Not `save_pretrained`: under an initialised torch.distributed it writes only on rank 0, so a draft grown on
    rank 1 published a directory with neither config nor weights and then failed to load it. The files are read
    back before the directory is published: a checkpoint that cannot be read never takes dst's place."""
    model.config.to_json_file(out / "config.json")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.to_json_file(out / "generation_config.json")
    weights = out / "model.safetensors"
    safetensors.torch.save_model(model, str(weights), metadata={"format": "pt"})  # shared tensors once
    with safetensors.safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
    state = model.state_dict()
    missing = [n for n in state if n not in names and not _is_tied_copy(state, n)]
    if missing or json.loads((out / "config.json").read_text()).get("model_type") != model.config.model_type:
        raise GrowthError(f"the grown checkpoint written to {out} does not read back (missing {missing[:3]})")


def _is_tied_copy(state: dict[str, torch.Tensor], name: str) -> bool:
    """Whether `name` shares its storage with another entry (saved once, under the other name)."""
    ptr = state[name].data_ptr()
    return any(other != name and t.data_ptr() == ptr for other, t in state.items())


def grow_checkpoint(src: Path, dst: Path, width: int, layers: int, dtype: str | None = None) -> Path:
    """Loads the checkpoint at src (local, offline), grows it and writes a normal checkpoint directory to dst.

    dst gets config.json, model.safetensors, generation_config.json, the source's tokenizer/processor files
    and grown_from.json. It is written to a temporary directory beside dst and renamed into place, so a crash
    never leaves a half checkpoint. An existing dst is replaced only if it is itself a grown checkpoint.
    dtype: "float32", "bfloat16" or "float16"; None keeps the source's.
    """
    src, dst = Path(src), Path(dst)
    name = checkpoint_family(src)
    if dtype is not None and dtype not in DTYPES:
        raise GrowthError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dst.resolve() == src.resolve():
        raise GrowthError("the grown checkpoint cannot replace its source")
    source_sha = weights_sha256(src)
    model = family(name).model_class.from_pretrained(src, dtype=DTYPES[dtype] if dtype else "auto")
    grown = grow_model(model.eval(), width, layers)
    record = GrownFrom(
        source=str(src.resolve()),
        source_sha256=source_sha,
        width=width,
        layers=layers,
        source_layers=int(model.config.get_text_config().num_hidden_layers),
        dtype=dtype,
        vpsd_version=vpsd.__version__,
    )
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        _write_checkpoint(grown, tmp)
        _copy_side_files(src, tmp)
        (tmp / RECORD).write_text(json.dumps(record.__dict__, indent=2) + "\n")
        _publish_modes(tmp)
        _replace_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return dst


def is_grown(src: Path, dst: Path, width: int, layers: int, dtype: str | None = None) -> bool:
    """Whether dst holds a checkpoint grown from src's current weights with these settings."""
    record = GrownFrom.read(dst)
    return (
        record is not None
        and (Path(dst) / "config.json").is_file()
        and any(Path(dst).glob("*.safetensors"))
        and (record.width, record.layers, record.dtype) == (width, layers, dtype)
        and record.source_sha256 == weights_sha256(src)
        and _side_files_match(Path(src), Path(dst))
    )


def ensure_grown(src: Path, dst: Path, width: int, layers: int, dtype: str | None = None) -> Path:
    """dst, grown from src on first use; reused while grown_from.json matches src's weights, width, layers
    and dtype, rebuilt when any of them changed (the source hash reads every source weight byte).

    Processes calling this at once (ranks loading the same model) serialise on a lock file named by dst's
    absolute path in the temp directory (not beside dst: nothing to git-ignore): the first builds, the
    others wait and then reuse; none moves a checkpoint away while another reads it.
    """
    src, dst = Path(src), Path(dst)
    if is_grown(src, dst, width, layers, dtype):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(dst.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"vpsd-grow-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not is_grown(src, dst, width, layers, dtype):  # another process may have built it meanwhile
            grow_checkpoint(src, dst, width, layers, dtype)
    return dst

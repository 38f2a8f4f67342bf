"""A checkpoint's weights read straight into their place: each rank reads only what it holds, no rank holds more.

`load_model(model_class, path, dtype, device, group=None)` loads a checkpoint directory (safetensors: one
`model.safetensors`, or shards named by `model.safetensors.index.json`) without ever holding the whole model:

1. the model is built with its parameters on the meta device (no memory, no initialisation: `empty_model`);
   its buffers (rotary frequencies, position ids: computed by the model's own __init__, never in a checkpoint)
   are built for real, as `from_pretrained` builds them;
2. with a `group` (a target split over its ranks, models/tensor_parallel.py), its decoder layers are split by
   the same call that splits a loaded model (`shard_language_model`), on the meta parameters: no data moves,
   and each parameter becomes a DTensor whose local shard has the shape this rank keeps;
3. every parameter is then read from the checkpoint into memory allocated on its device: a split one exactly
   its rank's slice (rows for Shard(0), columns for Shard(1), the rank's chunk in mesh order, which is what
   `distribute_tensor` keeps), a whole one whole, each with `pread`s straight into the parameter's memory
   (models/safetensors_file.py: nothing is mapped, so nothing read stays resident beside the parameters).

A model that is not split (group None) loads the same way, straight onto its device. Tied parameters (an
lm_head sharing the embeddings) are read once. Checkpoints written before transformers 5 name their keys by the
older layout (`model.layers.*`, `visual.*`; LLaVA's `language_model.model.*`): `LEGACY_KEYS` renames them as
transformers' own loading does. The generation config is the checkpoint's `generation_config.json` when it
has one (the EOS ids come from it), as with `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import AutoConfig, GenerationConfig

from vpsd.models.safetensors_file import SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Checkpoint key -> model key for checkpoints saved in the layout before transformers 5 (first match wins;
# keys already in the model's layout are used as they are). transformers' conversion_mapping renames the same.
LEGACY_KEYS: dict[str, list[tuple[str, str]]] = {
    "qwen2_5_vl": [(r"^visual\.", "model.visual."), (r"^model\.(?!language_model\.|visual\.)", "model.language_model.")],
    "qwen3_vl": [(r"^visual\.", "model.visual."), (r"^model\.(?!language_model\.|visual\.)", "model.language_model.")],
    "llava_onevision": [(r"^language_model\.lm_head\.", "lm_head."), (r"^language_model\.model\.", "model.language_model."),
                        (r"^vision_tower\.vision_model\.", "model.vision_tower."), (r"^vision_tower\.", "model.vision_tower."),
                        (r"^multi_modal_projector\.", "model.multi_modal_projector."),
                        (r"^image_newline$", "model.image_newline")],
}


class LoadError(ValueError):
    """A checkpoint that cannot fill the model: no safetensors, or parameters it does not hold."""


def weight_files(path: Path) -> dict[str, SafetensorsFile]:
    """Checkpoint key -> the safetensors file holding it (from the index, or the one file), headers read once."""
    path = Path(path)
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        files = {name: SafetensorsFile(path / name) for name in set(weight_map.values())}
        return {key: files[name] for key, name in weight_map.items()}
    if (path / SINGLE).is_file():
        single = SafetensorsFile(path / SINGLE)
        return {key: single for key in single.keys()}
    raise LoadError(f"{path} holds no safetensors weights ({SINGLE} or {INDEX}); vpsd loads safetensors only")


def model_keys(family: str, files: dict[str, SafetensorsFile], wanted: set[str]) -> dict[str, tuple[SafetensorsFile, str]]:
    """Model parameter name -> (file, checkpoint key), renaming legacy keys (LEGACY_KEYS)."""
    rules = [(re.compile(a), b) for a, b in LEGACY_KEYS.get(family, [])]
    found: dict[str, tuple[SafetensorsFile, str]] = {}
    for key, file in files.items():
        name = key
        if name not in wanted:
            for pattern, repl in rules:
                if pattern.search(name):
                    name = pattern.sub(repl, name, count=1)
                    break
        if name in wanted:
            found[name] = (file, key)
    return found


@contextlib.contextmanager
def empty_model(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (what accelerate's `init_empty_weights`
    does, buffers included=False): a parameter's memory is never touched, its initialisation runs on meta, and
    buffers are computed for real. Parameters are built in `dtype` (the default dtype meanwhile), as
    `from_pretrained(dtype=...)` builds them; buffers made in an explicit dtype (rotary frequencies are float32)
    keep it."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    default = torch.get_default_dtype()
    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
        torch.set_default_dtype(default)


def build_empty(model_class: Any, path: Path, dtype: torch.dtype) -> Any:
    """The checkpoint's model, parameters on meta, buffers real (empty_model), attention as from_pretrained's."""
    config = AutoConfig.from_pretrained(path, attn_implementation="sdpa")
    # transformers builds each sub-model (language model, vision tower) in its own sub-config's `dtype`; a
    # checkpoint trained in float32 records float32 there, which would build float32 layers under a bf16 lm_head
    # (the long pair's bf16 jobs died at lm_head so). from_pretrained(dtype=...) overrides every sub-config's;
    # so does this.
    config.dtype = dtype
    for key in config.sub_configs:
        if (sub_config := getattr(config, key, None)) is not None:
            sub_config.dtype = dtype
    with empty_model(dtype):
        model = model_class(config)
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _local_slice(param: torch.Tensor, group_rank: int) -> tuple[int | None, int]:
    """(dim, start) of the slice this rank holds of a split parameter; (None, 0) for a whole one."""
    placements = getattr(param, "placements", None)
    if not placements or not placements[0].is_shard():
        return None, 0
    dim = placements[0].dim
    size = param.to_local().shape[dim]
    if size * param.device_mesh.size() != param.shape[dim]:  # shard_problems refuses uneven splits at launch
        raise LoadError(f"a split of {tuple(param.shape)} on dim {dim} is uneven over {param.device_mesh.size()} ranks")
    return dim, group_rank * size


def fill(model: Any, where: dict[str, tuple[SafetensorsFile, str]], device: torch.device, group_rank: int = 0) -> None:
    """Every parameter of `model` (meta, some of them DTensors) replaced by one allocated on `device` and read
    from `where` (model name -> (file, key)); tied parameters once, shared as they were."""
    from torch.distributed.tensor import DTensor

    done: dict[int, torch.nn.Parameter] = {}
    missing = []
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if id(param) not in done:
            if name not in where:
                missing.append(name)
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            data = torch.empty(local.shape, dtype=local.dtype, device=device)
            file, key = where[name]
            file.read_into(key, data, *_local_slice(param, group_rank))
            if isinstance(param, DTensor):
                data = DTensor.from_local(data, param.device_mesh, param.placements, run_check=False,
                                          shape=param.shape, stride=param.stride())
            done[id(param)] = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        module.register_parameter(attr, done[id(param)])
    if missing:
        raise LoadError(f"the checkpoint holds no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")


def load_model(model_class: Any, family: str, path: Path, dtype: torch.dtype, device: str | torch.device,
               group: Any = None) -> Any:
    """The checkpoint at `path` built in place (module docstring): whole on `device`, or this rank's share of
    its decoder layers when `group` splits it."""
    device = torch.device(device)
    model = build_empty(model_class, Path(path), dtype)
    group_rank = 0
    if group is not None:
        import torch.distributed as dist

        from vpsd.models.tensor_parallel import shard_language_model

        shard_language_model(model.model.language_model, group, device.type, src_data_rank=None)
        group_rank = dist.get_rank(group)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    fill(model, model_keys(family, weight_files(Path(path)), names), device, group_rank)
    for module in model.modules():  # the buffers, built on the host (assigning keeps a buffer's persistence)
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, buf.to(device))
    return model.eval()

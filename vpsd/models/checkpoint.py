"""A checkpoint directory laid out like the published ones, read as such.

Published Qwen2.5-VL / Qwen3-VL / LLaVA-OneVision checkpoints hold, beside the weights:
  config.json, generation_config.json             the model and its EOS ids
  video_preprocessor_config.json (transformers 5) how videos are preprocessed; older checkpoints have
  or preprocessor_config.json                     only preprocessor_config.json (images and videos alike)
  tokenizer.json + tokenizer_config.json          the tokenizer, and its chat template (in
  (+ chat_template.jinja / chat_template.json)    tokenizer_config.json or a file of its own)

`read_checkpoint(path, family)` checks they are there and agree with config.json, and turns the processor
settings into the adapter's keyword arguments: patch, merge and temporal patch sizes, mean / std and the
per-frame pixel bounds (Qwen: `size.shortest_edge` / `size.longest_edge`, or the older `min_pixels` /
`max_pixels`), the sampling rate the frames are taken at when no times are given (`fps`); LLaVA-OneVision:
mean / std and the frame side. The chat template itself is the tokenizer's (`apply_chat_template`), which
the adapters render when the tokenizer has one. A missing file, a file that is not JSON, or a setting that
contradicts config.json is a `CheckpointError` naming the file, at load, before any weights are read.

`read_frame_sampling(path, family)` is the processor's own frame rule (`video.sampling: checkpoint`): its
fps / num_frames / min_frames / max_frames with the family's transformers defaults (Qwen: 2 fps, 4..768
frames), or None where the checkpoint names neither a count nor a rate (LLaVA-OneVision's published ones).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vpsd.models.qwen_video import QwenVisionSpec
from vpsd.video.sampling import QWEN2_VL, QWEN3_VL, UNIFORM_FLOOR, ProcessorSampling

PROCESSOR_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


class CheckpointError(ValueError):
    """The checkpoint directory is not laid out like a published checkpoint, or contradicts itself."""


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a published checkpoint has it)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def has_chat_template(path: Path) -> bool:
    config = path / "tokenizer_config.json"
    in_config = config.is_file() and bool(_json(config).get("chat_template"))
    return in_config or (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file()


def _agree(name: str, processor_file: Path, value: Any, config_value: Any) -> None:
    if value is not None and config_value is not None and value != config_value:
        raise CheckpointError(
            f"{processor_file}: {name} {value!r} contradicts config.json's {config_value!r}"
        )


def _pixel_bounds(proc: dict[str, Any]) -> tuple[int | None, int | None]:
    size = proc.get("size") or {}
    low = size.get("shortest_edge", proc.get("min_pixels"))
    high = size.get("longest_edge", proc.get("max_pixels"))
    return low, high


def _processor_file(path: Path) -> Path:
    proc_file = next((path / f for f in PROCESSOR_FILES if (path / f).is_file()), None)
    if proc_file is None:
        raise CheckpointError(f"{path}: missing {' or '.join(PROCESSOR_FILES)} (the video preprocessing settings)")
    return proc_file


# Family -> (frame rule, default fps): transformers 5's Qwen2VLVideoProcessor (at Qwen2_5_VLProcessor's fps
# default, 2.0), Qwen3VLVideoProcessor (fps = 2), and the base processor LLaVA-OneVision's uses (no default).
FRAME_RULES = {"qwen2_5_vl": (QWEN2_VL, 2.0), "qwen3_vl": (QWEN3_VL, 2.0), "llava_onevision": (UNIFORM_FLOOR, None)}


def read_frame_sampling(path: str | Path, family: str) -> ProcessorSampling | None:
    """The checkpoint's video processor's frame rule and settings (module docstring)."""
    path = Path(path)
    proc_file = _processor_file(path)
    proc = _json(proc_file)
    rule, default_fps = FRAME_RULES[family]
    num_frames, fps = proc.get("num_frames"), proc.get("fps", default_fps)
    if num_frames is None and fps is None:
        return None
    vision = _json(path / "config.json").get("vision_config") or {}
    try:
        return ProcessorSampling(
            rule, num_frames=None if num_frames is None else int(num_frames), fps=None if fps is None else float(fps),
            min_frames=int(proc.get("min_frames", 4)), max_frames=int(proc.get("max_frames", 768)),
            temporal_factor=int(proc.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{proc_file}: frame sampling settings: {e}") from None


def read_checkpoint(path: str | Path, family: str) -> dict[str, Any]:
    """Adapter keyword arguments from the checkpoint's own processor settings (see the module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    config = _json(path / "config.json")
    _json(path / "generation_config.json")
    proc_file = _processor_file(path)
    proc = _json(proc_file)
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        raise CheckpointError(f"{path}: missing tokenizer.json / tokenizer_config.json")
    if not has_chat_template(path):
        raise CheckpointError(f"{path}: the tokenizer has no chat template (tokenizer_config.json's chat_template, "
                              "chat_template.jinja or chat_template.json)")
    vision = config.get("vision_config") or {}
    if family == "llava_onevision":
        return _llava(proc, proc_file, vision)
    return _qwen(proc, proc_file, vision, family)


def _qwen(proc: dict[str, Any], proc_file: Path, vision: dict[str, Any], family: str) -> dict[str, Any]:
    from vpsd.models.qwen3_vl import qwen3_vision_spec

    default = qwen3_vision_spec() if family == "qwen3_vl" else QwenVisionSpec()
    sizes = {}
    for name, config_name in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                              ("temporal_patch_size", "temporal_patch_size")):
        _agree(name, proc_file, proc.get(name), vision.get(config_name))
        sizes[name] = proc.get(name, vision.get(config_name, getattr(default, name)))
    low, high = _pixel_bounds(proc)
    spec = QwenVisionSpec(
        **sizes,
        mean=tuple(proc.get("image_mean", default.mean)),
        std=tuple(proc.get("image_std", default.std)),
        min_pixels=int(low if low is not None else default.min_pixels),
        max_pixels=int(high if high is not None else default.max_pixels),
    )
    factor = spec.factor
    if not factor * factor <= spec.min_pixels <= spec.max_pixels:
        raise CheckpointError(f"{proc_file}: pixel bounds {spec.min_pixels}..{spec.max_pixels} do not fit "
                              f"patch x merge = {factor}")
    out: dict[str, Any] = {"vision_spec": spec}
    if proc.get("fps") is not None:
        out["fps"] = float(proc["fps"])
    return out


def _llava(proc: dict[str, Any], proc_file: Path, vision: dict[str, Any]) -> dict[str, Any]:
    size = proc.get("size") or {}
    side = size.get("height", size.get("shortest_edge"))
    if size.get("height") is not None and size.get("width") not in (None, size["height"]):
        raise CheckpointError(f"{proc_file}: frames must be square, got size {size}")
    _agree("size", proc_file, side, vision.get("image_size"))
    out: dict[str, Any] = {}
    if "image_mean" in proc:
        out["image_mean"] = tuple(proc["image_mean"])
    if "image_std" in proc:
        out["image_std"] = tuple(proc["image_std"])
    return out

"""A model's spec (where it comes from, where it runs), apart from the code that loads one.

Configs hold specs, and every process reads its config; only the ranks that load a model need torch's model
stack and transformers (models/registry.py), whose import costs seconds a process. A rank that holds no model
(the pruner, a rank its method leaves idle) reads its config without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")

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


@dataclass
class ModelSpec:
    """Where a model comes from and where it runs."""

    path: str | None = None  # local checkpoint directory (real weights)
    tiny: dict[str, Any] | None = None  # {"seed": int, "text": {...}, "vision": {...}}
    dtype: str = "float32"
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)  # adapter keyword arguments (e.g. fps)
    # A scale model of the checkpoint at `path`: {width: k, layers: N} grows it function-preservingly
    # (models/grow.py) into `grown_path()` on first use, reused while it matches the source's weights.
    grow: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("a model spec needs exactly one of `path` (checkpoint) or `tiny` (config)")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.grow is not None:
            if self.path is None or set(self.grow) != {"width", "layers"}:
                raise ValueError(f"`grow` needs a checkpoint `path` and exactly width and layers, got {self.grow}")
            if not all(type(v) is int and v >= 1 for v in self.grow.values()):
                raise ValueError(f"grow width and layers must be positive integers, got {self.grow}")

    def grown_path(self) -> str | None:
        """Where the scale model lives: beside its source, named by its shape (git-ignored: *.grown-*)."""
        if self.grow is None or self.path is None:
            return None
        src = Path(self.path)
        return str(src.with_name(f"{src.name}.grown-w{self.grow['width']}-l{self.grow['layers']}"))

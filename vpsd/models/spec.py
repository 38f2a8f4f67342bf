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
# How a model's steps are captured (models/captured.py), each a torch.compile backend and mode:
#   cudagraphs     CUDA graphs of dynamo's trace of a step, recorded by vpsd (models/step_graphs.py: not torch's
#                  cudagraphs backend, which copies every weight a replay): a step is one replay, and a graph
#                  records in about a forward's time; what a GPU wants
#   reduce-overhead, default, max-autotune, max-autotune-no-cudagraphs: inductor's modes (generated kernels, with
#                  CUDA graphs where the mode says; tens of seconds of code generation a graph on a large model)
#   trace          the same recorded steps with each replay run by the eager kernels instead (no GPU, no code
#                  generation: a check of the capture itself, on any device)
CAPTURE_MODES = ("cudagraphs", "reduce-overhead", "default", "max-autotune", "max-autotune-no-cudagraphs", "trace")

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
    # Captured steps (models/captured.py): a batch-1 step or verify as one graph over a preallocated cache of up
    # to `capture_len` entries a layer (buckets of halving sizes, the smallest that fits). null (eager) is the
    # default: on a CPU a captured step saves 5-30% and costs seconds of compilation a graph. Longer sequences
    # and batches of several items step eagerly.
    capture: str | None = None
    capture_len: int = 8192
    # The target split over this many ranks (models/tensor_parallel.py): its pipeline takes k - 1 ranks more,
    # after its roles' (launch/layout.py), each holding 1/k of the language model's layers and KV cache.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.capture is not None and self.capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {list(CAPTURE_MODES)} or null, got {self.capture!r}")
        if type(self.tensor_parallel) is not int or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {self.tensor_parallel!r}")
        if type(self.capture_len) is not int or self.capture_len < 1:
            raise ValueError(f"capture_len must be a positive integer, got {self.capture_len!r}")
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

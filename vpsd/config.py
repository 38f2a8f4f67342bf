"""Run configuration: dataclasses loaded from the YAML files in configs/.

A config names the model family, the target and draft models (see models/registry.ModelSpec),
how videos are sampled, and the decoding and pruning settings. `draft: self` selects
self-speculation: the draft is the target's own weights fed only the kept video tokens.
Every component reads only its own section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vpsd.models.registry import ModelSpec


@dataclass
class VideoConfig:
    num_frames: int | None = 8  # uniform sampling by count (None: use fps or every frame)
    fps: float | None = None
    max_side: int | None = None  # longest side after resizing, before the family's own sizing rule
    # Tokens a sequence may hold (prompt + video + max_new_tokens); None: the target's
    # max_position_embeddings. A clip over it fails as VideoError("too_long")...
    context_limit: int | None = None
    subsample_to_fit: bool = False  # ...unless this is set: then frames are dropped evenly until it fits


@dataclass
class DecodingConfig:
    gamma: int = 4  # draft tokens per chunk
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # seeds the acceptance test and sampling when temperature > 0
    # The target verifies a chunk with one-token forwards, the kernels `ar` runs: greedy output then equals
    # `ar`'s bit for bit in any dtype, even at near-ties (README "What lossless means"), at the price of
    # k target forwards per verify instead of one.
    exact_verify: bool = False

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class PruningConfig:
    strategy: str = "uniform"
    ratio: float = 0.9  # share of prunable video tokens dropped from the draft's input
    seed: int = 0
    # Target layers the signals are read from. null (default): the papers' definitions: attention
    # strategies average over ALL layers (HIPPO Eq. 2, SpecVLM Eq. 5), UV-Prune compares layers 0 and 20
    # (ParallelVLM App. D). An int L: the first L layers (UV: layers 0 and L).
    layers: int | None = None
    # Parallel runs only (ParallelVLM's streaming): the target sends the signals right after this layer,
    # so they are of the first min(layers, stream_layers) layers and the draft's pruned prefill overlaps
    # the rest of the target's. For attention strategies that departs from HIPPO / SpecVLM (all layers);
    # it is the default because a parallel draft otherwise waits for the target's whole prefill.
    # null: no streaming, the draft waits for the scores of `layers` (all layers by default).
    stream_layers: int | None = 20
    crop: int = 5  # HIPPO spatial crop side (M = crop^2 tokens, Eq. 5-6)
    specvlm_lambda: float | None = None  # SpecVLM Eq. 6 top-P mass; null: the family's value from the paper

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"pruning ratio must be in [0, 1), got {self.ratio}")
        for name in ("layers", "stream_layers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"pruning.{name} must be a positive int or null, got {value!r}")
        if isinstance(self.crop, bool) or not isinstance(self.crop, int) or self.crop < 1:
            raise ValueError(f"pruning.crop must be a positive int, got {self.crop!r}")
        if self.specvlm_lambda is not None and not 0.0 <= self.specvlm_lambda <= 1.0:
            raise ValueError(f"pruning.specvlm_lambda must be in [0, 1] or null, got {self.specvlm_lambda!r}")

    def signal_layers(self, parallel: bool) -> int | None:
        """Target layers the pruning signals come from in a serial or parallel run (None: all; see above)."""
        if parallel and self.stream_layers is not None:
            return self.stream_layers if self.layers is None else min(self.layers, self.stream_layers)
        return self.layers

    @property
    def applied_ratio(self) -> float:
        """The ratio actually pruned: strategy "none" keeps every token whatever `ratio` says."""
        return 0.0 if self.strategy == "none" else self.ratio


@dataclass
class RunConfig:
    family: str
    target: ModelSpec
    draft: ModelSpec | None  # None: self-speculation with the target's weights
    video: VideoConfig = field(default_factory=VideoConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    pruning: PruningConfig = field(default_factory=PruningConfig)
    extra: dict[str, Any] = field(default_factory=dict)  # sections other components own (roles, launch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _section(cls, data: dict | None):
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown keys in {cls.__name__}: {sorted(unknown)}")
    return cls(**data)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    data = dict(data)
    try:
        family = data.pop("family")
        target = _section(ModelSpec, data.pop("target"))
    except KeyError as e:
        raise ValueError(f"config is missing {e}") from None
    draft_data = data.pop("draft", "self")
    draft = None if draft_data in ("self", None) else _section(ModelSpec, draft_data)
    return RunConfig(
        family=family,
        target=target,
        draft=draft,
        video=_section(VideoConfig, data.pop("video", None)),
        decoding=_section(DecodingConfig, data.pop("decoding", None)),
        pruning=_section(PruningConfig, data.pop("pruning", None)),
        extra=data,
    )


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` arguments as load_config overrides; values are YAML ("4" -> 4, "self" -> "self")."""
    overrides = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--set needs KEY=VALUE, got {kv!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Reads a YAML config; `overrides` maps dotted keys ("decoding.gamma") to values.

    A relative checkpoint `path` in the file is relative to the file's folder, so a config and the
    checkpoints it names move together; a path given as an override is relative to the working directory.
    """
    data = yaml.safe_load(Path(path).read_text())
    _resolve_model_paths(data, Path(path).resolve().parent)
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config_from_dict(data)


def _resolve_model_paths(data: dict, base: Path) -> None:
    for role in ("target", "draft"):
        spec = data.get(role)
        if isinstance(spec, dict) and spec.get("path") and not Path(spec["path"]).is_absolute():
            spec["path"] = str((base / spec["path"]).resolve())

"""Run configuration: dataclasses loaded from the YAML files in configs/.

A config names the model family, the target and draft models (see models/registry.ModelSpec),
how videos are sampled, and the decoding and pruning settings. `draft: self` selects
self-speculation: the draft is the target's own weights fed only the kept video tokens.
Every component reads only its own section.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vpsd.checked import ConfigError, checked_section, fits, nearest, type_name
from vpsd.models.spec import ModelSpec
from vpsd.pipeline.ensemble import TabedConfig
from vpsd.pipeline.sampling import SamplingRule
from vpsd.pipeline.tree import parse_tree
from vpsd.pipeline.cost import AUTO


@dataclass
class VideoConfig:
    num_frames: int | None = 8  # uniform sampling by count (None: use fps or every frame)
    fps: float | None = None
    max_side: int | None = None  # longest side after resizing, before the family's own sizing rule
    # Tokens a sequence may hold (prompt + video + max_new_tokens); None: the target's
    # max_position_embeddings. A clip over it fails as VideoError("too_long")...
    context_limit: int | None = None
    subsample_to_fit: bool = False  # ...unless this is set: then frames are dropped evenly until it fits
    # Which frames a video gives when its manifest line asks for none: "config" (num_frames / fps above) or
    # "checkpoint": the target checkpoint's own video processor's rule and settings (its fps, min / max
    # frames; models/checkpoint.read_frame_sampling), as transformers would sample the video. A manifest
    # line's own num_frames / fps still win.
    sampling: str = "config"
    # How a video file is read (vpsd/video/decode.py): "exact", the frames a front to back decode gives, reached
    # by seeking to the keyframe before each; or "keyframe", approximate: the keyframe nearest each wanted frame,
    # decoding keyframes only (faster on long videos; the frames, so the outputs, differ from "exact").
    seek: str = "exact"
    # Reading (vpsd/video/pool.py; no output depends on these): `readers` threads decode videos at once, on the
    # cores of the process's mask that cpu_affinity pins no role to (null: one a spare core, at least one, at most
    # read_ahead + 1); up to `read_ahead` items are read ahead of the one being prepared, while the frames read and
    # not yet taken fit in `frames_budget_mib` (a read that would exceed it waits; one bigger than the whole budget
    # is read alone). `share_frames`: the target sends a draft rank the frames it read (the tensor channel), so
    # the draft does not decode the video a second time; false: the draft reads the file itself.
    readers: int | None = None
    read_ahead: int = 4
    frames_budget_mib: float = 1024.0
    share_frames: bool = True

    def __post_init__(self) -> None:
        if self.sampling not in ("config", "checkpoint"):
            raise ValueError(f"video.sampling must be 'config' or 'checkpoint', got {self.sampling!r}")
        if self.seek not in ("exact", "keyframe"):
            raise ValueError(f"video.seek must be 'exact' or 'keyframe', got {self.seek!r}")
        if self.readers is not None and self.readers < 1:
            raise ValueError(f"video.readers must be >= 1 or null (one a spare core), got {self.readers!r}")
        if self.read_ahead < 0:
            raise ValueError(f"video.read_ahead must be >= 0, got {self.read_ahead!r}")
        if not self.frames_budget_mib > 0:
            raise ValueError(f"video.frames_budget_mib must be > 0, got {self.frames_budget_mib!r}")
        # Positive or null: a 0 failed every item at its read, one error row each, instead of the launch.
        for name in ("num_frames", "fps", "max_side", "context_limit"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"video.{name} must be > 0 or null, got {value!r}")


# The window serial methods use under `gamma: auto`: ParallelVLM's and HIPPO's baselines run vanilla SD
# with gamma 5 (ParallelVLM Table 1); Eq. 6's balance exists only where draft and target run concurrently.
SERIAL_AUTO_GAMMA = 5


@dataclass
class DecodingConfig:
    # Draft tokens per chunk: an int, or "auto" (parallel methods: matched live to the measured speed ratio,
    # ParallelVLM Eq. 6, within [gamma_min, gamma_max], starting from gamma_start; serial methods: 5).
    gamma: int | str = 4
    gamma_min: int = 2
    gamma_max: int = 16
    gamma_start: int = 5  # the first item's first window under auto, before anything was measured
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # an item's seed when it has none of its own (a manifest line's "seed"; pipeline/seeds.py)
    # How a sampled token is chosen (pipeline/sampling.py): "keyed" (position-keyed Gumbel-max: a seeded output
    # is `ar`'s own, token for token, whatever drafted it) or "rejection" (min(1, p/q) and the residual: exact in
    # distribution, but a seeded output depends on the windows, hence on timing).
    sampling: str = "keyed"
    # Filters applied to target and draft alike before either rule (0 / 1.0 / 0.0: off), in transformers' order.
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # The draft tree of the methods that draft one (sd-tree, specvlm; pipeline/tree.py): None = the method's
    # default (EAGLE's / SpecVLM's tree), "chain" = a chain of gamma tokens instead, a name ("eagle"),
    # per-depth branching factors ([4, 2, 1]) or node paths ([[0], [1], [0, 0]]). Chain methods ignore it.
    tree: Any = None
    # The target verifies a chunk with one-token forwards, the kernels `ar` runs: greedy output then equals
    # `ar`'s bit for bit in any dtype, even at near-ties (docs/design.md, "Lossless"), at the price of
    # k target forwards per verify instead of one.
    exact_verify: bool = False
    # Parallel drafting (pipeline/state_machine.DraftMachine): how far past the last confirmed token the draft
    # may run (null: two windows, one being verified and one being drafted), and whether it sends a short chunk
    # when the target has nothing to verify (off: on a CPU the extra short rounds cost more than the idle time).
    lookahead: int | None = None
    eager_when_idle: bool = False
    # HIPPO's synchronous prefill (Sec. 3.3): a draft on its own rank prunes, prefills and drafts while the target
    # prefills (its head start capped at `lookahead`: in a target-bound pipeline more is never needed before a
    # verdict). false: the draft hears of an item after the target's prefill (PEARL-video, HIPPO Table 3).
    sync_prefill: bool = True

    def __post_init__(self) -> None:
        parse_tree(self.tree)  # a bad shape fails here, with the reason
        if self.lookahead is not None and (type(self.lookahead) is not int or self.lookahead < 1):
            raise ValueError(f"lookahead must be an int >= 1 or null, got {self.lookahead!r}")
        if self.gamma != AUTO and (type(self.gamma) is not int or self.gamma < 1):
            raise ValueError(f"gamma must be an int >= 1 or {AUTO!r}, got {self.gamma!r}")
        if not 1 <= self.gamma_min <= self.gamma_start <= self.gamma_max:
            raise ValueError(f"need 1 <= gamma_min <= gamma_start <= gamma_max, got "
                             f"{self.gamma_min}, {self.gamma_start}, {self.gamma_max}")
        self.rule  # a bad temperature, filter or rule fails here, with the reason
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")

    @property
    def auto_gamma(self) -> bool:
        return self.gamma == AUTO

    @property
    def rule(self) -> SamplingRule:
        """Every setting of how logits become tokens, for the pure core (pipeline/sampling.py)."""
        return SamplingRule(self.temperature, self.top_k, self.top_p, self.min_p, self.sampling)

    def serial_gamma(self) -> int:
        """The fixed window of a serial method."""
        return SERIAL_AUTO_GAMMA if self.gamma == AUTO else int(self.gamma)

    def lookahead_for(self, gamma: int) -> int:
        """The draft's lookahead under window `gamma` (never below it)."""
        return max(self.lookahead if self.lookahead is not None else 2 * gamma, gamma)


@dataclass
class PruningConfig:
    strategy: str = "uniform"
    ratio: float = 0.9  # share of prunable video tokens dropped from the draft's input
    seed: int = 0
    # Target layers the signals are read from. null (default): the papers' definitions: attention
    # strategies average over ALL layers (HIPPO Eq. 2, SpecVLM Eq. 5), UV-Prune compares layers 0 and 20
    # (ParallelVLM App. D). An int L: the first L layers (UV: layers 0 and L).
    layers: int | None = None
    # Parallel runs (ParallelVLM's streaming): the signals leave after this layer (of the first min(layers,
    # stream_layers)), so the draft's pruned prefill overlaps the rest of the target's: for attention scores a
    # departure from HIPPO / SpecVLM (all layers), made so a parallel draft need not wait. null: no streaming.
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
class BatchingConfig:
    """Many items in flight (engine/engine.py; `--batch N` sets `size`)."""

    size: int = 1  # items decoded together; 1: one at a time, through the roles for parallel methods
    # KV cache the items in flight may reserve together, target and draft, in MiB (null: the room the memory plan
    # leaves at launch, launch/memory.py; no limit outside a launch). An item joins only while its cache (prompt +
    # video + max_new_tokens + one window, both models) fits beside the others'; one that does not fit alone fails
    # with that error, and the job goes on.
    kv_budget_mib: float | None = None
    # A parallel method over a batch: false runs draft and target in turns on the target's rank (the draft's core
    # prefills the next items); true on their own ranks at the same time, each forward carrying the batch
    # (which is faster depends on where the draft runs: docs/design.md, "Many items in flight").
    pipelined: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pipelined, bool):
            raise ValueError(f"batching.pipelined must be true or false, got {self.pipelined!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"batching.size must be an int >= 1, got {self.size!r}")
        if self.kv_budget_mib is not None and self.kv_budget_mib <= 0:
            raise ValueError(f"batching.kv_budget_mib must be > 0 or null, got {self.kv_budget_mib!r}")

    @property
    def kv_budget_bytes(self) -> int | None:
        return None if self.kv_budget_mib is None else int(self.kv_budget_mib * 2**20)


def draft_reuse_budget(target_budget_bytes: int) -> int:
    """A draft model's kept vision features: a quarter of the target's reuse budget. A draft keeps no KV (its
    pruned prefill depends on the question), only each video's features, a few MiB; the whole budget on every
    draft rank would plan memory it never holds."""
    return target_budget_bytes // 4


@dataclass
class ReuseConfig:
    """One video, many questions (engine/prefix_cache.py): the target keeps the KV cache of each prompt's prefix up
    to the end of its video block (and the vision tower's output) and prefills only what follows, for every later
    question or turn about the same video. Keyed by the video as the model sees it (its pixel tensors and grid) and
    the prefix's token ids, so a video that changed on disk never hits; least recently used evicted first. The
    decoded frames are kept too (video/frame_cache.py), so a later question does not read its video again."""

    enabled: bool = True
    # Bytes of cached prefixes and vision features this target keeps, in MiB, on the target's device; the memory
    # plan counts them (launch/memory.py). 0 keeps nothing (as enabled: false).
    budget_mib: float = 512.0
    # Bytes of decoded frames kept, in MiB of host memory, by the rank that reads the videos (the target's; a draft
    # rank's too when it reads them itself, video.share_frames: false), keyed by the file's identity and the frames
    # asked for; the memory plan counts them. 0 keeps none (as enabled: false).
    frames_mib: float = 128.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"reuse.enabled must be true or false, got {self.enabled!r}")
        for name in ("budget_mib", "frames_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"reuse.{name} must be a number >= 0, got {value!r}")

    @property
    def budget_bytes(self) -> int:
        """What the cache may hold (0 when reuse is off)."""
        return int(self.budget_mib * 2**20) if self.enabled else 0

    @property
    def draft_budget_bytes(self) -> int:
        """What a draft model's kept vision features may hold (engine/prefix_cache.py draft_embed)."""
        return draft_reuse_budget(self.budget_bytes)

    @property
    def frames_bytes(self) -> int:
        """What the frame cache may hold (0 when reuse is off)."""
        return int(self.frames_mib * 2**20) if self.enabled else 0


@dataclass
class RunConfig:
    family: str
    target: ModelSpec
    draft: ModelSpec | None  # None: self-speculation with the target's weights
    video: VideoConfig = field(default_factory=VideoConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    pruning: PruningConfig = field(default_factory=PruningConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    # TABED's settings (pipeline/ensemble.py), read by its draft and target; None: its defaults.
    tabed: TabedConfig | None = None
    # Where and how the ranks run (no output depends on them, so they are not part of a job's identity): each
    # role's rank in a pipeline and the cores it is pinned to (launch/layout.py), how long a peer may be silent
    # before the job ends naming it (--timeout wins), how long a live peer may be waited for, and how long the
    # job may take to start: every rank up, models loaded (--startup-timeout wins; transport/startup.py).
    roles: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_ROLES))
    cpu_affinity: dict[str, list[int]] | None = None
    timeout_s: float = 120.0
    idle_timeout_s: float = 3600.0
    startup_timeout_s: float = 600.0
    # Where a parallel method's draft and pruner run: "rank", ranks of their own (roles:); "thread", threads of the
    # target's process (on a GPU, their own CUDA streams: launch/in_process.py), the same roles either way.
    draft_on: str = "rank"
    # Profile this many rounds of each pipeline's target (after 5; vpsd/profiling.py): the profiler's trace and the
    # split of a round's time (kernels, launches, host waits, the rest) beside the rank's trace. 0: none.
    profile_rounds: int = 0
    # What `vpsd tune` chose for this config and what it was tuned on (vpsd/launch/tuned.py): `--method auto` runs
    # its choice, and a config whose pair or machine differs from the one it was tuned on is refused at launch.
    # Written by `vpsd tune --out`; null (the default): not tuned.
    tuned: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if sorted(self.roles) != sorted(DEFAULT_ROLES) or len(set(self.roles.values())) != len(DEFAULT_ROLES):
            raise ValueError(f"roles must map target, draft and pruner to distinct ranks, got {self.roles}")
        if min(self.timeout_s, self.idle_timeout_s, self.startup_timeout_s) <= 0:
            raise ValueError(f"timeout_s, idle_timeout_s and startup_timeout_s must be > 0, got {self.timeout_s}, "
                             f"{self.idle_timeout_s}, {self.startup_timeout_s}")
        if self.profile_rounds < 0:
            raise ValueError(f"profile_rounds must be >= 0, got {self.profile_rounds}")
        if self.draft_on not in DRAFT_ON:
            raise ValueError(f"draft_on must be one of {', '.join(DRAFT_ON)}, got {self.draft_on!r}")
        for role, cpus in (self.cpu_affinity or {}).items():
            if role not in DEFAULT_ROLES:
                raise ValueError(f"cpu_affinity: unknown role {role!r}{nearest(role, DEFAULT_ROLES)}; "
                                 f"roles: {', '.join(DEFAULT_ROLES)}")
            if not isinstance(cpus, list) or not cpus or not all(type(c) is int and c >= 0 for c in cpus):
                raise ValueError(f"cpu_affinity.{role} must be a non-empty list of core numbers, got {cpus!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def tabed_settings(self) -> TabedConfig:
        return self.tabed or TabedConfig()


DEFAULT_ROLES = {"target": 0, "draft": 1, "pruner": 2}
DRAFT_ON = ("rank", "thread")
SECTIONS = ("family", "target", "draft", "video", "decoding", "pruning", "batching", "reuse")
# Top-level settings outside the sections (RunConfig's own fields), type-checked like a section's keys.
TOP_LEVEL = ("roles", "cpu_affinity", "timeout_s", "idle_timeout_s", "startup_timeout_s", "draft_on",
             "profile_rounds", "tuned")


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    data = dict(data)
    missing = [k for k in ("family", "target") if k not in data]
    if missing:
        raise ConfigError([f"config is missing {k!r}" for k in missing])
    family, draft_data = data.pop("family"), data.pop("draft", "self")
    sections = {"target": (ModelSpec, data.pop("target")), "video": (VideoConfig, data.pop("video", None)),
                "decoding": (DecodingConfig, data.pop("decoding", None)),
                "pruning": (PruningConfig, data.pop("pruning", None)),
                "batching": (BatchingConfig, data.pop("batching", None)),
                "reuse": (ReuseConfig, data.pop("reuse", None))}
    if draft_data not in ("self", None):
        sections["draft"] = (ModelSpec, draft_data)
    built, problems = {}, []
    for name, (cls, section) in sections.items():  # every section's problems, not just the first one's
        try:
            built[name] = checked_section(cls, section, name)
        except ConfigError as e:
            problems += e.problems
    tabed = data.pop("tabed", None)
    try:
        built["tabed"] = TabedConfig.from_dict(tabed) if tabed is not None else None
    except (ValueError, TypeError) as e:
        problems.append(f"tabed: {e}")
    hints = typing.get_type_hints(RunConfig)
    top = {}
    for key in TOP_LEVEL:
        if key in data:
            value = data.pop(key)
            if fits(value, hints[key]):
                top[key] = value
            else:
                problems.append(f"{key} must be {type_name(hints[key])}, got {value!r}")
    known = [*SECTIONS, "tabed", *TOP_LEVEL]
    problems += [f"unknown setting {k!r}{nearest(k, known)}" for k in data]  # read by nobody: say so
    if problems:
        raise ConfigError(problems)
    try:
        return RunConfig(family=family, draft=built.pop("draft", None), **built, **top)
    except ValueError as e:
        raise ConfigError([str(e)]) from None


# libyaml's parser where PyYAML was built with it (the wheels are): the same safe schema, ~10x faster than the
# pure-Python one (~20 ms a config here), which every rank, every API call and every test's config paid.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAML_LOADER)  # noqa: S506 (a safe loader)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` arguments as load_config overrides; values are YAML ("4" -> 4, "self" -> "self")."""
    overrides, problems = {}, []
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep:
            problems.append(f"--set needs KEY=VALUE, got {kv!r}")
            continue
        try:
            overrides[key] = _yaml(value)
        except yaml.YAMLError:
            overrides[key] = value  # not YAML: the text itself (the type check then says what was expected)
    if problems:
        raise ConfigError(problems)
    return overrides


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Reads a YAML config; `overrides` maps dotted keys ("decoding.gamma") to values.

    A relative checkpoint `path` in the file is relative to the file's folder, so a config and the
    checkpoints it names move together; a path given as an override is relative to the working directory.
    """
    try:
        data = _yaml(Path(path).read_text())
    except FileNotFoundError:
        raise  # the launcher names the missing file
    except OSError as e:
        raise ConfigError([f"cannot read config {path}: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError([f"config {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config {path}: expected a mapping of sections (family, target, ...), got "
                           f"{type(data).__name__}"])
    _resolve_model_paths(data, Path(path).resolve().parent)
    known = set(SECTIONS) | {"tabed", *TOP_LEVEL}
    unknown = [k for k in overrides or {} if k.split(".")[0] not in known]
    # A mistyped --set would otherwise be read by nobody.
    problems = [f"--set {k}: unknown setting{nearest(k.split('.')[0], known)}" for k in unknown]
    for key, value in (overrides or {}).items():
        if key in unknown:
            continue
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(problems)
    return cfg


def _resolve_model_paths(data: dict, base: Path) -> None:
    for role in ("target", "draft"):
        spec = data.get(role)
        if isinstance(spec, dict) and spec.get("path") and not Path(spec["path"]).is_absolute():
            spec["path"] = str((base / spec["path"]).resolve())

"""A run's settings from a config file and the job's options, checked before any model loads: one path for the
torchrun job (launch/entry.py, from its command line) and the Python API (vpsd/api.py, from its arguments).

`run_config(config, method, ...)` applies the method's defaults and the overrides (as --set KEY=VALUE pairs or a
{key: value} dict) and checks everything that can be checked without loading a model: each setting's type and
name, the pruning strategy, what only one method reads, the checkpoints, the devices, a split target, and the
memory plan (launch/memory.py: a layout that cannot fit is refused, and the KV budget defaults to the room it
leaves), and a tuned config's fit to the pair and machine it was tuned on (launch/tuned.py). A problem is a
`ConfigError`, one line each. `auto_method` turns `--method auto` into a tuned config's choice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from vpsd.config import ConfigError, RunConfig, load_config, nearest, parse_overrides
from vpsd.launch.memory import node_plan, with_kv_budget
from vpsd.launch.preflight import (affinity_problems, checkpoint_problems, device_problems, memory_problems,
                                   tensor_parallel_problems)
from vpsd.launch.tuned import Choice, auto_choice, tuned_problems
from vpsd.models.shapes import ShapeError
from vpsd.pipeline.methods import Method, get_method
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.transport.placement import visible_gpus


def run_config(config: str | Path, method: str, *, pruning: str | None = None, ratio: float | None = None,
               gamma: int | str | None = None, temperature: float | None = None, batch: int | None = None,
               overrides: Sequence[str] | Mapping[str, Any] = (), local_world: int | None = None) -> RunConfig:
    """The checked settings of a run (module docstring); FileNotFoundError for a missing config file.
    `local_world`: the ranks on this node (default torchrun's LOCAL_WORLD_SIZE, else 1)."""
    m = get_method(method)
    settings = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(list(overrides))
    settings["pruning.strategy"] = pruning or m.default_strategy
    ratio = ratio if ratio is not None else m.default_ratio
    for key, value in (("pruning.ratio", ratio), ("decoding.gamma", gamma), ("decoding.temperature", temperature),
                       ("batching.size", batch)):
        if value is not None:
            settings[key] = value
    cfg = load_config(config, settings)
    if cfg.pruning.strategy not in STRATEGIES:  # else a KeyError on the target rank and a ValueError on the pruner's
        raise ConfigError([f"unknown pruning strategy {cfg.pruning.strategy!r}"
                           f"{nearest(cfg.pruning.strategy, STRATEGIES)}; known: {', '.join(sorted(STRATEGIES))}"])
    check_method_settings(m, cfg)
    local_world = local_world or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = visible_gpus()
    problems = (checkpoint_problems(cfg) + affinity_problems(cfg) + device_problems(cfg, gpus)
                + tensor_parallel_problems(cfg, m, gpus, local_world))
    problems = problems or tuned_problems(cfg)  # a tuned config on another pair or machine (launch/tuned.py)
    # What the layout needs of this node's memory, once the settings themselves are sound (launch/memory.py);
    # the KV budget defaults to the room it leaves.
    problems = problems or memory_problems(cfg, m, local_world, gpus)
    if problems:
        raise ConfigError(problems)
    try:
        return with_kv_budget(cfg, *node_plan(cfg, m, local_world, gpus))
    except (ShapeError, ValueError):
        return cfg


def check_method_settings(method: Method, cfg: RunConfig) -> None:
    """Settings only one method reads: a bad one must stop the run before a model loads, not crash the draft role
    on the first item."""
    try:
        method.draft_place(cfg.batching.size, cfg.batching.pipelined, cfg.draft_on)  # ValueError where it cannot run
        if method.draft == "sparse_kv" and cfg.pruning.strategy != "none":
            raise ValueError(f"std picks its own KV entries per head; --pruning {cfg.pruning.strategy} does not apply")
    except (ValueError, TypeError) as e:
        raise ConfigError([f"method {method.name}: {e}"]) from None


def auto_method(config: str | Path | RunConfig, batch: int | None = None,
                overrides: Sequence[str] | Mapping[str, Any] = ()) -> Choice:
    """`--method auto`: the choice the config's tuned: block holds for --batch `batch` (None: its winner's), read
    with the run's overrides (`--set tuned=null` leaves none); ConfigError (one line) when there is none, and
    FileNotFoundError for a missing config file, as run_config."""
    if isinstance(config, RunConfig):
        return auto_choice(config, batch)
    settings = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(list(overrides))
    return auto_choice(load_config(config, settings), batch, str(config))

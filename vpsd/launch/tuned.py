"""A tuned config's `tuned:` block: what `vpsd tune` chose (vpsd/bench/tune/), and what it was tuned on.

`vpsd tune --out tuned.yaml` writes the user's config with the winner's keys set and this block:

    tuned:
      method: hippo                          # the winner, at `batch`
      batch: 1
      settings: {pruning.strategy: hippo, pruning.ratio: 0.9, decoding.gamma: auto, draft_on: rank}
      choices:                               # the best confirmed candidate at each batch size tuned
      - {batch: 1, method: hippo, settings: {...}, items_per_hour: 412.0, x_ar: 1.08, noise: 0.02}
      pair: {family: qwen2_5_vl, target: {..., weights: 3f2a...}, draft: {...}}   # job_identity.identity's
      machine: {cpu: AMD EPYC 7B13, cores: 2, gpus: [], devices: {target: cpu, draft: cpu}}
      source: {config: configs/world_qwen2_5_vl_scaled.yaml, sha: 1c9e..., sets: []}
      report: runs/tune/tune.txt

- `--method auto` (./torchrun.sh run, vpsd.LLM, vpsd serve) runs `auto_choice(cfg, batch)`: the choice at the batch
  asked (--batch N), or the winner's when none is asked; a batch the config was not tuned at is refused.
- A config whose block no longer fits (other weights or another pair: the identity's models, their weights hashed
  as a resumed job's are, launch/job_identity.py; another CPU, core count, GPUs or model devices) is refused at
  launch, whatever the method, naming what differs (`tuned_problems`); `--set tuned=null` runs it anyway.
Light on purpose: every rank and the Python API read it before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpsd.config import ConfigError, RunConfig
from vpsd.launch.job_identity import differences, identity

AUTO = "auto"
# The settings a choice sets, as --set keys; the ones a job takes as options are passed as those options.
OPTION_KEYS = {"pruning.strategy": "pruning", "pruning.ratio": "ratio", "decoding.gamma": "gamma",
               "batching.size": "batch"}


@dataclass(frozen=True)
class Choice:
    """What `--method auto` runs: a method and the settings it was confirmed with."""

    method: str
    batch: int
    settings: dict[str, Any] = field(default_factory=dict)  # dotted keys: OPTION_KEYS, draft_on, batching.pipelined

    def option(self, name: str) -> Any:
        """The value of a job option (pruning, ratio, gamma, batch) this choice sets, or None."""
        keys = {v: k for k, v in OPTION_KEYS.items()}
        return self.batch if name == "batch" else self.settings.get(keys[name])

    def sets(self) -> list[str]:
        """The choice's other settings as --set KEY=VALUE arguments."""
        return [f"{k}={_yaml_value(v)}" for k, v in self.settings.items() if k not in OPTION_KEYS]

    def describe(self) -> str:
        s = self.settings
        parts = [f"pruning {s['pruning.strategy']}" + (f" {s['pruning.ratio']:g}" if s.get("pruning.ratio") else "")
                 ] if "pruning.strategy" in s else []
        parts += [f"gamma {s['decoding.gamma']}"] if "decoding.gamma" in s else []
        parts += [f"batch {self.batch}"] + [f"{k} {v}" for k, v in s.items() if k not in OPTION_KEYS]
        return f"{self.method} ({', '.join(parts)})"


def _yaml_value(v: Any) -> str:
    return "true" if v is True else "false" if v is False else str(v)


def machine() -> dict[str, Any]:
    """What a tuned choice depends on outside the config: the CPU, its cores and the GPUs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "gpus": _gpus()}


def _gpus() -> list[str]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def tuned_on(cfg: RunConfig) -> dict[str, Any]:
    """The `pair` and `machine` entries of a block for `cfg` here, now (what `tuned_problems` compares)."""
    ident = identity(cfg)
    pair = {"family": ident["family"], "target": ident["target"], "draft": ident["draft"]}
    for spec in (pair["target"], pair["draft"]):
        if spec is not None and spec.get("weights"):
            spec.pop("path", None)  # the weights' hash says what they are, wherever the checkout lies
    devices = {"target": cfg.target.device, "draft": cfg.draft.device if cfg.draft is not None else cfg.target.device}
    return {"pair": pair, "machine": {**machine(), "devices": devices}}


def tuned_problems(cfg: RunConfig) -> list[str]:
    """One line when `cfg` carries a tuned: block that no longer fits its pair or this machine, naming what differs."""
    block = cfg.tuned
    if not block:
        return []
    now = tuned_on(cfg)
    diff = differences({"pair": block.get("pair"), "machine": block.get("machine")}, now)
    if not diff:
        return []
    return [f"this config was tuned on another pair or machine ({'; '.join(diff)}): its choice would not hold here. "
            "Tune it again (vpsd tune --config C --manifest M --out tuned.yaml) or run without it (--set tuned=null)"]


def auto_choice(cfg: RunConfig, batch: int | None = None, config_name: str = "the config") -> Choice:
    """The choice `--method auto` runs under `cfg` at --batch `batch` (None: the winner's); ConfigError when `cfg`
    holds no tuned: block or none for that batch. `tuned_problems` is the launch's check, made by run_config."""
    block = cfg.tuned
    if not block:
        raise ConfigError([f"--method auto: {config_name} has no tuned: block; tune it first (vpsd tune --config C "
                           "--manifest M --out tuned.yaml), or let ./torchrun.sh run --method auto tune on the "
                           "job's first items"])
    choices = {int(c["batch"]): c for c in block.get("choices") or []}
    if batch is None or batch == block.get("batch"):
        return Choice(block["method"], int(block["batch"]), dict(block.get("settings") or {}))
    if batch not in choices:
        raise ConfigError([f"--method auto --batch {batch}: {config_name} was tuned at batch "
                           f"{', '.join(map(str, sorted(choices))) or block.get('batch')} only; tune at {batch} "
                           f"(vpsd tune --batch {batch} ...) or give a batch it was tuned at"])
    c = choices[batch]
    return Choice(c["method"], batch, dict(c.get("settings") or {}))


def source_stamp(config: str | Path, sets: list[str]) -> dict[str, Any]:
    """What a tuned config was made from: the user's config file (its text hashed) and the --set overrides."""
    text = Path(config).read_bytes()
    return {"config": str(config), "sha": hashlib.sha256(text + json.dumps(sets).encode()).hexdigest()[:16],
            "sets": list(sets)}


def write_tuned(source: str | Path, out: str | Path, sets: list[str], winner: Choice, choices: list[dict[str, Any]],
                cfg: RunConfig, extra: dict[str, Any]) -> Path:
    """The user's config `source` with its --set overrides and the winner's settings applied, and the tuned: block
    (module docstring) for `cfg` (the user's settings, as tuned): written to `out`, its checkpoint paths made
    relative to where it lies."""
    import yaml

    from vpsd.config import parse_overrides

    source, out = Path(source), Path(out)
    data = yaml.safe_load(source.read_text()) or {}
    data.pop("tuned", None)
    for key, value in {**parse_overrides(list(sets)), **winner.settings}.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    for role in ("target", "draft"):
        spec = data.get(role)
        if isinstance(spec, dict) and spec.get("path") and not Path(spec["path"]).is_absolute():
            real = (source.resolve().parent / spec["path"]).resolve()
            spec["path"] = os.path.relpath(real, out.resolve().parent)
    data["tuned"] = {"method": winner.method, "batch": winner.batch, "settings": dict(winner.settings),
                     "choices": choices, **tuned_on(cfg), "source": source_stamp(source, sets), **extra}
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Written by vpsd tune from {source}: the winner's settings set and, in tuned:, what it was tuned on\n"
              "# (run it with --method auto; vpsd/launch/tuned.py).\n")
    out.write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
    return out

"""What a run directory's results were made with, so that a rerun resumes only the same job.

A rerun into the same --out skips every id already in results.jsonl (launch/results.py). Rerun with other
weights, another pruning strategy or another gamma, that would silently mix two jobs in one results file:
some items decoded one way, the rest the other, and a summary over both. So every run records, per method,
the settings that decide its outputs and statistics (`identity`) in DIR/job.json, and a rerun whose settings
differ stops at launch, before any rank loads a model, saying which settings differ.

Not part of the identity: where and how fast the job runs (the model's device, captured steps and tensor parallelism, cpu affinity, roles,
timeouts, how many items are in flight: `batching`, whose items decode exactly as at batch 1), how it is
driven (--shard, --quiet, --retry-failed), how videos are read (`video.readers`, `read_ahead`,
`frames_budget_mib`, `share_frames`: the same frames either way), and how over-long items are admitted
(`video.context_limit`, `video.subsample_to_fit`: an item that fits decodes the same either way, and
retrying the items that did not fit with subsampling on is how such failures are meant to be rerun).
A setting vpsd gained after a directory was recorded (absent from its job.json) counts as its default there,
so upgrading vpsd mid-job resumes the job unless the new setting is used. Weights replaced in place under the
same path count too: a checkpoint directory's identity includes a hash
of each weight file's name, size and three 1 MiB samples (start, middle, end). Retrained or fine-tuned
weights differ throughout, and reading 3 MiB a shard costs milliseconds where hashing a real checkpoint
whole would take minutes on every launch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vpsd.config import DecodingConfig, PruningConfig, RunConfig, VideoConfig
from vpsd.pipeline.ensemble import TabedConfig
from vpsd.launch.results import ResultsFile

JOB_FILE = "job.json"
SECTIONS = ("family", "target", "draft", "video", "decoding", "pruning", "tabed")
NOT_IDENTITY = ("target.device", "draft.device", "target.capture", "draft.capture", "target.capture_len",
                "draft.capture_len", "target.tensor_parallel", "draft.tensor_parallel", "video.context_limit",
                "video.subsample_to_fit", "video.readers", "video.read_ahead", "video.frames_budget_mib",
                "video.share_frames")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
SAMPLE = 1 << 20  # bytes read at each of a weight file's start, middle and end


class JobMismatch(ValueError):
    """A rerun's settings differ from those the directory's results were made with."""


def identity(cfg: RunConfig) -> dict[str, Any]:
    data = cfg.to_dict()
    out = {k: data[k] for k in SECTIONS}
    for dotted in NOT_IDENTITY:
        section, key = dotted.split(".")
        if out[section] is not None:
            out[section].pop(key, None)
    for model in ("target", "draft"):
        if out[model] is not None and out[model].get("path"):
            out[model]["weights"] = weights_fingerprint(Path(out[model]["path"]))
    return json.loads(json.dumps(out, default=str))  # the form it has once read back from job.json


def weights_fingerprint(path: Path) -> str | None:
    """Sampled hash of a checkpoint directory's weight files (see the module docstring); None if it has none."""
    files = sorted({f for pattern in WEIGHT_FILES for f in path.glob(pattern)}) if path.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for offset in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
                fh.seek(offset)
                digest.update(fh.read(SAMPLE))
    return digest.hexdigest()[:16]


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """'key.path: old -> new' for every leaf that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def check_resume(out: Path, method: str, cfg: RunConfig) -> None:
    """Raise JobMismatch if `out` holds results of `method` made with other settings than `cfg`'s."""
    recorded = _read(out).get(method)
    if recorded is None or not ResultsFile(out).finished(method):
        return  # nothing of this method's to mix with
    diff = differences(_with_later_defaults(recorded), identity(cfg))
    if diff:
        raise JobMismatch(
            f"{out} holds {method} results made with other settings ({'; '.join(diff)}); resuming would mix "
            f"the two jobs. Use another --out, or remove {Path(out) / 'results.jsonl'} to start over."
        )


def _with_later_defaults(recorded: dict[str, Any]) -> dict[str, Any]:
    """`recorded` with each section setting it lacks (added to vpsd since) set to that setting's default."""
    out = json.loads(json.dumps(recorded))
    skipped = {tuple(d.split(".")) for d in NOT_IDENTITY}
    # tabed: recorded as written (a partial section) before it was typed; its missing keys are its defaults.
    for section, cls in (("video", VideoConfig), ("decoding", DecodingConfig), ("pruning", PruningConfig),
                         ("tabed", TabedConfig)):
        if isinstance(out.get(section), dict):
            defaults = json.loads(json.dumps(dataclasses.asdict(cls()), default=str))
            for key, value in defaults.items():
                if (section, key) not in skipped:
                    out[section].setdefault(key, value)
    return out


def record(out: Path, method: str, cfg: RunConfig) -> None:
    """Note `cfg`'s identity for `method` in out/job.json (other methods' entries kept)."""
    jobs = _read(out)
    jobs[method] = identity(cfg)
    path = Path(out) / JOB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jobs, indent=1))
    os.replace(tmp, path)  # a crash leaves the old file or the new one


def _read(out: Path) -> dict[str, Any]:
    path = Path(out) / JOB_FILE
    return json.loads(path.read_text()) if path.exists() else {}

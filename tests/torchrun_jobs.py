"""Launching real vpsd jobs through torchrun from tests, reading what they wrote, and the `ar` reference they are
held to, decoded in the test's own process (a job less to launch)."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_pair
from vpsd.config import DecodingConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.launch.manifest import load_manifest
from vpsd.video.item import load_item_frames

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def world_manifest(root: str, count: int = 2) -> Path:
    """A small manifest of procedural world videos (written once per session)."""
    from vpsd.world.dataset import write_manifest

    out = Path(root) / f"world{count}"
    if not (out / "manifest.jsonl").exists():
        write_manifest(out, seeds=list(range(count)), num_frames=8, size=(112, 112), max_new_tokens=24)
    return out / "manifest.jsonl"


def job_env() -> dict[str, str]:
    """The environment of a job a test launches: its ranks, like the suite (pyproject's filterwarnings), take a
    DeprecationWarning or FutureWarning for an error, so a deprecated call made only inside a role fails a test."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "error::DeprecationWarning,error::FutureWarning"}


def torchrun_cmd(nproc: int, *, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *(extra or ["--standalone"]), "--nproc-per-node", str(nproc)]


def job_args(config: str, manifest: Path, out: Path, method: str, *more: str) -> list[str]:
    return ["-m", "vpsd.launch.entry", "--config", str(ROOT / "configs" / config), "--manifest", str(manifest),
            "--out", str(out), "--method", method, *more]


def run_job(config: str, manifest: Path, out: Path, method: str, *more: str, nproc: int = 3, timeout: float = 180):
    env = job_env()
    return subprocess.run(torchrun_cmd(nproc) + job_args(config, manifest, out, method, *more),
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def launcher_cmd(config: str, manifest: Path, out: Path, method: str, *more: str,
                 torchrun_opts: tuple[str, ...] = ()) -> list[str]:
    """The job through ./torchrun.sh, the users' launcher (3 standalone ranks unless told otherwise)."""
    return [str(ROOT / "torchrun.sh"), *torchrun_opts, "run", *job_args(config, manifest, out, method, *more)[2:]]


def run_launcher(config: str, manifest: Path, out: Path, method: str, *more: str, timeout: float = 180,
                 cwd: Path = ROOT, env_extra: dict[str, str] | None = None):
    """./torchrun.sh from `cwd`: relative paths are the caller's, as for a user in their own directory."""
    env = {**job_env(), **(env_extra or {})}
    return subprocess.run(launcher_cmd(config, manifest, out, method, *more), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def results(out: Path) -> dict[str, dict]:
    path = Path(out) / "results.jsonl"
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ar_reference(family: str, manifest) -> dict[str, list[int]]:
    """Plain autoregressive decoding of the target, in this process, on the same frames."""
    cfg = load_config(ROOT / "configs" / f"tiny_{family}.yaml")
    target, _ = tiny_pair(family)
    items, _ = load_manifest(manifest)
    out = {}
    for it in items:
        frames, times = load_item_frames(it.video, cfg.video.num_frames, None, cfg.video.max_side)
        dec = DecodingConfig(gamma=cfg.decoding.gamma, max_new_tokens=it.max_new_tokens, temperature=0.0)
        out[it.id] = decode_ar(target, frames, it.prompt, dec, times).token_ids
    return out

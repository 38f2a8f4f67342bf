"""Shared fixtures: tiny models of every family, built offline from configs/tiny_*.yaml."""

from __future__ import annotations

import functools
import os
import secrets
from pathlib import Path

import numpy as np
import pytest
import torch

from vpsd.config import load_config
from vpsd.models.registry import load_adapter, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "llava_onevision"]

torch.set_num_threads(1)
# The control plane's keys come from it (vpsd/transport/auth.py); jobs the tests launch inherit it.
os.environ.setdefault("VPSD_JOB_SECRET", secrets.token_hex(16))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true",
                     help="also run the `slow` cases: further combinations of torchrun checks the suite makes once")


# The files whose cases take longest (their waits for start-up bounds and timeouts included), longest first, as
# measured by a per-test meter over `scripts/test.sh` (2026-11-28): run first, so that the workers of `-n auto
# --dist loadfile` end together (longest first is the classic schedule for that) instead of one finishing a long
# file alone at the end while the other waits; the rest keep their order.
LONGEST_FIRST = ["test_batch_torchrun.py", "test_gpu_check.py", "test_startup_torchrun.py", "test_api.py",
                 "test_job_safety_torchrun.py", "test_pipeline_torchrun.py", "test_batch_decode.py",
                 "test_scale_out_torchrun.py", "test_batch_workers.py", "test_stuck_torchrun.py",
                 "test_tensor_parallel_torchrun.py", "test_captured.py", "test_sharded_load.py",
                 "test_world_long_torchrun.py", "test_lossless_sd.py", "test_lossless_margin.py", "test_world_long.py",
                 "test_batch_trees_and_sparse_kv.py", "test_verification.py", "test_prune_stream_torchrun.py",
                 "test_bench_pruning.py", "test_world_long_pair.py", "test_state_machine.py",
                 "test_transport_torchrun.py", "test_launch_settings.py", "test_grow.py", "test_distill_long.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's cases keep their order
    # CI runs the suite in well under 15 minutes by launching each torchrun scenario once; the extra combinations
    # (another phase of the same stuck-peer check, the same fault at batch 1 and batched...) run with --slow.
    if config.getoption("--slow") or os.environ.get("VPSD_SLOW") == "1":
        return
    # A case named on the command line (path::name[params]) runs, slow or not: naming it is asking for it.
    named = {f"{os.path.relpath(os.path.abspath(path), config.rootpath)}::{case}"
             for path, sep, case in (arg.partition("::") for arg in config.args) if sep}
    skip = pytest.mark.skip(reason="a further combination of a case run once already (./scripts/test.sh --slow)")
    for item in items:
        if "slow" in item.keywords and item.nodeid not in named:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _scheduling_unchanged():
    """Every case leaves its worker's scheduling as it found it: a thread made real-time (SVT-AV1's encoder does
    that to its caller when run as root: tests/video/corpus.py scheduling_kept) hands the policy to every job and
    server the worker starts later, and a busy one then starves the machine. The case that did it fails, named."""
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    yield
    after = os.sched_getscheduler(0), os.sched_getparam(0)
    if after != before:
        os.sched_setscheduler(0, *before)  # the rest of the worker's cases run as they should
        pytest.fail(f"this case left its thread's scheduling policy {after[0]} (priority {after[1].sched_priority}),"
                    f" not {before[0]}: whatever changed it must put it back", pytrace=False)


def config_path(family: str) -> Path:
    return ROOT / "configs" / f"tiny_{family}.yaml"


@functools.lru_cache(maxsize=None)
def tiny_pair(family: str):
    """(target adapter, draft adapter) of the family's tiny config, cached for the session."""
    cfg = load_config(config_path(family))
    tok = tiny_tokenizer()
    target = load_adapter(family, cfg.target, tok)
    draft = load_adapter(family, cfg.draft, tok) if cfg.draft is not None else target
    return target, draft


def random_frames(seed: int, t: int = 4, h: int = 56, w: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param

"""A rank pinned to cores runs one intra-op thread a core, whatever torchrun's environment says: a lone rank
(torchrun leaves OMP_NUM_THREADS unset for one rank a node, so torch takes one thread a core of the machine) pinned
to one core ran two OpenMP threads on it, each spinning at the other's barriers, its multi-row forwards 40% slower.
The role's trace says what it runs on (`role_started`: cpus, threads)."""

from __future__ import annotations

import json
import os

import pytest

from tests.torchrun_jobs import results, run_job, world_manifest

pytestmark = pytest.mark.torchrun


def _started(out) -> dict:
    with (out / "traces" / "rank0_target.jsonl").open() as lines:
        return next(e for e in map(json.loads, lines) if e["event"] == "role_started")


def test_a_lone_rank_pinned_to_one_core_runs_one_thread_there(tmp_path):
    core = min(os.sched_getaffinity(0))
    out = tmp_path / "out"
    proc = run_job("tiny_qwen2_5_vl.yaml", world_manifest(str(tmp_path), 1), out, "ar", "--quiet",
                   "--set", f"cpu_affinity={{target: [{core}]}}", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(results(out)) == 1
    started = _started(out)
    assert (started["cpus"], started["threads"]) == ([core], 1)

"""The GPU check's dry run: every stage of scripts/gpu_check.sh, its commands on the CPU with small inputs, so the
command a session runs the moment it is lent a GPU cannot rot between such sessions."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_stage_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"))
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    steps = (tmp_path / "out" / "steps.txt").read_text().split("\n")
    failed = [s.split()[0] for s in steps if s and " rc=0 " not in s]
    logs = "".join(f"\n--- {name}.log\n" + (tmp_path / "out" / f"{name}.log").read_text()[-3000:] for name in failed
                   if (tmp_path / "out" / f"{name}.log").exists())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-1000:] + logs
    assert [s.split()[:2] for s in steps if s] == [
        ["env", "rc=0"], ["cuda_tests", "rc=0"], ["profile", "rc=0"], ["step_cost", "rc=0"], ["b8", "rc=0"]]
    # The benches checked every output against batch-1 `ar`'s and wrote their tables where the tool fetches them.
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"b8.json", "env.log", "profile.json", "step_cost.json"}

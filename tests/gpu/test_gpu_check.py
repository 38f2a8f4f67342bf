"""The GPU check's dry run: every stage of scripts/gpu_check.sh, its commands on the CPU with small inputs, so the
command a session runs the moment it is lent a GPU cannot rot between such sessions."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("run", ["1", pytest.param("all", marks=pytest.mark.slow)])
def test_the_gpu_check_runs_every_stage_on_cpu(tmp_path, run):
    """CI: run 1's stages (what the first call on a GPU brings back); --slow: run 2's bench too."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"))
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--run", run], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    steps = (tmp_path / "out" / "steps.txt").read_text().split("\n")
    failed = [s.split()[0] for s in steps if s and " rc=0 " not in s]
    logs = "".join(f"\n--- {name}.log\n" + (tmp_path / "out" / f"{name}.log").read_text()[-3000:] for name in failed
                   if (tmp_path / "out" / f"{name}.log").exists())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-1000:] + logs
    expected = [["env", "rc=0"], ["cuda_tests", "rc=0"], ["profile", "rc=0"], ["step_cost", "rc=0"]]
    assert [s.split()[:2] for s in steps if s] == expected + ([["b8", "rc=0"]] if run == "all" else [])
    # The benches checked every output against batch-1 `ar`'s and wrote their tables where the tool fetches them.
    wrote = {"env.log", "profile.json", "step_cost.json", "goals.txt"} | ({"b8.json"} if run == "all" else set())
    assert {p.name for p in (tmp_path / "out").iterdir()} >= wrote
    # Issue 52's goals judged from those files (vpsd/reports/gpu_goals.py): here the CPU's c, the benches not run.
    goals = (tmp_path / "out" / "goals.txt").read_text()
    assert "c = T_p / T_q, captured" in goals and "not run" in goals and "Traceback" not in goals
    c_line = next(line for line in goals.splitlines() if line.startswith("c = T_p"))
    assert c_line.split("captured", 1)[1].split()[0] != "-", c_line  # measured

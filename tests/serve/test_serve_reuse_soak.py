"""`vpsd bench reuse-soak` end to end at its smallest (vpsd/bench/reuse_soak.py; its report's arithmetic is
tests/unit/test_bench_reuse_soak.py's): a real server, 24 requests over 10 videos (the 8 of examples/world and 2
written from the short world, all distinct) at a 1 MiB budget: every request answered, the cache evicted and its
peak stayed within its budget, RSS sampled through the load, a verdict line printed. Nothing is judged on the
numbers: a load this short measures nothing."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from tests.torchrun_jobs import ROOT, job_env


def test_a_tiny_soak_answers_every_request_evicts_within_its_budget_and_reports(tmp_path):
    out = tmp_path / "soak"
    run = subprocess.run([sys.executable, "-m", "vpsd.bench", "reuse-soak", "--config",
                          str(ROOT / "configs" / "world_qwen2_5_vl.yaml"), "--manifest",
                          str(ROOT / "examples" / "world" / "manifest.jsonl"), "--requests", "24", "--videos", "10",
                          "--budget-mib", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=job_env(), cwd=tmp_path)
    assert run.returncode in (0, 1), run.stdout + run.stderr  # 1: not flat; a load this short is noise
    videos = sorted((out / "videos").iterdir())
    assert len(videos) == 10 and len({hashlib.sha256(v.read_bytes()).digest() for v in videos}) == 10
    report = json.loads((out / "soak.json").read_text())
    assert (report["answered"], report["errors"]) == (24, {})
    reuse = report["reuse"]
    assert reuse["vpsd_prefix_reuse_evictions_total"] > 0 and reuse["vpsd_prefix_reuse_misses_total"] >= 10
    assert 0 < reuse["vpsd_prefix_reuse_peak_bytes"] <= reuse["vpsd_prefix_reuse_budget_bytes"] == 2**20
    assert report["within_budget"] is True
    assert len(report["samples"]) >= 3 and report["summary"]["rss_at_100"] > 0
    assert report["samples"][-1]["done"] == 24
    assert "answered 24, failed 0" in run.stdout and "verdict: " in run.stdout

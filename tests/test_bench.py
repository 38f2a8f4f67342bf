"""The method benchmark end to end on the tiny pair: real torchrun runs, a table, CSV/JSON and a chart."""

import csv
import json

from tests.torchrun_jobs import ROOT, world_manifest
from vpsd.reports.bench import BenchRun, default_runs, main


def test_default_runs_cover_every_method_then_every_other_strategy():
    runs = default_runs("hippo", methods=["ar", "sd", "hippo"], strategies=["hippo", "random", "none"])
    assert runs == [BenchRun("ar", "ar"), BenchRun("sd", "sd"), BenchRun("hippo", "hippo"),
                    BenchRun("hippo+random", "hippo", "random"), BenchRun("hippo+none", "hippo", "none")]


def test_bench_runs_ar_and_a_parallel_baseline_losslessly(tmp_path):
    manifest = world_manifest(str(tmp_path), 2)
    out = tmp_path / "bench"
    # A row left by an earlier bench (other weights, say): a job resuming in that directory would skip the
    # item, and the table would mix that run's output and timing into this one's.
    first = json.loads(manifest.read_text().splitlines()[0])["id"]
    (out / "ar").mkdir(parents=True)
    stale = {"id": first, "method": "ar", "token_ids": [1, 2, 3], "text": "stale", "stats": {}, "wall_s": 99.0}
    (out / "ar" / "results.jsonl").write_text(json.dumps(stale) + "\n")
    code = main(["--config", str(ROOT / "configs" / "tiny_qwen2_5_vl.yaml"), "--manifest", str(manifest),
                 "--out", str(out), "--methods", "ar", "--strategies", "random"])
    assert code == 0
    rows = list(csv.DictReader(open(out / "bench.csv")))
    assert [r["label"] for r in rows] == ["ar", "hippo+random"]
    data = json.loads((out / "bench.json").read_text())
    parallel = data["rows"][1]
    assert parallel["identical"] == parallel["items"] == 2
    assert parallel["t_target_ms"] > 0 and parallel["t_draft_ms"] > 0  # measured from the run's traces
    assert parallel["theory_speedup"] is not None
    assert (out / "bench.png").stat().st_size > 0
    assert "stale" not in (out / "ar" / "results.jsonl").read_text()

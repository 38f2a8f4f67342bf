"""Smoke test of `vpsd bench pruning` on 2 tiny items: every strategy, one run, lossless, hand-checked MAT."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

from tests.torchrun_jobs import ROOT
from vpsd.reports.bias import bias_report
from vpsd.reports.kept_log import read_kept
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.world.dataset import write_manifest


def test_every_strategy_on_the_same_items(tmp_path):
    manifest = write_manifest(tmp_path / "data", seeds=[0, 1], num_frames=8, size=(112, 112), max_new_tokens=24)
    out = tmp_path / "bench"
    # draft=self: with strategy none the draft IS the target, so every draft token is accepted.
    cmd = [sys.executable, "-m", "vpsd.bench", "pruning",
           "--config", str(ROOT / "configs" / "tiny_qwen2_5_vl.yaml"), "--manifest", str(manifest), "--out", str(out), "--max-new-tokens", "8", "--repeats", "1",
           "--set", "draft=self", "--set", "decoding.gamma=4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in STRATEGIES:
        assert f"\n{name:<14} " in proc.stdout

    saved = json.loads((out / "bench_pruning.json").read_text())
    rows = {r["strategy"]: r for r in saved["rows"]}
    assert list(rows) == list(STRATEGIES) and saved["items"] == ["world-000000", "world-000001"]
    budget = round(0.1 * saved["video_tokens_per_item"][0])
    for name, r in rows.items():
        assert r["lossless"] and r["items"] == 2 and len(r["per_item_prune_ms"]) == 2
        assert r["prune_ms_per_10k"] > 0 and 1.0 <= r["mean_accepted_tokens"] <= 5.0
        assert r["mean_kept"] == (saved["video_tokens_per_item"][0] if name == "none" else budget)
    # 8 tokens, gamma 4, all accepted: round 1 drafts 4 and commits 5 (1 + 5 = 6 tokens), round 2 drafts
    # min(4, 8 - 6 - 1) = 1 and commits 2; per item 2 rounds and 5 accepted -> MAT (5 + 2) / 2.
    assert rows["none"]["acceptance_rate"] == 1.0 and rows["none"]["mean_accepted_tokens"] == 3.5

    with (out / "bench_pruning.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [r["strategy"] for r in table] == list(STRATEGIES)
    assert float(table[0]["prune_ms_per_10k"]) == rows[table[0]["strategy"]]["prune_ms_per_10k"]

    kept = read_kept(out)  # same items for every strategy, ready for `vpsd bias`
    assert len(kept) == 2 * len(STRATEGIES)
    assert set(bias_report(kept)) == set(STRATEGIES)

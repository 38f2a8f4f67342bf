"""`vpsd bias` on a real torchrun run: kept.jsonl holds the kept sets the strategy picks (written by the
pruner rank in a parallel run, by the target rank in a serial one), and the report's numbers are their
boundary shares."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import tiny_pair
from tests.torchrun_jobs import ROOT, results, run_job, world_manifest
from vpsd.config import PruningConfig, load_config
from vpsd.engine.keep import keep_policy_for
from vpsd.reports.kept_log import read_kept
from vpsd.launch.manifest import load_manifest
from vpsd.engine.pair_prefill import prefill_for_strategy
from vpsd.pipeline.pruning.position_bias import boundary_share
from vpsd.video.item import load_item_frames

pytestmark = pytest.mark.torchrun


# --slow only: the report's arithmetic is test_bias_report's, in process, and a run's kept log is read in CI by
# test_pipeline_torchrun (a parallel run's).
@pytest.mark.slow
@pytest.mark.parametrize("method", ["specvlm"])
def test_bias_report_of_an_attention_only_run(tmp_path_factory, method):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp(f"bias-run-{method}")
    proc = run_job("tiny_qwen2_5_vl.yaml", manifest, out, method, "--pruning", "attn", "--set", "pruning.layers=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r.item_id: r for r in read_kept(out)}
    assert set(records) == set(results(out))

    # The logged kept sets are what the serial keep policy picks from the same target signals.
    cfg = load_config(ROOT / "configs" / "tiny_qwen2_5_vl.yaml")
    target, _ = tiny_pair("qwen2_5_vl")
    pruning = PruningConfig("attn", 0.9, layers=2)
    policy = keep_policy_for(pruning)
    items, _ = load_manifest(manifest)
    for it in items:
        frames, times = load_item_frames(it.video, cfg.video.num_frames, None, cfg.video.max_side)
        emb = target.embed(target.prepare(frames, it.prompt, times))
        keep = policy(emb, prefill_for_strategy(target, emb, pruning), emb)
        rec = records[it.id]
        assert torch.equal(rec.kept, keep) and rec.strategy == "attn" and rec.ratio == 0.9
        assert torch.equal(rec.layout.row, emb.layout.row) and rec.layout.grid == emb.layout.grid

    fig = out / "fig.png"
    shown = subprocess.run([sys.executable, "-m", "vpsd.launch.cli", "bias", str(out), "--out", str(fig)],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "strategy attn: 2 items" in shown.stdout
    report = json.loads((out / "bias.json").read_text())["attn"]
    per_item = torch.stack([boundary_share(r.kept, r.layout) for r in records.values()])
    want = [None if torch.isnan(col).all() else float(col[~torch.isnan(col)].mean()) for col in per_item.T]
    assert report["share"] == pytest.approx(want)
    assert fig.read_bytes()[:4] == b"\x89PNG"

"""`vpsd tune` end to end on the tiny pair, a grid of two (ar and sd): measured, predicted, confirmed as real jobs
interleaved with ar; the config it writes runs through ./torchrun.sh with --method auto, its choice said and its
outputs `ar`'s; the same config on another pair is refused at launch, naming what differs."""

from __future__ import annotations

import json

import pytest

from tests.torchrun_jobs import ROOT, results, run_launcher, world_manifest
from vpsd.bench.tune import main
from vpsd.config import load_config
from vpsd.launch.entry import command_line

pytestmark = pytest.mark.torchrun
TINY = str(ROOT / "configs" / "tiny_qwen2_5_vl.yaml")


def test_tune_writes_a_config_whose_choice_runs_losslessly_with_method_auto(tmp_path, capsys):
    manifest = world_manifest(str(tmp_path), 2)
    out = tmp_path / "tuned.yaml"
    # draft=self: the draft agrees with the target, so sd's rounds commit more than one token each
    code = main(["--config", TINY, "--manifest", str(manifest), "--out", str(out), "--items", "2", "--methods", "sd",
                 "--gammas", "3", "--confirm", "1", "--set", "draft=self", "--forward-repeats", "1"])
    assert code == 0
    report = json.loads((tmp_path / "tuned.tune" / "tune.json").read_text())
    confirmed = {r["label"]: r for r in report["confirmed"]}
    assert set(confirmed) == {"ar B=1", "sd g=3 B=1"}
    assert all(r["identical"] == r["items"] == 2 for r in confirmed.values())  # every output ar's
    assert len(confirmed["ar B=1"]["runs"]) == 2  # ar opened and closed the confirmation
    sd = next(p for p in report["predictions"] if p["label"] == "sd g=3 B=1")
    assert sd["mat"] > 1.5 and sd["items_per_hour"] > 0  # the replayed rounds of a draft that agrees
    block = load_config(out).tuned
    best = max(confirmed.values(), key=lambda r: r["items_per_hour"])  # the same rows, the best measured
    assert block["method"] == best["candidate"]["method"] and block["choices"][0]["x_ar"] == round(best["x_ar"], 3)

    job = tmp_path / "job"
    done = run_launcher(str(out), manifest, job, "auto", "--quiet", env_extra={"NPROC": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"--method auto: {block['method']} (" in done.stderr
    ar = {r["id"]: r["token_ids"] for r in results(tmp_path / "tuned.tune" / "jobs" / "ar_B1_r1").values()}
    assert {i: r["token_ids"] for i, r in results(job).items()} == ar
    assert {r["method"] for r in results(job).values()} == {block["method"]}

    # what every rank of such a launch checks first (vpsd/launch/entry.py), here in this process
    refused = command_line(["--config", str(out), "--manifest", str(manifest), "--out", str(tmp_path / "other"),
                            "--method", "auto", "--set", "target.tiny.seed=7"])
    assert refused == 2
    assert "tuned on another pair or machine (pair.target.tiny.seed: 0 -> 7)" in capsys.readouterr().err

"""`std` and `tabed` through real torchrun: greedy output identical to `ar`, sampling completes."""

from __future__ import annotations

import json

import pytest

from tests.torchrun_jobs import ar_reference
from tests.torchrun_jobs import results, run_job, world_manifest

pytestmark = pytest.mark.torchrun

CASES = [
    ("qwen2_5_vl", "std", []),
    ("qwen2_5_vl", "tabed", []),  # KL, grid policy, three views; greedy: p one-hot, nothing shipped
    ("llava_onevision", "tabed", ["--set", "tabed.distance=match", "--set", "tabed.policy=softmax",
                                  "--set", "tabed.views=[multimodal,text]"]),
    # Over a pipelined batch: each item drafts from its own views beside the other rows (roles/draft.py).
    ("qwen2_5_vl", "tabed", ["--batch", "2", "--set", "batching.pipelined=true"]),
]


@pytest.mark.parametrize("family,method,extra", [
    # With --slow only: TABED one item at a time, with its default settings and with the others (the distances and
    # policies are test_ensemble's, in process), and over a pipelined batch (its draft worker drafts each item from
    # its own views beside the other rows over the real protocol in process: test_batch_workers), and std: a
    # one-rank job drafting in the target's process, the job's engine that vpsd.LLM runs it through in CI (test_api,
    # B = 2; test_std and test_batch_trees_and_sparse_kv hold it to ar in process).
    pytest.param(f, m, e, id=f"{f}-{m}" + ("-batch" if "--batch" in e else ""), marks=pytest.mark.slow)
    for f, m, e in CASES])
def test_greedy_output_equals_ar(tmp_path_factory, family, method, extra):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp(f"{family}-{method}")
    proc = run_job(f"tiny_{family}.yaml", manifest, out, method, *extra, nproc=1 if method == "std" else 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results(out)
    ref = ar_reference(family, manifest)
    assert set(got) == set(ref)
    for item_id, tokens in ref.items():
        assert got[item_id]["error"] is None
        assert got[item_id]["token_ids"] == tokens, f"{method} differs from ar on {item_id}"
        assert got[item_id]["stats"]["rounds"] >= 1
    if method == "tabed":
        events = [json.loads(line) for line in (out / "traces" / "rank1_draft.jsonl").read_text().splitlines()]
        weights = [e for e in events if e["event"] == "tabed_weights"]
        assert len(weights) == len(ref)
        for e in weights:
            assert all(abs(sum(w) - 1.0) < 1e-3 and len(w) == len(e["views"]) for w in e["blocks"])


@pytest.mark.slow  # CI: sampling on child ranks in test_api, TABED's law in process
def test_tabed_sampling_with_soft_labels_completes(tmp_path_factory):
    """temperature > 0 with KL: the target ships its p rows after every verdict."""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp("tabed-sampling")
    proc = run_job("tiny_qwen2_5_vl.yaml", manifest, out, "tabed", "--temperature", "0.8", "--set", "draft=self")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = results(out)
    assert len(rows) == 2
    for row in rows.values():
        assert row["error"] is None and 1 <= len(row["token_ids"]) <= 24

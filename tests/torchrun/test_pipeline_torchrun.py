"""The distributed pipeline through real torchrun on CPU (gloo): lossless against `ar`, faults, multi-node."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
import signal
import subprocess
import time

import pytest

from tests.torchrun_jobs import (ROOT, ar_reference, free_port, job_args, results, role_pids, run_job, torchrun_cmd,
                                 wait_for_results, world_manifest)
from vpsd.config import load_config
from vpsd.decoders.ar import decode_ar
from vpsd.models.registry import load_adapter
from vpsd.reports.kept_log import read_kept
from vpsd.reports.timeline import load_spans
from vpsd.pipeline.methods import get_method
from vpsd.video.item import load_item_frames

pytestmark = pytest.mark.torchrun


# (family, method, extra args): every method through the pipeline, every family, smaller drafts and
# self-speculation, streamed signals, fixed and auto gamma. Serial sd runs here once (in process it is checked for
# every family, draft kind and ratio by test_lossless_sd, and through torchrun again by test_acceptance). Which pruning strategy a parallel run uses does not
# touch its losslessness (the pruner only picks indices, checked against select.py's contract before they leave);
# every strategy's output is checked against ar in process by tests/engine/test_bench_pruning.py, and the pruning
# strategies run through torchrun in test_bias_torchrun, test_prune_stream_torchrun and test_bench.
CASES = [
    ("qwen2_5_vl", "ar", []),
    ("qwen2_5_vl", "sd", ["--pruning", "uniform", "--ratio", "0.5"]),
    # gamma auto: the target re-matches the window every round (pipeline/window.py) and the draft follows.
    ("qwen2_5_vl", "pearl", ["--gamma", "auto", "--set", "decoding.gamma_max=6"]),
    ("qwen3_vl", "pearl", ["--pruning", "uniform", "--ratio", "0.9", "--set", "draft=self"]),
    ("llava_onevision", "pearl", ["--pruning", "spatial", "--ratio", "0.5", "--set", "draft=self"]),
    # pruning.layers below the tiny target's 4 layers: the signals leave mid-prefill (streaming).
    ("qwen2_5_vl", "hippo", ["--set", "draft=self", "--set", "pruning.layers=2"]),
    ("qwen2_5_vl", "parallelvlm", []),
    ("qwen3_vl", "hippo", ["--pruning", "hippo_no_attn", "--ratio", "0.5"]),  # --slow: CI runs it on threads below
    ("llava_onevision", "specvlm", []),
    ("llava_onevision", "hippo", ["--pruning", "attn", "--set", "draft=self", "--set", "pruning.layers=1"]),
    # The draft and pruner roles on threads of the target's process (launch/in_process.py): a launch of one rank.
    ("qwen3_vl", "hippo", ["--set", "draft_on=thread", "--pruning", "hippo_no_attn", "--ratio", "0.5"]),
]


# With --slow only: ar (every torchrun test's reference runs it), pearl on the two other families (they run
# hippo through the same parallel path in CI), hippo and parallelvlm on the first (it runs pearl; UV-Prune's
# selection is checked in process by test_bench_pruning, batched by test_batch_workers), and the serial methods
# sd and specvlm: one-rank jobs drafting in the target's process, the job's engine that vpsd.LLM runs sd and
# sd-tree through in CI (test_api); sd and SpecVLM's tree are held to ar in process by test_lossless_sd and
# test_batch_trees_and_sparse_kv.
SLOW_CASES = {("qwen2_5_vl", "ar"), ("qwen3_vl", "pearl"), ("llava_onevision", "pearl"), ("qwen2_5_vl", "hippo"),
              ("qwen2_5_vl", "parallelvlm"), ("qwen2_5_vl", "sd"), ("llava_onevision", "specvlm")}
SLOW_EXTRA = {("qwen3_vl", "hippo", "--pruning")}  # qwen3's hippo on ranks: CI runs it with its roles on threads


@pytest.mark.parametrize("family,method,extra", [
    pytest.param(f, m, e, id=f"{f}-{m}-{'-'.join(e[1:2]).replace('=', '-') or 'default'}",
                 marks=[pytest.mark.slow] if (f, m) in SLOW_CASES or (f, m, e[0]) in SLOW_EXTRA else [])
    for f, m, e in CASES])
def test_greedy_output_equals_ar(tmp_path_factory, family, method, extra):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp(f"{family}-{method}")
    proc = run_job(f"tiny_{family}.yaml", manifest, out, method, *extra, nproc=1 if "draft_on=thread" in extra else 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results(out)
    ref = ar_reference(family, manifest)
    assert set(got) == set(ref)
    for item_id, tokens in ref.items():
        row = got[item_id]
        assert row["error"] is None
        assert row["token_ids"] == tokens, f"{method} differs from ar on {item_id}"
        stats = row["stats"]
        assert stats["rounds"] >= 1 and 0.0 <= stats["acceptance_rate"] <= 1.0
        if method != "ar" and stats["num_kept"] is None:  # gamma auto decoded it plain (TargetWorker.drafting_pays)
            assert "auto" in extra and item_id != next(iter(ref))  # the first item always drafts
        elif method != "ar":  # every path with a draft reports what it kept, and under which strategy
            assert 1 <= stats["num_kept"] <= stats["num_video_tokens"]
            assert row["strategy"] == json.loads((out / "config.json").read_text())["config"]["pruning"]["strategy"]
    drafted_items = {k: r for k, r in got.items() if r["stats"]["num_kept"] is not None}
    if get_method(method).parallel:  # the pruner logged the kept set the target reported
        kept = {r.item_id: r for r in read_kept(out)}
        assert {k: int(r.kept.numel()) for k, r in kept.items()} == {k: r["stats"]["num_kept"]
                                                                     for k, r in drafted_items.items()}
    traces = sorted(p.name for p in (out / "traces").iterdir())
    assert "rank0_target.jsonl" in traces
    if "auto" in extra:  # the window each round ran with is in the traces and, averaged, in the results
        verify = [s for s in load_spans(out) if s.name == "verify" and s.kind == "span" and s.fields["gamma"]]
        # (the roles' verify spans carry one entry per row in lists, a serial decoder's one number; a round
        # of a plain item has gamma 0)
        drafted = [d for s in verify for d in (s.fields["drafted"] if isinstance(s.fields["drafted"], list)
                                                else [s.fields["drafted"]])]
        assert verify and all(2 <= s.fields["gamma"] <= 6 for s in verify) and max(drafted) <= 6
        assert drafted_items and all(2 <= r["stats"]["gamma"] <= 6 for r in drafted_items.values())
    if method == "pearl":
        assert traces == ["rank0_target.jsonl", "rank1_draft.jsonl", "rank2_pruner.jsonl"]


def test_a_sampled_job_is_ar_own_sample(tmp_path_factory):
    """hippo through the three ranks at temperature 0.7, top-p 0.9, seed 5 (one item with a seed of its own): every
    output is `ar`'s sample at its seed, token for token (position-keyed sampling: the draft rank proposes with
    the target's noise, and what it drafted never changes what is committed)."""
    base = world_manifest(str(tmp_path_factory.getbasetemp()))
    lines = [json.loads(line) for line in base.read_text().splitlines()]
    lines[1]["seed"] = 9
    manifest = base.parent / "sampled.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path_factory.mktemp("sampling")
    proc = run_job("tiny_qwen2_5_vl.yaml", manifest, out, "hippo", "--temperature", "0.7", "--set",
                   "decoding.top_p=0.9", "--set", "decoding.seed=5", "--set", "draft=self")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ar = ar_reference("qwen2_5_vl", manifest, temperature=0.7, top_p=0.9, seed=5)
    rows = results(out)
    assert {k: r["token_ids"] for k, r in rows.items()} == ar
    assert len({tuple(t) for t in ar.values()}) == 2 and sum(r["stats"]["accepted_tokens"] for r in rows.values())


FAULT_TIMEOUT_S = 5


@pytest.mark.parametrize("role,fault", [pytest.param("draft", "kill", marks=pytest.mark.slow),  # CI: scale-out kills
                                        pytest.param("target", "hang", marks=pytest.mark.slow),  # CI: stuck in verify
                                        pytest.param("draft", "hang", marks=pytest.mark.slow),
                                        pytest.param("pruner", "hang", marks=pytest.mark.slow)])
def test_a_dead_or_hung_rank_ends_the_job_naming_it(tmp_path_factory, role, fault):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=6)
    out = tmp_path_factory.mktemp(f"fault-{role}-{fault}")
    cmd = torchrun_cmd(3) + job_args("tiny_qwen2_5_vl.yaml", manifest, out, "pearl", "--timeout", str(FAULT_TIMEOUT_S))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_results(proc, out, 1, 120)  # at least one item finished before the fault
        pid = role_pids(out)[role]
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = proc.communicate(timeout=90)
        ended_after = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
        if fault == "hang":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    rank = {"target": 0, "draft": 1, "pruner": 2}[role]
    if fault == "hang":
        # A surviving rank names the silent one, its rank and the item, and ends it (same host), so the job ends
        # within the timeout plus slack, not after torchrun's 30 s SIGTERM grace on a stopped process.
        named = re.search(rf"vpsd: \w+ \(rank \d\) .*({role} \(rank {rank}\)|rank {rank} \({role}\)).* on item world-",
                          stderr)
        assert named, stderr[-3000:]
        assert ended_after < FAULT_TIMEOUT_S + 15, ended_after  # loose (2 shared cores); was 30 s more before
    else:
        assert "another rank failed" in stderr or f"{role} (rank {rank})" in stderr
    done = results(out)
    assert done and all(r["error"] is None for r in done.values())  # finished results are kept


@pytest.mark.slow  # CI: test_scale_out_torchrun, two nodes of one rank (draft on threads) making a pipeline each
def test_two_node_launch_on_one_machine(tmp_path_factory):
    """Two torchrun agents (2 + 2 ranks), rendezvous on 127.0.0.1; the fourth rank is a spare."""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp("twonode")
    port = free_port()
    procs = []
    for node in (0, 1):
        rdzv = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "vpsd-test", "--max-restarts", "0"]
        procs.append(subprocess.Popen(torchrun_cmd(2, extra=rdzv) + job_args("tiny_qwen2_5_vl.yaml", manifest, out, "pearl"),
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert ar_reference("qwen2_5_vl", manifest) == {k: r["token_ids"] for k, r in results(out).items()}


def test_a_draft_on_another_video_grid_fails_each_item_clearly(tmp_path_factory):
    """A draft checkpoint whose vision settings differ from the target's (here: temporal patch 1, so twice the
    frames on its token grid) would index the wrong tokens with the target's kept indices: the draft checks its
    grid against the target's (sent with the kept indices), and the item fails with that error instead. The draft
    role on a thread of the target's one rank: the same role and messages as on a rank of its own
    (launch/in_process.py), one process to start instead of three."""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp("grid")
    proc = run_job("tiny_qwen2_5_vl.yaml", manifest, out, "pearl", "--set", "draft.tiny.vision.temporal_patch_size=1",
                   "--set", "draft_on=thread", "--timeout", "60", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = results(out)
    assert len(rows) == 2
    for row in rows.values():
        assert row["error"]["type"] == "ValueError" and row["token_ids"] == []
        assert "draft video grid (8, 4, 4) differs from the target's (4, 4, 4)" in row["error"]["message"]


def test_a_draft_whose_own_eos_set_differs_stops_where_the_target_does(tmp_path_factory, tmp_path):
    """The world pair's draft saved with another EOS id in its generation_config.json: a word the target writes
    mid-caption. Stopping on its own EOS set, the draft would stop drafting after that word while the target
    goes on, and the item would hang until the timeout; it stops on the target's (sent with each job) instead.
    The draft role on a thread of the target's one rank, as above."""
    config = ROOT / "configs" / "world_qwen2_5_vl.yaml"
    examples = ROOT / "examples" / "world" / "manifest.jsonl"
    line = examples.read_text().splitlines()[0]
    item = json.loads(line)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({**item, "video": str(examples.parent / item["video"])}) + "\n")
    cfg = load_config(config)
    target = load_adapter(cfg.family, cfg.target)
    frames, times = load_item_frames(examples.parent / item["video"], cfg.video.num_frames, None, None)
    ar = decode_ar(target, frames, item["prompt"], cfg.decoding, times).token_ids
    assert ar[-1] in target.eos_token_ids and len(ar) > 8  # the caption ends on the target's EOS
    draft_eos = ar[3]  # a word early in the caption
    draft = tmp_path / "draft"
    draft.mkdir()
    for f in Path(cfg.draft.path).iterdir():
        (draft / f.name).symlink_to(f)
    (draft / "generation_config.json").unlink()
    gen = json.loads((Path(cfg.draft.path) / "generation_config.json").read_text())
    (draft / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [draft_eos]}))
    assert load_adapter(cfg.family, replace(cfg.draft, path=str(draft))).eos_token_ids == [draft_eos]

    out = tmp_path_factory.mktemp("draft-eos")
    proc = run_job("world_qwen2_5_vl.yaml", manifest, out, "pearl", "--set", f"draft.path={draft}",
                   "--set", "draft_on=thread", "--timeout", "90", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = results(out)[item["id"]]
    assert row["error"] is None, row["error"]
    assert row["token_ids"] == ar


@pytest.mark.slow  # growth and its reuse: test_grow in process; a grown target runs in every demo
def test_a_draft_grown_on_first_use_loads_on_the_draft_rank(tmp_path_factory, tmp_path):
    """`grow:` on the draft's spec: the draft rank (rank 1) builds the scale model. transformers' save_pretrained
    writes nothing off rank 0, so this published a directory without config or weights and the job failed."""
    config = ROOT / "configs" / "world_qwen2_5_vl.yaml"
    examples = ROOT / "examples" / "world" / "manifest.jsonl"
    item = json.loads(examples.read_text().splitlines()[0])
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({**item, "video": str(examples.parent / item["video"])}) + "\n")
    cfg = load_config(config)
    draft = tmp_path / "draft"  # a source of our own, so the scale model is built beside it, here
    draft.mkdir()
    for f in Path(cfg.draft.path).iterdir():
        (draft / f.name).symlink_to(f)
    out = tmp_path_factory.mktemp("grown-draft")
    proc = run_job("world_qwen2_5_vl.yaml", manifest, out, "pearl", "--set", f"draft.path={draft}",
                   "--set", "draft.grow={width: 2, layers: 3}", "--timeout", "90")
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown = tmp_path / "draft.grown-w2-l3"
    assert (grown / "config.json").is_file() and (grown / "model.safetensors").is_file()
    target = load_adapter(cfg.family, cfg.target)
    frames, times = load_item_frames(examples.parent / item["video"], cfg.video.num_frames, None, None)
    row = results(out)[item["id"]]
    assert row["error"] is None and row["token_ids"] == decode_ar(target, frames, item["prompt"], cfg.decoding, times).token_ids

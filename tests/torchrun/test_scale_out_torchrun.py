"""One launch, several pipelines (launch/layout.py, launch/coordinator.py), through real torchrun on CPU:
two pipelines on one node share the manifest item by item, and when a rank of one of them is killed mid-job,
torchrun's restart finishes the job; two "nodes" over a localhost rendezvous make one pipeline each. Every id is
done exactly once and every output equals a one-pipeline `ar` run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.torchrun_jobs import (ROOT, ar_reference, free_port, job_args, job_env, launcher_cmd, results, run_job, torchrun_cmd,
                                 world_manifest)

CONFIG = "tiny_qwen2_5_vl.yaml"
LONG, SHORT = 40, 4  # tokens: the long items are 10x the short ones


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """Ten items, two of them 10x longer than the rest, both where dealing the manifest round-robin to two
    pipelines in advance would give them to the same one (lines 8 and 10)."""
    base = world_manifest(str(tmp_path_factory.getbasetemp()), count=10)
    lines = [json.loads(line) for line in base.read_text().splitlines()]
    for i, line in enumerate(lines):
        line["max_new_tokens"] = LONG if i in (7, 9) else SHORT
        line["video"] = str(base.parent / line["video"])
    path = tmp_path_factory.mktemp("uneven") / "manifest.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def reference(uneven):
    """`ar` on the same items, decoded in this process (tests/torchrun_jobs.py)."""
    return ar_reference("qwen2_5_vl", uneven)


def assert_done_once_and_lossless(out, reference) -> dict:
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(reference)  # every id exactly once
    assert all(r["error"] is None and r["token_ids"] == reference[r["id"]] for r in lines)
    return {r["id"]: r for r in lines}


def assert_items_taken_as_pipelines_free_up(out, rows: dict, items: int) -> None:
    """Both pipelines of the (last) attempt took items; the two long ones went to different pipelines, and the
    pipelines finished within one long item of each other, where dealing in advance would leave one idle for two."""
    pipes = json.loads((out / "summary.json").read_text())["run"]["pipelines"]
    assert [p["ranks"] for p in pipes] == [{"target": 0, "draft": 1, "pruner": 2}, {"target": 3, "draft": 4, "pruner": 5}]
    assert sum(p["items"] for p in pipes) == items and all(p["items"] > 0 for p in pipes)
    assert sorted(rows[i]["stats"]["pipeline"] for i in ("world-000007", "world-000009")) == [0, 1]
    long_s = max(rows[i]["stats"]["wall_s"] for i in ("world-000007", "world-000009"))
    assert abs(pipes[0]["done_s"] - pipes[1]["done_s"]) < long_s + 1.0, pipes
    assert len(list((out / "traces").glob("rank*_*.jsonl"))) == 6


@pytest.mark.slow  # CI: the restart below runs the same two pipelines, and is held to the same dispatch
def test_two_pipelines_on_one_node_take_items_as_they_free_up(tmp_path, uneven, reference):
    out = tmp_path / "hippo"
    proc = run_job(CONFIG, uneven, out, "hippo", "--quiet", nproc=6, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_items_taken_as_pipelines_free_up(out, assert_done_once_and_lossless(out, reference), 10)


def test_two_nodes_over_a_localhost_rendezvous_make_a_pipeline_each(tmp_path, uneven, reference):
    """A pipeline of one rank a node (the draft and pruner on threads of its target: what crosses the nodes is the
    coordinator's traffic with pipeline 1's target; pipelines of several ranks a node: --slow, in
    test_pipeline_torchrun, and the restart below on one node)."""
    out = tmp_path / "two-nodes"
    port = free_port()
    procs = []
    for node in (0, 1):
        rdzv = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "vpsd-scale-out", "--max-restarts", "0"]
        args = job_args(CONFIG, uneven, out, "pearl", "--quiet", "--set", "draft_on=thread")
        procs.append(subprocess.Popen(torchrun_cmd(1, extra=rdzv) + args,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=job_env()))
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert_done_once_and_lossless(out, reference)
    pipes = json.loads((out / "summary.json").read_text())["run"]["pipelines"]
    assert [p["ranks"]["target"] for p in pipes] == [0, 1] and all(p["items"] > 0 for p in pipes)


@pytest.mark.parametrize("kills", [
    pytest.param([(3, 2)], id="target"),
    pytest.param([(4, 2), (3, 5)], id="draft-then-target", marks=pytest.mark.slow),  # the same restart, twice
])
def test_ranks_that_die_are_restarted_and_the_restarts_finish_the_job(tmp_path, uneven, reference, kills):
    """Torchrun stops every rank when one dies and restarts them all (--max-restarts 2): the target of pipeline 1
    is killed once 2 items are done (with --slow also: its draft first, then its target in the restarted job). The
    coordinator wrote each finished item as it came, so each restart does exactly the items that were in flight
    or not yet given, and its two pipelines take them as they free up (the long items come after the kills)."""
    out = tmp_path / "kills"
    cmd = launcher_cmd(CONFIG, uneven, out, "hippo", "--quiet", torchrun_opts=("--max-restarts", "2"))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**job_env(), "NPROC": "6"})
    try:
        for restart, (rank, done) in enumerate(kills):
            deadline = time.monotonic() + 240
            while len(results(out)) < done or _pid(out, rank, restart) is None:
                assert time.monotonic() < deadline and proc.poll() is None, "the job did not get going"
                time.sleep(0.05)
            os.kill(_pid(out, rank, restart), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    rows = assert_done_once_and_lossless(out, reference)
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["restart"] == len(kills) and run["skipped"] >= kills[-1][1]
    if len(kills) == 1:  # the long items, 8th and 10th, come after the kill, to both pipelines of the restart
        assert_items_taken_as_pipelines_free_up(out, rows, 10 - run["skipped"])


def _pid(out, rank: int, restart: int) -> int | None:
    """The pid of `rank` in the torchrun attempt `restart`, from its role_started event."""
    for path in (out / "traces").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "role_started" and ev.get("rank") == rank and ev.get("restart", 0) == restart:
                return ev["pid"]
    return None

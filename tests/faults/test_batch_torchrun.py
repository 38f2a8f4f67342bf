"""Batch jobs through real torchrun on CPU: bad items next to good ones, a job killed and rerun, a manifest
split between two shard jobs, a rank that dies under `torchrun --max-restarts 1`, and the read-ahead of
videos seen in the traces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import media
from tests.conftest import tiny_pair
from tests.torchrun_jobs import (ROOT, assert_trace_rounds_add_up, job_args, job_env, launcher_cmd, results, role_pids,
                                 run_job, run_launcher, torchrun_cmd, wait_for_results, world_manifest)
from vpsd.config import DecodingConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.launch.manifest import check_manifest, load_manifest
from vpsd.reports import timeline, timeline_command, timeline_plot
from vpsd.reports.summary import EXIT_ITEMS_FAILED
from vpsd.video.item import cap_frames, load_item_frames

pytestmark = pytest.mark.torchrun

CONFIG = "tiny_qwen2_5_vl.yaml"
METHOD = "pearl"  # all three ranks: the draft takes every video's frames from the target


def ar_tokens(video: Path, prompt: str, num_frames: int, max_new_tokens: int, cap: int | None = None) -> list[int]:
    """Plain autoregressive decoding of the tiny target, in this process."""
    cfg = load_config(ROOT / "configs" / CONFIG)
    target, _ = tiny_pair("qwen2_5_vl")
    frames, times = load_item_frames(video, num_frames, None, cfg.video.max_side)
    dec = DecodingConfig(gamma=cfg.decoding.gamma, max_new_tokens=max_new_tokens, temperature=0.0)
    return decode_ar(target, cap_frames(frames, cap), prompt, dec, cap_frames(times, cap)).token_ids


def tokens_needed(video: Path, prompt: str, num_frames: int, max_new_tokens: int) -> int:
    cfg = load_config(ROOT / "configs" / CONFIG)
    target, _ = tiny_pair("qwen2_5_vl")
    frames, times = load_item_frames(video, num_frames, None, cfg.video.max_side)
    return target.prepare(frames, prompt, times).seq_len + max_new_tokens


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def spans(out: Path, rank_role: str) -> list[dict]:
    path = out / "traces" / f"{rank_role}.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "span"]


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> Path:
    return world_manifest(str(tmp_path_factory.getbasetemp()), count=6)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, six) -> Path:
    """The reference: the six-item job run once, start to end."""
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = run_job(CONFIG, six, out, METHOD, "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def assert_same_results(out: Path, reference: Path) -> None:
    """Exactly one line per id, and the same outputs as the uninterrupted run (timings aside)."""
    got, ref = lines(out), results(reference)
    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(ref) and len(ids) == len(set(ids)), ids
    for row in got:
        expected = ref[row["id"]]
        assert row["error"] is None
        assert (row["token_ids"], row["text"], row["reference"]) == (
            expected["token_ids"], expected["text"], expected["reference"])


@pytest.mark.parametrize("batching", [pytest.param([], marks=pytest.mark.slow),
                                      ["--batch", "3", "--set", "batching.pipelined=true"]],
                         ids=["one-at-a-time", "pipelined-batch"])
def test_bad_items_fail_alone_and_retry_with_subsampling(tmp_path_factory, batching):
    world = world_manifest(str(tmp_path_factory.getbasetemp()), count=2)
    good = load_manifest(world)[0]
    d = tmp_path_factory.mktemp("bad-items")
    (d / "v").mkdir()
    media.write_zero_bytes(d / "v" / "zero.mp4")
    media.write_random_bytes(d / "v" / "corrupt.mp4")
    media.write_audio_only(d / "v" / "audio.wav")
    prompt = good[0].prompt
    long_needed = tokens_needed(good[1].video, prompt, 32, 24)
    limit = long_needed - 1  # the 32-frame item is one token over; the 8-frame items fit easily
    assert tokens_needed(good[0].video, prompt, 8, 24) < limit
    rows = [
        {"id": "good-0", "video": str(good[0].video), "prompt": prompt, "tag": {"keep": [1, "x"]}},
        {"id": "missing", "video": "v/nope.mp4", "prompt": prompt},
        {"id": "zero", "video": "v/zero.mp4", "prompt": prompt},
        {"id": "corrupt", "video": "v/corrupt.mp4", "prompt": prompt},
        {"id": "audio", "video": "v/audio.wav", "prompt": prompt},
        '{"id": "torn", "video": "v/zero.mp4", ',  # line 6: bad JSON
        {"id": "good-0", "video": str(good[1].video), "prompt": prompt},  # line 7: duplicate id
        {"id": "long", "video": str(good[1].video), "prompt": prompt, "num_frames": 32},
        {"id": "good-1", "video": str(good[1].video), "prompt": prompt, "max_new_tokens": 12},
    ]
    manifest = d / "manifest.jsonl"
    manifest.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    # The checker, without models, names every bad line with its number.
    assert check_manifest(manifest) == 1
    problems = {p.line: p.message for p in load_manifest(manifest)[1]}
    assert set(problems) == {2, 3, 6, 7}  # missing, zero bytes, bad JSON, duplicate id

    out = d / "out"
    tmp = d / "tmp"  # the job's temporary directory: it leaves nothing there (torchrun's log directory included)
    tmp.mkdir()
    proc = run_launcher(CONFIG, manifest, out, METHOD, "--set", f"video.context_limit={limit}", "--quiet", *batching,
                        env_extra={"TMPDIR": str(tmp)})
    assert proc.returncode == EXIT_ITEMS_FAILED, proc.stderr[-3000:]
    assert list(tmp.iterdir()) == []
    got = results(out)
    assert set(got) == {"good-0", "good-1", "missing", "zero", "corrupt", "audio", "long", "line:6", "line:7"}
    errors = {k: r["error"] for k, r in got.items() if r["error"] is not None}
    assert {k: e.get("kind") for k, e in errors.items()} == {
        "missing": "missing", "zero": "empty", "corrupt": "corrupt", "audio": "no_video_stream",
        "long": "too_long", "line:6": None, "line:7": None}
    assert "not valid JSON" in errors["line:6"]["message"] and f"{manifest}:6:" in errors["line:6"]["message"]
    assert "duplicate id 'good-0'" in errors["line:7"]["message"]
    assert "nope.mp4" in errors["missing"]["message"] and str(limit) in errors["long"]["message"]
    assert got["good-0"]["token_ids"] == ar_tokens(good[0].video, prompt, 8, 24)
    assert got["good-1"]["token_ids"] == ar_tokens(good[1].video, prompt, 8, 12)
    assert got["good-0"]["tag"] == {"keep": [1, "x"]}  # extra fields carried untouched
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["items_done"], summary["items_failed"]) == (2, 7)

    # Retry the failures with subsampling on: the long item now fits, the broken files still fail,
    # and the file keeps one line per id. Launched from the job's own directory, with relative paths.
    proc = run_launcher(CONFIG, Path(manifest.name), Path(out.name), METHOD, "--set", f"video.context_limit={limit}",
                        "--set", "video.subsample_to_fit=true", "--retry-failed", "--quiet", *batching, cwd=d)
    assert proc.returncode == EXIT_ITEMS_FAILED, proc.stderr[-3000:]
    ids = [r["id"] for r in lines(out)]
    assert len(ids) == len(set(ids)) == 9
    long = results(out)["long"]
    assert long["error"] is None and long["stats"]["num_frames"] < 32
    # The draft read the same subsampled frames (or the output would still match, but slower): check
    # losslessness against ar on exactly those frames.
    assert long["token_ids"] == ar_tokens(good[1].video, prompt, 32, 24, cap=long["stats"]["num_frames"])
    assert got["good-0"] == results(out)["good-0"]  # finished items were not run again


@pytest.mark.slow  # CI: the batched kill below, ctrl-c and the scale-out restarts resume the same way
def test_killed_job_rerun_equals_uninterrupted_run(tmp_path_factory, six, uninterrupted):
    out = tmp_path_factory.mktemp("killed")
    proc = subprocess.Popen(torchrun_cmd(3) + job_args(CONFIG, six, out, METHOD, "--quiet"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_results(proc, out, 2, 180)
        os.kill(role_pids(out)["target"], signal.SIGKILL)  # the results writer dies without any cleanup
        proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert 2 <= len(results(out)) < 6, "the kill came too late to test anything"
    rerun = run_job(CONFIG, six, out, METHOD, "--quiet")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_same_results(out, uninterrupted)
    assert json.loads((out / "summary.json").read_text())["run"]["skipped"] >= 2


@pytest.mark.parametrize("pipelined", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["serial-batch", "pipelined-batch"])
def test_a_killed_batched_job_resumes_to_the_uninterrupted_batch1_results(tmp_path_factory, six, uninterrupted,
                                                                          pipelined):
    """Continuous batching (3 items in flight; the parallel method's draft on the target's rank, or pipelined on
    its own): killed with items in flight, rerun, every id exactly once and every output the batch-1 pipeline's.
    ./torchrun.sh names the rank that died, by role, rank, node and signal, in the job's one line."""
    out = tmp_path_factory.mktemp("killed_batched")
    mode = ["--set", f"batching.pipelined={str(pipelined).lower()}"]
    proc = subprocess.Popen(launcher_cmd(CONFIG, six, out, METHOD, "--quiet", "--batch", "3", *mode), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env())
    try:
        wait_for_results(proc, out, 1, 180)
        pids = role_pids(out)
        # Frozen first, so the kill lands with items in flight however fast the machine decodes the rest (on a fast
        # one the job could finish in the half second the stacks are given, and the kill found no target).
        os.kill(pids["target"], signal.SIGSTOP)
        os.kill(pids["draft"], signal.SIGUSR1)  # a user's look at a rank that seems stalled
        time.sleep(0.5)
        os.kill(pids["target"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "most recent call first" in stderr and "serve_draft" in stderr, stderr[-3000:]  # its threads' stacks
    assert 1 <= len(results(out)) < 6, "the kill came too late to test anything"
    assert [line for line in stderr.splitlines() if line.startswith("vpsd:")] == [
        f"vpsd: target (rank 0, node 0) was killed by SIGKILL; {len(results(out))} results kept in {out}; rerun the "
        f"same command to do the rest"], stderr[-3000:]
    assert "ChildFailedError" not in stderr
    rerun = run_job(CONFIG, six, out, METHOD, "--quiet", "--batch", "3", *mode)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_same_results(out, uninterrupted)
    summary = json.loads((out / "summary.json").read_text())["run"]
    assert summary["skipped"] >= 1 and summary["batching"]["size"] == 3 and summary["batching"]["rounds"] > 0
    verify = [s for s in spans(out, "rank0_target") if s["name"] == "verify"]
    assert max(len(s["items"]) for s in verify) > 1  # rounds really carried several items' rows


def test_a_pipelined_batch_overlaps_draft_and_target_and_equals_batch1(tmp_path_factory, six, uninterrupted):
    """Parallel SD over a batch on three ranks (`batching.pipelined`): the draft rank drafts every row in one
    forward while the target rank verifies every ready window in one forward; every output is the batch-1
    pipeline's, and both ranks' traces show forwards that carried several items."""
    out = tmp_path_factory.mktemp("pipelined")
    proc = run_job(CONFIG, six, out, METHOD, "--quiet", "--batch", "3", "--set", "batching.pipelined=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_results(out, uninterrupted)
    batching = json.loads((out / "summary.json").read_text())["run"]["batching"]
    assert batching["pipelined"] and batching["rounds"] > 0
    verify = [s for s in spans(out, "rank0_target") if s["name"] == "verify"]
    assert max(len(s["items"]) for s in verify) > 1
    drafted = [s for s in spans(out, "rank1_draft") if s["name"] == "draft_step"]
    assert max(len(s["items"]) for s in drafted) > 1
    # Each row's rounds, read back from the traces, add up to what its result holds (the pipelined commit rule).
    assert_trace_rounds_add_up(out, METHOD, max_new=24)  # world_manifest's max_new_tokens
    # The timeline reads it back: each item was carried only while it was in flight, and the default plot of a
    # batched run is the whole batch.
    tracks = {t.item: t for t in timeline_plot.item_tracks(timeline.load_spans(out))}
    assert set(tracks) == set(results(out))
    for t in tracks.values():
        verifies = [s for s in t.carried_by if s.name == "verify"]
        assert verifies and t.joined is not None and t.left is not None
        assert all(t.joined <= s.t0 and s.t1 <= t.left for s in verifies)
    assert timeline_command.main([str(out)]) == 0 and (out / "timeline.png").stat().st_size > 10_000


@pytest.mark.slow  # the check itself: test_job_identity in process; a refusal through torchrun: test_job_safety
def test_a_rerun_with_other_settings_is_refused_and_changes_nothing(six, uninterrupted):
    """Resuming would skip every finished id and mix two jobs in one results file."""
    before = (uninterrupted / "results.jsonl").read_text()
    proc = run_job(CONFIG, six, uninterrupted, METHOD, "--gamma", "2", "--quiet")
    assert proc.returncode != 0  # torchrun's own code: each rank exited 2
    assert "decoding.gamma: 4 -> 2" in proc.stderr and "another --out" in proc.stderr, proc.stderr[-3000:]
    assert (uninterrupted / "results.jsonl").read_text() == before


@pytest.mark.slow  # CI: one launch over many pipelines (test_scale_out_torchrun) is the way to split a job
def test_two_shard_jobs_split_the_manifest_and_together_equal_one_job(tmp_path_factory, six, uninterrupted):
    outs = [tmp_path_factory.mktemp(f"shard{i}") for i in range(2)]
    for i, out in enumerate(outs):
        proc = run_job(CONFIG, six, out, METHOD, "--quiet", "--shard", f"{i}/2")
        assert proc.returncode == 0, proc.stderr[-3000:]
    ids = [set(results(out)) for out in outs]
    assert len(ids[0]) == len(ids[1]) == 3 and not ids[0] & ids[1]
    merged = {**results(outs[0]), **results(outs[1])}
    reference = results(uninterrupted)
    assert set(merged) == set(reference)
    assert all(merged[k]["token_ids"] == reference[k]["token_ids"] for k in merged)


@pytest.mark.slow  # CI: test_scale_out_torchrun's job restarts twice under --max-restarts
def test_elastic_restart_resumes_after_a_rank_dies(tmp_path_factory, six, uninterrupted):
    out = tmp_path_factory.mktemp("elastic")
    cmd = launcher_cmd(CONFIG, six, out, METHOD, "--quiet", torchrun_opts=("--max-restarts", "1"))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_results(proc, out, 2, 180)
        os.kill(role_pids(out)["draft"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert_same_results(out, uninterrupted)
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["restart"] == 1 and run["skipped"] >= 2


def test_video_reading_is_timed_and_read_ahead(uninterrupted):
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert summary["video_read_s"] > 0 and summary["preprocess_s"] > 0 and summary["video_wait_s"] >= 0
    for row in results(uninterrupted).values():
        assert {"video_read_s", "preprocess_s", "video_wait_s"} <= set(row["stats"])
    target, draft = spans(uninterrupted, "rank0_target"), spans(uninterrupted, "rank1_draft")
    order = [e["item"] for e in target if e["name"] == "item"]
    assert len(order) == 6

    def first(events, name, item):
        return next(e for e in events if e["name"] == name and e.get("item") == item)

    for prev, item in zip(order, order[1:]):
        item_span = first(target, "item", prev)
        # The target read item k while item k-1 was still being decoded...
        assert first(target, "video_read", item)["t0"] < item_span["t0"] + item_span["dur"]
        # ...and the draft took the frames it read, sent with the item's start (video.share_frames)
        assert first(draft, "frames_received", item)["t0"] >= first(target, "item", item)["t0"]
        assert first(target, "preprocess", item) and first(target, "video_wait", item)
    assert not [e for e in draft if e["name"] == "video_read"]  # it decoded no video a second time

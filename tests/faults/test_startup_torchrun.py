"""A slow start is not a fault, through real ranks: start-up (every rank up, the models loaded, the draft and pruner
ready) has its own bound, --startup-timeout, and --timeout only rules once the job runs.

Under --timeout 4 (the stuck-peer tests' setting): a rank that comes up 10 s after the others joins and the job
completes, the waiting said in a progress line; a rank that never comes is named in one line within the start-up
bound, with no traceback from any rank; a draft that takes 10 s more to load than its peers is waited for; one
that never finishes loading is named once the bound has passed."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.torchrun_jobs import ROOT, job_args, job_env, results, torchrun_cmd, world_manifest
from vpsd.transport.startup import FIRST_REPORT_S

CONFIG = "tiny_qwen2_5_vl.yaml"
ARGS = ("--gamma", "3", "--timeout", "4")


LATE_S = 10  # the draft's rank comes up this long after the others


@pytest.fixture(scope="module")
def late_job(tmp_path_factory):
    """The job whose draft rank comes up LATE_S after the others (under --timeout 4), run once for the tests of this
    file: (the finished process, its out dir, {line: seconds since the launch}, seconds from the launch to the last
    rank's role_started)."""
    proc, out, when, t0 = _run(tmp_path_factory, tmp_path_factory.mktemp("late"), {"VPSD_TEST_LATE_START": f"1:{LATE_S}"})
    started = [json.loads(line)["t"] for trace in (out / "traces").glob("*.jsonl")
               for line in trace.read_text().splitlines() if '"role_started"' in line]
    return proc, out, when, (max(started) - t0 if started else None)


@pytest.fixture(scope="module")
def bound_s(late_job) -> int:
    """The start-up bound of the tests that wait it out: long enough for every rank of a job to come up on this
    machine, as the late-rank job measured it (the launch to the last rank's role_started, its LATE_S taken off),
    twice over and a little: a bound of a constant named ranks that were only slow on a machine twice as slow as
    this one."""
    proc, _, _, come_up_s = late_job
    assert proc.returncode == 0 and come_up_s is not None, proc.stderr[-3000:]
    return max(8, round(2 * (come_up_s - LATE_S)) + 4)


@pytest.fixture(scope="module")
def arrival_bound_s(late_job) -> int:
    """The start-up bound of the test that waits out a rank that never arrives: every other rank must arrive within
    it (ranks wait for each other right after their imports, before any model loads). Measured in the late-rank
    job: rank 0 (the target, the heaviest imports) said it was waiting FIRST_REPORT_S after it arrived, so it
    arrived that much before its progress line; twice over and a little, as `bound_s`."""
    proc, _, when, _ = late_job
    waiting = [t for ln, t in when.items() if "starting: 2 of 3 ranks up" in ln]
    assert proc.returncode == 0 and waiting, proc.stderr[-3000:]
    return max(8, round(2 * (waiting[0] - FIRST_REPORT_S)) + 4)


def _run(tmp_path_factory, tmp_path, env: dict, *more: str):
    """The job, its stderr read line by line as it comes: (the finished process, its out dir, {line: seconds
    since the launch it arrived at} for the lines vpsd says, the launch's wall-clock time)."""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=3)
    out = tmp_path / "job"
    t0 = time.monotonic()
    proc = subprocess.Popen(torchrun_cmd(3) + job_args(CONFIG, manifest, out, "hippo", *ARGS, *more), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**job_env(), **env}, cwd=ROOT)
    lines, when = [], {}
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("vpsd:"):
            when[line.rstrip("\n")] = time.monotonic() - t0
    proc.wait(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", "".join(lines)), out, when, time.time() - (
        time.monotonic() - t0)


def _said(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("vpsd:")]


@pytest.mark.torchrun
def test_a_late_rank_joins_and_the_job_completes(late_job):
    proc, out, _, _ = late_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(results(out)) == 3 and all(r["error"] is None for r in results(out).values())
    waiting = [ln for ln in _said(proc) if "starting: 2 of 3 ranks up, waiting for rank 1 (node 0)" in ln]
    assert waiting, proc.stderr[-3000:]


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_rank_that_loads_longer_is_waited_for(tmp_path_factory, tmp_path):
    proc, out, _, _ = _run(tmp_path_factory, tmp_path, {"VPSD_TEST_SLOW": f"draft:start:1:{LATE_S}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(results(out)) == 3 and all(r["error"] is None for r in results(out).values())


def _no_rank_traceback(proc) -> bool:
    """torchrun's agent prints its own summary; no rank may print a traceback of vpsd's or torch's frames."""
    return f'File "{ROOT}/vpsd' not in proc.stderr and "DistNetworkError" not in proc.stderr


@pytest.mark.torchrun
def test_a_rank_that_never_starts_is_named_within_the_start_up_bound(tmp_path_factory, tmp_path, arrival_bound_s):
    bound_s = arrival_bound_s
    proc, out, when, _ = _run(tmp_path_factory, tmp_path, {"VPSD_TEST_LATE_START": "2:never"},
                           "--startup-timeout", str(bound_s))
    assert proc.returncode != 0
    lines = [ln for ln in _said(proc) if "did not start" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("vpsd: rank 2 (node 0, host ") and f"start-up bound ({bound_s} s" in lines[0]
    assert _no_rank_traceback(proc), proc.stderr[-3000:]
    # Timed from what the job said, not from the launch (how long ranks take to come up is the machine's): rank 0
    # said it was waiting 5 s into its wait, and the first rank up gives up at most the bound after rank 0 arrived.
    waiting = [t for ln, t in when.items() if "starting: 2 of 3 ranks up" in ln]
    assert waiting and when[lines[0]] - waiting[0] < bound_s, when
    assert not results(out)


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_draft_that_never_finishes_loading_is_named_after_the_start_up_bound(tmp_path_factory, tmp_path, bound_s):
    proc, _, _, _ = _run(tmp_path_factory, tmp_path, {"VPSD_TEST_HANG": "draft:start:1"},
                      "--startup-timeout", str(bound_s))
    assert proc.returncode != 0
    lines = [ln for ln in _said(proc) if "loading its models" in ln]
    assert lines and lines[0].startswith("vpsd: target (rank 0): draft (rank 1) has been loading its models for "), \
        proc.stderr[-3000:]
    loading_s = int(lines[0].split("loading its models for ")[1].split(" s")[0])  # as the target measured it
    assert bound_s <= loading_s <= bound_s + 4, lines[0]  # past the bound, by a heartbeat or two

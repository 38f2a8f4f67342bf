"""A peer alive but stuck is named within its limit, through real ranks: its heartbeats say which phase it has
been in and for how long, and how long such work took so far in this job (vpsd/activity.py). A peer made to
block forever (a test hook) in each phase, prefill, verify, draft and prune, on the second item: the job ends
within --timeout plus a few seconds, with one line naming the stuck role and its phase, and the same command
resumes. A slow first prefill (nothing measured yet: the limit is idle_timeout_s) is never called stuck."""

from __future__ import annotations

import time

import pytest

from tests.torchrun_jobs import ROOT, job_args, job_env, results, torchrun_cmd, world_manifest

CONFIG = "tiny_qwen2_5_vl.yaml"
ARGS = ("--gamma", "3", "--timeout", "4", "--quiet", "--set", "idle_timeout_s=120")


def _run(tmp_path, manifest, env_extra: dict, name: str, nproc: int = 3):
    import subprocess

    out = tmp_path / name
    t0 = time.monotonic()
    proc = subprocess.run(torchrun_cmd(nproc) + job_args(CONFIG, manifest, out, "hippo", *ARGS), capture_output=True,
                          text=True, timeout=240, env={**job_env(), **env_extra}, cwd=ROOT)
    return proc, out, time.monotonic() - t0


@pytest.mark.torchrun
@pytest.mark.parametrize("hang,role,phase,resume", [
    pytest.param("target:prefill:2", "target", "prefill", False, marks=pytest.mark.slow),  # the second item's vision and prefill
    # a round of the second item (--slow: the target is named by its peers as the draft, below, by the target)
    pytest.param("target:verify:12", "target", "verify", False, marks=pytest.mark.slow),
    ("draft:draft:12", "draft", "draft", False),
    # resuming is the same whichever way the job ended (CI: after a Ctrl-C, a killed batch and torchrun's restarts)
    pytest.param("draft:draft:12", "draft", "draft", True, marks=pytest.mark.slow),
    pytest.param("pruner:prune:2", "pruner", "prune", False, marks=pytest.mark.slow),
], ids=["prefill", "verify", "draft", "draft-resumed", "prune"])
def test_a_stuck_peer_is_named_within_its_limit_and_the_job_resumes(tmp_path_factory, tmp_path, hang, role, phase,
                                                                    resume):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=3)
    proc, out, took = _run(tmp_path, manifest, {"VPSD_TEST_HANG": hang}, "job")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("vpsd:") and "it is stuck" in ln]
    assert lines and f"{role} (rank" in lines[0] and f"has been in {phase} of item" in lines[0], proc.stderr[-3000:]
    assert "took at most" in lines[0]  # measured in this job, not the hour-long idle limit
    assert took < 90, took  # startup, the first item, then --timeout (4 s) and a heartbeat or two
    if not resume:
        return
    done = set(results(out))
    proc, out, _ = _run(tmp_path, manifest, {}, "job")  # the same command, no hook: it resumes
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(results(out)) >= done and len(results(out)) == 3


@pytest.mark.torchrun
def test_a_slow_first_prefill_is_not_stuck_and_a_spare_rank_outlasts_the_timeout(tmp_path_factory, tmp_path):
    """8 s in its first prefill, twice --timeout: nothing measured yet, so only idle_timeout_s bounds it. The
    launch's fourth rank is a spare (hippo's pipeline takes three): it leaves at once, as a rank a method leaves
    idle does, instead of waiting in a collective that --timeout would end."""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=3)
    proc, out, _ = _run(tmp_path, manifest, {"VPSD_TEST_SLOW": "target:prefill:1:8"}, "slow", nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(results(out)) == 3 and "stuck" not in proc.stderr
    assert "1 rank (rank 3) of 4 idle" in proc.stderr, proc.stderr[-3000:]  # the leader said which rank it left idle


@pytest.mark.slow  # CI: the spare rank above leaves the same way (entry.py: no role, no pipeline to wait for)
def test_ranks_a_method_leaves_idle_outlast_the_timeout(tmp_path_factory, tmp_path):
    """`ar` on a 3-rank launch leaves the draft and pruner ranks idle; a job longer than --timeout (a first prefill
    of 8 s against 4) finishes: idle ranks leave at once instead of waiting in a collective under the timeout."""
    import subprocess

    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=3)
    out = tmp_path / "idle"
    proc = subprocess.run(torchrun_cmd(3) + job_args(CONFIG, manifest, out, "ar", *ARGS[2:]), capture_output=True,
                          text=True, timeout=240, env={**job_env(), "VPSD_TEST_SLOW": "target:prefill:1:8"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(results(out)) == 3 and all(r["error"] is None for r in results(out).values())

"""./torchrun.sh's launcher (vpsd/launch/launcher.py) without a job: what it says from the ranks' ends and records,
and the lock check that refuses a busy --out before any rank starts. Through real torchrun:
tests/faults/test_job_safety_torchrun.py and test_batch_torchrun.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from vpsd.launch import lifetime
from vpsd.launch.launcher import failure_lines, main, out_dir
from vpsd.launch.rank_records import RankRecord
from vpsd.launch.torchrun import LAUNCH_DIR_PREFIX, remove_orphaned_launch_dirs


def records(**extra) -> dict[int, RankRecord]:
    made = {0: RankRecord("target", 0, 0, 0, 100, item="clip-7"), 1: RankRecord("draft", 1, 0, 0, 101),
            2: RankRecord("pruner", 2, 0, 0, 102)}
    for rank, fields in extra.items():
        made[int(rank[1:])] = RankRecord(**{**made[int(rank[1:])].__dict__, **fields})
    return made


def kept(tmp_path, n: int):
    (tmp_path / "results.jsonl").write_text("".join('{"id": "%d"}\n' % i for i in range(n)))
    return tmp_path


def test_the_rank_that_died_is_named_not_the_survivors_torchrun_stopped(tmp_path):
    out = kept(tmp_path, 4)
    # torchrun reports every rank that ended non-zero: the draft SIGKILLed, the others stopped by its SIGTERM.
    failures = {0: 128 + signal.SIGTERM, 1: -signal.SIGKILL, 2: 128 + signal.SIGTERM}
    assert failure_lines(failures, records(), out) == [
        f"draft (rank 1, node 0) was killed by SIGKILL while the target was on item clip-7; 4 results kept in {out}; "
        f"rerun the same command to do the rest"]
    # A peer noticed first and ended with its own account (exit 2): the death is still the cause named.
    failures = {1: -signal.SIGKILL, 2: 2}
    assert failure_lines(failures, records(r2={"said": "pruner (rank 2) waited ..."}), out)[0].startswith(
        "draft (rank 1, node 0) was killed by SIGKILL")
    # A crash of its own (exit 1, its traceback above) when nobody died of a signal; the target has no item then.
    assert failure_lines({0: 1, 1: -signal.SIGTERM}, records(r0={"item": None}), out) == [
        f"target (rank 0, node 0) exited with code 1; 4 results kept in {out}; rerun the same command to do the rest"]


def test_a_silent_peer_is_said_once_by_the_rank_that_found_it():
    said = "draft (rank 1) heard nothing from pruner (rank 2) for 5 s while on item clip-7: it is stopped, hung or dead"
    # The draft killed the silent pruner (end_silent_peer) and exited 2: its account is the job's one line.
    failures = {1: 2, 2: -signal.SIGKILL}
    assert failure_lines(failures, records(r1={"said": said}, r2={"ended_by": "draft (rank 1)"}), None) == [said]
    assert failure_lines({0: 2}, {}, None) == []  # a rank that said why itself (a full disk): nothing more


def test_ranks_stopped_one_by_one_and_ranks_without_a_record_are_named_by_number(tmp_path):
    failures = {1: 128 + signal.SIGHUP, 2: -signal.SIGSEGV}
    assert failure_lines(failures, {0: records()[0]}, None) == ["rank 2 was killed by SIGSEGV while the target was "
                                                                "on item clip-7"]
    assert failure_lines({1: 128 + signal.SIGTERM}, records(), None) == [
        "draft (rank 1, node 0) was stopped by SIGTERM while the target was on item clip-7"]


def test_a_busy_out_is_refused_before_any_rank_starts(tmp_path, capsys):
    assert lifetime.out_dir_holder(tmp_path / "none") is None and not (tmp_path / "none").exists()
    out = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", f"from vpsd.launch.lifetime import lock_out_dir; "
                               f"lock_out_dir({str(out)!r}); print('held', flush=True); import time; time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["run", "--config", "c.yaml", "--manifest", "m.jsonl", "--out", str(out)]) == 2
    finally:
        holder.kill()
        holder.wait()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"vpsd: {out} is in use by another job (pid {holder.pid} on ")
    assert lifetime.out_dir_holder(out) is None  # its holder gone, the lock went with it


def test_the_launchers_command_line():
    assert out_dir(["--config", "c", "--out", "o"]) == out_dir(["--out=o"]) != None  # noqa: E711
    assert out_dir(["--config", "c"]) is None
    assert main(["--nnodes", "2"]) == 2  # no `run`: the usage line


def test_a_killed_launchers_directory_is_removed_by_the_next_launch(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphaned = tmp_path / f"{LAUNCH_DIR_PREFIX}{gone.stdout.strip()}.abc"
    alive = tmp_path / f"{LAUNCH_DIR_PREFIX}{os.getpid()}.def"
    other = tmp_path / "vpsd-launch.notapid.x"
    for d in (orphaned, alive, other):
        (d / "torchrun").mkdir(parents=True)
    remove_orphaned_launch_dirs()
    assert not orphaned.exists() and alive.exists() and other.exists()

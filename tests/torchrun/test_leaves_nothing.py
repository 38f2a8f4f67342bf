"""A torchrun launch leaves nothing behind, however it ends: torchrun's agent makes a log directory per launch
(/tmp/torchelastic_*) and never removes it; the launches of vpsd's benches and tests go through
vpsd/launch/torchrun.py (`torchrun_command`), and ./torchrun.sh's launcher uses its `launch_directory` and
`with_log_dir`: torchrun's log directory is in a directory of the launch's own, which goes with it. The launcher's own check, with a real job:
tests/faults/test_batch_torchrun.py (its bad items' job runs under a TMPDIR of its own)."""

from __future__ import annotations

import ast
import signal
import subprocess
import time

import pytest

from tests.torchrun_jobs import ROOT, job_env, torchrun_cmd

# Each rank says it is up, then ends as the case asks: at once, rank 1 with an error, or waiting to be stopped.
WORKER = """
import os, sys, time
from pathlib import Path
rank = int(os.environ["RANK"])
Path(sys.argv[1], f"rank{rank}").write_text(str(os.getpid()))
if sys.argv[2] == "fails" and rank == 1:
    sys.exit(3)
if sys.argv[2] == "waits":
    time.sleep(120)
"""
NPROC = 2


def _wait_for(ready, what: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the launch ended (exit {proc.returncode}) before {what}:\n{proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(0.02)


@pytest.mark.torchrun
@pytest.mark.parametrize("end", ["done", "a rank fails", "stopped", "stopped as it starts"])
def test_a_launch_leaves_nothing_in_the_temporary_directory(tmp_path, end):
    """The path the tests' jobs and the benches' rows take (tests/torchrun_jobs.py `torchrun_cmd`, bench/methods.py
    `run_one`: both vpsd.launch.torchrun), with a TMPDIR of its own so that no other process's files count."""
    tmp, ready = tmp_path / "tmp", tmp_path / "ready"
    tmp.mkdir()
    ready.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    how = {"done": "done", "a rank fails": "fails"}.get(end, "waits")
    proc = subprocess.Popen(torchrun_cmd(NPROC) + [str(worker), str(ready), how], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**job_env(), "TMPDIR": str(tmp)})
    try:
        if end == "stopped as it starts":  # the launch's directory is there, its ranks are not started yet
            _wait_for(lambda: any(tmp.iterdir()), "launch directory", proc)
            proc.send_signal(signal.SIGTERM)
        elif end == "stopped":  # every rank up: torchrun's agent forwards the signal to them
            _wait_for(lambda: len(list(ready.iterdir())) == NPROC, "ranks up", proc)
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # torchrun's own exit status, as it was: 0 done, 1 a rank failed; stopped, 1 (its agent's SignalException) or,
    # before the agent handles signals, killed by it.
    assert proc.returncode in {"done": {0}, "a rank fails": {1}}.get(end, {1, -signal.SIGTERM}), stderr[-3000:]
    assert sorted(p.name for p in tmp.iterdir()) == []


def test_every_torchrun_launch_goes_through_the_one_that_leaves_nothing():
    """No module of vpsd, the tests or the scripts starts torchrun itself (`python -m torch.distributed.run`, or its
    agent in process) but vpsd/launch/torchrun.py and ./torchrun.sh's launcher, which uses its `with_log_dir`."""
    allowed = {ROOT / "vpsd" / "launch" / "torchrun.py", ROOT / "vpsd" / "launch" / "launcher.py"}
    module = "torch.distributed." + "run"  # not this file's own constant
    found = []
    for path in sorted(p for top in ("vpsd", "tests", "scripts") for p in (ROOT / top).rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Constant) and node.value == module
                    or isinstance(node, ast.ImportFrom) and node.module == module
                    or isinstance(node, ast.Import) and any(a.name == module for a in node.names)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"torchrun started outside vpsd.launch.torchrun (use torchrun_command): {found}"
    launcher = (ROOT / "vpsd" / "launch" / "launcher.py").read_text()
    assert "with_log_dir(" in launcher


def test_a_log_directory_the_caller_names_is_theirs(tmp_path, monkeypatch):
    from vpsd.launch.torchrun import with_log_dir

    args = ["--standalone", "--nproc-per-node", "2", "-m", "vpsd.launch.entry", "--log-dir", "x"]  # the job's own
    assert with_log_dir(args, tmp_path) == ["--log-dir", str(tmp_path / "torchrun"), *args]
    assert with_log_dir(["--log_dir=/logs", *args], tmp_path) == ["--log_dir=/logs", *args]
    monkeypatch.setenv("PET_LOG_DIR", "/logs")
    assert with_log_dir(args, tmp_path) == args

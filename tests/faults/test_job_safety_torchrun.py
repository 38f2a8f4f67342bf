"""Jobs no stranger can stop and no mistake can double, through real torchrun.

- A process without the job's secret sends the ranks forged Shutdowns and random bytes under the ranks'
  identities while a second job is started on the same --out: the first job ends as if alone (exit 0, outputs
  equal to `ar`, one line per item) and the second stops at launch naming the first.
- However a job is stopped (Ctrl-C, a rank killed, SIGTERM or SIGKILL to ./torchrun.sh's process, SIGHUP,
  SIGTERM to its group), every process of it ends within a bound, nothing in --out changes after, one line says
  what happened, and the same command resumes: every item once.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from tests.torchrun_jobs import ar_reference
from tests.torchrun_jobs import (ROOT, job_args, job_env, launcher_cmd, results, torchrun_cmd, wait_for_results,
                                 world_manifest)
from vpsd.launch.entry import main
from vpsd.launch.lifetime import LOCK_FILE
from vpsd.launch.manifest import load_manifest

pytestmark = pytest.mark.torchrun

CONFIG = "tiny_qwen2_5_vl.yaml"


def control_addresses(out: Path) -> dict[int, str]:
    """Each rank's control address, as a snooper finds it (here from the traces; `ss -ltnp` would do)."""
    found = {}
    for path in (out / "traces").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            if '"control_bound"' in line:
                ev = json.loads(line)
                found[ev["rank"]] = ev["address"]
    return found


def attack(out: Path, stop: threading.Event, sent: list[int]) -> None:
    """Forged Shutdowns and random bytes under every rank's identity, plain and with CURVE keys of our own."""
    forged = msgpack.packb({"type": "Shutdown", "v": 1, "reason": "forged"})
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    while not stop.is_set():
        addresses = control_addresses(out) if (out / "traces").exists() else {}
        if len(addresses) < 3:
            time.sleep(0.05)
            continue
        for address in addresses.values():
            for identity in (b"0", b"1", b"2"):
                for curve in (False, True):
                    sock = ctx.socket(zmq.DEALER)
                    sock.linger = 0
                    if curve:
                        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                        sock.curve_serverkey = zmq.curve_keypair()[0]
                    sock.setsockopt(zmq.IDENTITY, identity)
                    sock.connect(address)
                    for payload in (forged, os.urandom(4096)):
                        try:
                            sock.send(payload, zmq.NOBLOCK)
                            sent[0] += 1
                        except zmq.Again:
                            pass
                    socks.append(sock)
        stop.wait(0.3)
        for sock in socks:  # each round's sockets go: a fresh connection per round
            sock.close()
        socks.clear()
    ctx.term()


def test_strangers_change_nothing_and_a_second_job_on_the_same_out_refuses(tmp_path_factory, monkeypatch, capsys):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp("guarded")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(torchrun_cmd(3) + job_args(CONFIG, manifest, out, "pearl", "--timeout", "20", "--quiet"),
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, sent = threading.Event(), [0]
    attacker = threading.Thread(target=attack, args=(out, stop, sent), daemon=True)
    attacker.start()
    try:
        deadline = time.monotonic() + 120
        while not (out / LOCK_FILE).exists() or not (out / LOCK_FILE).read_text():
            assert time.monotonic() < deadline and first.poll() is None, "the first job never took its lock"
            time.sleep(0.1)
        with open(out / LOCK_FILE) as f:  # the running job holds --out (it has just started: models still loading)
            with pytest.raises(BlockingIOError):
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        _, stderr = first.communicate(timeout=180)
    finally:
        stop.set()
        if first.poll() is None:
            first.kill()
    attacker.join(10)
    assert sent[0] > 0, "the attacker never reached the ranks"
    assert first.returncode == 0, stderr[-3000:]
    lines = (out / "results.jsonl").read_text().splitlines()
    got = results(out)
    assert len(lines) == len(got) == 2
    assert {k: r["token_ids"] for k, r in got.items()} == ar_reference("qwen2_5_vl", manifest)

    # Another job's process holding the directory: a job launched on it stops at launch, naming it. Its
    # target rank's launch runs here in-process (what every torchrun rank runs first; a torchrun launch would
    # only add seconds): the refusal comes before any process group, socket or model.
    holder = subprocess.Popen([sys.executable, "-c", f"from vpsd.launch.lifetime import lock_out_dir; "
                               f"lock_out_dir({str(out)!r}); print('held', flush=True); import time; time.sleep(120)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("RANK", "0")
        code = main(job_args(CONFIG, manifest, out, "pearl", "--retry-failed", "--quiet")[2:])
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    err = capsys.readouterr().err
    assert f"vpsd: {out} is in use by another job (pid {holder.pid} on " in err and err.count("\n") == 1
    assert (out / "results.jsonl").read_text().splitlines() == lines


def _job_processes(out: Path) -> list[int]:
    """Every live process of a job on `out` (its launcher and ranks all carry --out in their command line), but
    this test's own."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if str(out).encode() + b"\0" in (entry / "cmdline").read_bytes() and _alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _snapshot(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}


def _rank_pid(out: Path, role: str) -> int:
    """The pid of the running job's `role` rank: the last role_started event of its trace (a resumed job appends)."""
    pids = [json.loads(line)["pid"] for path in (out / "traces").glob(f"rank*_{role}.jsonl")
            for line in path.read_text().splitlines() if '"role_started"' in line]
    return pids[-1]


def _stop_midway(cmd: list[str], out: Path, stop) -> tuple[int, str, int]:
    """Launch `cmd`, wait for one more result than --out holds, `stop(launcher)`; then every process of the job
    is gone within a bound and nothing writes in --out any more. The launcher's exit status, its stderr and how
    many results were kept."""
    before = len(results(out))
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # a group of its own, as a terminal's job
    try:
        wait_for_results(launcher, out, before + 1, 120)
        stop(launcher)
        _, stderr = launcher.communicate(timeout=STOP_BOUND_S)
        deadline = time.monotonic() + STOP_BOUND_S
        while _job_processes(out):
            assert time.monotonic() < deadline, f"still running after the stop: {_job_processes(out)}\n{stderr[-3000:]}"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    snapshot = _snapshot(out)
    time.sleep(1.0)
    assert _snapshot(out) == snapshot, "something still writes in --out"
    kept = results(out)
    assert before < len(kept) and all(r["error"] is None for r in kept.values())
    return launcher.returncode, stderr, len(kept)


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vpsd:")]


STOP_BOUND_S = 30  # torchrun's agent kills a rank SHUTDOWN_S (5 s) after the stop signal; the rest is start-up slack


def test_however_the_job_is_stopped_it_all_stops_says_what_is_kept_and_the_same_command_resumes(tmp_path_factory):
    """One job on a 10-item manifest, stopped midway the ways users and supervisors stop jobs, then run to its end by
    the same command: every id exactly once, the kept lines untouched.

    - Ctrl-C (SIGINT to the launcher's group): each rank printed a KeyboardInterrupt traceback and the launcher
      exited 1; now one line says what is kept and the launcher exits 130, as a shell does.
    - SIGTERM to the launcher's pid alone (`Popen.terminate()`, a supervisor): the launcher exited 143 at once and
      silently while torchrun and every rank went on, re-parented to init, writing results. A second job on the
      same --out meanwhile is refused at once, exit 2, with the one line and no torchrun failure block.
    - SIGKILL to the launcher's pid: nothing can run in it; the ranks die with it.
    (A rank that dies: test_batch_torchrun's killed pipelined batch; SIGHUP and SIGTERM to the group: below.)"""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=10)
    out = tmp_path_factory.mktemp("stopped")
    cmd = launcher_cmd(CONFIG, manifest, out, "pearl", "--quiet")

    code, stderr, kept = _stop_midway(cmd, out, lambda launcher: os.killpg(launcher.pid, signal.SIGINT))
    assert code == 130, stderr[-3000:]
    assert _said(stderr) == [f"vpsd: interrupted: the items finished are kept in {out}; rerun the same command to "
                             f"do the rest"]
    assert "[rank" not in stderr and "KeyboardInterrupt" not in stderr
    first = results(out)

    def terminate_and_start_another(launcher: subprocess.Popen) -> None:
        t0 = time.monotonic()
        second = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and time.monotonic() - t0 < 5, second.stderr[-3000:]
        assert _said(second.stderr) == [line for line in second.stderr.splitlines() if line.strip()]
        assert len(_said(second.stderr)) == 1 and f"{out} is in use by another job (pid " in second.stderr
        launcher.terminate()

    code, stderr, kept = _stop_midway(cmd, out, terminate_and_start_another)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert _said(stderr) == [f"vpsd: stopped by SIGTERM: the items finished are kept in {out}; rerun the same "
                             f"command to do the rest"]

    code, stderr, kept = _stop_midway(cmd, out, lambda launcher: launcher.kill())
    assert code == -signal.SIGKILL and kept < 10, "the kill came too late to test anything"

    rerun = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(it.id for it in load_manifest(manifest)[0])
    assert lines[:len(first)] == list(first.values())  # the kept lines, untouched, first


@pytest.mark.slow  # the same launcher code as SIGTERM to its pid, and a rank's death as in test_batch_torchrun
def test_sighup_sigint_a_dead_draft_and_sigterm_to_the_group_stop_the_job_the_same_way(tmp_path_factory):
    """A closed terminal (SIGHUP to the launcher); SIGINT to the launcher's pid alone (it was ignored: the job ran
    to its end); the draft rank SIGKILLed, named with the target's item (it was "target (rank 0) stopped by
    torchrun ...: another rank failed"); SLURM's SIGTERM to every process of the step, before its SIGKILL. Then
    the same command finishes the rest, every id once."""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=12)
    out = tmp_path_factory.mktemp("hangup")
    cmd = launcher_cmd(CONFIG, manifest, out, "pearl", "--quiet")
    code, stderr, _ = _stop_midway(cmd, out, lambda launcher: os.kill(launcher.pid, signal.SIGHUP))
    assert code == 128 + signal.SIGHUP, stderr[-3000:]
    assert _said(stderr) == [f"vpsd: stopped by SIGHUP: the items finished are kept in {out}; rerun the same "
                             f"command to do the rest"]

    code, stderr, _ = _stop_midway(cmd, out, lambda launcher: os.kill(launcher.pid, signal.SIGINT))
    assert code == 130, stderr[-3000:]
    assert _said(stderr) == [f"vpsd: interrupted: the items finished are kept in {out}; rerun the same command to "
                             f"do the rest"]

    code, stderr, kept = _stop_midway(cmd, out, lambda launcher: os.kill(_rank_pid(out, "draft"), signal.SIGKILL))
    assert code == 1, stderr[-3000:]
    (line,) = _said(stderr)
    assert re.fullmatch(rf"vpsd: draft \(rank 1, node 0\) was killed by SIGKILL while the target was on item "
                        rf"world-\d+; {kept} results kept in {re.escape(str(out))}; rerun the same command to do the "
                        rf"rest", line), line
    assert "ChildFailedError" not in stderr

    code, stderr, _ = _stop_midway(cmd, out, lambda launcher: os.killpg(launcher.pid, signal.SIGTERM))
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert _said(stderr) == [f"vpsd: stopped by SIGTERM: the items finished are kept in {out}; rerun the same "
                             f"command to do the rest"]
    rerun = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    ids = [json.loads(line)["id"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(it.id for it in load_manifest(manifest)[0])

"""Jobs no stranger can stop and no mistake can double, through real torchrun.

- A process without the job's secret sends the ranks forged Shutdowns and random bytes under the ranks'
  identities while a second job is started on the same --out: the first job ends as if alone (exit 0, outputs
  equal to `ar`, one line per item) and the second stops at launch naming the first.
- A SIGKILLed torchrun agent takes its ranks with it: nothing in --out changes after a second, and
  ./torchrun.sh says what happened.
"""

from __future__ import annotations

import fcntl
import json
import os
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
from tests.torchrun_jobs import ROOT, job_args, launcher_cmd, results, torchrun_cmd, world_manifest
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


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _snapshot(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}


def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path_factory):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=6)
    out = tmp_path_factory.mktemp("orphans")
    launcher = subprocess.Popen(launcher_cmd(CONFIG, manifest, out, "pearl", "--quiet"), cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not results(out):  # at least one item done: the ranks are writing
            assert time.monotonic() < deadline and launcher.poll() is None, "no item finished"
            time.sleep(0.1)
        (agent,) = _children(launcher.pid)  # ./torchrun.sh -> torchrun's agent -> the ranks
        ranks = _children(agent)
        assert len(ranks) == 3
        os.kill(agent, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=30)
        time.sleep(1.0)
        assert not [r for r in ranks if _alive(r)], "ranks outlived their launcher"
        before = _snapshot(out)
        time.sleep(1.0)
        assert _snapshot(out) == before  # nothing writes any more
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "torchrun was killed by signal KILL" in stderr and "rerun the same command" in stderr


def test_ctrl_c_says_one_line_keeps_what_finished_and_the_same_command_resumes(tmp_path_factory):
    """Ctrl-C reaches the launcher's whole process group. Each rank printed a KeyboardInterrupt traceback and the
    launcher exited 1; now the target rank says once what is kept, every rank leaves at once, the launcher exits
    130 (as a shell does for SIGINT), and the same command finishes the rest, every id once."""
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=6)
    out = tmp_path_factory.mktemp("ctrl-c")
    cmd = launcher_cmd(CONFIG, manifest, out, "pearl", "--quiet")
    launcher = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not results(out):  # at least one item done
            assert time.monotonic() < deadline and launcher.poll() is None, "no item finished"
            time.sleep(0.1)
        (agent,) = _children(launcher.pid)
        ranks = _children(agent)
        os.killpg(launcher.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("vpsd:")]
    assert said == [f"vpsd: interrupted: the items finished are kept in {out}; rerun the same command to do the rest"]
    assert "[rank" not in stderr and "KeyboardInterrupt" not in stderr
    assert not [r for r in ranks if _alive(r)]
    kept = results(out)  # whole lines, each a finished item
    assert 1 <= len(kept) < 6 and all(r["error"] is None for r in kept.values())
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(it.id for it in load_manifest(manifest)[0])
    assert all(lines[i] == kept[lines[i]["id"]] for i in range(len(kept)))  # the kept lines, untouched, first

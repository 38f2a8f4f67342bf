"""`vpsd serve` as a child process on a free loopback port, handed over once it answers /health: what the serving
benchmark (vpsd/bench/serve.py) and the tests that call a real server start it with."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Sequence


class ServerFailed(RuntimeError):
    """The server exited, or did not answer /health in time (it is killed then); the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VPSD_SERVE = (sys.executable, "-m", "vpsd.launch.cli", "serve")


def start_server(args: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None,
                 cwd: Path | None = None, command: Sequence[str] = VPSD_SERVE) -> tuple[subprocess.Popen, str]:
    """`vpsd serve ARGS --port P` (P free on 127.0.0.1; `command`: what runs it, e.g. `./torchrun.sh serve`), its
    output in `log`; returns the process and its base URL (http://127.0.0.1:P) once /health answers 200."""
    port = free_port()
    cmd = [*command, *args, "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerFailed(f"vpsd serve exited {proc.returncode} at startup:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise ServerFailed(f"vpsd serve did not answer in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (the server and its child ranks), in MiB: psutil where it
    is installed, else /proc."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0.0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        return total / 2**20
    total_kib, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total_kib += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total_kib / 1024

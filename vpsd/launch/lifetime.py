"""What ties a job's processes to the job's life: one writer per results directory, no orphaned ranks.

- `lock_out_dir(out)`: an exclusive flock on `out/.vpsd.lock`, taken at launch by the rank that writes
  results.jsonl (the target) and held until that process ends. The kernel drops it when the process dies, however
  it dies, so a crash never leaves a stale lock. The holder writes its pid, host and start time into the file;
  a second job on the same directory stops at launch with `OutDirBusy` naming them. (Two jobs on one --out
  would otherwise both run every item and append it twice.)
- `die_with_parent()`: the rank asks the kernel for SIGKILL when its parent (the torchrun agent) dies, so a
  killed launcher takes its ranks with it at once instead of leaving them writing results for a rerun to
  duplicate. Linux only (prctl); elsewhere a no-op.
- `end_silent_peer(record)`: a rank that found a peer silent past the timeout kills it (SIGKILL) when it runs on
  the same host. A stopped or hung rank ignores torchrun's SIGTERM, and torchrun waits 30 s before its SIGKILL
  (not configurable on the failure path), so without this the job would end 30 s after it was reported.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".vpsd.lock"
_PR_SET_PDEATHSIG = 1

_held: list[IO[str]] = []  # the open lock files: the lock lives as long as the file stays open


class OutDirBusy(RuntimeError):
    """Another live job holds the results directory."""


def lock_out_dir(out: Path) -> None:
    """Hold `out`'s lock for the rest of this process's life; OutDirBusy if another process holds it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / LOCK_FILE, "a+", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _describe(f.read())
        f.close()
        raise OutDirBusy(
            f"{out} is in use by another job ({holder}): two jobs on one --out would run every item twice. "
            f"Wait for it to end, or give this job another --out."
        ) from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}) + "\n")
    f.flush()
    _held.append(f)


def _describe(text: str) -> str:
    try:
        h = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h["started"])))
        return f"pid {h['pid']} on {h['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (see the module doc); exits at once if it already has."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the launcher's death then ends the ranks by their timeouts
    if os.getppid() == 1:  # the parent died before the request took effect (orphans go to init)
        os._exit(1)


def end_silent_peer(record: dict) -> bool:
    """SIGKILL the rank `record` describes (ControlChannel.peer_record) if it is a vpsd rank on this host."""
    pid = int(record.get("pid") or 0)
    if pid <= 0 or pid == os.getpid() or record.get("host") != socket.gethostname():
        return False
    try:
        if b"vpsd.launch.entry" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False  # gone, and the pid reused by something else
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        return False
    return True

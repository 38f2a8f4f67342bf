"""What ties a job's processes to the job's life: one writer per results directory, no orphaned ranks.

- `lock_out_dir(out)`: an exclusive flock on `out/.vpsd.lock`, taken at launch by the rank that writes
  results.jsonl (the target) and held until that process ends. The kernel drops it when the process dies, however
  it dies, so a crash never leaves a stale lock. The holder writes its pid, host and start time into the file;
  a second job on the same directory stops at launch with `OutDirBusy` naming them. (Two jobs on one --out
  would otherwise both run every item and append it twice.)
- `die_with_parent()`: the rank asks the kernel for SIGKILL when its parent (the torchrun agent, which is
  ./torchrun.sh's own process: vpsd/launch/launcher.py) dies, so a launcher killed even by SIGKILL takes its
  ranks with it at once instead of leaving them writing results for a rerun to duplicate. Where prctl is not
  there or not allowed, a thread polls the parent's pid twice a second and ends the rank when it changes.
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
import threading
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
        raise OutDirBusy(_busy(out, holder)) from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}) + "\n")
    f.flush()
    _held.append(f)


def out_dir_holder(out: Path) -> str | None:
    """Without taking it for long: OutDirBusy's message if a live process holds `out`'s lock, else None. The
    launcher asks before it starts any rank, so that a second job on a busy --out is refused at once; the target
    rank's `lock_out_dir` stays the one that counts (this check and a start could race). Creates nothing."""
    try:
        f = open(Path(out) / LOCK_FILE, "r", encoding="utf-8")
    except OSError:
        return None  # no lock file (or no directory): no job has held it
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _busy(Path(out), _describe(f.read()))
        except OSError:
            return None  # a file system without flock: the rank's own lock decides
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


def _busy(out: Path, holder: str) -> str:
    return (f"{out} is in use by another job ({holder}): two jobs on one --out would run every item twice. "
            f"Wait for it to end, or give this job another --out.")


def _describe(text: str) -> str:
    try:
        h = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h["started"])))
        return f"pid {h['pid']} on {h['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def die_with_parent() -> None:
    """End this process when its parent dies (see the module doc); exits at once if it already has."""
    parent = os.getppid()
    if parent == 1:  # the parent died before this process could ask (orphans go to init)
        os._exit(1)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died between the two looks: the request came too late
                os._exit(1)
            return
    # No prctl (another OS, or a sandbox that forbids it): a thread watches for the re-parenting instead.
    threading.Thread(target=_watch_parent, args=(parent,), name="vpsd-parent-watch", daemon=True).start()


def _watch_parent(parent: int, interval_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(interval_s)
    os._exit(1)  # whole results lines only (vpsd/storage.py): what finished is kept


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

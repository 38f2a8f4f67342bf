"""The ranks' arrival: every rank of the launch is up before the process group connects, under the start-up bound.

Why a barrier of our own: `init_process_group(timeout=...)` bounds the rendezvous and gloo's mesh connect with the
same limit that later bounds a transfer to a peer that stopped answering. With a short `--timeout` (a few seconds)
ranks that come up seconds apart (imports on a busy node, a slow shared filesystem) died in gloo's connect with a
traceback in every rank before the job had started. Here each rank announces itself in the rendezvous store and
waits for all the others for up to `--startup-timeout`; only then does the process group connect (everyone is
there, so that is quick), and `--timeout` governs what follows.

Contract:
- `make_store(startup_timeout_s, say)` opens the store torchrun's environment describes, as torch's env://
  rendezvous would: every rank a client of the agent's store when torchrun shares it (its default; the store is
  up before any rank, and each restart attempt keeps to keys of its own), else rank 0 hosts it.
- `await_ranks(store, rank, world, local_world, startup_timeout_s, say)` returns once every rank has arrived.
  While it waits, rank 0 says a progress line now and then (ranks up, who is missing, time spent of the bound);
  when the bound passes, one rank says one line naming each missing rank, its node, and the host of a rank of
  that node that did arrive, and every rank that came raises `RanksMissing` (the launcher exits 2: torchrun then
  stops the ranks still starting).
- A store that cannot be reached at all (its host, rank 0, never started) is `RanksMissing` too, naming rank 0.
- `await_connected(store, rank, world, startup_timeout_s)`, called once the process group is made, returns once
  every rank has made it. Why: gloo's mesh connect returns in a rank when its own pairs are up, not everyone's;
  a rank that leaves at once (one a method leaves idle) closed its pairs while a slower peer still read its
  handshake, and that peer died with "Connection closed by peer" in its connect (seen in CI, 1 run in ~10).

Test hook (the start-up tests through real ranks; never set outside tests): VPSD_TEST_LATE_START=<rank>:<seconds>
makes that rank sleep that long before it arrives; <seconds> = "never" makes it never arrive.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import msgspec
import torch.distributed as dist

KEY = "vpsd/start"
POLL_S = 0.05  # how often a waiting rank looks again: start-up costs at most this past the last arrival
FIRST_REPORT_S = 5.0  # a wait shorter than this is not worth a line
REPORT_EVERY_S = 15.0
SETTLE_S = 5.0  # how long a rank that gave up waits for the reporter to say why, before it exits
GAVE_UP, SAID, CONNECTED = f"{KEY}/gave_up", f"{KEY}/said", f"{KEY}/connected"


class RanksMissing(RuntimeError):
    """Ranks that did not arrive within the start-up bound; the message is the one line the user reads."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Arrival:
    rank: int
    host: str
    pid: int


def make_store(startup_timeout_s: float, say: Callable[[str], None]) -> dist.Store:
    """The rendezvous store of torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE): what torch's
    env:// rendezvous opens, with the start-up bound as its timeout. RanksMissing when rank 0's store never
    answers: said by one rank a node where it can be (the lowest local rank other than rank 0; nothing is shared
    yet to agree on one), the others giving it a moment before they exit."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
    try:
        # wait_for_workers=False: rank 0 waits in await_ranks, where it can say who is missing, not in here.
        store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store,
                              timeout=timedelta(seconds=startup_timeout_s), wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, dist.DistError) as e:
        if rank == 0 or agent_store:
            raise
        line = (f"rank 0 (node 0) did not start within the start-up bound ({startup_timeout_s:.0f} s, "
                f"--startup-timeout): rank {rank} found no rendezvous store at {host}:{port} "
                f"({str(e).splitlines()[0]})")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank == (1 if rank == local_rank else 0):
            say(line)
        else:
            time.sleep(SETTLE_S)
        raise RanksMissing(line, [0]) from None
    if not agent_store:
        return store  # rank 0's, new with every attempt
    # The agent's store outlives a restart: each attempt keeps to keys of its own, or a restarted rank would read
    # the dead attempt's addresses and hang in the process group's connect (pytorch/pytorch#135712).
    global _opened
    _opened = attempt_store(store, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    return _opened


_opened: dist.Store | None = None


def rendezvous_store() -> dist.Store:
    """The store this launch met in (its attempt's keys), as `make_store` opened it: where the control plane
    publishes its addresses. Not the default group's view of it, whose key prefix is torch's business: a process
    outside the group (the Python API playing a job's coordinator, launch/served.py) opens the same keys with
    `attempt_store`."""
    if _opened is None:  # a group made some other way (a test's own init_process_group)
        return dist.distributed_c10d._get_default_store()
    return _opened


def attempt_store(store: dist.Store, attempt: int = 0) -> dist.Store:
    """The keys of one restart attempt of a launch in its rendezvous store (torchrun's restarts share the store)."""
    return dist.PrefixStore(f"vpsd/attempt-{attempt}", store)


def late_start_hook(rank: int) -> None:
    """The test hook of the module docstring."""
    want, _, seconds = os.environ.get("VPSD_TEST_LATE_START", "").partition(":")
    if want != str(rank):
        return
    if seconds == "never":
        while True:
            time.sleep(1.0)
    time.sleep(float(seconds))


def await_connected(store: dist.Store, rank: int, world: int, startup_timeout_s: float,
                    say: Callable[[str], None]) -> None:
    """Wait (under the start-up bound) until every rank's process group is made: the module docstring's why.
    RanksMissing names the ranks whose connect never finished (crashed in it, or hang), said by the lowest rank
    that finished."""
    store.set(f"{CONNECTED}/{rank}", b"1")
    keys = [f"{CONNECTED}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=startup_timeout_s))
    except (RuntimeError, dist.DistError):
        missing = [r for r in range(world) if not store.check([f"{CONNECTED}/{r}"])]
        line = (f"{_plural('rank', missing)} {', '.join(map(str, missing))} did not finish the process group's "
                f"connect within the start-up bound ({startup_timeout_s:.0f} s, --startup-timeout)")
        if rank == min(r for r in range(world) if r not in missing):
            say(line)
        raise RanksMissing(line, missing) from None


def await_ranks(store: dist.Store, rank: int, world: int, local_world: int, startup_timeout_s: float,
                say: Callable[[str], None], progress: bool = True) -> float:
    """Announce this rank and wait for all `world` ranks (see the module docstring); returns the seconds waited.

    Progress lines (`progress`, rank 0 only) and the final line go to `say`. When the bound passes, the first
    rank to give up records its line in the store, every waiting rank sees it on its next look, and the lowest
    rank that came says it: one line for the job, wherever the ranks' bounds ran out first."""
    store.set(f"{KEY}/{rank}", msgspec.msgpack.encode({"host": socket.gethostname(), "pid": os.getpid()}))
    store.add(f"{KEY}/count", 1)
    start = time.monotonic()
    next_report = start + FIRST_REPORT_S
    while True:
        waited = time.monotonic() - start
        if store.add(f"{KEY}/count", 0) >= world:
            return waited
        if store.check([GAVE_UP]) or waited >= startup_timeout_s:
            _give_up(store, rank, world, local_world, startup_timeout_s, say)
        if progress and rank == 0 and time.monotonic() >= next_report:
            missing = _missing(store, world)
            say(f"starting: {world - len(missing)} of {world} ranks up, waiting for "
                f"{_ranks_and_nodes(missing, local_world)} ({waited:.0f} s of the start-up bound, "
                f"{startup_timeout_s:.0f} s)")
            next_report += REPORT_EVERY_S
        time.sleep(POLL_S)


def _give_up(store: dist.Store, rank: int, world: int, local_world: int, startup_timeout_s: float,
             say: Callable[[str], None]) -> None:
    """Record (first giver wins) or read the verdict, say it if this rank is the reporter, raise RanksMissing."""
    missing = _missing(store, world)
    mine = msgspec.msgpack.encode({"line": missing_line(missing, _arrivals(store, world), local_world,
                                                        startup_timeout_s), "missing": missing})
    verdict = msgspec.msgpack.decode(store.compare_set(GAVE_UP, b"", mine))
    missing = verdict["missing"]
    if rank == min(r for r in range(world) if r not in missing):
        say(verdict["line"])
        store.set(SAID, b"1")
    else:  # torchrun stops every rank once one exits: give the reporter its moment
        try:
            store.wait([SAID], timedelta(seconds=SETTLE_S))
        except (RuntimeError, dist.DistError):
            pass
    raise RanksMissing(verdict["line"], missing)


def missing_line(missing: list[int], arrived: dict[int, Arrival], local_world: int, startup_timeout_s: float) -> str:
    """One line naming the ranks that never arrived: rank, node, and the host of that node where one is known."""
    parts = []
    for r in missing:
        node = r // local_world
        hosts = sorted({a.host for k, a in arrived.items() if k // local_world == node})
        where = f"node {node}, host {hosts[0]}" if hosts else f"node {node}"
        parts.append(f"rank {r} ({where})")
    up = sorted(arrived)
    return (f"{', '.join(parts)} did not start within the start-up bound ({startup_timeout_s:.0f} s, "
            f"--startup-timeout); {_plural('rank', up)} {', '.join(map(str, up))} waited for "
            f"{'it' if len(missing) == 1 else 'them'}: a rank still importing or loading on a busy node needs a "
            f"longer bound, a node that failed needs restarting")


def _missing(store: dist.Store, world: int) -> list[int]:
    return [r for r in range(world) if not store.check([f"{KEY}/{r}"])]


def _arrivals(store: dist.Store, world: int) -> dict[int, Arrival]:
    out = {}
    for r in range(world):
        if store.check([f"{KEY}/{r}"]):
            rec = msgspec.msgpack.decode(store.get(f"{KEY}/{r}"))
            out[r] = Arrival(r, rec["host"], rec["pid"])
    return out


def _ranks_and_nodes(ranks: list[int], local_world: int) -> str:
    return ", ".join(f"rank {r} (node {r // local_world})" for r in ranks)


def _plural(word: str, items: list) -> str:
    return word if len(items) == 1 else word + "s"

"""Served pipelines: a method's ranks fed one request at a time by a coordinator in this process. They are the
Python API's child processes (`vpsd.LLM(..., draft_on="rank")`, the API's default: `ServedRanks`), or, under
torchrun, the launch's pipelines, coordinated from the leader's process (`ServedPipelines`, serve/launched.py).

`ServedRanks` starts one pipeline's ranks (target, draft, pruner; a split target's followers) the way torchrun
starts a job's: the same entry (launch/entry.py), roles, transport and control plane, each child with torchrun's
environment over a rendezvous store this process hosts. This process then plays the job's coordinator for them
(launch/coordinator.py's protocol, over the control plane as its identity, rank `world`): `submit(item)` queues an
item beside those in flight, granted as the pipeline's target asks for work (`WorkRequest` / `WorkGrant`: at once
to a target that waits with nothing decoding, else at its next request, when its batch has a free slot), and
`poll(timeout_s)` answers the target meanwhile and returns each item's result line (`ItemResult`) as it finishes;
`run(items)` is both, for the API's `generate` calls. The target reports each round's committed tokens
(`ItemProgress`: `committed(id)` holds them, `fresh()` says whose grew), and `cancel(id)` drops an item: one not
granted yet here, one decoding at the target's next round (`CancelItem`); either ends as an error row. Each result
carries its target's prefix-cache counters as they were then (`ItemResult.reuse`): `reuse_stats()` holds each
pipeline's latest, summed (a server's /metrics). A target
with nothing decoding and nothing submitted waits here, unanswered, with the models loaded; one that asks with
items decoding is told "not now" and asks again after its next round. With several pipelines an item goes to
whichever asks first. `close()` ends the pipelines as a job's end does (no more items, runs reported, `Shutdown`).

Why child processes and not threads: each role gets its own interpreter (no GIL shared between the draft's and the
target's eager steps) and its own CUDA context, as in a job; and this process needs no torch.distributed group of
its own, so it runs inside a program that has one (lmms-eval under `accelerate launch`). Only a store, a ZeroMQ
socket and the children.

Lifetime: the children die with this process (PR_SET_PDEATHSIG, launch/lifetime.py: tied to the thread that
started them, so start an `LLM` on a thread that outlives it, the main thread in a notebook) and run in a session
of their own, so a terminal's Ctrl-C reaches only the caller, whose `KeyboardInterrupt` stops them (`kill`). A child
that exits while this process waits for it is `RanksFailed`, with the lines it said (its stderr is kept in
`out/ranks/`), never a hang.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import yaml

from vpsd.config import RunConfig
from vpsd.launch.arguments import SERVED
from vpsd.launch.layout import Layout, plan
from vpsd.launch.manifest import ManifestItem
from vpsd.engine.request import CANCELLED
from vpsd.launch.results import ItemError, ResultRow
from vpsd.pipeline.messages import (CancelItem, ItemProgress, ItemResult, PipelineDone, Shutdown, WorkGrant,
                                    WorkRequest)
from vpsd.transport.auth import SECRET_ENV
from vpsd.transport.control import ControlChannel, PeerTimeout
from vpsd.transport.startup import attempt_store

POLL_S = 0.5  # how often a wait looks at the children's health
STOP_S = 30.0  # how long close() waits for the ranks to leave before it kills them


class RanksFailed(RuntimeError):
    """A child rank exited (or never started); the message holds what it said."""


class ServedPipelines:
    """The coordinator's side of served pipelines (module docstring), over a control channel given to `attach`:
    the API's child ranks (`ServedRanks`) or, under torchrun, the launch's pipelines, coordinated from a thread of
    the leader's process (`vpsd serve` on ranks: serve/launched.py)."""

    def __init__(self, method: str, pipelines: int = 1) -> None:
        self.method, self.pipelines = method, pipelines
        self.ctrl: ControlChannel | None = None
        self._asked: list[int] = []  # targets waiting for an item (WorkRequest with needed), unanswered
        self._pending: deque[ManifestItem] = deque()  # submitted, not granted yet
        self._granted: dict[str, int] = {}  # granted to a pipeline, no result yet: to which target rank
        self._committed: dict[str, list[int]] = {}  # a granted item's tokens so far (ItemProgress)
        self._fresh: set[str] = set()  # items whose committed tokens grew since `fresh()` was last asked
        self._reports = 0  # ItemProgress messages taken so far
        self._done: dict[str, ResultRow] = {}  # finished, not taken by poll or run yet
        self._ended = 0  # pipelines that reported their run (PipelineDone) and were told to stop
        self._closed = False
        # Each pipeline's target's prefix-cache counters, as its latest result carried them (ItemResult.reuse).
        # Replaced whole on each update: another thread (a server's /metrics) reads it without a lock.
        self._reuse: dict[int, dict[str, int]] = {}

    def attach(self, ctrl: ControlChannel, startup_timeout_s: float) -> None:
        """Coordinates over `ctrl` (its identity the layout's coordinator); returns once every pipeline's target
        has asked for its first item (models loaded, draft and pruner up), within `startup_timeout_s`."""
        self.ctrl = ctrl
        self._await_request(startup_timeout_s)

    def check(self) -> None:
        """RanksFailed when a rank is gone (ranks this process started can be watched; torchrun's stop the launch)."""

    def kill(self) -> None:
        """Stops coordinating at once (a failure, an interrupt): the ranks cannot be used after it."""
        self._closed = True
        if self.ctrl is not None:
            self.ctrl.close()
            self.ctrl = None

    def _leave(self, deadline: float) -> None:
        """After the pipelines' end: what else must go by `deadline` (the children of ServedRanks)."""

    def _where(self) -> str:
        return "the ranks' output"

    # ---- the coordinator's side ------------------------------------------------------------------------

    def _recv(self, limit_s: float | None) -> tuple[int, object]:
        """The next message from a rank, the children watched meanwhile (RanksFailed), within `limit_s`."""
        deadline = None if limit_s is None else time.monotonic() + limit_s
        while True:
            try:
                return self.ctrl.recv(timeout_s=POLL_S)
            except PeerTimeout:
                pass
            self.check()  # outside the except: a RanksFailed is not "during handling of" a poll's timeout
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise RanksFailed(f"the ranks did not start within the start-up bound ({limit_s:.0f} s, "
                                  f"startup_timeout_s); see {self._where()}")

    def _await_request(self, limit_s: float) -> None:
        while len(self._asked) < self.pipelines:
            src, msg = self._recv(limit_s)
            self._answer(src, msg)

    def _answer(self, src: int, msg: object) -> None:
        if isinstance(msg, WorkRequest):
            if self._pending:  # needed or read ahead: the pipeline takes the items as it has room
                self._grant(src)
            elif msg.needed and src not in self._granted.values():
                self._asked.append(src)  # nothing decoding: answered with the next item submitted, or at close
            else:  # not now: a read-ahead, or a slot free beside items decoding (it asks again after a round)
                self.ctrl.send(src, WorkGrant(None, more=True))
        elif isinstance(msg, ItemProgress):
            for item_id, tokens in msg.tokens.items():
                if item_id in self._granted:
                    self._committed.setdefault(item_id, []).extend(tokens)
                    self._fresh.add(item_id)
            self._reports += 1
        elif isinstance(msg, ItemResult):
            row = ResultRow.from_json(msg.row)
            if msg.reuse is not None:
                self._reuse = {**self._reuse, msg.pipeline: dict(msg.reuse)}
            self._granted.pop(row.id, None)
            self._committed.pop(row.id, None)
            self._fresh.discard(row.id)
            self._done[row.id] = row
        elif isinstance(msg, PipelineDone):
            self.ctrl.send(src, Shutdown("the server closed its ranks"))
            self._ended += 1

    def _grant(self, src: int) -> None:
        item = self._pending.popleft()
        self._granted[item.id] = src
        self.ctrl.send(src, WorkGrant(item.to_wire(), more=True))

    @property
    def in_flight(self) -> int:
        """Items submitted whose result has not been taken yet (queued here, decoding, or finished)."""
        return len(self._pending) + len(self._granted) + len(self._done)

    def submit(self, item: ManifestItem) -> None:
        """Queues an item for the pipelines, beside those in flight: a waiting pipeline gets it at once, a busy
        one when it asks (at its next round with a free slot, or when its batch frees one). Its id must be new
        among the items in flight."""
        if self._closed or self.ctrl is None:
            raise RanksFailed("the ranks are stopped")
        self._pending.append(item)
        try:
            while self._pending and self._asked:
                self._grant(self._asked.pop(0))
        except BaseException:
            self.kill()
            raise

    def poll(self, timeout_s: float | None) -> list[ResultRow]:
        """The rows finished so far, waiting up to `timeout_s` (None: no bound) for one, or for an item's tokens
        to grow (`fresh`), while answering the
        pipeline's requests from the submitted items; RanksFailed when a child exited (the ranks are then
        stopped, as on any exception: an interrupt stops them as a job's Ctrl-C does)."""
        try:
            reports = self._reports  # a report that comes during this call ends it, not one left untaken before
            self._pump(timeout_s, lambda: bool(self._done) or self._reports > reports)
        except BaseException:
            self.kill()
            raise
        rows, self._done = list(self._done.values()), {}
        return rows

    def _pump(self, timeout_s: float | None, enough: Callable[[], bool]) -> None:
        """Answers the pipeline's messages until `enough()` or `timeout_s` passes, the children watched."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not enough():
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                self.check()  # a busy channel never times out: look at the children once a bounded pump ends
                return
            try:
                src, msg = self.ctrl.recv(timeout_s=wait)
            except PeerTimeout:
                src, msg = None, None
            if msg is None:
                self.check()  # outside the except: a RanksFailed is not "during handling of" a poll's timeout
                continue
            self._answer(src, msg)

    def committed(self, item_id: str) -> list[int]:
        """The tokens a granted item has committed so far (its target's rounds' reports)."""
        return self._committed.get(item_id, [])

    def reuse_stats(self) -> dict[str, int] | None:
        """The pipelines' targets' prefix-cache counters (engine/prefix_cache.py ReuseStats), each as its latest
        result carried them, summed over the pipelines (bytes, peaks and budgets too: each target holds its own
        cache); None before any result carried them (none yet, reuse off, or a split target). Any thread."""
        held = list(self._reuse.values())
        if not held:
            return None
        return {k: sum(s.get(k, 0) for s in held) for k in held[0]}

    def fresh(self) -> set[str]:
        """The items whose committed tokens grew since the last call."""
        ids, self._fresh = self._fresh, set()
        return ids

    def cancel(self, item_id: str) -> None:
        """Drops an item: one not granted yet now, one granted at its target's next round; its row (`poll`) is an
        error. An item already finished keeps its row."""
        if item_id in self._granted:
            self.ctrl.send(self._granted[item_id], CancelItem(item_id))
        elif any(item.id == item_id for item in self._pending):
            self._pending = deque(item for item in self._pending if item.id != item_id)
            self._done[item_id] = ResultRow(item_id, self.method, [], "", {}, ItemError("ValueError", CANCELLED))

    def run(self, items: Iterable[ManifestItem]) -> dict[str, ResultRow]:
        """Each item's result line, by id, once all of them have finished (submit, then pump until they are
        done; rows of other items submitted meanwhile stay for `poll`)."""
        items = list(items)
        wanted = {item.id for item in items}
        for item in items:
            self.submit(item)
        try:
            self._pump(None, lambda: wanted <= self._done.keys())
        except BaseException:  # an interrupt, or a rank gone (already stopped): nothing is left running
            self.kill()
            raise
        return {i: self._done.pop(i) for i in wanted}

    def close(self) -> None:
        """The pipelines' end, as a job's (each target reports its run and is told to stop), then the children's;
        any that has not left within STOP_S is killed."""
        if self._closed or self.ctrl is None:
            return
        self._closed = True
        try:
            for src in self._asked:
                self.ctrl.send(src, WorkGrant(None, more=False))
            self._asked = []
            deadline = time.monotonic() + STOP_S
            while self._ended < self.pipelines and time.monotonic() < deadline:
                try:
                    src, msg = self.ctrl.recv(timeout_s=POLL_S)
                except PeerTimeout:
                    try:
                        self.check()
                    except RanksFailed:
                        break  # a rank gone: the others are stopped with it
                    continue
                if isinstance(msg, WorkRequest):
                    self.ctrl.send(src, WorkGrant(None, more=False))
                else:
                    self._answer(src, msg)
            self._leave(deadline)
        except BaseException:
            self.kill()
            raise
        finally:
            if self.ctrl is not None:
                self.ctrl.close()
                self.ctrl = None


class ServedRanks(ServedPipelines):
    def __init__(self, cfg: RunConfig, method: str, out: Path, startup_timeout_s: float) -> None:
        """Starts the ranks and returns once the pipeline's target asks for its first item (models loaded, draft
        and pruner up): the pipeline's start-up, bounded by `startup_timeout_s`."""
        super().__init__(method)
        self.cfg, self.out = cfg, Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        size = max(cfg.roles.values()) + cfg.target.tensor_parallel  # one pipeline's ranks
        self.layout: Layout = plan(size, size, dict(cfg.roles), cfg.target.tensor_parallel)
        secret = secrets.token_hex(32)
        self.children: list[tuple[int, subprocess.Popen, Path]] = []
        try:  # an interrupt (or a failure) while they start stops what has started
            # This process hosts the store (on a free port); every child is a client of it, as a rank is of
            # torchrun's agent store.
            self._store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=startup_timeout_s), multi_tenant=True)
            self._spawn(self._store.port, secret)
            store = attempt_store(self._store)  # the keys the children publish their addresses under
            self.attach(ControlChannel(self.layout.coordinator, self.layout.world + 1, "coordinator", store,
                                       secret=secret.encode(), connect_timeout_s=startup_timeout_s),
                        startup_timeout_s)
        except BaseException:
            self.kill()
            raise

    # ---- the children ----------------------------------------------------------------------------------

    def _spawn(self, port: int, secret: str) -> None:
        config = self.out / "config.yaml"
        config.write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        manifest = self.out / "served.jsonl"  # the job's manifest, empty: items come from here, not a file
        manifest.touch()
        logs = self.out / "ranks"
        logs.mkdir(exist_ok=True)
        p = self.cfg.pruning
        argv = [sys.executable, "-m", "vpsd.launch.entry", "--config", str(config), "--manifest", str(manifest),
                "--out", str(self.out), "--method", self.method, "--pruning", p.strategy, "--ratio", str(p.ratio),
                "--quiet"]
        world = self.layout.world
        base = _child_environment()
        for rank in range(world):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True", SECRET_ENV: secret,
                   SERVED: "1"}
            log = logs / f"rank{rank}.log"
            with open(log, "wb") as stderr:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                        start_new_session=True)
            self.children.append((rank, proc, log))

    def check(self) -> None:
        """RanksFailed when a child has exited (or the ranks were closed)."""
        for rank, proc, log in self.children:
            code = proc.poll()
            if code is not None:
                said = [line.removeprefix("vpsd: ") for line in _tail(log) if line.startswith("vpsd: ")]
                role = next((r for r, k in self.layout.leader.ranks.items() if k == rank), "follower")
                self.kill()
                raise RanksFailed(f"the {role} rank (rank {rank}) exited with status {code}"
                                  + (f": {'; '.join(said)}" if said else f"; its output is in {log}"))

    def kill(self) -> None:
        """Stops every child at once (a failure, an interrupt); the ranks cannot be used after it."""
        for _, proc, _ in self.children:
            if proc.poll() is None:
                proc.kill()
        for _, proc, _ in self.children:
            proc.wait()
        super().kill()

    def _leave(self, deadline: float) -> None:
        for _, proc, _ in self.children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _where(self) -> str:
        return str(self.out / "ranks")


def _child_environment() -> dict[str, str]:
    """The caller's environment without what a launcher gave the caller itself (it may be one rank of its own
    launch: lmms-eval under torchrun or `accelerate launch`). Such a caller's ranks get its GPU alone, so that
    their placement (transport/placement.py, by local rank) stays on the GPU the caller was given."""
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "VPSD_REFUSAL_MARK", "VPSD_LAUNCH_DIR")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    # One intra-op thread a rank unless the caller says otherwise, as torchrun sets for several ranks a node: three
    # ranks each with a thread a core oversubscribe the cores (measured: the embedded pair's hippo decoded an item
    # in 1.55 s on ranks so started, 0.19 s in the same job under torchrun).
    env.setdefault("OMP_NUM_THREADS", "1")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
        gpus = [g for g in visible.split(",") if g.strip()]
        env["CUDA_VISIBLE_DEVICES"] = gpus[int(local_rank) % len(gpus)]
    return env


def _tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []

"""The engine wired for a method: one path for the torchrun job's target (launch/job.py) and the Python API
(vpsd/api.py).

`build_engine` picks the drafter where the method's draft runs (`Method.draft_place`): none (`ar`), the draft in
this process (serial, or a parallel method over a batch that is not pipelined), its own rank (`rank_link`, the
job only), or threads of this process (`draft_on: thread`, launch/in_process.py); in this process, the drafter
for what the method drafts (`local_drafter`: a chain, a tree, Sparse-to-Dense's sparse KV). It returns the engine,
its scheduler, and what stops the drafter after the last item.

`SharedFrames` hands a draft thread the frames the target side read (the same, already fitted to the context),
instead of having it read the file again; what it does not hold it reads as a draft rank does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vpsd.config import RunConfig
from vpsd.engine.engine import Engine
from vpsd.engine.drafters.local import LocalDrafter
from vpsd.engine.scheduler import Scheduler
from vpsd.engine.drafters.sparse_kv import SparseKVDrafter
from vpsd.engine.drafters.tree import TreeDrafter
from vpsd.launch.in_process import RoleThreads
from vpsd.models.base import VideoLMAdapter
from vpsd.models.registry import load_draft
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.pipeline.methods import DraftPlace, Method
from vpsd.roles.link import Link
from vpsd.engine.drafters.remote import RemoteDrafter
from vpsd.video.prefetch import FramePrefetcher


@dataclass
class Wired:
    engine: Engine
    scheduler: Scheduler
    stop: Callable[[], None]  # after the last item: the drafter's shutdown (its threads or ranks leave)

    def ready(self, limit_s: float) -> None:
        """Before the first item: a draft and pruner of their own (ranks or threads) have loaded and said so."""
        if isinstance(self.engine.drafter, RemoteDrafter):
            self.engine.drafter.await_peers(limit_s)


def local_drafter(cfg: RunConfig, method: Method, target: VideoLMAdapter, draft: VideoLMAdapter | None) -> LocalDrafter:
    """The drafter in the target's process for what `method` drafts: Sparse-to-Dense's sparse KV of the target, a
    static tree, or a chain (`draft` None: the target drafts for itself, `draft: self`)."""
    if method.draft == "sparse_kv":
        return SparseKVDrafter(target, cfg.decoding, cfg.pruning)
    tree = method.draft_tree(cfg.decoding.tree)
    if tree is not None:
        return TreeDrafter(target, draft or target, cfg.decoding, cfg.pruning, tree)
    return LocalDrafter(target, draft or target, cfg.decoding, cfg.pruning, method.parallel)


def build_engine(cfg: RunConfig, method: Method, target: VideoLMAdapter, *, draft: VideoLMAdapter | None = None,
                 rank_link: Callable[[], Link] | None = None, out: Path | None = None, job_id: str = "",
                 timeout_s: float = 60.0, videos: Any = None, shared_items: bool = False) -> Wired:
    """The engine for `method` at the config's batch size (module docstring). `draft`: the draft model when already
    loaded (else loaded here where the method needs it in this process); `rank_link`: the link to the draft and
    pruner ranks; `videos`: where draft threads take frames from; `shared_items`: other pipelines take from the
    same items."""
    size = cfg.batching.size
    place = method.draft_place(size, cfg.batching.pipelined, cfg.draft_on)
    cpus = (cfg.cpu_affinity or {}).get("draft")  # the prefill thread's: free where no draft rank works there
    budget = cfg.batching.kv_budget_bytes
    probs = verdicts_carry_target_probs(method.draft, cfg.tabed_settings, cfg.decoding.temperature)
    if place is DraftPlace.REMOTE:
        if rank_link is None:
            raise ValueError(f"method {method.name} drafts on ranks of its own here: set draft_on: thread")
        # A draft rank takes the frames this process read, unless told to read the files itself (video.share_frames)
        drafter = RemoteDrafter(rank_link(), target, cfg, job_id=job_id, timeout_s=timeout_s, target_probs=probs,
                                send_frames=cfg.video.share_frames)
        engine = Engine(target, cfg, size, drafter)
        return Wired(engine, Scheduler(engine, budget, prefill_cpus=cpus, shared_items=shared_items), drafter.shutdown)
    if draft is None and method.loads_draft_model:
        draft = load_draft(cfg.family, cfg.draft, target)
    if place is DraftPlace.THREADS:
        threads = RoleThreads(target, draft if draft is not None else target, cfg, method, out, job_id, timeout_s,
                              videos=videos)
        engine = Engine(target, cfg, size, threads.drafter)
        return Wired(engine, Scheduler(engine, budget, shared_items=shared_items), threads.stop)
    drafter = local_drafter(cfg, method, target, draft) if place is DraftPlace.LOCAL else None
    engine = Engine(target, cfg, size, drafter)
    return Wired(engine, Scheduler(engine, budget, draft if drafter is not None else None, prefill_cpus=cpus,
                                   lend_cores=True, shared_items=shared_items), lambda: None)


class SharedFrames:
    """Frames the target side read, by item id, for a draft thread (the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._files: FramePrefetcher | None = None

    def put(self, item_id: str, frames: np.ndarray, times: np.ndarray) -> None:
        with self._lock:
            self._held[item_id] = (frames, times)

    def drop(self, item_id: str) -> None:
        with self._lock:
            self._held.pop(item_id, None)

    def take(self, wire: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        with self._lock:
            held = self._held.get(str(wire.get("item", "")))
        if held is not None:
            return held[0], held[1], {"video_read_s": 0.0, "video_wait_s": 0.0}
        return self._reader().take(wire)

    def ahead(self, wire: dict[str, Any] | None) -> None:
        if wire is not None and "video" in wire:
            self._reader().ahead(wire)

    def _reader(self) -> FramePrefetcher:
        with self._lock:
            if self._files is None:
                self._files = FramePrefetcher()
            return self._files

    def close(self) -> None:
        if self._files is not None:
            self._files.close()

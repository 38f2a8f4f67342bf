"""A pipeline's target, its I/O and wiring: items from the job's coordinator in, one results line per item back,
the models loaded and the engine wired for the method; the loop itself is the target role's (roles/target.py
`serve_target`).

Contract (the README's "Batch jobs" section says it for users; the job as a whole is launch/coordinator.py):
- Items come from the coordinator one at a time, as this pipeline has room (`CoordinatorLink.items`), and each
  finished item's line goes back to it the moment it finishes (it writes results.jsonl), so a killed job redoes
  only the items in flight.
- One bad item never sinks the job: a VideoError (missing, empty, corrupt, no video stream, too long) or a
  ValueError while decoding it is written as that item's `error: {type, message}` (plus `kind` for a
  VideoError) and the job goes on. Anything else (a dead peer, a bug) ends the job, and what was finished stays.

Served (the API's child ranks, launch/served.py): after every round the tokens each item committed go to the
coordinator (`ItemProgress`), so a server streams them as they commit, and an item the coordinator cancels
(`CancelItem`: its client left) is dropped at the next round, its KV freed, its result an error row. Each result
carries the target's prefix-cache counters as they are then (`ItemResult.reuse`), which the server's /metrics
shows. A job's pipelines do none of it: their results come whole, their counters with their run (`PipelineDone`).

Wiring: `Method.draft_place` says where the method's draft runs; launch/wiring.py builds the engine
(engine/engine.py) with that drafter, and the scheduler's loop (engine/scheduler.py) runs every item.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Callable, Hashable

from vpsd.activity import START, doing
from vpsd.config import RunConfig
from vpsd.engine.engine import Engine
from vpsd.engine.request import CANCELLED, Request
from vpsd.launch.items import ItemReader, LoadedItem
from vpsd.launch.manifest import ManifestItem
from vpsd.launch.video_queue import video_key
from vpsd.launch.wiring import SharedFrames, build_engine
from vpsd.launch.results import ItemError, ResultRow, output_of
from vpsd.models.base import VideoLMAdapter
from vpsd.models.registry import load_adapter
from vpsd.models.tensor_parallel import Mirror
from vpsd.profiling import RoundProfile
from vpsd.pipeline.messages import (CancelItem, ItemProgress, ItemResult, PipelineDone, Shutdown, WorkGrant,
                                    WorkRequest)
from vpsd.reports.kept_log import KeptRecord, append_kept
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.link import RankLink
from vpsd.roles.target import serve_target
from vpsd.tracing import get_logger
from vpsd.transport.control import PeerTimeout
from vpsd.video.errors import VideoError
from vpsd.video.frame_cache import cache_for
from vpsd.video.prefetch import frame_pool


def peak_rss_mib() -> float | None:
    """This process's peak resident memory (VmHWM), in MiB; None where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def error_of(e: Exception | str) -> ItemError:
    if isinstance(e, str):
        return ItemError("ValueError", e)
    return ItemError(type(e).__name__, str(e), e.kind if isinstance(e, VideoError) else None)


class CoordinatorLink:
    """A pipeline target's side of the job's coordinator (launch/coordinator.py), or of a served pipeline's
    (launch/served.py, `served`), over the control plane."""

    def __init__(self, ctx: RoleContext, pipeline: int, coordinator: int, served: bool = False) -> None:
        self.ctx, self.pipeline, self.coordinator, self.served = ctx, pipeline, coordinator, served
        self._cancels: list[str] = []  # CancelItems that came while an answer was awaited
        # A served target's prefix-cache counters (Engine.reuse_stats), sent with each result for the server's
        # /metrics; set once the engine is built.
        self.reuse_stats: Callable[[], dict[str, int] | None] | None = None

    def take(self, needed: bool) -> tuple[ManifestItem | None, bool]:
        """The next item the coordinator grants this pipeline, and whether more may come (engine ItemSource)."""
        self.ctx.ctrl.send(self.coordinator, WorkRequest(self.pipeline, needed))
        grant = self._answer(WorkGrant)
        return (None if grant.item is None else ManifestItem.from_wire(grant.item)), grant.more

    def result(self, row: ResultRow) -> None:
        reuse = self.reuse_stats() if self.served and self.reuse_stats is not None else None
        self.ctx.ctrl.send(self.coordinator, ItemResult(self.pipeline, row.to_json(), reuse))

    def done(self, run: dict) -> None:
        """After the last result: this pipeline's run; returns once the coordinator has written every result."""
        self.ctx.ctrl.send(self.coordinator, PipelineDone(self.pipeline, run))
        self._answer(Shutdown)

    def progress(self, tokens: dict[str, list[int]]) -> None:
        """A served pipeline's round: the tokens each item committed in it."""
        self.ctx.ctrl.send(self.coordinator, ItemProgress(self.pipeline, tokens))

    def cancelled(self) -> list[str]:
        """The items the coordinator cancelled since the last look (never waits)."""
        while self.ctx.ctrl.poll(0.0, src=self.coordinator):
            self._cancels.append(self._take(CancelItem, 0.0).item_id)
        ids, self._cancels = self._cancels, []
        return ids

    def _answer(self, kind: type):
        while True:
            msg = self._take((kind, CancelItem), self.ctx.idle_timeout_s)
            if not isinstance(msg, CancelItem):
                return msg
            self._cancels.append(msg.item_id)  # sent before the answer: taken at the next round

    def _take(self, kind: type | tuple[type, ...], timeout_s: float):
        try:
            _, msg = self.ctx.ctrl.recv(timeout_s=timeout_s, src=self.coordinator)
        except PeerTimeout:
            raise RoleFailure(f"{self.ctx.role} (rank {self.ctx.rank}): the job's coordinator (in the process of rank "
                              f"0's pipeline target) did not answer for {self.ctx.idle_timeout_s:.0f} s") from None
        if not isinstance(msg, kind):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise RoleFailure(f"{self.ctx.role} (rank {self.ctx.rank}): the coordinator sent {type(msg).__name__}, "
                              f"expected {expected}")
        return msg


class ItemEvents:
    """The scheduler's view of the launcher (engine/scheduler.py JobEvents): items become requests, and
    each finished or failed item becomes its results line, sent to the coordinator."""

    def __init__(self, ctx: RoleContext, cfg: RunConfig, reader: ItemReader, target: VideoLMAdapter,
                 sink: CoordinatorLink, frames: SharedFrames | None = None) -> None:
        self.ctx, self.cfg, self.reader, self.target, self.sink, self.frames = ctx, cfg, reader, target, sink, frames
        self.loaded: dict[str, LoadedItem] = {}
        self.failures = self.finished_items = 0
        self.sent: dict[str, int] = {}  # a served item's tokens reported so far (ItemProgress)
        self.cancelled: set[str] = set()  # served items whose client left, until they leave the engine
        # The last items that left: a cancel that crossed an item's result on the wire names one of them, and is
        # dropped (kept, it would stay in `cancelled` for the server's life).
        self.left: collections.deque[str] = collections.deque(maxlen=256)

    def request(self, item: ManifestItem, nxt: ManifestItem | None) -> Request:
        loaded = self.reader.load(item)
        self.loaded[item.id] = loaded
        if self.frames is not None:
            self.frames.put(item.id, loaded.frames, loaded.times)
        return self.reader.request(item, loaded, nxt)

    def started(self, item: ManifestItem) -> None:
        self.ctx.item_id = item.id

    def read_ahead(self, item: ManifestItem) -> None:
        """The scheduler took the item: its video is read on the readers while earlier items are prepared."""
        self.reader.ahead(item)

    def group_key(self, item: ManifestItem) -> Hashable:
        """Items that read the same frames (launch/video_queue.py): a run of them is prefilled together."""
        return video_key(item)

    def after_round(self, engine: Engine) -> None:
        """A served pipeline's round (module docstring): the cancelled items marked to leave, the committed
        tokens of the others reported."""
        self.cancelled.update(i for i in self.sink.cancelled() if i not in self.left)
        fresh: dict[str, list[int]] = {}
        for rid, request in engine.requests.items():
            if request.machine is None or request.error is not None:
                continue
            if rid in self.cancelled:
                request.error = CANCELLED  # it leaves at the next round, as an item its drafter failed
                continue
            out, sent = request.machine.output(), self.sent.get(rid, 0)
            if len(out) > sent:
                fresh[rid], self.sent[rid] = out[sent:], len(out)
        if fresh:
            self.sink.progress(fresh)

    def _left_engine(self, item_id: str) -> None:
        """What this process held for an item, dropped as it leaves the engine (finished or failed)."""
        self.sent.pop(item_id, None)
        self.cancelled.discard(item_id)
        self.left.append(item_id)
        if self.frames is not None:
            self.frames.drop(item_id)

    def finished(self, item: ManifestItem, request: Request) -> None:
        if request.error is not None:
            self.failed(item, request.error)
            return
        self._left_engine(item.id)
        loaded = self.loaded.pop(item.id)
        res = request.result()
        if res.kept is not None and self.ctx.out is not None:  # chosen here; a pruner rank logs its own
            pruning = self.cfg.pruning
            append_kept(self.ctx.out, KeptRecord(item.id, pruning.strategy, pruning.applied_ratio, res.kept, res.layout))
        self.finished_items += 1
        out, reason = output_of(self.target.text, res.token_ids, item.stop, self.target.eos_token_ids)
        stats = {**res.stats_dict(), **loaded.timings, "num_frames": int(loaded.frames.shape[0]),
                 "batch": self.cfg.batching.size, "pipeline": self.sink.pipeline, "generated_tokens": out.generated,
                 "finish_reason": reason}
        self.record(self.row(item, out.tokens, stats, out.text))

    def failed(self, item: ManifestItem, error: Exception | str) -> None:
        self._left_engine(item.id)
        self.failures += 1
        loaded = self.loaded.pop(item.id, None)
        get_logger().error("item_failed", item=item.id, error=str(error))
        self.record(self.row(item, [], loaded.timings if loaded else {}, "", error_of(error)))

    def row(self, item: ManifestItem, token_ids: list[int], stats: dict, text: str,
            error: ItemError | None = None) -> ResultRow:
        return ResultRow(item.id, self.ctx.method.name, token_ids, text, stats, error, self.cfg.pruning.strategy,
                         dict(item.extra))

    def record(self, row: ResultRow) -> None:
        """An item's result line, flushed as it finishes (exactly once: the resume skips its id)."""
        self.sink.result(row)
        get_logger().info("item_done", item=row.id, tokens=len(row.token_ids),
                          error=None if row.error is None else row.error.to_json())


def run_pipeline(ctx: RoleContext, cfg: RunConfig, link: CoordinatorLink, pipelines: int,
                 target_group=None) -> None:
    """This pipeline's share of the job: items from the coordinator until it has no more, then its run.
    `target_group`: the ranks of a split target, this one leading (models/tensor_parallel.py)."""
    with doing(START):  # the models load (and grow) under the start-up bound, not --timeout
        target = load_adapter(cfg.family, cfg.target, group=target_group)  # this rank's share, when split
        if target_group is not None:
            target.mirror = Mirror(target_group, ctx.rank, target.device)
        frames = SharedFrames()  # what a draft thread takes instead of reading the file again
        # The videos, read ahead on the cores no role is pinned to (none left: the prefill thread's, the draft's);
        # a video's frames kept for its next question (video/frame_cache.py: the target's, as ItemReader's)
        frames_cache = cache_for(target, cfg.reuse.frames_bytes)
        readers = frame_pool(cfg.video, cfg.cpu_affinity, (cfg.cpu_affinity or {}).get("draft"), "reader",
                             frames_cache)
        events = ItemEvents(ctx, cfg, ItemReader(target, cfg, readers), target, link, frames)
        wired = build_engine(cfg, ctx.method, target, rank_link=lambda: RankLink(ctx), out=ctx.out, job_id=ctx.job_id,
                             timeout_s=ctx.timeout_s, videos=frames, shared_items=pipelines > 1)
        engine, scheduler, stop_drafter = wired.engine, wired.scheduler, wired.stop
        link.reuse_stats = engine.reuse_stats  # sent with a served pipeline's results (CoordinatorLink.result)
    profile = None
    if cfg.profile_rounds > 0 and ctx.out is not None:
        profile = RoundProfile(ctx.out, ctx.role, ctx.rank, cfg.profile_rounds, target.device.type == "cuda")
    # start-up ends when a draft and pruner of their own have loaded
    loop_s = serve_target(engine, scheduler, link, events, ready=lambda: wired.ready(ctx.startup_timeout_s),
                          stop=stop_drafter, profile=profile,
                          after_round=(lambda: events.after_round(engine)) if link.served else None)
    frames.close()
    readers.close()
    if target.mirror is not None:
        target.mirror.stop()  # the followers leave
    report = engine.report.as_dict() if cfg.batching.size > 1 else None
    if report is not None:
        get_logger().info("batching_done", **report)
    link.done({"loop_s": loop_s, "peak_rss_mib": peak_rss_mib(), "batching": report,
               "items": events.finished_items, "failed": events.failures, "capture_s": capture_s(engine),
               "reuse": engine.reuse_stats(),  # the prefix cache's hits, misses, bytes (engine/prefix_cache.py)
               "frames_cache": None if frames_cache is None else frames_cache.stats()})  # video/frame_cache.py


def capture_s(engine: Engine) -> float | None:
    """The one-time cost of this process's captured steps (models/captured.py), target's and local draft's."""
    models = {id(m): m for m in (engine.target, getattr(engine.drafter, "draft", None)) if m is not None}
    graphs = [m.captured for m in models.values() if getattr(m, "captured", None) is not None]
    return round(sum(g.capture_s for g in graphs), 3) if graphs else None

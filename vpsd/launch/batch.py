"""The target rank's batch loop: manifest in, one results.jsonl line per item out.

Contract (the README's "Batch jobs" section says it for users):
- Resumable: `ResultsFile.resume` first; ids already in results.jsonl for this method are skipped
  (failed ones too, unless `--retry-failed`), so a rerun or a torchrun restart finishes the rest
  with no duplicates and no gaps. Bad manifest lines become error rows `line:N` once. A rerun with
  other settings (weights, strategy, gamma, ...) is refused at launch instead (launch/job_identity.py).
- One bad item never sinks the job: a VideoError (missing, empty, corrupt, no video stream,
  too long) or a ValueError while decoding it is written as that item's `error: {type, message}`
  (plus `kind` for a VideoError) and the loop goes on. Anything else (a dead peer, a bug) ends the
  job, and what was finished stays.
- Read-ahead: while item i decodes, one background thread reads, scales and fits item i+1
  (`vpsd.video.prefetch`); the draft is told item i+1's request in item i's JobStart and reads it
  ahead the same way. Per item, `stats` gets `video_read_s`, `preprocess_s` and `video_wait_s`
  (the part the target waited for), and `num_frames` (after any subsampling); the same spans are in
  the target's trace.
- Context: an item whose prompt + video + max_new_tokens exceeds `video.context_limit` (default
  the target's max_position_embeddings) fails as `too_long`, or is subsampled to fit when
  `video.subsample_to_fit` is set (`vpsd.video.fit`).
- Returns the summary; the rank exits 0 even when items failed (see summary.EXIT_ITEMS_FAILED for
  the job's status).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from vpsd.config import RunConfig
from vpsd.decoders.batched import BatchDecoder, BatchItem, Prefilled
from vpsd.decoders.result import DecodeResult
from vpsd.decoders.serial import decode_serial
from vpsd.launch.job_identity import record as record_job
from vpsd.launch.manifest import ManifestItem, load_manifest
from vpsd.launch.progress import Progress, wants_bar
from vpsd.launch.results import ResultsFile
from vpsd.provenance import stack
from vpsd.reports.summary import summarize
from vpsd.models.base import VideoLMAdapter
from vpsd.models.checkpoint import read_frame_sampling
from vpsd.models.registry import load_adapter, load_draft
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.reports.kept_log import KeptRecord, append_kept
from vpsd.roles.target import TargetWorker
from vpsd.roles.context import RoleContext
from vpsd.roles.link import RankLink
from vpsd.roles.starting import WorkItem
from vpsd.tracing import get_logger, span
from vpsd.video.errors import VideoError
from vpsd.video.fit import fit_to_context
from vpsd.video.item import FrameRequest, cap_frames, load_frames, timed
from vpsd.video.prefetch import Prefetcher

def peak_rss_mib() -> float | None:
    """This process's peak resident memory (VmHWM), in MiB; None where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def context_limit(target: VideoLMAdapter, cfg: RunConfig) -> int:
    """Tokens one sequence may hold: the config's limit, else what the target's positions allow."""
    if cfg.video.context_limit is not None:
        return int(cfg.video.context_limit)
    return int(target.model.config.get_text_config().max_position_embeddings)


@dataclass
class LoadedItem:
    frames: np.ndarray  # read, scaled, fitted to the context
    times: np.ndarray  # (T,) seconds at which each of those frames was taken
    video: dict  # the wire-form request the draft reads the same frames by (with max_frames if capped)
    timings: dict[str, float]  # video_read_s, preprocess_s


class ItemReader:
    """Reads one item for the target: frames as its request says, scaled, fitted to the context.
    Runs on the prefetch thread; touches the target only through `prepare` (no model forward)."""

    def __init__(self, target: VideoLMAdapter, cfg: RunConfig) -> None:
        self.target = target
        self.cfg = cfg
        self.limit = context_limit(target, cfg)
        # video.sampling: checkpoint: the target processor's rule (checked at launch by preflight).
        self.processor = (read_frame_sampling(cfg.target.path, cfg.family)
                          if cfg.video.sampling == "checkpoint" else None)

    def request(self, item: ManifestItem) -> FrameRequest:
        v = self.cfg.video
        return FrameRequest.resolve(item.video, item.num_frames, item.fps, v.num_frames, v.fps, v.max_side,
                                    self.processor)

    def max_new_tokens(self, item: ManifestItem) -> int:
        return item.max_new_tokens or self.cfg.decoding.max_new_tokens

    def work_item(self, item: ManifestItem, loaded: LoadedItem, nxt: ManifestItem | None) -> WorkItem:
        """The item as the target's roles take it: its frames, and how the draft reads them and the next item's."""
        return WorkItem(item.id, item.prompt, self.max_new_tokens(item), loaded.frames, loaded.video,
                        self.request(nxt).to_wire(nxt.id) if nxt is not None else None, item.extra,
                        frame_times=loaded.times)

    def load(self, item: ManifestItem) -> LoadedItem:
        timings: dict[str, float] = {}
        request = self.request(item)
        frames, times = load_frames(request, item.id, timings)
        reserve = self.max_new_tokens(item)
        with timed("preprocess", timings, item=item.id, step="fit"):
            # A capped clip's times are the same cap of the times (Qwen3-VL's prompt counts them).
            frames, max_frames = fit_to_context(
                frames, lambda f: self.target.prepare(f, item.prompt, cap_frames(times, len(f))).seq_len + reserve,
                self.limit, self.cfg.video.subsample_to_fit, item.video,
            )
        if max_frames is not None:
            get_logger().info("video_subsampled", item=item.id, frames=max_frames, limit=self.limit)
        return LoadedItem(frames, cap_frames(times, max_frames), request.to_wire(item.id, max_frames), timings)


def _error(e: Exception) -> dict:
    err = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, VideoError):
        err["kind"] = e.kind
    return err


Record = Callable[[dict], None]


def _record(results: ResultsFile, progress: Progress, row: dict) -> None:
    """An item's result line, flushed as it finishes (exactly once: the resume skips its id)."""
    results.append(row)
    progress.item_done(len(row["token_ids"]), failed=row["error"] is not None)
    get_logger().info("item_done", item=row["id"], tokens=len(row["token_ids"]), error=row["error"])


def _row(cfg: RunConfig, method: str, it: ManifestItem) -> dict:
    return {"id": it.id, "method": method, "strategy": cfg.pruning.strategy, **it.extra}


def _failed_row(row: dict, timings: dict, e: Exception) -> dict:
    get_logger().error("item_failed", item=row["id"], error=str(e))
    return {**row, "token_ids": [], "text": "", "stats": timings, "error": _error(e)}


def decode_one_at_a_time(ctx: RoleContext, cfg: RunConfig, target: VideoLMAdapter, draft: VideoLMAdapter | None,
                         reader: ItemReader, todo: list[ManifestItem], record: Record) -> int:
    """Each item in turn: a serial method through its reference decoder, a parallel one through the roles (the
    target's worker with one item in flight, roles/target.py, the same worker a pipelined batch runs).
    Returns the failures."""
    method = ctx.method
    link = RankLink(ctx) if method.parallel else None
    worker = target_worker(ctx, link, target, 1) if link is not None else None
    prefetch: Prefetcher[ManifestItem, LoadedItem] = Prefetcher(reader.load, "items")
    if todo:
        prefetch.ahead(todo[0])
    failed = 0
    for i, it in enumerate(todo):
        ctx.item_id = it.id
        nxt = todo[i + 1] if i + 1 < len(todo) else None
        if nxt is not None:
            prefetch.ahead(nxt)  # read while this item decodes
        row = _row(cfg, method.name, it)
        timings: dict[str, float] = {}
        try:
            loaded = prefetch.take(it, timings, item=it.id)
            timings.update(loaded.timings)
            item = reader.work_item(it, loaded, nxt)
            with span("item", item=it.id, method=method.name):
                if worker is not None:
                    res = _decode_in_roles(worker, link, item)
                else:
                    res = _decode_serial(ctx, cfg, target, draft, item)
            row.update(token_ids=res.token_ids, text=target.tokenizer.decode(res.token_ids, skip_special_tokens=True),
                       stats={**res.stats_dict(), **timings, "num_frames": int(loaded.frames.shape[0])}, error=None)
        except (VideoError, ValueError) as e:
            failed += 1
            row = _failed_row(row, timings, e)
        record(row)
    prefetch.close()
    if worker is not None:
        worker.shutdown()
    return failed


def target_worker(ctx: RoleContext, link: RankLink, target: VideoLMAdapter, size: int) -> TargetWorker:
    """The target role's worker for this job, up to `size` items in flight."""
    cfg, method = ctx.config, ctx.method
    return TargetWorker(link, target, cfg, size, job_id=ctx.job_id, timeout_s=ctx.timeout_s,
                        target_probs=verdicts_carry_target_probs(method.draft, cfg.tabed_settings,
                                                                 cfg.decoding.temperature))


def _decode_in_roles(worker: TargetWorker, link: RankLink, item: WorkItem) -> DecodeResult:
    """One item through the roles: admitted on this thread, so its prefill streams the pruner its signals from
    inside (the pruning and the draft's pruned prefill overlap it: HIPPO's synchronous prefill), then verified
    round by round until it is done. A ValueError fails the item alone (the worker has told the roles)."""
    worker.admit(item)  # an empty batch always has room
    while True:
        while link.poll():
            worker.handle(*link.recv())
        ran, finished = worker.step()
        if finished:  # the one item in flight
            (_, res), = finished
            if isinstance(res, Exception):
                raise res
            return res
        if not ran:
            with span("recv_wait", item=item.id):
                link.wait()  # the draft's next chunk (or the pruner's report)


def _decode_serial(ctx: RoleContext, cfg: RunConfig, target: VideoLMAdapter, draft: VideoLMAdapter | None,
                   item: WorkItem) -> DecodeResult:
    """A serial method (`ar`, `sd`, the trees, `std`) on this rank alone, through its reference decoder."""
    dec = dataclasses.replace(cfg.decoding, max_new_tokens=item.max_new_tokens)
    result = decode_serial(ctx.method, target, draft, item.frames, item.prompt, dec, cfg.pruning, item.frame_times)
    if ctx.method.uses_draft:
        result.gamma = float(dec.serial_gamma())
    if result.kept is not None and ctx.out is not None:
        # The pruner rank logs a parallel run's kept tokens; a serial run chose them here.
        append_kept(ctx.out, KeptRecord(item.id, cfg.pruning.strategy, cfg.pruning.applied_ratio, result.kept,
                                        result.layout))
    return result


class PrefillAhead:
    """The next items, read and prefilled ahead on a thread of their own, in manifest order.

    The thread is pinned to the draft's cores when the config pins roles: in the batched engine they are free,
    and in a pipelined batch the draft rank's short forwards leave them mostly idle. So a joining item costs the
    batch its join, not its vision and prefill. Two items more than the free slots are prepared, so a slot that
    frees is taken at once. While the batch is under half full the decode thread prefills too (`steal_if_thin`):
    the decode thread drains its batch faster than one thread can prefill when speculation makes decoding cheap
    (hippo on the scaled default: an item's vision + prefill costs about what its decoding does at B = 8), and a
    half-empty batch wastes the forwards it runs; then both cores prefill until the batch fills again. A thread
    that must wait for the next item (nothing is decoding: the job's start) prefills a later one meanwhile.
    Once every prefill of the job has run (the manifest's tail), the thread's cores go to the decode thread's
    forwards (`lend_cores_when_drained`) until `close`.
    `prepare(item, next item)` runs on either thread and must not touch the transport."""

    def __init__(self, todo: list[ManifestItem], size: int, prepare: Callable, cpus: list[int] | None) -> None:
        self.queue, self.size, self.prepare, self.cpus = list(todo), size, prepare, cpus
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefill", initializer=_pin_thread, initargs=(cpus,))
        self.ahead: deque[tuple[ManifestItem, Future]] = deque()
        self.stolen_s = 0.0  # time the decode thread spent prefilling
        self.lent: tuple[set[int], int] | None = None  # the decode thread's own cores and threads, while lent

    @property
    def pending(self) -> bool:
        return bool(self.queue or self.ahead)

    @property
    def drained(self) -> bool:
        """Every prefill of the job has run: the prefill thread has nothing left to do."""
        return not self.queue and all(future.done() for _, future in self.ahead)

    def lend_cores_when_drained(self) -> int | None:
        """At the manifest's tail the prefill thread's core idles while the last items decode (9-20% of a 32-item
        job's wall at B = 8-16 on the scaled default, for `ar` and hippo alike). Once drained, the calling (decode)
        thread takes those cores and one intra-op thread each, so its forwards run on both: the scaled target's
        forward at B = 8 runs 1.3x (a row an item) to 1.6x (six rows an item) faster on two cores here, and the
        tails of the default's 32-item jobs shrank 0.05-0.2 s (README). The results are bitwise those of one
        thread (tests/test_batch_units.py checks a forward). Returns the intra-op threads now, once; else None.
        Call it only where the prefill cores are otherwise idle (the batched engine: the draft and pruner ranks
        wait at the job's end barrier), not in a pipelined batch, whose draft rank works on them."""
        if self.lent is not None or not self.drained:
            return None
        mine = os.sched_getaffinity(0)
        threads = torch.get_num_threads()
        self.lent = (mine, threads)
        if self.cpus:
            cores = mine | set(self.cpus)
            os.sched_setaffinity(0, cores)  # this thread; the intra-op threads it starts now inherit it
            extra = len(cores) - len(mine)
        else:
            extra = 1  # unpinned: the prefill thread ran one thread's worth wherever there was room
        torch.set_num_threads(threads + extra)
        return torch.get_num_threads()

    def top_up(self, in_flight: int) -> None:
        while self.queue and len(self.ahead) < self.size - in_flight + 2:
            it = self.queue.pop(0)
            self.ahead.append((it, self.pool.submit(self.prepare, it, self.queue[0] if self.queue else None)))

    def next_ready(self, block: bool) -> tuple[ManifestItem, Any] | None:
        """The next item in order and what `prepare` returned, if its prefill is done (or `block`: nothing is
        decoding, so wait for it, prefilling a later item on this thread meanwhile: at a job's start the first
        item's prefill left this core idle for all of it). An item that failed (VideoError, ValueError) comes
        with its error instead, and is taken off the queue; a prepared one stays first until `pop`."""
        if not (self.ahead and (block or self.ahead[0][1].done())):
            return None
        if block and not self.ahead[0][1].done():
            self._steal()
        it, future = self.ahead[0]
        try:
            return it, future.result()
        except (VideoError, ValueError) as e:
            self.pop()
            return it, e

    def pop(self) -> None:
        self.ahead.popleft()

    def steal_if_thin(self, in_flight: int) -> bool:
        """Runs on this thread the last queued prefill that has not started, when the batch is under half full and
        the next item is not ready; True when it did. False when every prefill left has started or finished (the
        manifest's tail): the caller decodes what it has meanwhile. (Returning True there made the loop spin
        without a round, holding the GIL, so the prefill it waited for ran 10-15x slower: 1-3.5 s stalls.)"""
        if not self.ahead or in_flight >= max(1, self.size // 2) or self.ahead[0][1].done():
            return False
        return self._steal()

    def _steal(self) -> bool:
        """Runs the last queued prefill that has not started on this thread; False when there is none."""
        for i in range(len(self.ahead) - 1, -1, -1):
            it, future = self.ahead[i]
            if future.cancel():
                t0 = time.perf_counter()
                done: Future = Future()
                try:
                    done.set_result(self.prepare(it, self.queue[0] if self.queue else None))
                except Exception as e:  # noqa: BLE001 - delivered where the pool's would be: future.result()
                    done.set_exception(e)
                self.ahead[i] = (it, done)
                self.stolen_s += time.perf_counter() - t0
                return True
        return False

    def close(self) -> None:
        self.pool.shutdown()
        if self.lent is not None:  # the decode thread's own cores and threads again
            mine, threads = self.lent
            os.sched_setaffinity(0, mine)
            torch.set_num_threads(threads)
            self.lent = None


def _done_row(row: dict, timings: dict, num_frames: int, res: DecodeResult, size: int, target: VideoLMAdapter) -> dict:
    stats = {**res.stats_dict(), **timings, "num_frames": num_frames, "batch": size}
    return {**row, "token_ids": res.token_ids, "error": None, "stats": stats,
            "text": target.tokenizer.decode(res.token_ids, skip_special_tokens=True)}


def decode_in_batches(ctx: RoleContext, cfg: RunConfig, target: VideoLMAdapter, draft: VideoLMAdapter | None,
                      reader: ItemReader, todo: list[ManifestItem], record: Record) -> int:
    """Up to `batching.size` items in flight (decoders/batched.py), the next ones prefilled ahead
    (`PrefillAhead`). An item joins as soon as a slot is free and its KV fits the budget; its line is written
    the moment it finishes, so a killed job redoes only the items that were in flight. Returns the failures."""
    method = ctx.method.name
    size = cfg.batching.size
    engine = BatchDecoder(target, draft, cfg.decoding, cfg.pruning if draft is not None else None, size,
                          kv_budget_bytes=cfg.batching.kv_budget_bytes, parallel_signals=ctx.method.parallel)
    in_flight: dict[str, tuple[dict, dict, int]] = {}  # row, timings, frames
    failed = 0

    def read_and_prefill(it: ManifestItem, nxt: ManifestItem | None) -> tuple[Prefilled, LoadedItem]:
        loaded = reader.load(it)
        item = BatchItem(it.id, loaded.frames, it.prompt, reader.max_new_tokens(it), loaded.times)
        return engine.prefill(item), loaded

    def finish(item: BatchItem, res: DecodeResult) -> None:
        record(_done_row(*in_flight.pop(item.id), res, size, target))

    ahead = PrefillAhead(todo, size, read_and_prefill, (cfg.cpu_affinity or {}).get("draft"))
    started = time.perf_counter()
    tail: dict = {}
    while ahead.pending or engine.slots:
        ahead.top_up(len(engine.slots))
        if (threads := ahead.lend_cores_when_drained()) is not None:  # the manifest's tail
            tail = {"tail_from_s": time.perf_counter() - started, "tail_threads": threads}
            get_logger().info("prefill_cores_lent", in_flight=len(engine.slots), **tail)
        # Join what is ready, in order; block on a prefill only when nothing is decoding.
        while not engine.full and (nxt := ahead.next_ready(block=not engine.slots)) is not None:
            it, got = nxt
            ctx.item_id = it.id
            row = _row(cfg, method, it)
            if isinstance(got, Exception):
                failed += 1
                record(_failed_row(row, {}, got))
                continue
            prefilled, loaded = got
            in_flight[it.id] = (row, loaded.timings, int(loaded.frames.shape[0]))
            status, res = engine.join(prefilled)
            if status == "wait":
                break  # its KV does not fit beside the items in flight: after a round (never on an empty batch)
            ahead.pop()
            if status == "done":
                finish(prefilled.item, res)
        if ahead.steal_if_thin(len(engine.slots)):
            continue  # a thin batch: prefilling here beats decoding it
        for item, res in engine.round():
            finish(item, res)
    ahead.close()
    ctx.report["batching"] = {**engine.report(), **tail}  # into summary.json's run section
    get_logger().info("batching_done", **ctx.report["batching"])
    return failed


def decode_pipelined(ctx: RoleContext, cfg: RunConfig, target: VideoLMAdapter, draft: VideoLMAdapter | None,
                     reader: ItemReader, todo: list[ManifestItem], record: Record) -> int:
    """A parallel method over a batch with the draft on its own rank (`batching.pipelined`): the target's worker
    (roles/target.py) verifies every ready window in one forward while the draft rank drafts every row in
    one forward. The next items are prefilled ahead (`PrefillAhead`); a prefilled item joins between rounds (its
    JobStart and the pruner's signals go out then, and the draft prefills its pruned copy on its rank). Its line
    is written the moment it finishes. Returns the failures."""
    method = ctx.method.name
    size = cfg.batching.size
    link = RankLink(ctx)
    worker = target_worker(ctx, link, target, size)
    in_flight: dict[str, tuple[dict, dict, int]] = {}  # row, timings, frames
    failed = 0

    def read_and_prefill(it: ManifestItem, nxt: ManifestItem | None):
        loaded = reader.load(it)
        return worker.prefill(reader.work_item(it, loaded, nxt)), loaded

    ahead = PrefillAhead(todo, size, read_and_prefill, (cfg.cpu_affinity or {}).get("draft"))
    started = time.perf_counter()
    while ahead.pending or worker.rows:
        ahead.top_up(len(worker.rows))
        while not worker.full and (nxt := ahead.next_ready(block=not worker.rows)) is not None:
            it, got = nxt
            ctx.item_id = it.id
            row = _row(cfg, method, it)
            if isinstance(got, Exception):
                failed += 1
                record(_failed_row(row, {}, got))
                continue
            prefilled, loaded = got
            if not worker.join(prefilled):
                break  # its KV does not fit beside the items in flight: after a round (never on an empty batch)
            ahead.pop()
            in_flight[it.id] = (row, loaded.timings, int(loaded.frames.shape[0]))
        if ahead.steal_if_thin(len(worker.rows)):
            continue
        while link.poll():
            worker.handle(*link.recv())
        ready, rows = worker.readiness()
        if 0 < ready < rows:  # a round leaves without its stragglers only when waiting would cost more
            left = worker.patience_s(ready, rows - ready) - (time.perf_counter() - worker.round_end)
            if left > 0 and link.poll(timeout_s=left):
                continue
        ran, finished = worker.step()
        for item, res in finished:
            row, timings, num_frames = in_flight.pop(item.id)
            if isinstance(res, ValueError):
                failed += 1
                record(_failed_row(row, timings, res))
            else:
                record(_done_row(row, timings, num_frames, res, size, target))
        if not (ran or finished) and worker.rows:
            link.wait()  # nothing to verify: the draft's next chunk
    ahead.close()
    # Decoding: the loop's time outside what this thread spent admitting and prefilling.
    decode_s = time.perf_counter() - started - worker.admit_s - ahead.stolen_s
    ctx.report["batching"] = {**worker.report(), "decode_s": decode_s}
    get_logger().info("batching_done", **ctx.report["batching"])
    worker.shutdown()
    return failed


def _pin_thread(cpus: list[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # this thread only
    # Below the roles in priority: on the draft's cores a pipelined batch's draft must answer a verdict at once
    # (a late chunk costs its item a round), and a prefill loses nothing by yielding for a few ms.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def run_batch(ctx: RoleContext, args: argparse.Namespace, cfg: RunConfig, out: Path) -> dict:
    log = get_logger()
    started = time.perf_counter()
    method = ctx.method.name
    results = ResultsFile(out)
    done = results.resume(method, retry_failed=args.retry_failed)
    record_job(out, method, cfg)  # what a rerun must match to resume here (entry.py checks it)
    versions = stack()  # the software this run ran on: `vpsd summary` shows it, and what changed against a baseline
    (out / "config.json").write_text(json.dumps({"args": vars(args), "config": cfg.to_dict(), "stack": versions},
                                                indent=2, default=str))
    items, problems = load_manifest(args.manifest, check_files=False)
    if args.shard is not None:
        items, problems = args.shard.select(items, problems)
    problem_ids = [f"line:{p.line}" for p in problems]
    progress = Progress(total=len(items) + len(problems),
                        initial=sum(i in done for i in [it.id for it in items] + problem_ids),
                        enabled=wants_bar(args.quiet))
    failed = 0
    for p, pid in zip(problems, problem_ids):
        log.error("manifest_problem", line=p.line, message=p.message)
        if pid in done:
            continue
        failed += 1
        results.append({"id": pid, "method": method, "token_ids": [], "text": "", "stats": {},
                        "error": {"type": "ManifestError", "message": f"{args.manifest}:{p.line}: {p.message}"}})
        progress.item_done(0, failed=True)
    target = load_adapter(cfg.family, cfg.target)
    in_roles = ctx.method.runs_in_roles(cfg.batching.size, cfg.batching.pipelined)
    draft = None
    if ctx.method.loads_draft_model and not in_roles:
        draft = load_draft(cfg.family, cfg.draft, target)
    reader = ItemReader(target, cfg)
    todo = [it for it in items if it.id not in done]
    run = (decode_one_at_a_time if cfg.batching.size == 1 else decode_pipelined if in_roles else decode_in_batches)
    loop_start = time.perf_counter()
    failed += run(ctx, cfg, target, draft, reader, todo, lambda row: _record(results, progress, row))
    loop_s = time.perf_counter() - loop_start  # the items' wall, models loaded: what throughput divides by
    progress.close()
    summary = summarize(out)
    summary["run"] = {"total_s": time.perf_counter() - started, "items": len(todo), "failed": failed,
                      "skipped": len(done), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                      "loop_s": loop_s, "peak_rss_mib": peak_rss_mib(), "batching": ctx.report.get("batching"),
                      "stack": versions}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("job_done", **summary)
    if not args.quiet:
        print(f"vpsd: {summary['items_done']} items done, {summary['items_failed']} failed, "
              f"{summary['tokens_per_s']:.1f} tokens/s, {summary['run']['total_s']:.1f} s; see {out / 'summary.json'}",
              file=sys.stderr)
    return summary

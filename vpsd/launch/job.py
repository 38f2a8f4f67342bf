"""The target rank's job: manifest in, one results.jsonl line per item out; the engine wired for the method.

Contract (the README's "Batch jobs" section says it for users):
- Resumable: `ResultsFile.resume` first; ids already in results.jsonl for this method are skipped (failed
  ones too, unless `--retry-failed`), so a rerun or a torchrun restart finishes the rest with no duplicates and
  no gaps. Bad manifest lines become error rows `line:N` once. A rerun with other settings (weights, strategy,
  gamma, ...) is refused at launch instead (launch/job_identity.py).
- One bad item never sinks the job: a VideoError (missing, empty, corrupt, no video stream, too long) or a
  ValueError while decoding it is written as that item's `error: {type, message}` (plus `kind` for a
  VideoError) and the job goes on. Anything else (a dead peer, a bug) ends the job, and what was finished stays.
- Each line is written the moment its item finishes, so a killed job redoes only the items in flight.
- Returns the summary; the rank exits 0 even when items failed (summary.EXIT_ITEMS_FAILED gives the status).

Wiring: `Method.draft_place` says where the method's draft runs; this builds the engine (engine/engine.py)
with that drafter, and the scheduler's loop (engine/scheduler.py) runs every item.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vpsd.config import RunConfig
from vpsd.engine.engine import Engine
from vpsd.engine.local_drafter import LocalDrafter
from vpsd.engine.reference import ReferenceEngine
from vpsd.engine.request import Request
from vpsd.engine.scheduler import Scheduler
from vpsd.launch.items import ItemReader, LoadedItem
from vpsd.launch.job_identity import record as record_job
from vpsd.launch.manifest import ManifestItem, load_manifest
from vpsd.launch.progress import Progress, wants_bar
from vpsd.launch.results import ItemError, ResultRow, ResultsFile
from vpsd.models.base import VideoLMAdapter
from vpsd.models.registry import load_adapter, load_draft
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.provenance import stack
from vpsd.reports.kept_log import KeptRecord, append_kept
from vpsd.reports.summary import job_summary
from vpsd.roles.context import RoleContext
from vpsd.roles.link import RankLink
from vpsd.roles.target import RemoteDrafter
from vpsd.tracing import get_logger
from vpsd.video.errors import VideoError


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


class ItemEvents:
    """The scheduler's view of the launcher (engine/scheduler.py JobEvents): items become requests, and
    each finished or failed item becomes its results line."""

    def __init__(self, ctx: RoleContext, cfg: RunConfig, reader: ItemReader, target: VideoLMAdapter,
                 results: ResultsFile, progress: Progress) -> None:
        self.ctx, self.cfg, self.reader, self.target = ctx, cfg, reader, target
        self.results, self.progress = results, progress
        self.loaded: dict[str, LoadedItem] = {}
        self.failures = self.finished_items = 0

    def request(self, item: ManifestItem, nxt: ManifestItem | None) -> Request:
        loaded = self.reader.load(item)
        self.loaded[item.id] = loaded
        return self.reader.request(item, loaded, nxt)

    def started(self, item: ManifestItem) -> None:
        self.ctx.item_id = item.id

    def finished(self, item: ManifestItem, request: Request) -> None:
        if request.error is not None:
            self.failed(item, request.error)
            return
        loaded = self.loaded.pop(item.id)
        res = request.result()
        if res.kept is not None and self.ctx.out is not None:  # chosen here; a pruner rank logs its own
            pruning = self.cfg.pruning
            append_kept(self.ctx.out, KeptRecord(item.id, pruning.strategy, pruning.applied_ratio, res.kept, res.layout))
        self.finished_items += 1
        stats = {**res.stats_dict(), **loaded.timings, "num_frames": int(loaded.frames.shape[0]),
                 "batch": self.cfg.batching.size}
        self.record(self.row(item, res.token_ids, stats,
                             self.target.tokenizer.decode(res.token_ids, skip_special_tokens=True)))

    def failed(self, item: ManifestItem, error: Exception | str) -> None:
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
        self.results.append(row)
        self.progress.item_done(len(row.token_ids), failed=row.error is not None)
        get_logger().info("item_done", item=row.id, tokens=len(row.token_ids),
                          error=None if row.error is None else row.error.to_json())


def build_engine(ctx: RoleContext, cfg: RunConfig, target: VideoLMAdapter) -> tuple[Engine, Scheduler]:
    """The engine and its scheduler for the method at this batch size (`Method.draft_place`)."""
    method, size = ctx.method, cfg.batching.size
    place = method.draft_place(size, cfg.batching.pipelined)
    cpus = (cfg.cpu_affinity or {}).get("draft")  # the prefill thread's: free where no draft rank works there
    budget = cfg.batching.kv_budget_bytes
    if place == "remote":
        drafter = RemoteDrafter(RankLink(ctx), target, cfg, job_id=ctx.job_id, timeout_s=ctx.timeout_s,
                                target_probs=verdicts_carry_target_probs(method.draft, cfg.tabed_settings,
                                                                         cfg.decoding.temperature))
        engine = Engine(target, cfg, size, drafter)
        return engine, Scheduler(engine, budget, prefill_cpus=cpus)
    draft = load_draft(cfg.family, cfg.draft, target) if method.loads_draft_model else None
    if place == "reference":
        engine = ReferenceEngine(target, cfg, method, draft)
        return engine, Scheduler(engine, budget, prefill_cpus=cpus)
    drafter = LocalDrafter(target, draft, cfg.decoding, cfg.pruning, method.parallel) if place == "local" else None
    engine = Engine(target, cfg, size, drafter)
    return engine, Scheduler(engine, budget, draft if drafter is not None else None, prefill_cpus=cpus, lend_cores=True)


def run_job(ctx: RoleContext, args: argparse.Namespace, cfg: RunConfig, out: Path) -> dict:
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
    target = load_adapter(cfg.family, cfg.target)
    events = ItemEvents(ctx, cfg, ItemReader(target, cfg), target, results, progress)
    for p, pid in zip(problems, problem_ids):
        log.error("manifest_problem", line=p.line, message=p.message)
        if pid not in done:
            events.failures += 1
            events.record(ResultRow(pid, method, [], "", {},
                                    ItemError("ManifestError", f"{args.manifest}:{p.line}: {p.message}")))
    engine, scheduler = build_engine(ctx, cfg, target)
    todo = [it for it in items if it.id not in done]
    loop_start = time.perf_counter()
    scheduler.run(todo, events)
    loop_s = time.perf_counter() - loop_start  # the items' wall, models loaded: what throughput divides by
    if engine.parallel:
        engine.drafter.shutdown()
    progress.close()
    report = engine.report.as_dict() if cfg.batching.size > 1 else None
    if report is not None:
        log.info("batching_done", **report)
    run = {"total_s": time.perf_counter() - started, "items": len(todo), "failed": events.failures,
           "skipped": len(done), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
           "loop_s": loop_s, "peak_rss_mib": peak_rss_mib(), "batching": report, "stack": versions}
    summary = job_summary(out, method, run)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("job_done", **summary)
    if not args.quiet:  # this run's items, whatever else the directory holds
        print(f"vpsd: {method}: {events.finished_items} items done, {events.failures} failed"
              f"{f' ({len(done)} done before)' if done else ''}, {summary['tokens_per_s']:.1f} tokens/s, "
              f"{run['total_s']:.1f} s; see {out / 'summary.json'}", file=sys.stderr)
    return summary

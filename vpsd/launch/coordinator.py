"""The job's coordinator: one queue of items for every pipeline of the launch, and the one writer of --out.

It runs as a thread in pipeline 0's target process (the rank that holds --out's lock), with a control-plane
identity of its own (rank `world`, launch/layout.py). Per run:
- resume: results.jsonl is repaired and read (launch/results.py); ids done for this method are skipped, failed
  ones too unless --retry-failed; the manifest's bad lines become error rows `line:N`, once;
- dispatch: a pipeline's target asks for its next item when it has room or reads ahead (`WorkRequest`) and is
  granted the next one (`WorkGrant`): in manifest order, but a video's items together and on the pipeline that
  took its first (launch/video_queue.py), so one video's questions reuse its frames and prefix KV. Items go out one at a time as pipelines free up, never
  dealt in advance, so the job ends when its last item does, whatever the mix of lengths: a pipeline holds the
  items it decodes and one read ahead, and none read ahead once fewer items are left than pipelines;
- results: each finished item's line comes back (`ItemResult`) and is appended and fsynced here, so the file
  has one writer whatever the number of pipelines and nodes; the progress bar counts them;
- the end: each pipeline reports its run (`PipelineDone`) after its last result and is answered once that
  result is written; then summary.json (the job's sums, and per pipeline its items, items per hour and share).

Why the control plane and not torch.distributed's store: it is authenticated (the store is not), it carries
typed messages whose senders are proven, and a result line is data the store was not made for. A pipeline
whose rank dies takes the launch down (torchrun stops every rank); the items in flight were never written, so
`--max-restarts` (or the same command again) resumes with exactly those.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from vpsd.launch.say import say
from vpsd.launch.video_queue import VideoQueue, video_key
from vpsd.launch.job_identity import record as record_job
from vpsd.launch.layout import Layout
from vpsd.launch.manifest import load_manifest
from vpsd.launch.progress import Progress, wants_bar
from vpsd.launch.results import ItemError, ResultRow, ResultsFile
from vpsd.pipeline.messages import ItemResult, PipelineDone, Shutdown, WorkGrant, WorkRequest
from vpsd.provenance import stack
from vpsd.reports.summary import job_summary
from vpsd.tracing import get_logger
from vpsd.transport.control import ControlChannel
from vpsd.transport.startup import rendezvous_store


@dataclass
class PipelineTally:
    ranks: dict[str, int]
    items: int = 0
    failed: int = 0
    tokens: int = 0
    run: dict | None = None  # its PipelineDone report
    done_s: float | None = None  # when it reported, seconds after the job's first item went out


class Coordinator:
    def __init__(self, layout: Layout, args, cfg, method: str, out: Path, secret: bytes) -> None:
        self.layout, self.args, self.cfg, self.method, self.out, self.secret = layout, args, cfg, method, out, secret
        self.tally = {p.index: PipelineTally(dict(p.ranks)) for p in layout.pipelines}
        self.failure: BaseException | None = None
        self.summary: dict | None = None
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="vpsd-coordinator", daemon=True)

    def start(self) -> None:
        """Starts the thread; returns once its channel is published (pipelines can reach it)."""
        self._thread.start()
        self.ready.wait()

    def result(self) -> dict:
        """Waits for the job's end; the summary, or the coordinator's failure raised here. (Not `join`: in vpsd a
        request joins the batch, and nothing else does.)"""
        self._thread.join()
        if self.failure is not None:
            raise self.failure
        assert self.summary is not None
        return self.summary

    # ---- the thread ---------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            store = rendezvous_store()
            with ControlChannel(self.layout.coordinator, self.layout.world + 1, "coordinator", store,
                                secret=self.secret) as ctrl:
                self.ready.set()
                self.summary = self._run(ctrl)
        except BaseException as e:  # noqa: BLE001 - handed to join(), on the role's thread
            self.failure = e
        finally:
            self.ready.set()

    def _run(self, ctrl: ControlChannel) -> dict:
        started = time.perf_counter()
        log = get_logger()
        results = ResultsFile(self.out)
        done = results.resume(self.method, retry_failed=self.args.retry_failed)
        record_job(self.out, self.method, self.cfg)  # what a rerun must match to resume here (entry.py checks it)
        versions = stack()
        (self.out / "config.json").write_text(json.dumps({"args": vars(self.args), "config": self.cfg.to_dict(),
                                                          "stack": versions, "pipelines": self._ranks()},
                                                         indent=2, default=str))
        items, problems = load_manifest(self.args.manifest, check_files=False)
        if self.args.shard is not None:
            items, problems = self.args.shard.select(items, problems)
        problem_ids = [f"line:{p.line}" for p in problems]
        progress = Progress(total=len(items) + len(problems),
                            initial=sum(i in done for i in [it.id for it in items] + problem_ids),
                            enabled=wants_bar(self.args.quiet))
        failures = 0
        for p, pid in zip(problems, problem_ids):
            log.error("manifest_problem", line=p.line, message=p.message)
            if pid not in done:
                failures += 1
                row = ResultRow(pid, self.method, [], "", {},
                                ItemError("ManifestError", f"{self.args.manifest}:{p.line}: {p.message}"))
                results.append(row)
                progress.item_done(0, failed=True)
        # Whether another item reads an item's frames, over the whole (sharded) manifest, done items included: the
        # same on every rerun, and in the ar job it is compared with.
        sharing = Counter(video_key(it) for it in items)
        queue = VideoQueue(dataclasses.replace(it, shares_video=sharing[video_key(it)] > 1)
                           for it in items if it.id not in done)
        todo = len(queue)
        open_pipelines = set(self.tally)
        first_grant: float | None = None
        while open_pipelines:
            src, msg = ctrl.recv(timeout_s=None)
            if isinstance(msg, WorkRequest):
                # Read-ahead only while every other pipeline could still get one: at the tail an item goes to a
                # pipeline with room for it now, not to one busy for another item's time.
                item = queue.take(msg.pipeline) if queue and (msg.needed or len(queue) >= len(self.tally)) else None
                ctrl.send(src, WorkGrant(None if item is None else item.to_wire(), more=bool(queue)))
                first_grant = first_grant or time.perf_counter()
            elif isinstance(msg, ItemResult):
                row = ResultRow.from_json(msg.row)
                results.append(row)
                t = self.tally[msg.pipeline]
                t.items, t.failed, t.tokens = t.items + 1, t.failed + (row.error is not None), t.tokens + len(row.token_ids)
                progress.item_done(len(row.token_ids), failed=row.error is not None)
            elif isinstance(msg, PipelineDone):
                self.tally[msg.pipeline].run = dict(msg.run)
                self.tally[msg.pipeline].done_s = time.perf_counter() - (first_grant or started)
                open_pipelines.discard(msg.pipeline)
                ctrl.send(src, Shutdown("every result of the pipeline is written"))
            else:
                log.warning("unexpected_message", type=type(msg).__name__, src=src)
        progress.close()
        failures += sum(t.failed for t in self.tally.values())
        return self._finish(started, todo, failures, len(done), versions)

    def _ranks(self) -> list[dict[str, int]]:
        return [dict(p.ranks) for p in self.layout.pipelines]

    def _finish(self, started: float, todo: int, failures: int, skipped: int, versions: dict) -> dict:
        runs = {i: t.run or {} for i, t in self.tally.items()}
        loop_s = max((r.get("loop_s") or 0.0 for r in runs.values()), default=0.0)
        pipelines = [{"index": i, "ranks": t.ranks, "items": t.items, "failed": t.failed, "tokens": t.tokens,
                      "loop_s": runs[i].get("loop_s"),
                      "items_per_hour": 3600 * t.items / runs[i]["loop_s"] if runs[i].get("loop_s") else None,
                      "share": t.items / todo if todo else None, "done_s": t.done_s,
                      "batching": runs[i].get("batching"), "reuse": runs[i].get("reuse"),
                      "frames_cache": runs[i].get("frames_cache")}
                     for i, t in self.tally.items()]
        rss = [r["peak_rss_mib"] for r in runs.values() if r.get("peak_rss_mib") is not None]
        captures = [r["capture_s"] for r in runs.values() if r.get("capture_s") is not None]
        run = {"total_s": time.perf_counter() - started, "items": todo, "failed": failures, "skipped": skipped,
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "loop_s": loop_s,
               "peak_rss_mib": max(rss) if rss else None, "batching": runs[0].get("batching"), "stack": versions,
               # captured steps' one-time cost (each graph's first forward), inside loop_s: the pipelines' most
               "capture_s": max(captures) if captures else None, "pipelines": pipelines,
               # the prefix cache of each pipeline's target (engine/prefix_cache.py ReuseStats), summed; None: off
               "reuse": _summed([r.get("reuse") for r in runs.values()]),
               # the decoded frames each pipeline's target kept (video/frame_cache.py FrameCacheStats), summed
               "frames_cache": _summed([r.get("frames_cache") for r in runs.values()])}
        summary = job_summary(self.out, self.method, run)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        get_logger().info("job_done", **summary)
        if not self.args.quiet:  # this run's items, whatever else the directory holds
            spread = f" over {len(pipelines)} pipelines" if len(pipelines) > 1 else ""
            finished = sum(t.items - t.failed for t in self.tally.values())
            say(f"{self.method}: {finished} items done{spread}, {failures} failed{f' ({skipped} done before)' if skipped else ''}, "
                f"{summary['tokens_per_s']:.1f} tokens/s, {run['total_s']:.1f} s; see {self.out / 'summary.json'}")
        return summary


def _summed(stats: list[dict | None]) -> dict | None:
    """The pipelines' prefix-cache (or frame-cache) counters added up (peaks and budgets too: each pipeline's
    target holds its own)."""
    held = [s for s in stats if s]
    if not held:
        return None
    return {k: sum(s.get(k, 0) for s in held) for k in held[0]}

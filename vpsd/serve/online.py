"""Continuous batching fed from the server's queue: the runner for every method that decodes in the server's
process (`ar`, sd and the trees, a batch that drafts in process, `draft_on: thread`).

One engine (launch/wiring.py `build_engine`, the API's and the job's) runs the scheduler's loop over an item
source that is the queue: a request that arrives while others decode is read and prefilled ahead and joins the
batch at the next free slot (engine/scheduler.py), up to `batch` in flight; with nothing in flight the source
waits for the next arrival. Each request carries its own budget, stop strings and seed. The engine's decoding
settings (temperature and filters: what `LLM` maps from SamplingParams into the run's config) are one per
engine: a request that needs others waits until the requests in flight leave, and the engine is built again.

After every round (`Scheduler.on_round`) each streamed request's newly committed tokens are released as text
(serve/stream_text.py: never past a stop string's cut), and a request whose client left gets an error set, so
the engine drops it at its next round and frees its KV cache (the path a drafter's failed item takes). A request
that cannot be decoded (its video missing, corrupt, too long) answers with the job's error; an engine that fails
fails the requests it holds (503) and the next request builds it again.

The target's prefix cache (engine/prefix_cache.py) is the model's, shared by every engine built over it, so a later
question about a video prefills only its text whichever engine answers it; `reuse_stats` (what /metrics reads) gives
its counters.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import numpy as np

from vpsd.api import Output, SamplingParams
from vpsd.engine.request import CANCELLED, Request
from vpsd.launch.items import ItemReader
from vpsd.launch.manifest import ManifestItem
from vpsd.launch.results import output_of
from vpsd.launch.wiring import SharedFrames, build_engine
from vpsd.serve.jobs import Done, Job, JobQueue
from vpsd.serve.stream_text import TextStream
from vpsd.tracing import get_logger
from vpsd.video.errors import VideoError

log = get_logger()
IDLE_POLL_S = 0.5  # an idle engine looks at the queue's state this often (closing, another engine's requests)
# An engine's report keeps a few numbers a round for the job's summary; a server's engine would keep them for ever.
# Built again after this many requests (those in flight finish first), its memory stays bounded.
RENEW_AFTER_REQUESTS = 5000


def engine_key(params: SamplingParams) -> SamplingParams:
    """What one engine's requests share: the sampling parameters less those each request carries itself."""
    return dataclasses.replace(params, max_new_tokens=None, stop=(), seed=None)


class OnlineEngine:
    streams = True
    samples_per_request = True  # a request's num_frames / fps go with its item, as a manifest line's do

    def __init__(self, llm, queue: JobQueue) -> None:
        """llm: a `vpsd.LLM` whose method decodes in this process (`llm.served` False)."""
        self.llm, self.queue = llm, queue
        self._reuse = None  # the target's prefix cache, as the last engine holds it (None: off, or none built yet)
        self._thread = threading.Thread(target=self._loop, name="vpsd-engine", daemon=True)
        self._thread.start()

    def reuse_stats(self) -> dict[str, int] | None:
        """The target's prefix cache's counters (engine/prefix_cache.py ReuseStats; over every engine built)."""
        reuse = self._reuse
        return None if reuse is None else reuse.stats()

    def _loop(self) -> None:
        # This thread decodes: where the config pins the target, as a job's target rank runs there (its prefill
        # thread goes where it pins the draft, engine/prefill_ahead.py); HTTP stays on the others.
        cpus = (self.llm.config.cpu_affinity or {}).get("target")
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only
        self._serve(engine_key(SamplingParams()))  # built before the first request: it waits for requests
        while self.queue.wait():
            head = self.queue.head()
            if head is not None:
                self._serve(engine_key(head.params))

    def _serve(self, key: SamplingParams) -> None:
        """One engine for the requests of `key`, until none is queued or in flight."""
        frames = SharedFrames()
        events = None
        started = time.perf_counter()
        wired = None
        try:
            # The API's own mapping of SamplingParams to the run's decoding config, and its draft, loaded once.
            cfg = self.llm._decoding_config(key)
            events = _Events(self.llm.target, cfg, frames, self.queue)
            wired = build_engine(cfg, self.llm.method, self.llm.target, draft=self.llm._load_draft(cfg), videos=frames,
                                 timeout_s=cfg.timeout_s, job_id="serve")
            self._reuse = wired.engine.reuse  # the cache alone: a stopped engine is not kept for it
            wired.ready(cfg.startup_timeout_s)
            wired.scheduler.on_round = lambda: events.after_round(wired.engine)
            wired.scheduler.run(_QueueSource(self.queue, key, events), events)
        except BaseException as e:  # noqa: BLE001 - the requests it held get it (503); the next builds it again
            log.warning("serve_engine_failed", error=f"{type(e).__name__}: {e}")
            if events is not None and events.count:
                events.fail_all(e)
            else:  # it never ran: the request that asked for it gets the error (no retry loop on a broken build)
                head = self.queue.pop_head(lambda j: engine_key(j.params) == key)
                if head is not None and head.start():
                    head.future.set_exception(e)
        finally:
            if wired is not None:
                wired.stop()
            frames.close()
            self.queue.running = 0
            self.queue.observe()
            log.info("serve_engine_done", requests=events.count if events else 0,
                     seconds=time.perf_counter() - started)

    def close(self, grace_s: float) -> bool:
        """Fails the queued jobs; the requests in flight finish within grace_s (True if they did)."""
        self.queue.close()
        self._thread.join(grace_s)
        return not self._thread.is_alive()


@dataclasses.dataclass
class _Item:
    job: Job
    manifest: ManifestItem | None  # a file's; None: frames in memory
    stream: TextStream | None = None


class _QueueSource:
    """The scheduler's ItemSource (engine/prefill_ahead.py) over the queue: the next request of this engine's key.
    With nothing in flight it waits for one; it ends (no more) when the server closes, when the queue's next
    request needs another engine, or after RENEW_AFTER_REQUESTS, so that the requests in flight finish and the
    engine is built again."""

    def __init__(self, queue: JobQueue, key: SamplingParams, events: "_Events") -> None:
        self.queue, self.key, self.events = queue, key, events

    def take(self, needed: bool) -> tuple[_Item | None, bool]:
        if self.events.count >= RENEW_AFTER_REQUESTS:
            return None, False  # this engine's last: the next is built once these leave
        while True:
            job = self.queue.pop_head(lambda j: engine_key(j.params) == self.key)
            if job is not None:
                if not job.start():
                    continue  # its client left while it was queued
                return self.events.taken(job), True
            head = self.queue.head()
            if self.queue.closing or (head is not None and engine_key(head.params) != self.key):
                return None, False  # the server closes, or the next request needs another engine
            if not needed or self.events.jobs:
                return None, True  # not now: asked again after the next round
            if not self.queue.wait(IDLE_POLL_S) and self.queue.closing:
                return None, False


class _Events:
    """The scheduler's events (engine/scheduler.py JobEvents) over the server's jobs."""

    def __init__(self, target, cfg, frames: SharedFrames, queue: JobQueue) -> None:
        self.target, self.cfg, self.frames, self.queue = target, cfg, frames, queue
        self.reader = ItemReader(target, cfg)
        self.jobs: dict[str, _Item] = {}  # taken and not answered yet, by request id
        self.count = 0  # requests this engine took

    def seed(self, job: Job) -> int:
        """The request's seed, as the API's: its own (SamplingParams.seed), else the config's decoding.seed."""
        return int(job.params.seed if job.params.seed is not None else self.cfg.decoding.seed)

    def taken(self, job: Job) -> _Item:
        r = job.request
        video = None if isinstance(r.video, np.ndarray) else Path(r.video)
        manifest = None if video is None else ManifestItem(
            str(r.id), video, str(r.prompt), job.params.max_new_tokens, job.num_frames, job.fps, {}, 0,
            job.params.stop, self.seed(job))
        stream = TextStream(self.target.text, job.params.stop) if job.on_text is not None else None
        item = _Item(job, manifest, stream)
        self.jobs[str(r.id)] = item
        self.count += 1
        self.queue.running = len(self.jobs)
        self.queue.observe()
        return item

    # ---- JobEvents ---------------------------------------------------------------------------------

    def request(self, item: _Item, nxt: _Item | None) -> Request:
        """Its frames read and fitted, on the prefill thread (VideoError, ValueError: its answer carries them)."""
        job = item.job
        if item.manifest is not None:
            loaded = self.reader.load(item.manifest)
            request = self.reader.request(item.manifest, loaded, None)
        else:
            budget = job.params.max_new_tokens or self.cfg.decoding.max_new_tokens
            prompt = str(job.request.prompt)
            loaded = self.reader.load_array(str(job.request.id), prompt, job.request.video, job.request.frame_times,
                                            budget)
            request = Request(str(job.request.id), prompt, budget, loaded.frames, loaded.times, loaded.video, None,
                              job.params.stop, seed=self.seed(job))
        self.frames.put(request.id, loaded.frames, loaded.times)  # a draft thread takes them from here
        return request

    def started(self, item: _Item) -> None:
        pass

    def finished(self, item: _Item, request: Request) -> None:
        self.frames.drop(request.id)
        if request.error is not None:
            self._answer(item, _failed(request.id, ValueError(request.error)))
            return
        res = request.result()
        out, reason = output_of(self.target.text, res.token_ids, request.stop, self.target.eos_token_ids)
        stats = res.stats_dict()
        self._answer(item, Output(request.id, out.text, out.tokens, reason, stats.get("num_video_tokens"),
                                  out.generated, dict(stats)))

    def failed(self, item: _Item, error: Exception) -> None:
        self.frames.drop(str(item.job.request.id))
        self._answer(item, _failed(str(item.job.request.id), error))

    # ---- after each round (the engine thread) ------------------------------------------------------

    def after_round(self, engine) -> None:
        now = time.perf_counter()
        for rid, request in list(engine.requests.items()):
            item = self.jobs.get(rid)
            if item is None or request.machine is None:
                continue
            job = item.job
            if job.cancelled and request.error is None:
                request.error = CANCELLED  # it leaves at the next round, its KV freed
                continue
            if job.first_token is None and request.committed:
                job.first_token, job.batch_size = now, len(engine.requests)
            if item.stream is not None and (delta := item.stream.update(request.machine.output())):
                job.emit(delta)

    def _answer(self, item: _Item, out: Output) -> None:
        job = item.job
        self.jobs.pop(str(job.request.id), None)
        self.queue.running = len(self.jobs)
        self.queue.observe()
        if job.first_token is None:
            job.first_token = time.perf_counter()
        if job.started is not None:
            self.queue.served(time.perf_counter() - job.started)
        self.queue.stopped(job, out)
        if job.future.done():
            return
        if item.stream is not None and not job.gone and out.finish_reason != "error" and (
                rest := item.stream.finish(out.text)):
            job.emit(rest)
        job.future.set_result(Done(out, (job.started or job.enqueued) - job.enqueued, job.batch_size))

    def fail_all(self, error: BaseException) -> None:
        for item in list(self.jobs.values()):
            self.jobs.pop(str(item.job.request.id), None)
            if not item.job.future.done():
                item.job.future.set_exception(error)
        self.queue.running = 0


def _failed(item_id: str, error: Exception) -> Output:
    kind = error.kind if isinstance(error, VideoError) else None
    return Output(item_id, "", [], "error", error=f"{type(error).__name__}: {error}", error_kind=kind)

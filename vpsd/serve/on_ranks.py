"""Requests fed one at a time to a parallel method's child ranks: the runner where the roles run on the API's ranks.

The engine thread submits each queued request the moment it arrives (`LLM.submit`), up to `batch` a pipeline in
flight (the ranks' batch: their target takes an item as a slot frees, launch/served.py) and one more a pipeline,
whose video the target reads while it decodes (engine/prefill_ahead.py asks for it), and answers each as its result comes
(`LLM.results`), whatever the order they were submitted in. The ranks run one temperature and filters (their
config): a request with others waits until those in flight leave, and the API starts the ranks again for it
(`LLM.joins`). The ranks report each round's committed tokens (`LLM.progress`): a streamed request's text is
released as they commit (serve/stream_text.py, as in process), and its first token is timed when it commits. A
request whose client left is dropped while queued, and cancelled on the ranks while in flight (`LLM.cancel`: its
target drops it at its next round and frees its KV). A rank that dies (`RanksFailed`) fails the requests in flight
(503), and the next request starts the ranks again. The target's prefix cache lives in its rank's process: each
result the target sends carries the cache's counters as they are then (launch/job.py, `ItemResult.reuse`), and
/metrics shows the latest (`reuse_stats`, summed over the pipelines under torchrun); ranks started again start a
cache of their own, so the counts start again from zero with them.
"""

from __future__ import annotations

import threading
import time

from vpsd.config import ConfigError
from vpsd.serve.jobs import Done, Job, JobQueue
from vpsd.serve.stream_text import TextStream
from vpsd.tracing import get_logger

log = get_logger()
ARRIVAL_POLL_S = 0.02  # with requests in flight, how long a wait for results lets a new arrival wait to be submitted
IDLE_POLL_S = 0.5  # with none in flight, how often the thread looks whether the server closes


class RanksRunner:
    streams = True
    samples_per_request = False  # the ranks sample every request's video by the config

    def __init__(self, llm, queue: JobQueue) -> None:
        """llm: a `vpsd.LLM` whose method runs on child ranks (`llm.served`)."""
        self.llm, self.queue = llm, queue
        self.slots = queue.batch * llm.pipelines  # requests decoding at once: each pipeline's batch
        self._jobs: dict[str, Job] = {}  # submitted and not answered yet, by request id
        self._streams: dict[str, TextStream] = {}  # the streamed ones' text so far
        self._cancelled: set[str] = set()  # in flight, their client gone, the ranks told
        self._thread = threading.Thread(target=self._loop, name="vpsd-engine", daemon=True)
        self._thread.start()

    def reuse_stats(self) -> dict[str, int] | None:
        """The target ranks' prefix-cache counters as their latest results carried them (module docstring); None
        before the first result, with reuse off or a split target."""
        return self.llm.reuse_stats()

    def _loop(self) -> None:
        while True:
            self._submit_arrivals()
            if self._jobs:
                self._collect(ARRIVAL_POLL_S)
            elif self.queue.closing:
                return
            else:
                self.queue.wait(IDLE_POLL_S)

    def _submit_arrivals(self) -> None:
        """The queued requests that can join the ranks now, oldest first, while the ranks' batches have room, and
        one more a pipeline: the target reads its video ahead while it decodes (at its next read-ahead ask)."""
        q = self.queue
        while len(self._jobs) < self.slots + self.llm.pipelines:
            job = q.pop_head(lambda j: self.llm.joins(j.params))
            if job is None:
                return
            if not job.start():
                continue  # its client left while it was queued
            try:
                request_id = self.llm.submit(job.request, job.params)
            except (ConfigError, ValueError) as e:  # this request's own problem: the ranks go on
                job.future.set_exception(e)
                continue
            except BaseException as e:  # noqa: BLE001 - the ranks are gone: every request on them gets it (503)
                self._fail_all(e, [job])
                continue
            self._jobs[request_id] = job
            if job.on_text is not None:
                self._streams[request_id] = TextStream(self.llm.text, job.params.stop)
            for other in self._jobs.values():  # requests decoding together, at most, over each one's time
                other.batch_size = max(other.batch_size, min(len(self._jobs), self.slots))
            self._observe()

    def _collect(self, timeout_s: float) -> None:
        try:
            outputs = self.llm.results(timeout_s)
        except BaseException as e:  # noqa: BLE001 - a rank died: its requests get it; the next starts new ranks
            self._fail_all(e, [])
            return
        now = time.perf_counter()
        self._release(now)
        for out in outputs:
            job, stream = self._jobs.pop(out.id), self._streams.pop(out.id, None)
            self._cancelled.discard(out.id)
            job.first_token = job.first_token or now
            self.queue.served(now - (job.started or job.enqueued))
            self.queue.stopped(job, out)
            if job.future.done():
                continue
            if stream is not None and not job.gone and out.finish_reason != "error" and (rest := stream.finish(out.text)):
                job.emit(rest)
            job.future.set_result(Done(out, (job.started or job.enqueued) - job.enqueued, job.batch_size))
        if outputs:
            self._observe()

    def _release(self, now: float) -> None:
        """The tokens the ranks reported: first tokens timed, streamed text released; the ranks told of the
        requests whose client left."""
        for request_id, tokens in self.llm.progress().items():
            job = self._jobs.get(request_id)
            if job is None:
                continue
            if job.first_token is None and tokens:
                job.first_token = now
            stream = self._streams.get(request_id)
            if stream is not None and not job.cancelled and (delta := stream.update(tokens)):
                job.emit(delta)
        for request_id, job in self._jobs.items():
            if job.cancelled and request_id not in self._cancelled:
                self._cancelled.add(request_id)
                self.llm.cancel(request_id)

    def _fail_all(self, error: BaseException, jobs: list[Job]) -> None:
        failed = jobs + list(self._jobs.values())
        log.warning("serve_ranks_failed", error=f"{type(error).__name__}: {error}", requests=len(failed))
        self._jobs, self._streams, self._cancelled = {}, {}, set()
        for job in failed:
            if not job.future.done():
                job.future.set_exception(error)
        self._observe()

    def _observe(self) -> None:
        self.queue.running = min(len(self._jobs), self.slots)
        self.queue.observe()

    def close(self, grace_s: float) -> bool:
        """Fails the queued jobs; the requests in flight finish within grace_s (True if they did)."""
        self.queue.close()
        self._thread.join(grace_s)
        return not self._thread.is_alive()


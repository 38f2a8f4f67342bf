"""The server's request queue and the one engine thread that owns the `vpsd.LLM`.

HTTP handlers `submit` jobs (each with a future); the engine thread takes what is queued, up to `batch` requests
with the same sampling parameters (one `LLM.generate` call runs one SamplingParams), oldest first, and decodes
them in one call: requests that arrive while a call runs wait for the next one (dynamic batching; the engine's
continuous batching runs inside each call). A job whose client went away before its call started is dropped
(its future cancelled); one already decoding finishes and its result is discarded. A full queue refuses new jobs
(`QueueFull`, with a wait to suggest); `close` refuses new ones, fails the queued ones (`ServerClosing`) and waits
a bounded time for the call in flight.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from vpsd.api import Output, SamplingParams, VideoRequest
from vpsd.tracing import get_logger

log = get_logger()


class QueueFull(RuntimeError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the server's queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ServerClosing(RuntimeError):
    pass


class Generator(Protocol):
    def generate(self, requests: list[VideoRequest], params: SamplingParams) -> list[Output]: ...


@dataclass
class Done:
    output: Output
    queue_s: float  # from submit to the start of its engine call
    batch_size: int  # requests in that call
    engine_s: float  # the call's duration


@dataclass
class Job:
    request: VideoRequest
    params: SamplingParams
    future: "Future[Done]" = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(self, llm: Generator, batch: int, max_queue: int, observer: "BatchObserver | None" = None) -> None:
        self.llm, self.batch, self.max_queue, self.observer = llm, max(1, batch), max_queue, observer
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._running = 0  # requests in the engine call now
        self._recent_s: collections.deque[float] = collections.deque(maxlen=16)  # recent calls' durations
        self._thread = threading.Thread(target=self._loop, name="vpsd-engine", daemon=True)
        self._thread.start()

    # ---- the handlers' side ------------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._closing:
                raise ServerClosing("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(self._retry_after_s())
            self._queue.append(job)
            self._cond.notify()
        self._observe()
        return job

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return self._running

    def _retry_after_s(self) -> int:
        per_call = sum(self._recent_s) / len(self._recent_s) if self._recent_s else 1.0
        return max(1, min(120, math.ceil(per_call * math.ceil((len(self._queue) + 1) / self.batch))))

    # ---- the engine thread -------------------------------------------------------------------------

    def _take(self) -> list[Job] | None:
        """The next call's jobs: the oldest queued and up to batch - 1 more with its parameters; None: closing."""
        with self._cond:
            while True:
                while self._queue and self._queue[0].future.cancelled():
                    self._queue.popleft()
                if self._queue:
                    break
                if self._closing:
                    return None
                self._cond.wait()
            head = self._queue.popleft()
            taken = [head]
            for job in list(self._queue):
                if len(taken) == self.batch:
                    break
                if job.params == head.params:
                    self._queue.remove(job)
                    taken.append(job)
        jobs = [j for j in taken if j.future.set_running_or_notify_cancel()]  # a cancelled one is dropped
        self._running = len(jobs)
        return jobs

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            self._observe()
            if not jobs:
                continue
            started = time.perf_counter()
            try:
                outputs = self.llm.generate([j.request for j in jobs], jobs[0].params)
            except BaseException as e:  # noqa: BLE001 - every job of the call gets it; the thread goes on
                log.warning("serve_generate_failed", error=f"{type(e).__name__}: {e}", requests=len(jobs))
                for job in jobs:
                    job.future.set_exception(e)
                outputs = None
            took = time.perf_counter() - started
            self._recent_s.append(took)
            self._running = 0
            if outputs is not None:
                for job, out in zip(jobs, outputs):
                    job.future.set_result(Done(out, started - job.enqueued, len(jobs), took))
                if self.observer is not None:
                    self.observer.engine_call(len(jobs), took)
        self._running = 0

    def _observe(self) -> None:
        if self.observer is not None:
            self.observer.queue(len(self._queue), self._running)

    # ---- lifetime ----------------------------------------------------------------------------------

    def close(self, grace_s: float) -> bool:
        """Refuses new jobs, fails the queued ones, waits up to grace_s for the call in flight; True if it ended."""
        with self._cond:
            self._closing = True
            queued, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        for job in queued:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(ServerClosing("the server shut down before this request started"))
        self._thread.join(grace_s)
        return not self._thread.is_alive()


class BatchObserver(Protocol):
    def queue(self, depth: int, running: int) -> None: ...

    def engine_call(self, size: int, seconds: float) -> None: ...

"""The server's requests between the HTTP handlers and the one engine thread: `Job`s in a bounded `JobQueue`.

A handler `submit`s a job and awaits its future; the engine thread (serve/on_ranks.py or serve/online.py) takes
jobs off the queue, reports a streamed job's text as it commits (`Job.on_text`, called on the engine thread) and
resolves each future once, with a `Done` or an exception. A client that leaves cancels its job's future: a
queued job is then skipped, one in flight is stopped where the runner can (`Job.cancelled`). A full queue refuses
a job (`QueueFull`, with a wait to suggest from the recent pace); `close` refuses new ones and fails the queued
ones (`ServerClosing`).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

from vpsd.api import Output, SamplingParams, VideoRequest
from vpsd.engine.request import CANCELLED


class QueueFull(RuntimeError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the server's queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ServerClosing(RuntimeError):
    pass


@dataclass
class Done:
    output: Output
    queue_s: float  # from submit to the start of its decoding
    batch_size: int  # requests decoding beside it (itself included)


@dataclass
class Job:
    request: VideoRequest
    params: SamplingParams
    on_text: Callable[[str], None] | None = None  # a streamed job's text deltas, as they commit (engine thread)
    num_frames: int | None = None  # how its video file is sampled (media_io_kwargs); None: the config's
    fps: float | None = None
    future: "Future[Done]" = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when its decoding began (perf_counter)
    first_token: float | None = None  # when its first token committed
    batch_size: int = 1  # requests decoding beside it (itself included) when its first token committed
    gone: bool = False  # its client left

    def abandon(self) -> None:
        """Its client left: a queued job is skipped, one in flight stopped where the runner can."""
        self.gone = True
        self.future.cancel()

    def emit(self, text: str) -> None:
        """A streamed job's text to its handler (engine thread); a handler whose event loop has closed (the
        server stopped) is gone."""
        try:
            self.on_text(text)
        except RuntimeError:
            self.gone = True

    @property
    def cancelled(self) -> bool:
        return self.gone or self.future.cancelled()

    def start(self) -> bool:
        """Marks it running; False: its client left while it was queued (drop it)."""
        if not self.future.set_running_or_notify_cancel():
            return False
        self.started = time.perf_counter()
        return True


class Observer(Protocol):
    def queue(self, depth: int, running: int) -> None: ...

    def cancelled(self, where: str) -> None:
        """A request whose client left: dropped from the queue ("queue"), or stopped while decoding ("engine")."""


class JobQueue:
    def __init__(self, max_queue: int, batch: int, observer: Observer | None = None) -> None:
        self.max_queue, self.batch, self.observer = max_queue, max(1, batch), observer
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self.closing = False
        self.running = 0  # jobs the engine is decoding now (the runner keeps it)
        self._served_s: collections.deque[float] = collections.deque(maxlen=32)  # recent jobs' decode times

    # ---- the handlers' side ------------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self.closing:
                raise ServerClosing("the server is shutting down")
            if len(self._jobs) >= self.max_queue:
                raise QueueFull(self._retry_after_s())
            self._jobs.append(job)
            self._cond.notify_all()
        self.observe()
        return job

    @property
    def depth(self) -> int:
        """Jobs waiting (not those whose client left)."""
        with self._cond:
            self._drop_cancelled()
            return len(self._jobs)

    def _retry_after_s(self) -> int:
        """About when a slot frees: the queue ahead, served `batch` at a time at the recent pace per job."""
        per_job = sum(self._served_s) / len(self._served_s) if self._served_s else 1.0
        return max(1, min(120, math.ceil(per_job * (len(self._jobs) + 1) / self.batch)))

    # ---- the engine thread's side ------------------------------------------------------------------

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until a job is queued (True) or the queue closes empty or the timeout passes (False)."""
        with self._cond:
            self._drop_cancelled()
            end = None if timeout_s is None else time.monotonic() + timeout_s
            while not self._jobs and not self.closing:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
                self._drop_cancelled()
            return bool(self._jobs)

    def head(self) -> Job | None:
        with self._cond:
            self._drop_cancelled()
            return self._jobs[0] if self._jobs else None

    def pop_head(self, matching: Callable[[Job], bool]) -> Job | None:
        """The oldest queued job, taken off the queue if `matching` accepts it."""
        with self._cond:
            self._drop_cancelled()
            job = self._jobs.popleft() if self._jobs and matching(self._jobs[0]) else None
        self.observe()
        return job

    def take(self, matching: Callable[[Job], bool], limit: int) -> list[Job]:
        """Up to `limit` queued jobs that `matching` accepts, oldest first, taken off the queue."""
        with self._cond:
            self._drop_cancelled()
            taken = []
            for job in list(self._jobs):
                if len(taken) == limit:
                    break
                if matching(job):
                    self._jobs.remove(job)
                    taken.append(job)
        self.observe()
        return taken

    def served(self, seconds: float) -> None:
        self._served_s.append(seconds)

    def _drop_cancelled(self) -> None:
        kept = collections.deque(j for j in self._jobs if not j.cancelled)
        for _ in range(len(self._jobs) - len(kept)):
            self.count_cancelled("queue")
        self._jobs = kept

    def count_cancelled(self, where: str) -> None:
        if self.observer is not None:
            self.observer.cancelled(where)

    def stopped(self, job: Job, out: Output) -> None:
        """Counts an answer that is the engine's stop of a job whose client left (as the metrics tell them)."""
        if job.cancelled and out.finish_reason == "error" and CANCELLED in (out.error or ""):
            self.count_cancelled("engine")

    def observe(self) -> None:
        if self.observer is not None:
            self.observer.queue(self.depth, self.running)

    def close(self) -> None:
        """Refuses new jobs and fails the queued ones."""
        with self._cond:
            self.closing = True
            queued, self._jobs = list(self._jobs), collections.deque()
            self._cond.notify_all()
        for job in queued:
            if job.start():
                job.future.set_exception(ServerClosing("the server shut down before this request started"))
        self.observe()


class Runner(Protocol):
    """What owns the LLM on the engine thread: serve/on_ranks.py (requests submitted to a parallel method's child
    ranks) or serve/online.py (the engine's continuous batching fed from the queue)."""

    queue: JobQueue
    streams: bool  # whether on_text is called as tokens commit (else once, with the whole text, at the end)
    samples_per_request: bool  # whether a job's num_frames / fps are honoured (else only the config's run)

    def close(self, grace_s: float) -> bool: ...

    def reuse_stats(self) -> dict[str, int] | None: ...  # the prefix cache's counters for /metrics; None: none here

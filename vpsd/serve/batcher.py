"""Dynamic batching over `LLM.generate`: the runner for a method whose roles run on the API's child ranks.

The engine thread takes the oldest queued job and up to `batch - 1` more with the same sampling parameters (one
`generate` call runs one SamplingParams), and decodes them in one call; requests that arrive meanwhile wait for
the next call (the ranks' continuous batching runs inside each call). A job whose client left before its call
is dropped; one inside a call finishes and its answer is discarded. Streamed jobs get their whole text at the
end of their call. A call that raises (a child rank died: `RanksFailed`) fails its jobs (503) and the API starts
the ranks again for the next call.
"""

from __future__ import annotations

import threading
import time

from vpsd.serve.jobs import Done, Job, JobQueue
from vpsd.tracing import get_logger

log = get_logger()


class Batcher:
    streams = False
    samples_per_request = False  # generate samples every request's video by the config

    def __init__(self, llm, queue: JobQueue) -> None:
        self.llm, self.queue = llm, queue
        self._thread = threading.Thread(target=self._loop, name="vpsd-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        q = self.queue
        while q.wait():
            head = q.head()
            if head is None:
                continue
            jobs = [j for j in q.take(lambda j: j.params == head.params, q.batch) if j.start()]
            if not jobs:
                continue
            q.running = len(jobs)
            q.observe()
            started = time.perf_counter()
            try:
                outputs = self.llm.generate([j.request for j in jobs], jobs[0].params)
            except BaseException as e:  # noqa: BLE001 - every job of the call gets it; the thread goes on
                log.warning("serve_generate_failed", error=f"{type(e).__name__}: {e}", requests=len(jobs))
                for job in jobs:
                    job.future.set_exception(e)
                outputs = None
            took = time.perf_counter() - started
            q.running = 0
            for _ in jobs:
                q.served(took / len(jobs))
            if outputs is not None:
                for job, out in zip(jobs, outputs):
                    job.first_token, job.batch_size = time.perf_counter(), len(jobs)
                    job.future.set_result(Done(out, job.started - job.enqueued, len(jobs)))
            if q.observer is not None:
                q.observer.engine_call(len(jobs), took)
            q.observe()

    def close(self, grace_s: float) -> bool:
        """Fails the queued jobs and waits up to grace_s for the call in flight; True if it ended."""
        self.queue.close()
        self._thread.join(grace_s)
        return not self._thread.is_alive()

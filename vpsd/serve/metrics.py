"""The server's Prometheus metrics (`GET /metrics`, text format), on a registry of its own.

Per request: how it ended, its tokens, its latency, its time to first token (the first content the client got:
its first round's commit), its time in the queue, its MAT and the mean time of one
decoding round (decode_s / rounds: a target verification round, or one `ar` step), and how many requests were
decoding together when its first token committed (on child ranks: at most, over its decoding). Requests whose
client left, by where they were stopped. Gauges: the queue's depth and the requests decoding now.

The target's prefix cache (engine/prefix_cache.py: one video, many questions), read from the runner when scraped
(`watch_reuse`; `REUSE_METRICS`): `vpsd_prefix_reuse_hits_total` and `vpsd_prefix_reuse_misses_total` (prefills
whose video prefix was found, or not), `vpsd_prefix_reuse_reused_tokens_total` (prefix tokens taken from the cache
instead of prefilled), `vpsd_prefix_reuse_evictions_total`, and the gauges `vpsd_prefix_reuse_bytes` (held now),
`vpsd_prefix_reuse_peak_bytes` and `vpsd_prefix_reuse_budget_bytes`. In process the cache is the target model's,
shared by every engine the server builds over it, so the counts run over the server's life. On ranks (child ranks,
or a launch's under torchrun: serve/on_ranks.py) the cache lives in each target rank's process, and each result
carries its counters as they were then: these are the latest, summed over the pipelines, and start again from zero
when the ranks do. Absent when reuse is off (and on ranks before the first answer).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
MAT_BUCKETS = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model
        self.requests = Counter("vpsd_requests", "chat completion requests, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("vpsd_prompt_tokens", "prompt tokens (text and video) of answered requests",
                                     registry=r)
        self.generation_tokens = Counter("vpsd_generation_tokens", "completion tokens of answered requests", registry=r)
        self.latency = Histogram("vpsd_request_latency_seconds", "from the request's arrival to its last byte",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("vpsd_time_to_first_token_seconds", "from the request's arrival to its first content",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("vpsd_queue_wait_seconds", "from arrival to the start of its decoding",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.mat = Histogram("vpsd_mean_accepted_tokens", "a request's tokens committed per verification round (MAT)",
                             buckets=MAT_BUCKETS, registry=r)
        self.step = Histogram("vpsd_decode_step_seconds", "a request's mean decoding round (decode_s / rounds)",
                              buckets=STEP_BUCKETS, registry=r)
        self.batch = Histogram("vpsd_engine_batch_size", "requests decoding together at a request's first token",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.cancelled_requests = Counter("vpsd_requests_cancelled", "requests whose client left, by where they "
                                          "were stopped: queue (never decoded) or engine (at its next round)",
                                          ["where"], registry=r)
        self.queue_depth = Gauge("vpsd_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("vpsd_requests_running", "requests decoding now", registry=r)
        self._reuse: Callable[[], dict | None] | None = None
        r.register(_ReuseCollector(lambda: self._reuse() if self._reuse is not None else None))

    def watch_reuse(self, stats: Callable[[], dict | None] | None) -> None:
        """Where /metrics reads the prefix cache's counters (a runner's `reuse_stats`: ReuseStats as a dict, or
        None when it has none)."""
        self._reuse = stats

    # Observer (serve/jobs.py)
    def queue(self, depth: int, running: int) -> None:
        self.queue_depth.set(depth)
        self.running.set(running)

    def cancelled(self, where: str) -> None:
        self.cancelled_requests.labels(where).inc()

    def answered(self, prompt_tokens: int, completion_tokens: int, stats: dict, batch_size: int) -> None:
        self.batch.observe(batch_size)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if stats.get("mean_accepted_tokens") is not None:
            self.mat.observe(float(stats["mean_accepted_tokens"]))
        if stats.get("rounds") and stats.get("decode_s") is not None:
            self.step.observe(float(stats["decode_s"]) / int(stats["rounds"]))

    def text(self) -> bytes:
        return generate_latest(self.registry)


# The prefix cache's counters on /metrics: ReuseStats field -> (name, help, a counter or a gauge).
REUSE_METRICS = (
    ("hits", "vpsd_prefix_reuse_hits", "prefills whose video prefix was in the prefix cache", True),
    ("misses", "vpsd_prefix_reuse_misses", "prefills whose video prefix was not in the cache", True),
    ("skipped", "vpsd_prefix_reuse_skipped", "prefills that could not reuse (nothing after the video)", True),
    ("reused_tokens", "vpsd_prefix_reuse_reused_tokens", "prefix tokens taken from the cache instead of prefilled",
     True),
    ("prefilled_tokens", "vpsd_prefix_reuse_prefilled_tokens", "tokens prefilled by prefills through the cache",
     True),
    ("vision_hits", "vpsd_prefix_reuse_vision_hits", "vision features taken from the cache", True),
    ("pixel_hits", "vpsd_prefix_reuse_pixel_hits", "prefills whose video was not prepared again (its last question's)",
     True),
    ("stored", "vpsd_prefix_reuse_stored", "entries kept", True),
    ("evicted", "vpsd_prefix_reuse_evictions", "entries evicted for room (least recently used first)", True),
    ("evicted_bytes", "vpsd_prefix_reuse_evicted_bytes", "bytes of the entries evicted", True),
    ("too_large", "vpsd_prefix_reuse_too_large", "entries larger than the whole budget, not kept", True),
    ("bytes", "vpsd_prefix_reuse_bytes", "bytes the prefix cache holds now (KV and vision features)", False),
    ("peak_bytes", "vpsd_prefix_reuse_peak_bytes", "the most bytes the prefix cache has held", False),
    ("budget_bytes", "vpsd_prefix_reuse_budget_bytes", "the prefix cache's budget (reuse.budget_mib)", False),
)


class _ReuseCollector:
    """The prefix cache's counters as they are when scraped (module docstring); nothing when there are none."""

    def __init__(self, stats: Callable[[], dict | None]) -> None:
        self.stats = stats

    def describe(self) -> list:
        return []  # read at scrape time only (the registry must not call collect() to learn the names)

    def collect(self):
        stats = self.stats()
        if not stats:
            return
        for field, name, help_text, counter in REUSE_METRICS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(name, help_text, value=stats.get(field, 0))

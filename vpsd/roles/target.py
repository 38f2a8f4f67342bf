"""The target role: its loop (`serve_target`, as `serve_draft` is the draft's).

The target rank runs the engine (engine/engine.py) over the items its job grants (launch/job.py reads them and
writes their results). When the draft and the pruner run on their own ranks or threads, the engine's drafter is
`RemoteDrafter` (engine/drafters/remote.py), the target's side of their protocol.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from vpsd.engine.engine import Engine
from vpsd.engine.scheduler import Scheduler
from vpsd.profiling import RoundProfile


def serve_target(engine: Engine, scheduler: Scheduler, source: Any, events: Any, *, ready: Callable[[], None],
                 stop: Callable[[], None], profile: RoundProfile | None = None,
                 after_round: Callable[[], None] | None = None) -> float:
    """The target's loop: once its draft and pruner (ranks or threads of its own) say they are ready (`ready`, under
    the start-up bound), the scheduler's rounds over the items `source` grants until it has no more, each finished
    item handed to `events` (engine/scheduler.py ItemSource, JobEvents); then its drafter stops. `profile`:
    torch's profiler over some rounds; `after_round`: told after each round (a served pipeline reports its
    tokens there). Returns the loop's seconds, models loaded: what throughput divides by."""
    ready()
    told = [f for f in (profile.step if profile is not None else None, after_round) if f is not None]
    if told:
        scheduler.on_round = told[0] if len(told) == 1 else lambda: [f() for f in told]
    start = time.perf_counter()
    scheduler.run(source, events)
    loop_s = time.perf_counter() - start
    if profile is not None:
        profile.close()
    stop()
    return loop_s

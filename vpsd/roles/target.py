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
                 stop: Callable[[], None], profile: RoundProfile | None = None) -> float:
    """The target's loop: once its draft and pruner (ranks or threads of its own) say they are ready (`ready`, under
    the start-up bound), the scheduler's rounds over the items `source` grants until it has no more, each finished
    item handed to `events` (engine/scheduler.py ItemSource, JobEvents); then its drafter stops. `profile`:
    torch's profiler over some rounds. Returns the loop's seconds, models loaded: what throughput divides by."""
    ready()
    if profile is not None:
        scheduler.on_round = profile.step
    start = time.perf_counter()
    scheduler.run(source, events)
    loop_s = time.perf_counter() - start
    if profile is not None:
        profile.close()
    stop()
    return loop_s

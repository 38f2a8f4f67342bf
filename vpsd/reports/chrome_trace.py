"""A run's traces in the Chrome trace-event format: Perfetto (ui.perfetto.dev) or chrome://tracing open it
with one process lane per role.

    vpsd timeline RUN_DIR      # writes RUN_DIR/trace.json beside timeline.png

Each span becomes a complete event ("ph": "X", microseconds since the run's first span), each mark an
instant event ("ph": "i"); every field the span carried (item, round, epoch, tokens, gamma, ...) is in its
args. Lanes are processes named "ROLE (rank R)", sorted by rank; nested spans (item > verify) stack inside
the one thread of their rank, as they ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from vpsd.reports.timeline import Span, lanes


def chrome_events(spans: Sequence[Span]) -> dict:
    """The trace-event JSON object for these spans."""
    t0 = min((s.t0 for s in spans), default=0.0)
    events: list[dict] = []
    for role, rank in lanes(spans):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"{role} (rank {rank})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for s in spans:
        args = {k: v for k, v in {"item": s.item, "round": s.round, **s.fields}.items() if v is not None}
        event = {"name": s.name, "cat": s.role, "pid": s.rank, "tid": 0, "ts": round((s.t0 - t0) * 1e6, 3), "args": args}
        if s.kind == "mark":
            event.update(ph="i", s="p")
        else:
            event.update(ph="X", dur=round(s.dur * 1e6, 3))
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: Sequence[Span], path: Path) -> Path:
    Path(path).write_text(json.dumps(chrome_events(spans)))
    return Path(path)

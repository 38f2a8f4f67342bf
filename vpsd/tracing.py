"""Per-rank traces: every structlog event as one JSON line, plus timed spans for the timeline.

Contract:
- `configure_tracing(out_dir, role, rank)` routes every structlog event of the process (all levels,
  including the module loggers made with `structlog.get_logger(__name__)`) to
  `out_dir/traces/rank{rank}_{role}.jsonl`, one JSON object per line, written line by line so a crashing
  rank loses nothing, and always ending on a whole line (a full disk raises vpsd.storage.DiskFull). Every line carries `role`, `rank` and `t` (time.time() at logging) and
  `level`; these keys are reserved and overwrite fields of the same name. Warnings and errors are also
  printed to stderr as one line `[role rank] level event key=value ...`. With `out_dir` None nothing is
  written to disk and events of level info and above go to stderr in that same one-line form.
  Calling it again replaces the previous configuration (and closes its file): output is never doubled.
- The file is opened for appending, so a rank that torchrun restarts keeps the trace of the attempt that
  crashed. A run directory therefore holds one run.
- `span(name, **fields)` times a block and logs ONE debug event at its end, also when the block raises
  (then with `error` = "Type: message"; the exception propagates). It yields its fields dict: what the
  block learns (the verify span's `accepted`) is added there and logged with the span. `mark(name, **fields)` logs an instant.
  The lines, keys in this order:
      {"event": "span", "level": "debug", "role": "target", "rank": 0, "t": <time.time() at logging>,
       "name": "verify", "t0": <time.time() at entry>, "dur": <seconds, perf_counter>, **fields}
      {"event": "mark", "level": "debug", "role": "target", "rank": 0, "t": ..., "name": "rollback",
       "t0": <time.time()>, **fields}
  Values JSON cannot hold are written as numbers if they have `.item()` (numpy, torch scalars), else str.
  Usual fields: `item`, `round`, `epoch`, `tokens`; `verify` spans also carry `drafted` and `accepted`
  (draft tokens verified and accepted; the parallel target adds `start` and the `mode` the round was
  verified in), which `vpsd.reports.acceptance` plots. Span names used by the roles: video_read, vision,
  prefill, prune, draft_step, verify, send, recv_wait, rollback, mode_switch, item, preprocess and
  video_wait (vpsd.video.pool; video_read and preprocess run on its readers), frames_received (a draft rank
  taking the target's frames: roles/frames_wire.py); marks: rollback, mode_switch. `vpsd.reports.timeline` reads these lines back.
- Spans and marks are debug events: they are trace data, not messages for a person, so they never reach
  stderr. With a trace file they skip structlog's processor chain and are written straight to it (same
  line, same keys, same order): that chain costs ~40 us per event, i.e. ~5% of a 0.8 ms draft step and
  about a tenth of a millisecond per round on each side. Whenever structlog has been reconfigured
  since (structlog.testing.capture_logs, say) they go through structlog as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import structlog
from structlog.typing import EventDict, WrappedLogger

from vpsd.storage import LineFile

# Numeric ranks of the levels structlog passes as method names; what reaches stderr is filtered on them.
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40, "critical": 50}
_STDERR_LEVEL_WITH_FILE = 30
_STDERR_LEVEL_ALONE = 20

_trace_file: LineFile | None = None
_direct: "_DirectWriter | None" = None  # the fast path of spans and marks (see the module doc)


def trace_path(out_dir: Path, role: str, rank: int) -> Path:
    """Where rank `rank` playing `role` writes its trace under a run directory."""
    return Path(out_dir) / "traces" / f"rank{rank}_{role}.jsonl"


def configure_tracing(out_dir: Path | None, role: str, rank: int, stderr_level: int | None = None) -> None:
    """Send every structlog event of this process to the rank's JSON-lines trace (see module doc);
    `stderr_level`: the least level printed to stderr (default: warnings with a trace file, info without)."""
    global _trace_file, _direct
    close_tracing()
    identity = _Identity(role, rank)
    shared = [
        structlog.processors.add_log_level,
        identity,
        structlog.processors.format_exc_info,
    ]
    if out_dir is None:
        processors = shared + [_StderrLine(identity.prefix, stderr_level or _STDERR_LEVEL_ALONE, drop=True)]
        factory: Any = structlog.ReturnLoggerFactory()  # never reached: _StderrLine drops every event
    else:
        path = trace_path(Path(out_dir), role, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Each JSON line reaches the OS as it is written, so a crash loses nothing; a full disk cuts the file back
        # to its last whole line and raises DiskFull naming the directory (vpsd/storage.py).
        _trace_file = LineFile(path)
        renderer = structlog.processors.JSONRenderer(default=_jsonable)
        processors = shared + [_StderrLine(identity.prefix, stderr_level or _STDERR_LEVEL_WITH_FILE, drop=False),
                                        renderer]
        factory = structlog.WriteLoggerFactory(file=_trace_file)
        _direct = _DirectWriter(_trace_file, role, rank, renderer)
    # No logger caching: module-level proxies must follow a later reconfiguration (tests, restarts).
    structlog.configure(
        processors=processors,
        logger_factory=factory,
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=False,
    )


def close_tracing() -> None:
    """Close the trace file, if any, and put structlog back to its defaults."""
    global _trace_file, _direct
    _direct = None
    if _trace_file is not None:
        _trace_file.close()
        _trace_file = None
    structlog.reset_defaults()


def get_logger() -> Any:
    """The logger for trace events; any `structlog.get_logger()` ends up in the same place."""
    return structlog.get_logger("vpsd")


@contextlib.contextmanager
def span(name: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """Time the block; log one `span` event at its end, with `error` set if it raised.

    Yields the span's fields: keys the block sets are logged too (an outcome known only inside it).
    """
    t0 = time.time()  # wall clock: comparable across ranks on the timeline
    start = time.perf_counter()  # monotonic and precise: the duration
    try:
        yield fields
    except BaseException as exc:
        fields["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        record_span(name, t0, time.perf_counter() - start, **fields)


def record_span(name: str, t0: float, dur: float, **fields: Any) -> None:
    """Log a span that was timed elsewhere (`t0`: time.time() at its start): one that does not fit a block,
    such as an item's, from its prefill to its last round, overlapping other items'."""
    direct = _direct
    if direct is None or not direct.write("span", {"name": name, "t0": t0, "dur": dur}, fields):
        get_logger().debug("span", name=name, t0=t0, dur=dur, **fields)


def mark(name: str, **fields: Any) -> None:
    """Log an instant event (rollback, mode switch) at the current time."""
    t0 = time.time()
    direct = _direct
    if direct is None or not direct.write("mark", {"name": name, "t0": t0}, fields):
        get_logger().debug("mark", name=name, t0=t0, **fields)


class _DirectWriter:
    """Writes span and mark lines to the trace file without structlog's processor chain.

    The line is the one the chain would render (keys event, level, role, rank, t, then the event's own).
    `write` returns False, writing nothing, when the chain must handle the event: structlog was
    reconfigured since (its last processor is no longer our renderer) or a field would collide with a
    key of the line's head.
    """

    _HEAD = frozenset(("event", "level", "role", "rank", "t", "name", "t0", "dur"))

    def __init__(self, file: LineFile, role: str, rank: int, renderer: Any) -> None:
        self.file, self.role, self.rank, self.renderer = file, role, rank, renderer
        self.encode = json.JSONEncoder(default=_jsonable).encode
        try:  # the lock structlog's WriteLogger holds for this file, so lines of both never interleave
            from structlog._output import _get_lock_for_file

            self.lock = _get_lock_for_file(file)
        except (ImportError, AttributeError):
            self.lock = threading.Lock()

    def write(self, event: str, head: dict[str, Any], fields: dict[str, Any]) -> bool:
        processors = structlog.get_config()["processors"]
        if not processors or processors[-1] is not self.renderer or not self._HEAD.isdisjoint(fields):
            return False
        line = self.encode({"event": event, "level": "debug", "role": self.role, "rank": self.rank,
                            "t": time.time(), **head, **fields})
        with self.lock:
            self.file.write(line + "\n")
        return True


class _Identity:
    """Processor stamping role, rank and time on every event, first in the line for people reading it."""

    def __init__(self, role: str, rank: int) -> None:
        self.role = role
        self.rank = rank
        self.prefix = f"[{role} {rank}]"

    def __call__(self, logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
        head = {"event": event.pop("event", None), "level": event.pop("level", method)}
        event.pop("role", None), event.pop("rank", None), event.pop("t", None)
        return {**head, "role": self.role, "rank": self.rank, "t": time.time(), **event}


class _StderrLine:
    """Processor printing events at or above `min_level` to stderr as one readable line.

    `drop=True` ends the chain there (stderr-only mode). sys.stderr is looked up at each write so that a
    replaced stream (pytest capture, a redirecting launcher) is honoured.
    """

    _OMIT = ("event", "level", "role", "rank", "t", "exception")

    def __init__(self, prefix: str, min_level: int, drop: bool) -> None:
        self.prefix = prefix
        self.min_level = min_level
        self.drop = drop

    def __call__(self, logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
        if _LEVELS.get(method, 20) >= self.min_level:
            parts = [self.prefix, str(event.get("level", method)), str(event.get("event"))]
            parts += [f"{k}={event[k]!r}" for k in event if k not in self._OMIT]
            exc = event.get("exception")
            if exc and not self.drop:
                # The full traceback is in the trace file; one line here keeps stderr readable.
                parts.append(f"exception={exc.rstrip().splitlines()[-1]!r}")
            text = " ".join(parts) + "\n"
            if exc and self.drop:
                text += exc.rstrip() + "\n"  # stderr is the only record: keep the whole traceback
            sys.stderr.write(text)
            sys.stderr.flush()
        if self.drop:
            raise structlog.DropEvent
        return event


def _jsonable(value: Any) -> Any:
    """JSON fallback: numpy/torch scalars as numbers, everything else as its str()."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


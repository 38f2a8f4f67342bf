"""Read a run's per-rank traces back: a Gantt timeline (of one item, or of a batch) and a latency breakdown table.

Input: `RUN_DIR/traces/*.jsonl` as written by `vpsd.tracing` (span and mark events; every other event is
ignored). A line that is not a JSON object, or a span/mark without a numeric `t0` (and `dur`), is skipped
and counted in one warning (`malformed_trace_lines`): a rank that crashed mid-line must not hide the rest.
Times are the ranks' `time.time()`, so lanes line up only as well as the hosts' clocks agree.

- `load_spans(run_dir)` -> spans and marks (`Span.kind`), sorted by start.
- `plot_timeline(spans, out_png, item=None, window=None)` (reports/timeline_plot.py): one lane per (role, rank), target, draft,
  pruner first, labelled "role (rank r)"; a colour per span name with a legend; nested spans drawn thinner
  on top of their parent; marks as vertical ticks. x is ms from the item's first span; `window` (ms, ms)
  zooms. Spans of other items are left out; spans without an item are kept where they overlap it, and a
  batched forward (a span whose `items` field lists the items it carried) only where it carried this item.
  Default item: the one that starts first.
- `plot_batch_timeline(spans, out_png, window=None)` (the same): a batched run (`--batch N`) as a whole: the role lanes
  with every span, then one lane per item: when it was in flight (from `item_admitted` to `item_done`, events
  the launcher logs and read back here as marks), its own spans (video read, vision, prefill, on any rank) and
  every batched forward that carried its row (verify rounds, draft steps), so which rows each verify carried is
  read down a column. The default plot of a run whose forwards carried several items at once.
- `breakdown(spans)` over the whole run, per (role, rank):
    * one `span` row per span name: total s, count, mean ms, share of the role's busy time
      (share None for `item`, `recv_wait` and `video_wait`, which are not work; nested spans are counted both in their
      own row and inside their parent, so shares can add up to more than 1);
    * `total` rows: `wall` = for each item, the role's first to last span naming that item (the `item`
      span, and work for the item outside it, such as a video_read before it), united over items; a role
      whose spans name no item: its first to last span. `busy` = union of all spans but the
      not-work ones, inside the wall time (nested and overlapping spans counted once); `idle` = wall - busy;
      `waiting` = recv_wait time inside the wall time and outside busy time, the part of idle spent
      blocked on a peer. Shares of totals are of wall time.
- `vpsd timeline RUN_DIR` (reports/timeline_command.py) writes the plot, the table and the Perfetto trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from vpsd.tracing import get_logger

ROLE_ORDER = ("target", "draft", "pruner")
# Spans that are not busy time: the item frame, and blocking on a peer or on the video read ahead
# (that read is its own video_read span, on the prefetch thread).
NOT_WORK = ("item", "recv_wait", "video_wait")
# Fixed colours for the known names keep one colour per name across plots of different runs.
KNOWN_NAMES = (
    "video_read", "vision", "prefill", "prune", "draft_step", "verify",
    "send", "recv_wait", "rollback", "mode_switch", "item", "preprocess", "video_wait",
)
_RESERVED = ("event", "level", "role", "rank", "t", "name", "t0", "dur", "item", "round")
# Events (not spans) logged when an item joins a batch and when its result is written: read back as marks of
# those names, so that a plot shows when each item was in flight.
LIFECYCLE = ("item_admitted", "item_done")

Interval = tuple[float, float]


@dataclass(frozen=True)
class Span:
    """One span (or, with kind "mark", one instant: dur 0) of one rank."""

    role: str
    rank: int
    name: str
    t0: float  # seconds, time.time() of the rank
    dur: float  # seconds
    item: str | None = None
    round: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # epoch, tokens, error, ...
    kind: str = "span"  # "span" | "mark"

    @property
    def t1(self) -> float:
        return self.t0 + self.dur


@dataclass(frozen=True)
class Row:
    """One line of the breakdown: a span name (kind "span") or a role total (kind "total")."""

    role: str
    rank: int
    kind: str  # "span" | "total"
    name: str  # span name, or for totals: "wall", "busy", "idle", "waiting"
    total_s: float
    count: int | None = None  # spans only
    mean_ms: float | None = None  # spans only
    share: float | None = None  # spans: of busy time; totals: of wall time


# --- reading -----------------------------------------------------------------------------------------


def load_spans(run_dir: Path) -> list[Span]:
    """All spans and marks under RUN_DIR/traces, sorted by start time."""
    spans: list[Span] = []
    bad = 0
    for path in sorted((Path(run_dir) / "traces").glob("*.jsonl")):
        role, rank = _identity_from_name(path)
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                parsed = _parse_line(line, role, rank)
                if parsed is False:
                    bad += 1
                elif parsed is not None:
                    spans.append(parsed)
    if bad:
        get_logger().warning("malformed_trace_lines", skipped=bad, run_dir=str(run_dir))
    spans.sort(key=lambda s: (s.t0, -s.dur))
    return spans


def _identity_from_name(path: Path) -> tuple[str, int]:
    """rank{r}_{role}.jsonl -> (role, r): the fallback when a line lacks role or rank."""
    head, _, role = path.stem.partition("_")
    try:
        return role or path.stem, int(head.removeprefix("rank"))
    except ValueError:
        return role or path.stem, -1


def _parse_line(line: str, role: str, rank: int) -> Span | None | bool:
    """A Span, None for an event that is not a span or mark, False for a malformed line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return False
    if not isinstance(obj, dict):
        return False
    kind = obj.get("event")
    if kind in LIFECYCLE:
        obj = {**obj, "name": kind, "t0": obj.get("t")}
        kind = "mark"
    elif kind not in ("span", "mark"):
        return None
    t0 = obj.get("t0")
    dur = obj.get("dur") if kind == "span" else 0.0
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (t0, dur)) or dur < 0:
        return False
    item, rnd = obj.get("item"), obj.get("round")
    try:
        return Span(
            role=str(obj.get("role", role)),
            rank=int(obj.get("rank", rank)),
            name=str(obj.get("name", "?")),
            t0=float(t0),
            dur=float(dur),
            item=None if item is None else str(item),
            round=rnd if isinstance(rnd, int) else None,
            fields={k: v for k, v in obj.items() if k not in _RESERVED},
            kind=kind,
        )
    except (TypeError, ValueError):  # a rank that is not a number
        return False


# --- lanes and items ---------------------------------------------------------------------------------


def lanes(spans: Iterable[Span]) -> list[tuple[str, int]]:
    """(role, rank) pairs in display order: target, draft, pruner, then other roles; by rank within."""
    order = {r: i for i, r in enumerate(ROLE_ORDER)}
    keys = {(s.role, s.rank) for s in spans}
    return sorted(keys, key=lambda k: (order.get(k[0], len(order)), k[0], k[1]))


def first_item(spans: Sequence[Span]) -> str | None:
    """The item whose first span starts earliest; None when no span names an item."""
    with_item = [s for s in spans if s.item is not None]
    return min(with_item, key=lambda s: s.t0).item if with_item else None


def carried(s: Span) -> tuple[str, ...]:
    """The items a batched forward carried (its `items` list); () for a span of one item or of none."""
    items = s.fields.get("items")
    return tuple(str(i) for i in items) if isinstance(items, list) else ()


def item_spans(spans: Sequence[Span], item: str | None) -> list[Span]:
    """Spans of `item` (batched forwards that carried it included), plus spans of no item overlapping its time;
    all spans when item is None."""
    if item is None:
        return list(spans)
    own = [s for s in spans if s.item == item]
    if not own:
        raise ValueError(f"no span of item {item!r} in the trace")
    lo, hi = min(s.t0 for s in own), max(s.t1 for s in own)
    return [s for s in spans if s.item == item or item in carried(s)
            or (s.item is None and not carried(s) and s.t0 <= hi and s.t1 >= lo)]


def breakdown(spans: Sequence[Span]) -> list[Row]:
    """Per (role, rank): a row per span name (largest total first), then wall, busy, idle, waiting."""
    rows: list[Row] = []
    for role, rank in lanes(spans):
        mine = [s for s in spans if (s.role, s.rank) == (role, rank) and s.kind == "span"]
        if not mine:
            continue
        wall = _union(_extent(group) for group in _by_item(mine).values())
        if not wall:
            wall = [_extent(mine)]
        busy = _intersect(_union((s.t0, s.t1) for s in mine if s.name not in NOT_WORK), wall)
        waits = _intersect(_union((s.t0, s.t1) for s in mine if s.name == "recv_wait"), wall)
        wall_s, busy_s = _length(wall), _length(busy)
        waiting_s = _length(waits) - _length(_intersect(waits, busy))

        by_name: dict[str, list[Span]] = {}
        for s in mine:
            by_name.setdefault(s.name, []).append(s)
        named = []
        for name, group in by_name.items():
            total = sum(s.dur for s in group)
            share = None if name in NOT_WORK or busy_s == 0 else total / busy_s
            named.append(Row(role, rank, "span", name, total, len(group), total / len(group) * 1e3, share))
        rows += sorted(named, key=lambda r: (-r.total_s, r.name))

        def total_row(name: str, seconds: float) -> Row:
            return Row(role, rank, "total", name, seconds, share=seconds / wall_s if wall_s else None)

        rows += [
            total_row("wall", wall_s),
            total_row("busy", busy_s),
            total_row("idle", wall_s - busy_s),
            total_row("waiting", waiting_s),
        ]
    return rows


def format_breakdown(rows: Sequence[Row]) -> str:
    """A plain-text table, one block per role; totals marked with '=' and shares of wall time."""
    header = f"{'role':<22} {'span':<14} {'total s':>10} {'count':>7} {'mean ms':>10} {'share':>12}"
    lines = [header, "-" * len(header)]
    previous: tuple[str, int] | None = None
    for r in rows:
        lane = (r.role, r.rank)
        if previous is not None and lane != previous:
            lines.append("")
        previous = lane
        label = f"{r.role} (rank {r.rank})"
        name = r.name if r.kind == "span" else f"= {r.name}"
        count = "" if r.count is None else str(r.count)
        mean = "" if r.mean_ms is None else f"{r.mean_ms:.2f}"
        share = "" if r.share is None else f"{100 * r.share:.1f}%"
        if r.kind == "total" and share:
            share += " wall"
        lines.append(f"{label:<22} {name:<14} {r.total_s:>10.4f} {count:>7} {mean:>10} {share:>12}")
    return "\n".join(lines) + "\n"


def _by_item(spans: Iterable[Span]) -> dict[str, list[Span]]:
    groups: dict[str, list[Span]] = {}
    for s in spans:
        if s.item is not None:
            groups.setdefault(s.item, []).append(s)
    return groups


def _extent(spans: Sequence[Span]) -> Interval:
    """From the first start to the last end."""
    return min(s.t0 for s in spans), max(s.t1 for s in spans)


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[Interval] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two sorted, disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: Iterable[Interval]) -> float:
    return sum(hi - lo for lo, hi in intervals)

"""Read a run's per-rank traces back: a Gantt timeline (of one item, or of a batch) and a latency breakdown table.

Input: `RUN_DIR/traces/*.jsonl` as written by `vpsd.tracing` (span and mark events; every other event is
ignored). A line that is not a JSON object, or a span/mark without a numeric `t0` (and `dur`), is skipped
and counted in one warning (`malformed_trace_lines`): a rank that crashed mid-line must not hide the rest.
Times are the ranks' `time.time()`, so lanes line up only as well as the hosts' clocks agree.

- `load_spans(run_dir)` -> spans and marks (`Span.kind`), sorted by start.
- `plot_timeline(spans, out_png, item=None, window=None)`: one lane per (role, rank), target, draft,
  pruner first, labelled "role (rank r)"; a colour per span name with a legend; nested spans drawn thinner
  on top of their parent; marks as vertical ticks. x is ms from the item's first span; `window` (ms, ms)
  zooms. Spans of other items are left out; spans without an item are kept where they overlap it, and a
  batched forward (a span whose `items` field lists the items it carried) only where it carried this item.
  Default item: the one that starts first.
- `plot_batch_timeline(spans, out_png, window=None)`: a batched run (`--batch N`) as a whole: the role lanes
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
- `python -m vpsd.reports.timeline RUN_DIR [--item ID] [--out PNG]` writes RUN_DIR/timeline.png (or
  --out: the batch plot for a batched run, else the first item's; --item: that item's), RUN_DIR/breakdown.txt and RUN_DIR/trace.json (Chrome trace events for Perfetto, one lane per role:
  reports/chrome_trace.py), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import structlog

from vpsd.tracing import configure_tracing, get_logger

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


@dataclass
class ItemTrack:
    """One item of a batched run as its trace shows it."""

    item: str
    joined: float | None = None  # item_admitted: its row joined the batch
    left: float | None = None  # item_done: its result was written
    own: list[Span] = field(default_factory=list)  # spans naming it (video read, vision, prefill), any rank
    carried_by: list[Span] = field(default_factory=list)  # batched forwards that carried its row
    marks: list[Span] = field(default_factory=list)  # rollbacks, first chunk, ...

    @property
    def start(self) -> float:
        return min([s.t0 for s in self.own + self.carried_by] + ([self.joined] if self.joined else []))


def item_tracks(spans: Sequence[Span]) -> list[ItemTrack]:
    """Every item's track, in the order items started (their first span)."""
    tracks: dict[str, ItemTrack] = {}
    for s in spans:
        if s.kind == "mark" and s.item is not None:
            t = tracks.setdefault(s.item, ItemTrack(s.item))
            if s.name == "item_admitted":
                t.joined = s.t0
            elif s.name == "item_done":
                t.left = s.t0
            else:
                t.marks.append(s)
        elif s.kind == "span":
            if s.item is not None:
                tracks.setdefault(s.item, ItemTrack(s.item)).own.append(s)
            for item in carried(s):
                tracks.setdefault(item, ItemTrack(item)).carried_by.append(s)
    return sorted((t for t in tracks.values() if t.own or t.carried_by), key=lambda t: t.start)


# --- timeline ----------------------------------------------------------------------------------------


def plot_timeline(
    spans: Sequence[Span],
    out_png: Path,
    item: str | None = None,
    window: tuple[float, float] | None = None,
) -> Path:
    """Gantt chart of one item (default: the first) to `out_png`; see module doc. Returns the path."""
    # The Agg canvas directly, no pyplot: no global figure state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    chosen = item if item is not None else first_item(spans)
    shown = item_spans(spans, chosen)
    if not shown:
        raise ValueError("no spans to plot")
    origin = min(s.t0 for s in shown)
    lane_keys = lanes(shown)
    colours = _colours(s.name for s in shown)

    fig = Figure(figsize=(12, 1.2 + 0.7 * len(lane_keys)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used_spans: dict[str, None] = {}
    used_marks: dict[str, None] = {}
    for y, key in enumerate(lane_keys):
        _draw_lane(ax, y, [s for s in shown if (s.role, s.rank) == key], origin, colours, used_spans, used_marks)
    ax.set_yticks(range(len(lane_keys)), [f"{role} (rank {rank})" for role, rank in lane_keys])
    ax.set_ylim(len(lane_keys) - 0.5, -0.5)  # target on top
    ax.set_xlabel("time (ms) from the item's first span")
    ax.set_title(f"item {chosen}" if chosen is not None else "run")
    return _finish(fig, ax, colours, used_spans, used_marks, window, out_png)


def plot_batch_timeline(
    spans: Sequence[Span],
    out_png: Path,
    window: tuple[float, float] | None = None,
    max_items: int = 64,
) -> Path:
    """A batched run as a whole to `out_png`: the role lanes, then a lane per item (its first `max_items`):
    in flight (pale), its own spans, the batched forwards that carried its row, its marks. Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    tracks = item_tracks(spans)
    if not tracks:
        raise ValueError("no item in the trace")
    shown = tracks[:max_items]
    lane_keys = lanes(spans)
    origin = min(s.t0 for s in spans)
    colours = _colours(s.name for s in spans)
    fig = Figure(figsize=(12, 1.4 + 0.6 * len(lane_keys) + 0.22 * len(shown)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used_spans: dict[str, None] = {}
    used_marks: dict[str, None] = {}
    for y, key in enumerate(lane_keys):
        lane = [s for s in spans if (s.role, s.rank) == key and s.name not in LIFECYCLE]
        _draw_lane(ax, y, lane, origin, colours, used_spans, used_marks)
    in_flight = (0.93, 0.93, 0.93)
    for y, t in enumerate(shown, start=len(lane_keys)):
        if t.joined is not None:  # the row's life in the batch, behind everything else on the lane
            end = t.left if t.left is not None else max(s.t1 for s in t.carried_by or t.own)
            ax.barh(y, (end - t.joined) * 1e3, left=(t.joined - origin) * 1e3, height=0.9, color=in_flight,
                    edgecolor="none", zorder=1)
        _draw_lane(ax, y, sorted(t.own + t.carried_by + t.marks, key=lambda s: (s.t0, -s.dur)), origin, colours,
                   used_spans, used_marks, flat=True)
    ax.axhline(len(lane_keys) - 0.5, color="black", linewidth=0.8)
    labels = [f"{role} (rank {rank})" for role, rank in lane_keys] + [t.item for t in shown]
    ax.set_yticks(range(len(labels)), labels, fontsize="small")
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("time (ms) from the run's first span")
    rounds = [s for s in spans if s.kind == "span" and s.name == "verify" and carried(s)]
    per_round = sum(len(carried(s)) for s in rounds) / len(rounds) if rounds else 0.0
    more = f" (the first {len(shown)} of {len(tracks)} items shown)" if len(shown) < len(tracks) else ""
    ax.set_title(f"batch: {len(tracks)} items, {len(rounds)} verify rounds carrying {per_round:.1f} items "
                 f"on average{more}")
    extra = [Patch(color=in_flight, label="in flight (item lanes)")]
    return _finish(fig, ax, colours, used_spans, used_marks, window, out_png, extra)


def _draw_lane(ax, y: float, lane: Sequence[Span], origin: float, colours: dict, used_spans: dict,
               used_marks: dict, flat: bool = False) -> None:
    """One lane's spans as bars (each nesting level thinner on top of its parent; `flat`: all one height) and
    its marks as ticks."""
    bars = [s for s in lane if s.kind == "span"]
    for s, depth in zip(bars, [0] * len(bars) if flat else _depths(bars)):
        # An item span frames the lane; each nesting level is drawn thinner on top of its parent.
        height = 0.6 if flat else 0.8 * 0.7**depth
        ax.barh(
            y, s.dur * 1e3, left=(s.t0 - origin) * 1e3, height=height,
            color=colours[s.name], alpha=1.0 if s.name == "item" else 0.9,
            edgecolor="black", linewidth=0.3, zorder=2 + depth,
        )
        used_spans[s.name] = None
    for m in (s for s in lane if s.kind == "mark"):
        x = (m.t0 - origin) * 1e3
        ax.vlines(x, y - 0.48, y + 0.48, colors=colours[m.name], linewidths=1.5, zorder=50)
        used_marks[m.name] = None


def _finish(fig, ax, colours: dict, used_spans: dict, used_marks: dict, window: tuple[float, float] | None,
            out_png: Path, extra: list | None = None) -> Path:
    """Zoom, grid, legend, layout; writes the PNG."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if window is not None:
        ax.set_xlim(*window)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=colours[n], label=n) for n in used_spans]
    handles += [Line2D([], [], color=colours[n], linewidth=1.5, label=f"{n} (mark)") for n in used_marks]
    ax.legend(handles=handles + (extra or []), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=120)
    return out_png


def _colours(names: Iterable[str]) -> dict[str, Any]:
    """A distinct colour per name: known names fixed, others after them; `item` a neutral grey."""
    from matplotlib import colormaps

    # tab20 alternates dark and light shades of 10 hues: all dark ones first, then the light ones.
    palette = colormaps["tab20"].colors
    palette = palette[0::2] + palette[1::2]
    ordered = [n for n in KNOWN_NAMES if n != "item"] + sorted(set(names) - set(KNOWN_NAMES))
    colours: dict[str, Any] = {n: palette[i % len(palette)] for i, n in enumerate(ordered)}
    colours["item"] = (0.88, 0.88, 0.88)  # a background, paler than recv_wait's grey
    return colours


def _depths(bars: Sequence[Span]) -> list[int]:
    """Nesting depth of each span among `bars` (sorted by start, longer first): how many enclose it."""
    depths: list[int] = []
    open_ends: list[float] = []
    for s in bars:
        while open_ends and open_ends[-1] <= s.t0:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(s.t1)
    return depths


# --- breakdown ---------------------------------------------------------------------------------------


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


# --- command line ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vpsd.reports.timeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path, help="run directory holding traces/*.jsonl")
    parser.add_argument("--item", help="item id to plot (default: the whole batch of a batched run, else the "
                                       "first item of the run)")
    parser.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/timeline.png)")
    args = parser.parse_args(argv)
    if not structlog.is_configured():
        # Run as a command: warnings (malformed lines) belong on stderr, not between the table's lines.
        configure_tracing(None, "timeline", 0)

    spans = load_spans(args.run_dir)
    if not any(s.kind == "span" for s in spans):
        print(f"no spans under {args.run_dir / 'traces'}", file=sys.stderr)
        return 1
    try:
        out = args.out or args.run_dir / "timeline.png"
        if args.item is None and any(len(carried(s)) > 1 for s in spans):  # a batch: several items at once
            png = plot_batch_timeline(spans, out)
        else:
            png = plot_timeline(spans, out, item=args.item)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    from vpsd.reports.chrome_trace import write_chrome_trace  # it imports this module

    chrome = write_chrome_trace(spans, args.run_dir / "trace.json")
    table = format_breakdown(breakdown(spans))
    (args.run_dir / "breakdown.txt").write_text(table)
    print(table, end="")
    print(f"timeline: {png}\nbreakdown: {args.run_dir / 'breakdown.txt'}\nperfetto: {chrome} (open in ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

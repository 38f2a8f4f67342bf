"""The timeline plots of a run's traces (reports/timeline.py reads them): one item's Gantt chart, or a batched
run's, role lanes first and then one lane per item with the batched forwards that carried its row."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from vpsd.reports.timeline import KNOWN_NAMES, LIFECYCLE, Span, carried, first_item, item_spans, lanes


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



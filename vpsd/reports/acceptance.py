"""How drafting went, round by round: accepted draft tokens per verification round, read from a run's traces.

Input: the `verify` spans of `RUN_DIR/traces/*.jsonl` (read with `vpsd.reports.timeline.load_spans`).
Each carries `drafted` (draft tokens verified) and `accepted` (how many of them the target accepted);
the parallel target's also carry `mode` (the mode the round was verified in: "optimistic", or
"conservative" for the lone first token after a rollback). Serial methods (sd, specvlm, std) log their
verify spans without an item: such a span belongs to the item whose `item` span on the same rank
encloses it. A batched round (`--batch N`) carries several items' rows: its `items` lists them, and
`drafted`, `accepted`, `committed` (and, pipelined, `mode` and `start`) are lists in the same order, one
round per row. Spans without `accepted` (traces of an older vpsd) are skipped.

- `load_rounds(run_dir)` -> {item id: [Round, ...]} in verification order.
- `summarize(rounds)` -> Summary: rounds, MAT (the papers' tau, as `pipeline.stats`: accepted + 1 per
  round), acceptance rate, rollbacks (rounds that rejected a draft token), conservative rounds, the
  histogram of accepted lengths and the per-position acceptance rate, over the items that drafted; the
  items decoded plain and their rounds counted apart. For a drafted item, the same numbers as the `stats`
  of results.jsonl, recomputed from the traces.
- `plot_acceptance(rounds, out_png, gamma=None, title=...)`: three panels: accepted tokens per round
  (bars; rejecting rounds red and crossed below the axis, conservative-mode rounds shaded; tokens
  drafted per round as a step line, gamma dashed), the histogram of accepted lengths, and the acceptance rate per draft position.
  With several items their rounds are laid end to end, item boundaries marked.
- `python -m vpsd.reports.acceptance RUN_DIR [--item ID] [--out PNG]` writes RUN_DIR/acceptance.png
  (or --out) for one item or the whole run, and prints the summary. gamma comes from RUN_DIR/config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import structlog

from vpsd.reports.timeline import Span, carried, load_spans
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.tracing import configure_tracing

# A batched verify span's per-row fields, each a list in the order of its `items`.
ROW_FIELDS = ("drafted", "accepted", "committed", "mode", "start")
CONSERVATIVE = "conservative"  # pipeline.state_machine.Mode.CONSERVATIVE's value, as the trace holds it


@dataclass(frozen=True)
class Round:
    """One verification round of one item."""

    item: str
    index: int  # 0-based, in verification order within the item
    drafted: int
    accepted: int
    mode: str | None = None  # parallel methods only
    start: int | None = None  # committed length the chunk began at (parallel methods only)
    committed: int | None = None  # tokens the round committed (None: accepted + 1, the serial rule)

    @property
    def rejected(self) -> bool:
        """The target rejected a draft token: it emits its own token there (a rollback when parallel)."""
        return self.accepted < self.drafted


@dataclass(frozen=True)
class Summary:
    items: int
    rounds: int  # the rounds of the items that drafted; the numbers below are theirs
    mean_accepted_tokens: float
    acceptance_rate: float
    rollbacks: int
    conservative_rounds: int
    histogram: dict[int, int]  # accepted length -> rounds
    per_position: list[float]  # acceptance rate of draft position i among rounds that drafted it
    plain_rounds: int = 0  # the rounds of the items decoded plain (none of their rounds verified a draft)
    plain_items: int = 0

    def format(self) -> str:
        hist = " ".join(f"{k}:{v}" for k, v in self.histogram.items()) or "-"
        pos = " ".join(f"{p:.2f}" for p in self.per_position) or "-"
        plain = (f"  (besides: {self.plain_items} item(s) decoded plain, {self.plain_rounds} rounds)"
                 if self.plain_items else "")
        return (
            f"items {self.items}  rounds {self.rounds}  MAT {self.mean_accepted_tokens:.2f}  "
            f"acceptance {100 * self.acceptance_rate:.1f}%  rollbacks {self.rollbacks}  "
            f"conservative rounds {self.conservative_rounds}{plain}\n"
            f"accepted length histogram  {hist}\n"
            f"per-position acceptance    {pos}\n"
        )


# --- reading -----------------------------------------------------------------------------------------


def rounds_from_spans(spans: Sequence[Span]) -> dict[str, list[Round]]:
    """Verify spans carrying `accepted`, grouped by item (see module doc), each group in time order."""
    frames = [s for s in spans if s.kind == "span" and s.name == "item" and s.item is not None]
    verify = sorted(
        (s for s in spans if s.kind == "span" and s.name == "verify" and "accepted" in s.fields),
        key=lambda s: s.t0,
    )
    out: dict[str, list[Round]] = {}

    def add(item: str, fields: dict) -> None:
        rounds = out.setdefault(item, [])
        rounds.append(Round(item=item, index=len(rounds), drafted=int(fields["drafted"]),
                            accepted=int(fields["accepted"]), mode=fields.get("mode"), start=fields.get("start"),
                            committed=fields.get("committed")))

    for s in verify:
        items = carried(s)
        if items:  # a batched round: one round per row it carried
            if isinstance(s.fields["accepted"], list):  # (an older vpsd logged only the sum)
                for i, item in enumerate(items):
                    add(item, {k: v[i] for k, v in s.fields.items() if k in ROW_FIELDS and isinstance(v, list)})
            continue
        item = s.item if s.item is not None else _enclosing_item(s, frames)
        if item is None:
            continue  # a verify span outside every item: nothing to attribute it to
        add(item, s.fields)
    return out


def load_rounds(run_dir: Path) -> dict[str, list[Round]]:
    return rounds_from_spans(load_spans(run_dir))


def _enclosing_item(s: Span, frames: Sequence[Span]) -> str | None:
    for f in frames:
        if (f.role, f.rank) == (s.role, s.rank) and f.t0 <= s.t0 and s.t1 <= f.t1:
            return f.item
    return None


def run_gamma(run_dir: Path) -> int | None:
    """decoding.gamma of the run, from the config.json the target writes; None when it is not there."""
    try:
        cfg = json.loads((Path(run_dir) / "config.json").read_text())
        return int(cfg["config"]["decoding"]["gamma"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- numbers -----------------------------------------------------------------------------------------


def drafted_items_rounds(rounds: Sequence[Round]) -> list[Round]:
    """The rounds of the items that drafted at least once (an item decoded plain never does)."""
    drafting = {r.item for r in rounds if r.drafted > 0}
    return [r for r in rounds if r.item in drafting]


def summarize(rounds: Sequence[Round]) -> Summary:
    """The numbers of module doc; MAT and rates with pipeline.stats' definitions (one way to count), over the
    items that drafted. The rounds of an item decoded plain are counted apart: as accepted-length-0 rounds
    they would read as drafts rejected at their first token. (A drafted item's rounds that verified no draft,
    the last one cut at max_new_tokens or a batch round at gamma 0, stay in, as its results' stats count them.)"""
    drafted = drafted_items_rounds(rounds)
    drafting = {r.item for r in drafted}
    stats = AcceptanceStats()
    for r in drafted:
        stats.record(r.accepted, r.drafted, r.committed)
    stats.rollbacks = sum(r.rejected for r in drafted)
    items = {r.item for r in rounds}
    return Summary(
        items=len(items),
        rounds=stats.rounds,
        mean_accepted_tokens=stats.mean_accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        rollbacks=stats.rollbacks,
        conservative_rounds=sum(r.mode == CONSERVATIVE for r in drafted),
        histogram=stats.histogram(),
        per_position=stats.per_position_acceptance(),
        plain_rounds=len(rounds) - len(drafted),
        plain_items=len(items - drafting),
    )


# --- plot --------------------------------------------------------------------------------------------


OK, BAD, SHADE = "tab:blue", "tab:red", (1.0, 0.85, 0.6)


def plot_acceptance(rounds: Sequence[Round], out_png: Path, gamma: int | None = None, title: str = "") -> Path:
    """The three panels of the module doc to `out_png`; returns the path."""
    # The Agg canvas directly, no pyplot: no global figure state, no display needed (as timeline.py).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not rounds:
        raise ValueError("no verify rounds to plot")
    summary = summarize(rounds)
    fig = Figure(figsize=(13, 7.5))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=(3, 2))
    per_round, hist_ax, pos_ax = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    _plot_rounds(per_round, rounds, summary, gamma, title)
    _plot_distributions(hist_ax, pos_ax, summary)
    for ax in (per_round, hist_ax, pos_ax):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    return out_png


def _plot_rounds(ax, rounds: Sequence[Round], summary, gamma: int | None, title: str) -> None:
    """Accepted draft tokens per round: rejections, conservative mode, the drafted length and the window."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    xs = range(len(rounds))
    ax.bar(xs, [r.accepted for r in rounds], width=0.85, color=[BAD if r.rejected else OK for r in rounds],
           edgecolor="black", linewidth=0.3, zorder=2)
    # A round that accepted nothing has no bar: rejections and modes are marked below and behind the
    # bars instead, so every round shows them.
    rejected = [i for i, r in enumerate(rounds) if r.rejected]
    ax.scatter(rejected, [-0.3] * len(rejected), marker="x", color=BAD, s=18, zorder=3, label="rejection")
    for i, r in enumerate(rounds):
        if r.mode == CONSERVATIVE:
            ax.axvspan(i - 0.5, i + 0.5, color=SHADE, zorder=0, linewidth=0)
    ax.step(xs, [r.drafted for r in rounds], where="mid", color="black", linewidth=1.0, label="drafted", zorder=4)
    handles = [Patch(color=OK, label="all accepted"), Patch(color=BAD, label="rejected (rollback)")]
    if summary.conservative_rounds:
        handles.append(Patch(color=SHADE, label="conservative mode"))
    handles += ax.get_legend_handles_labels()[0]
    if gamma is not None:
        handles.append(ax.axhline(gamma, color="grey", linestyle="--", linewidth=1.0, label=f"gamma {gamma}"))
    for i in range(1, len(rounds)):
        if rounds[i].item != rounds[i - 1].item:  # several items end to end
            ax.axvline(i - 0.5, color="grey", linewidth=0.8, alpha=0.6)
    ax.set_xlabel("verification round")
    ax.set_ylabel("accepted draft tokens")
    ax.set_xlim(-0.6, len(rounds) - 0.4)
    ax.set_ylim(-0.6, max([r.drafted for r in rounds] + [gamma or 0]) + 0.5)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small")
    ax.set_title(f"{title}  rounds {summary.rounds}, MAT {summary.mean_accepted_tokens:.2f}, "
                 f"acceptance {100 * summary.acceptance_rate:.1f}%, rollbacks {summary.rollbacks}".strip())


def _plot_distributions(hist_ax, pos_ax, summary) -> None:
    """Rounds by accepted length, and the acceptance rate per draft position."""
    from matplotlib.ticker import MaxNLocator

    lengths = range(max(summary.histogram) + 1)
    hist_ax.bar(lengths, [summary.histogram.get(k, 0) for k in lengths], color=OK, edgecolor="black", linewidth=0.3)
    hist_ax.set_xticks(list(lengths))
    hist_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist_ax.set_xlabel("accepted draft tokens in a round")
    hist_ax.set_ylabel("rounds")
    positions = range(1, len(summary.per_position) + 1)
    pos_ax.bar(positions, summary.per_position, color=OK, edgecolor="black", linewidth=0.3)
    pos_ax.set_xticks(list(positions))
    pos_ax.set_ylim(0, 1.05)
    pos_ax.set_xlabel("draft position")
    pos_ax.set_ylabel("acceptance rate")


# --- command line ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vpsd.reports.acceptance", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path, help="run directory holding traces/*.jsonl")
    parser.add_argument("--item", help="item id to plot (default: every item of the run, end to end)")
    parser.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/acceptance.png)")
    args = parser.parse_args(argv)
    if not structlog.is_configured():
        configure_tracing(None, "acceptance", 0)  # warnings (malformed trace lines) to stderr

    by_item = load_rounds(args.run_dir)
    if args.item is not None:
        if args.item not in by_item:
            print(f"no verify round of item {args.item!r} under {args.run_dir / 'traces'}", file=sys.stderr)
            return 1
        by_item = {args.item: by_item[args.item]}
    rounds = [r for item_rounds in by_item.values() for r in item_rounds]
    if not rounds:
        print(f"no verify spans with `accepted` under {args.run_dir / 'traces'}", file=sys.stderr)
        return 1
    print(summarize(rounds).format(), end="")
    drafted = drafted_items_rounds(rounds)  # the plot is of drafting: plain items have none
    if not drafted:
        print("no round verified a draft: nothing to plot")
        return 0
    title = f"item {args.item}" if args.item is not None else f"{len(by_item)} item(s)"
    png = plot_acceptance(drafted, args.out or args.run_dir / "acceptance.png", run_gamma(args.run_dir), title)
    print(f"acceptance: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

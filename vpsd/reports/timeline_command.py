"""`vpsd timeline RUN_DIR [--item ID] [--out PNG]` (also `python -m vpsd.reports.timeline_command`): writes
RUN_DIR/timeline.png (or --out: the batch plot for a batched run, else the first item's; --item: that item's),
RUN_DIR/breakdown.txt and RUN_DIR/trace.json (Chrome trace events for Perfetto, one lane per role:
reports/chrome_trace.py), and prints the breakdown table (reports/timeline.py reads the traces)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import structlog

from vpsd.reports.chrome_trace import write_chrome_trace
from vpsd.reports.timeline import breakdown, carried, format_breakdown, load_spans
from vpsd.tracing import configure_tracing


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vpsd timeline", description="the timeline, latency breakdown and Perfetto trace of a run"
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
    from vpsd.reports.timeline_plot import plot_batch_timeline, plot_timeline  # matplotlib: only when plotting

    try:
        out = args.out or args.run_dir / "timeline.png"
        if args.item is None and any(len(carried(s)) > 1 for s in spans):  # a batch: several items at once
            png = plot_batch_timeline(spans, out)
        else:
            png = plot_timeline(spans, out, item=args.item)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    chrome = write_chrome_trace(spans, args.run_dir / "trace.json")
    table = format_breakdown(breakdown(spans))
    (args.run_dir / "breakdown.txt").write_text(table)
    print(table, end="")
    print(f"timeline: {png}\nbreakdown: {args.run_dir / 'breakdown.txt'}\nperfetto: {chrome} (open in ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`vpsd bias RUN_DIR`: the position bias of the kept video tokens, per frame (HIPPO Sec. 4, Fig. 2 / 8).

Input: RUN_DIR/kept.jsonl (reports/kept_log.py; the pruner of a parallel run writes it, so does
`vpsd bench pruning` with one record per strategy), or a kept.jsonl path. For every strategy in it and
every frame index: the share of the frame's kept prunable tokens that lie in the boundary band (the top and
bottom `band` of its rows, pipeline/pruning/position_bias.py), averaged over the items that have that frame
and keep something in it, next to the uniform expectation (the share of that frame's prunable tokens that
are boundary tokens: what an unbiased selection keeps, ~20% for band 0.1). HIPPO reports 44-58% for
attention-only selection against ~20%.

    vpsd bias RUN_DIR [--strategy S] [--band 0.1] [--out FIG.png]

prints the table, writes RUN_DIR/bias.json and draws FIG.png (default RUN_DIR/bias.png): per frame one bar
per strategy, the uniform expectation as a dashed line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from vpsd.reports.kept_log import FILENAME, KeptRecord, read_kept
from vpsd.pipeline.pruning.position_bias import boundary_share, is_boundary_row


@dataclass
class BiasReport:
    strategy: str
    band: float
    items: int
    share: list[float]  # per frame: mean boundary share of the kept tokens over items (NaN: none kept)
    uniform: list[float]  # per frame: mean boundary share of all prunable tokens (the unbiased expectation)
    counts: list[int]  # per frame: items that keep something in that frame
    overall: float  # boundary share of every kept prunable token of every item, pooled
    overall_uniform: float  # the same for every prunable token


def _nanmean_rows(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged (T_i,) rows -> per column mean over the non-NaN entries (NaN where none) and their count."""
    stack = torch.full((len(rows), width), float("nan"))
    for i, r in enumerate(rows):
        stack[i, : r.numel()] = r
    ok = ~stack.isnan()
    count = ok.sum(0)
    total = torch.where(ok, stack, torch.zeros_like(stack)).sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan"))), count


def _pooled(records: list[KeptRecord], band: float, all_tokens: bool) -> float:
    """Share of boundary tokens among the kept (or all) prunable tokens of every item together."""
    at_edge = total = 0
    for r in records:
        chosen = torch.arange(r.layout.num_tokens) if all_tokens else r.kept
        chosen = chosen[r.layout.prunable[chosen]]
        at_edge += int(is_boundary_row(r.layout.row[chosen], r.layout.grid[1], band).sum())
        total += int(chosen.numel())
    return at_edge / total if total else float("nan")


def bias_report(records: list[KeptRecord], band: float = 0.1) -> dict[str, BiasReport]:
    """One report per strategy found in `records`, in first-seen order."""
    by_strategy: dict[str, list[KeptRecord]] = {}
    for r in records:
        by_strategy.setdefault(r.strategy, []).append(r)
    reports = {}
    for strategy, recs in by_strategy.items():
        width = max(r.layout.grid[0] for r in recs)
        kept_rows = [boundary_share(r.kept, r.layout, band) for r in recs]
        all_rows = [boundary_share(torch.nonzero(r.layout.prunable).squeeze(1), r.layout, band) for r in recs]
        share, counts = _nanmean_rows(kept_rows, width)
        uniform, _ = _nanmean_rows(all_rows, width)
        reports[strategy] = BiasReport(
            strategy, band, len(recs), share.tolist(), uniform.tolist(), counts.tolist(),
            _pooled(recs, band, all_tokens=False), _pooled(recs, band, all_tokens=True),
        )
    return reports


def format_report(report: BiasReport) -> str:
    pct = lambda v: "   -" if math.isnan(v) else f"{100 * v:5.1f}%"  # noqa: E731
    lines = [f"strategy {report.strategy}: {report.items} items, boundary band = top and bottom "
             f"{100 * report.band:g}% of rows",
             f"{'frame':>5}  {'kept at boundary':>16}  {'uniform expectation':>19}  {'items':>5}"]
    for f, (s, u, n) in enumerate(zip(report.share, report.uniform, report.counts)):
        lines.append(f"{f:>5}  {pct(s):>16}  {pct(u):>19}  {n:>5}")
    lines.append(f"{'all':>5}  {pct(report.overall):>16}  {pct(report.overall_uniform):>19}  {report.items:>5}")
    return "\n".join(lines)


def plot_report(reports: dict[str, BiasReport], out_png: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = max(len(r.share) for r in reports.values())
    bar = 0.8 / max(1, len(reports))
    for i, r in enumerate(reports.values()):
        x = [f - 0.4 + bar * (i + 0.5) for f in range(len(r.share))]
        ax.bar(x, [100 * (0.0 if math.isnan(v) else v) for v in r.share], width=bar, label=r.strategy)
    first = next(iter(reports.values()))
    ax.plot(range(len(first.uniform)), [100 * v for v in first.uniform], "k--", marker="o", label="uniform expectation")
    ax.set_xticks(range(width))
    ax.set_xlabel("frame")
    ax.set_ylabel(f"kept tokens in boundary band (%), band {100 * first.band:g}%")
    ax.set_ylim(0, 100)
    ax.set_title("Position bias of the kept video tokens per frame")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def _json_safe(value):
    """NaN (a frame where nothing was kept) -> null: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bias", description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help=f"a run directory holding {FILENAME}, or a {FILENAME} file")
    p.add_argument("--strategy", default=None, help="only this strategy (default: every one in the file)")
    p.add_argument("--band", type=float, default=0.1, help="boundary band as a share of the rows (HIPPO: 0.1)")
    p.add_argument("--out", type=Path, default=None, help="figure path (default RUN_DIR/bias.png)")
    args = p.parse_args(argv)
    source = args.run / FILENAME if args.run.is_dir() else args.run
    if not source.exists():
        print(f"vpsd bias: {source} not found (written by the pruner of a parallel run, or by "
              "`vpsd bench pruning`)", file=sys.stderr)
        return 2
    records = [r for r in read_kept(source) if args.strategy in (None, r.strategy)]
    if not records:
        print(f"vpsd bias: no kept sets{f' for strategy {args.strategy!r}' if args.strategy else ''} in {source}",
              file=sys.stderr)
        return 2
    reports = bias_report(records, args.band)
    print("\n\n".join(format_report(r) for r in reports.values()))
    run_dir = source.parent
    (run_dir / "bias.json").write_text(json.dumps({k: _json_safe(asdict(r)) for k, r in reports.items()}, indent=2))
    out_png = args.out or run_dir / "bias.png"
    plot_report(reports, out_png)
    print(f"wrote {out_png} and {run_dir / 'bias.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

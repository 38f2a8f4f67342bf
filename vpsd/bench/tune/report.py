"""`vpsd tune`'s report: every candidate's prediction, the confirmed ones measured, the winner and by how much, the
noise; printed, and written beside the tuned config's work (tune.txt, tune.json)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vpsd.bench.tune.confirm import Confirmed, Skipped
from vpsd.bench.tune.predict import Prediction


@dataclass(frozen=True)
class Verdict:
    """The winner over every confirmed row (the best at each batch size in `by_batch`), and what it beat."""

    winner: Confirmed | None
    by_batch: dict[int, Confirmed]
    runner_up: Confirmed | None  # the next best lossless row at the winner's batch size
    disqualified: list[str]  # rows whose outputs differ from `ar`'s, or whose job failed


def decide(rows: list[Confirmed]) -> Verdict:
    """The highest measured items/hour among the lossless rows (`ar` among them), overall and at each batch size."""
    good = sorted((r for r in rows if r.lossless), key=lambda r: -r.items_per_hour)
    by_batch: dict[int, Confirmed] = {}
    for r in good:
        by_batch.setdefault(r.candidate.batch, r)
    winner = good[0] if good else None
    runner = next((r for r in good[1:] if winner is not None and r.candidate.batch == winner.candidate.batch), None)
    bad = [f"{r.candidate.label} ({'exit ' + str(r.exit_code) if r.exit_code else f'{r.identical}/{r.items} same'})"
           for r in rows if not r.lossless]
    return Verdict(winner, by_batch, runner, bad)


def _num(v, spec: str, width: int, suffix: str = "") -> str:
    return (format(v, spec) + suffix if v is not None else "-").rjust(width)


def predictions_table(preds: list[Prediction], ar: dict[int, Prediction], limit: int | None = None) -> str:
    head = (f"{'candidate':<40}{'pred/h':>8}{'x ar':>7}{'dec tok/s':>10}{'gamma':>6}{'MAT':>6}{'tau':>6}"
            f"{'T_p ms':>8}{'T_q ms':>8}{'P s':>7}")
    lines = [head, "-" * len(head)]
    shown: dict[int, int] = {}
    for p in preds:
        b = p.candidate.batch
        shown[b] = shown.get(b, 0) + 1
        if limit is not None and shown[b] > limit:
            continue
        base = ar[b].items_per_hour if b in ar else 0.0
        lines.append(f"{p.candidate.label:<40}{p.items_per_hour:>8.0f}{_num(p.items_per_hour / base if base else None, '.2f', 7, 'x')}"
                     f"{p.decode_tokens_per_s:>10.1f}{_num(p.gamma_used, '.0f', 6)}{_num(p.mat, '.2f', 6)}"
                     f"{_num(p.tau, '.2f', 6)}{_num(p.t_p_ms, '.1f', 8)}{_num(p.t_q_ms, '.2f', 8)}{p.prefill_s:>7.2f}")
    hidden = sum(max(n - limit, 0) for n in shown.values()) if limit is not None else 0
    if hidden:
        lines.append(f"... and {hidden} more (tune.txt lists every one)")
    return "\n".join(lines)


def confirmed_table(rows: list[Confirmed], preds: dict, noise: dict[int, float], skipped: list[Skipped] = ()) -> str:
    head = (f"{'candidate':<40}{'pred/h':>8}{'items/h':>9}{'spread':>7}{'x ar':>7}{'pred/meas':>10}"
            f"{'dec tok/s':>10}  same as ar")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.candidate.batch, r.candidate.method != "ar", -r.items_per_hour)):
        p = preds.get(r.candidate)
        ratio = p.items_per_hour / r.items_per_hour if p is not None and r.items_per_hour else None
        same = f"{r.identical}/{r.items}" + (f" +{r.ties} ties" if r.ties else "") + ("" if r.lossless else "  NO")
        lines.append(f"{r.candidate.label:<40}{_num(p.items_per_hour if p else None, '.0f', 8)}{r.items_per_hour:>9.0f}"
                     f"{100 * r.spread:>6.0f}%{r.x_ar:>6.2f}x{_num(ratio, '.2f', 10)}{r.decode_tokens_per_s:>10.1f}  {same}")
    lines.append("noise (spread of the ar jobs' items/hour at each B): "
                 + ", ".join(f"B={b}: {v:.0%}" for b, v in sorted(noise.items())))
    lines += [f"not run: {s.prediction.candidate.label}, {s.why}" for s in skipped]
    return "\n".join(lines)


def verdict_lines(v: Verdict, noise: dict[int, float]) -> list[str]:
    if v.winner is None:
        return ["no candidate ran losslessly: nothing to choose"]
    w = v.winner
    b = w.candidate.batch
    line = f"winner: {w.candidate.label}, {w.items_per_hour:.0f} items/hour, {w.x_ar:.2f}x ar at B={b}"
    if v.runner_up is not None:
        line += f", {w.items_per_hour / v.runner_up.items_per_hour:.2f}x the runner-up ({v.runner_up.candidate.label})"
    line += f"; noise at B={b}: {noise.get(b, 0.0):.0%}"
    if w.candidate.method != "ar" and w.x_ar - 1 < noise.get(b, 0.0):
        line += " (its lead over ar is inside the noise)"
    lines = [line]
    lines += [f"best at B={bb}: {r.candidate.label}, {r.items_per_hour:.0f} items/hour, {r.x_ar:.2f}x ar"
              for bb, r in sorted(v.by_batch.items()) if r is not w]
    if v.disqualified:
        lines.append("not lossless or failed (never chosen): " + "; ".join(v.disqualified))
    return lines


def write(work: Path, text: str, meta: dict, preds: list[Prediction], rows: list[Confirmed],
          skipped: list[Skipped] = ()) -> None:
    (work / "tune.txt").write_text(text + "\n")
    data = {**meta, "predictions": [{**asdict(p), "label": p.candidate.label} for p in preds],
            "not_run": [{"label": s.prediction.candidate.label, "predicted": s.predicted, "why": s.why}
                        for s in skipped],
            "confirmed": [{"label": r.candidate.label, "candidate": asdict(r.candidate),
                           "items_per_hour": r.items_per_hour, "x_ar": r.x_ar, "spread": r.spread,
                           "decode_tokens_per_s": r.decode_tokens_per_s, "items": r.items, "identical": r.identical,
                           "ties": r.ties, "exit_code": r.exit_code, "runs": [str(p) for p in r.runs]} for r in rows]}
    (work / "tune.json").write_text(json.dumps(data, indent=1, default=str))

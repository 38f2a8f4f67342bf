"""The predictions' best few, confirmed as real jobs on the sample, interleaved with `ar` (as the benches run them).

At each batch size: an `ar` job, then the best predicted candidates (as many as `--confirm` asks and the time budget
leaves room for: each job estimated at the first `ar` job's start-up plus its predicted items), all `--repeats`
times in rounds, and one more `ar` job closing each batch size, so `ar` brackets every row in time. In the first
round a candidate runs only if its job could change the choice (`_not_worth_it`): its prediction, scaled by the job
factor the `ar` job just gave (predict.py) and raised by the predictions' tolerance, reaches the best measured so
far, and it is no tie with a candidate confirmed as predicted. Each job is
`vpsd bench methods`' own (run_one: the launcher users run, torchrun leaving nothing behind); a cell is read as the
throughput bench reads one (read_cell: items/hour over the job's item loop, decode tokens/s). Every output is
compared with the first `ar` job's at that batch size, and a difference is judged by the target's top-2 margin
where it first differs (judge_differences: a tie in float noise, or a real divergence, which disqualifies the
candidate). The noise at a batch size: the spread of its `ar` jobs' items/hour.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from vpsd.bench.methods import BenchRun, run_one
from vpsd.bench.throughput import Cell, judge_differences, read_cell
from vpsd.bench.tune.candidates import AUTO, Candidate
from vpsd.bench.tune.predict import Prediction, job_factor, scaled_by, with_job_factor

# How far a prediction may be off and its candidate still be run (issue 63's goal for the predictions: within 15%).
PREDICTION_TOLERANCE = 0.15
# Predictions this close are a tie: one of them is confirmed (`ties`).
PREDICTION_TIE = 0.02


@dataclass
class Confirmed:
    candidate: Candidate
    runs: list[Path] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    exit_code: int = 0
    items_per_hour: float = 0.0  # median over the repeats
    decode_tokens_per_s: float = 0.0
    spread: float = 0.0  # (max - min) / median of its items/hour
    x_ar: float = 0.0  # over the `ar` jobs' median at its batch size
    items: int = 0
    identical: int = 0
    ties: int = 0

    @property
    def lossless(self) -> bool:
        """Every item done and every output `ar`'s (a tie in the target's float noise counts as `ar`'s)."""
        return self.exit_code == 0 and self.items > 0 and self.identical + self.ties == self.items


@dataclass
class JobPlan:
    config: str
    manifests: dict[int, Path]  # the sample at each batch size
    out: Path
    torchrun: list[str]
    sets: list[str]  # --set KEY=VALUE of every job
    repeats: int = 1
    budget_s: float = 600.0
    started: float = 0.0  # time.time() at the tune's start: the budget counts the measurement too


def ar_at(batch: int) -> Candidate:
    return Candidate("ar", "none", 0.0, AUTO, batch)


def choose_confirmed(predictions: list[Prediction], per_batch: int) -> dict[int, list[Prediction]]:
    """The best `per_batch` predicted drafting candidates at each batch size, best first: the best of each draft
    (method, strategy, ratio) before a second window or placement of one already chosen, which the prediction
    tells apart least. A tie with one confirmed (`ties`) is left out as it comes up, in `confirm`."""
    out: dict[int, list[Prediction]] = {}
    for b in dict.fromkeys(p.candidate.batch for p in predictions):
        mine = [p for p in predictions if p.candidate.batch == b and p.candidate.method != "ar"]
        seen, first, rest = set(), [], []
        for p in mine:
            key = (p.candidate.method, p.candidate.strategy, p.candidate.ratio)
            (rest if key in seen else first).append(p)
            seen.add(key)
        if mine:
            out[b] = sorted((first + rest)[:per_batch], key=lambda p: -p.items_per_hour)
    return out


def ties(a: float, b: float) -> bool:
    """Two predictions (items/hour) the model cannot tell apart: within PREDICTION_TIE of each other. Their jobs
    could not either (the `ar` jobs' spread is 1-3% here): on the long pair ten pruning strategies at one ratio
    were predicted within 2%, and the three of them run measured within 1%, three jobs of ~37 s each."""
    hi, lo = max(a, b), min(a, b)
    return hi > 0 and (hi - lo) / hi <= PREDICTION_TIE


def as_predicted(predicted: float, measured: float) -> bool:
    """Whether a confirmed candidate's job came within the predictions' tolerance of its prediction."""
    return measured > 0 and abs(predicted / measured - 1) <= PREDICTION_TOLERANCE


def run_job(plan: JobPlan, c: Candidate, label: str) -> tuple[Path, int, float]:
    """One candidate's job on its batch size's sample: (its run directory, exit code, seconds)."""
    run, extra = c.job()
    path = plan.out / label
    t0 = time.time()
    code = run_one(BenchRun(label, run.method, run.strategy, run.settings), plan.config, str(plan.manifests[c.batch]),
                   path, plan.torchrun + ["--nproc-per-node", str(c.nproc)], [f"--set={kv}" for kv in plan.sets] + extra)
    return path, code, time.time() - t0


def within_budget(chosen: dict[int, list[Prediction]], ar: dict[int, Prediction], plan: JobPlan, startup_s: float,
                  spent_s: float) -> dict[int, list[Prediction]]:
    """The chosen, cut (the worst predicted first, never a batch size's best) to what fits the time left: each job
    costs `startup_s` and its predicted items; every `ar` job still to run is counted."""
    def job_s(p: Prediction, n: int) -> float:
        return startup_s + 3600 * n / max(p.items_per_hour, 1e-9)

    sizes = {b: len(plan.manifests[b].read_text().splitlines()) for b in chosen}
    kept = {b: list(ps) for b, ps in chosen.items()}
    while True:
        ar_s = sum((plan.repeats + 1) * job_s(ar[b], sizes[b]) for b in kept)
        total = spent_s + ar_s + plan.repeats * sum(job_s(p, sizes[b]) for b, ps in kept.items() for p in ps)
        longest = max(kept, key=lambda b: len(kept[b]), default=None)
        if total <= plan.budget_s or longest is None or len(kept[longest]) <= 1:
            return kept
        kept[longest].pop()


def confirm(plan: JobPlan, predictions: list[Prediction], per_batch: int, ar: dict[int, Prediction],
            say: Callable[[str], None] = print) -> tuple[list[Confirmed], dict[int, float], list[Skipped]]:
    """Runs the schedule (module docstring) over the best `per_batch` predicted at each batch size, chosen again
    once its first `ar` job gave the job factor (it reorders candidates run as `ar` is against those with a draft
    rank: on the long pair sd came first only then); returns every row measured (ar's included), the noise at each
    batch size, and the chosen candidates left unrun. `ar`: its prediction at each batch size (the budget's
    estimate of its jobs, and the job factor's reference)."""
    rows: dict[Candidate, Confirmed] = {}
    skipped: list[Skipped] = []
    chosen = choose_confirmed(predictions, per_batch)
    for rep in range(plan.repeats):
        for b in sorted(chosen):
            secs = _run_into(rows, plan, ar_at(b), _label(ar_at(b), rep, opening=True), say)
            if rep == 0 and b == min(chosen):  # the first ar job: what a job costs beside its items
                startup = max(secs - _loop_s(rows[ar_at(b)].runs[-1]), 1.0)
                chosen = within_budget(chosen, ar, plan, startup, time.time() - (plan.started or time.time()))
            factor = job_factor(ar[b].items_per_hour, _rate(rows[ar_at(b)].runs[0]))
            if rep == 0:
                chosen[b] = _chosen_again(predictions, b, factor, len(chosen[b]))
            ran: list[tuple[Prediction, float]] = []  # (prediction, measured) of those confirmed at b
            kept = []
            for p in chosen[b]:
                mine = p.items_per_hour / scaled_by(p.candidate, factor)
                why = _not_worth_it(mine, ran, factor) if rep == 0 else None
                if why is not None:
                    skipped.append(Skipped(p, mine, why))
                    say(f"not running {p.candidate.label}: {why}")
                    continue
                kept.append(p)
                _run_into(rows, plan, p.candidate, _label(p.candidate, rep, opening=True), say)
                ran.append((p, _rate(rows[p.candidate].runs[-1])))
            chosen[b] = kept
    for b in sorted(chosen):  # ar closes each batch size
        _run_into(rows, plan, ar_at(b), _label(ar_at(b), plan.repeats, opening=False), say)
    noise = _measure(plan, list(rows.values()))
    return list(rows.values()), noise, skipped


def _chosen_again(predictions: list[Prediction], batch: int, factor: float, count: int) -> list[Prediction]:
    """The best `count` at `batch` by their predictions scaled as the job factor says (predict.py scaled_by); the
    predictions themselves, unscaled, in that order."""
    mine = [p for p in predictions if p.candidate.batch == batch]
    raw = {p.candidate: p for p in mine}
    return [raw[q.candidate] for q in choose_confirmed(with_job_factor(mine, {batch: factor}), count).get(batch, [])]


@dataclass(frozen=True)
class Skipped:
    prediction: Prediction
    predicted: float  # items/hour, with the job factor it takes (predict.py scaled_by)
    why: str


def _not_worth_it(predicted: float, ran: list[tuple[Prediction, float]], factor: float) -> str | None:
    """Why a candidate's job could not change the choice, or None: it cannot win (`could_win`), or it ties one
    already confirmed (`ties`) whose job came as predicted (a tie with a candidate the model mispredicted says
    nothing: the short pair's pipelined TABED at B = 8 was predicted within 1% of sd and measured 36% below it)."""
    best = max((m for _, m in ran), default=0.0)
    if not could_win(predicted, best):
        return (f"predicted {predicted:.0f} items/hour, more than {100 * PREDICTION_TOLERANCE:.0f}% below the best "
                f"measured ({best:.0f})")
    for q, measured in ran:
        mine = q.items_per_hour / scaled_by(q.candidate, factor)
        if ties(predicted, mine) and as_predicted(mine, measured):
            return (f"predicted {predicted:.0f} items/hour, a tie with {q.candidate.label} (predicted {mine:.0f}, "
                    f"measured {measured:.0f})")
    return None


def could_win(predicted: float, best_measured: float) -> bool:
    """Whether a candidate is worth its job: its prediction (job factor applied), raised by the predictions'
    tolerance, reaches the best measured so far at its batch size. The rest cannot win unless their prediction is
    off by more than the tolerance (docs/benchmarks.md, "Tuning", measures how far off they are); each job saved
    is a job's start-up and the sample's items, the tune's largest cost on a small manifest."""
    return best_measured <= 0 or predicted * (1 + PREDICTION_TOLERANCE) >= best_measured


def _rate(path: Path) -> float:
    try:
        return read_cell(path).items_per_hour
    except (OSError, ValueError):
        return 0.0


def _run_into(rows: dict[Candidate, Confirmed], plan: JobPlan, c: Candidate, label: str,
              say: Callable[[str], None]) -> float:
    path, code, secs = run_job(plan, c, label)
    row = rows.setdefault(c, Confirmed(c))
    row.runs.append(path)
    row.exit_code = max(row.exit_code, code)
    say(f"job {label}: exit {code} ({secs:.0f} s)")
    return secs


def _label(c: Candidate, rep: int, opening: bool) -> str:
    base = c.label.replace(" ", "_").replace("=", "").replace(":", "-").replace("+", "_")
    return f"{base}_r{rep + 1}" if opening else f"{base}_close"


def _loop_s(path: Path) -> float:
    try:
        cell = read_cell(path)
    except (OSError, ValueError):
        return 0.0
    return 3600 * cell.items / cell.items_per_hour if cell.items_per_hour else 0.0


def _measure(plan: JobPlan, rows: list[Confirmed]) -> dict[int, float]:
    """Each row's cells, medians, ratio over `ar` and outputs against `ar`'s; the noise at each batch size."""
    noise = {}
    for r in rows:
        r.cells = [read_cell(p) for p in r.runs]
        rates = [c.items_per_hour for c in r.cells]
        r.items_per_hour = statistics.median(rates)
        r.decode_tokens_per_s = statistics.median(c.decode_tokens_per_s for c in r.cells)
        r.spread = (max(rates) - min(rates)) / r.items_per_hour if r.items_per_hour and len(rates) > 1 else 0.0
    for b in sorted({r.candidate.batch for r in rows}):
        ar = next(r for r in rows if r.candidate == ar_at(b))
        noise[b] = ar.spread
        reference = ar.cells[0].outputs
        mine = [r for r in rows if r.candidate.batch == b]
        for r in mine:
            r.x_ar = r.items_per_hour / ar.items_per_hour if ar.items_per_hour else 0.0
            first = r.cells[0]
            r.items = len(reference)  # an item this row failed is one it did not decode as `ar` did
            r.identical = sum(first.outputs.get(i) == toks for i, toks in reference.items())
        _judge(plan, b, ar, mine)
    return noise


def _judge(plan: JobPlan, batch: int, ar: Confirmed, rows: list[Confirmed]) -> None:
    """Differences from `ar` judged by the target's margin (vpsd/bench/throughput.py judge_differences)."""
    views = [SimpleNamespace(method=r.candidate.label, batch=batch, identical=r.identical, items=r.items, ties=0)
             for r in rows]
    a = argparse.Namespace(out=plan.out, config=plan.config, set=plan.sets)
    judge_differences(a, plan.manifests[batch], views, ar.runs[0], {(v.method, batch): r.runs[0]
                                                                    for v, r in zip(views, rows)})
    for v, r in zip(views, rows):
        r.ties = v.ties

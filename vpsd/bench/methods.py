"""The method benchmark: every method, pruning baseline and ablation on one manifest, in one run.

    vpsd bench methods --config configs/world_qwen2_5_vl_scaled.yaml --manifest M --out runs/bench [--repeats 3]

Each row is a real torchrun job of `vpsd.launch.entry` (the same launcher users run), writing its own run
directory under --out. Rows: the methods (pearl preceded by `pearl-video`, its draft told of an item only
after the target's prefill), then each pruning strategy in the parallel pipeline (`--baseline-method`, default
`hippo`) at the config's ratio; with pearl, hippo and specvlm pruning among them, HIPPO Table 3 follows as
steps (`format_table3`). Timing is measured side by side, never
claimed: the whole list runs `--repeats` times in rounds, each round opening with an `ar` run, and one more
`ar` run closes the bench, so `ar` brackets every row in time; the baseline is the per-item median over
those `ar` runs, their spread (max - min over median of the totals) is printed as this run's timing noise,
and a row repeated R times reports its median.

Per row: MAT and acceptance; tau_hat (per-token acceptance, pipeline/theory.py); the window gamma the row
ran with (the mean of what `gamma: auto` chose, ParallelVLM Eq. 6); the measured wall speedup (vision +
prefill + decode) and decode-only speedup over `ar` on the same ids; the decode-only speedup ParallelVLM
Appendix C predicts from the row's own measured T_p (mean target verify forward), T_q (mean draft forward),
gamma and tau_hat against `ar`'s own measured per-token time (Theorem 6 for parallel rows; for serial ones the
round the serial window prices, pipeline/theory.py); efficiency = measured decode-only / predicted; per round, what the target spent neither
verifying nor waiting for a chunk (overhead: Python, messaging, bookkeeping); the mean wait from the end of
the target's prefill to the first chunk; whether every output equals `ar`'s.
Writes OUT/bench.txt, bench.csv, bench.json and bench.png; exits 1 if any output differs from `ar`.
A bench measures, it never resumes: each row's run directory is emptied before its job starts.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vpsd.launch.torchrun import torchrun_command
from vpsd.pipeline.methods import METHODS, get_method
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.reports.accounting import predict
from vpsd.reports.summary import read_rows, summarize


@dataclass(frozen=True)
class BenchRun:
    label: str
    method: str
    strategy: str | None = None  # None: the method's own default
    settings: tuple[str, ...] = ()  # KEY=VALUE config settings of this row alone

    def args(self) -> list[str]:
        return (["--method", self.method] + (["--pruning", self.strategy] if self.strategy else [])
                + [f"--set={kv}" for kv in self.settings])


# HIPPO Table 3 (VideoMME, wall speedup over AR): each row adds one of HIPPO's parts to PEARL-video.
TABLE3 = [("pearl-video", "PEARL-video", 2.24), ("pearl", "+ synchronous prefill", 2.46),
          ("hippo+specvlm", "+ SpecVLM's selection", 2.52), ("hippo", "HIPPO", 2.85)]
PEARL_VIDEO = BenchRun("pearl-video", "pearl", settings=("decoding.sync_prefill=false",))


@dataclass
class BenchRow:
    label: str
    method: str
    strategy: str
    parallel: bool
    items: int
    identical: int
    mat: float
    acceptance: float
    tau_hat: float
    gamma: float | None  # mean window the row's chunks were drafted with (None: no draft)
    speedup: float  # wall (vision + prefill + decode) over ar, median of the repeats
    decode_speedup: float  # decode phase only over ar, median of the repeats
    theory_speedup: float | None  # decode-only, ParallelVLM App. C against ar's per-token time
    efficiency: float | None  # decode_speedup / theory_speedup
    tokens_per_s: float
    t_target_ms: float | None  # mean verify forward of a whole window (full_window_verify_ms)
    t_draft_ms: float | None  # mean draft forward (one token)
    overhead_ms: float | None  # per round: target time neither verifying nor waiting for a chunk
    first_chunk_ms: float | None  # per item: target prefill end -> first chunk (parallel rows)
    repeats: int
    exit_code: int


def default_runs(baseline_method: str = "hippo", methods: list[str] | None = None,
                 strategies: list[str] | None = None) -> list[BenchRun]:
    names = methods if methods is not None else list(METHODS)
    runs = [BenchRun("ar", "ar")]
    for m in names:
        if m == "pearl":  # with its row of HIPPO Table 3 before it: the draft told of an item after the prefill
            runs.append(PEARL_VIDEO)
        if m != "ar":
            runs.append(BenchRun(m, m))
    default = get_method(baseline_method).default_strategy
    for s in strategies if strategies is not None else list(STRATEGIES):
        if s != default:
            runs.append(BenchRun(f"{baseline_method}+{s}", baseline_method, s))
    return runs


def run_one(run: BenchRun, config: str, manifest: str, out: Path, torchrun: list[str], extra: list[str]) -> int:
    # torchrun leaving nothing behind (its log directory goes with the job), as ./torchrun.sh's launcher does.
    cmd = torchrun_command(*torchrun, "-m", "vpsd.launch.entry", "--config", config, "--manifest", manifest,
                           "--out", str(out), "--quiet", *run.args(), *extra)
    if out.exists():
        shutil.rmtree(out)  # the job would resume from an old results.jsonl and skip every item
    out.mkdir(parents=True)
    with open(out / "launch.log", "w") as log:
        # Its own control-plane secret, as ./torchrun.sh makes one (vpsd/transport/auth.py).
        env = {**os.environ, "VPSD_JOB_SECRET": os.environ.get("VPSD_JOB_SECRET") or secrets.token_hex(32)}
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def run_schedule(schedule: list[tuple[BenchRun, int]], config: str, manifest: str, out: Path, torchrun: list[str],
                 extra: list[str]) -> tuple[dict[str, list[Path]], dict[str, int]]:
    """Each (row, repeat) of `schedule` as a job, in order, a line printed as each ends; returns every row's run
    directories (its repeats in order) and its worst exit code, by label."""
    dirs: dict[str, list[Path]] = {}
    codes: dict[str, int] = {}
    for i, (run, rep) in enumerate(schedule, 1):
        t = time.time()
        path = run_dir(out, run, rep)
        code = run_one(run, config, manifest, path, torchrun, extra)
        codes[run.label] = max(codes.get(run.label, 0), code)
        dirs.setdefault(run.label, []).append(path)
        print(f"[{i}/{len(schedule)}] {path.name:<24} exit {code}  ({time.time() - t:.0f} s)", flush=True)
    return dirs, codes


def run_dir(out: Path, run: BenchRun, repeat: int = 0) -> Path:
    """OUT/LABEL for a row's first run, OUT/LABEL_2, _3, ... for its repeats."""
    return out / (run.label.replace("+", "_") + (f"_{repeat + 1}" if repeat else ""))


@dataclass
class Baseline:
    """The `ar` runs of one bench: per-item medians over every ar run, and their spread."""

    dirs: list[Path]

    def __post_init__(self) -> None:
        runs = [{r["id"]: r for r in read_rows(d) if r.get("error") is None} for d in self.dirs]
        self.reference = runs[0]  # outputs: every ar run decodes the same tokens (checked in the table)
        ids = set.intersection(*(set(r) for r in runs)) if runs else set()
        self.items = {i: {key: statistics.median(r[i]["stats"][key] for r in runs) for key in ("wall_s", "decode_s")}
                      for i in ids}
        totals = [sum(r[i]["stats"]["wall_s"] for i in ids) for r in runs]
        self.noise = (max(totals) - min(totals)) / statistics.median(totals) if len(totals) > 1 and ids else 0.0
        tokens = sum(len(runs[0][i]["token_ids"]) - 1 for i in ids)
        # ar's seconds per decoded token (one target step), the unit of every speedup (pipeline/theory.py)
        self.step_s = sum(v["decode_s"] for v in self.items.values()) / tokens if tokens > 0 else 0.0
        self.consistent = all(r[i]["token_ids"] == runs[0][i]["token_ids"] for r in runs for i in ids)

    def speedups(self, run_dir: Path) -> tuple[float, float, int, int]:
        """(wall speedup, decode-only speedup, items compared, outputs identical to ar) for one run."""
        run = {r["id"]: r for r in read_rows(run_dir) if r.get("error") is None}
        common = [i for i in self.items if i in run]

        def ratio(key: str) -> float:
            mine = sum(run[i]["stats"][key] for i in common)
            return sum(self.items[i][key] for i in common) / mine if mine else 0.0

        same = sum(run[i]["token_ids"] == self.reference[i]["token_ids"] for i in common)
        return ratio("wall_s"), ratio("decode_s"), len(common), same


def measure(run: BenchRun, paths: list[Path], base: Baseline, code: int) -> BenchRow:
    """One row from the run directories of its repeats (speedups: medians; rates and times: the first run's)."""
    method = get_method(run.method)
    path = paths[0]
    s = summarize(path)
    ratios = [base.speedups(p) for p in paths]
    wall = statistics.median(r[0] for r in ratios)
    decode = statistics.median(r[1] for r in ratios)
    items, identical = min(r[2] for r in ratios), min(r[3] for r in ratios)
    pred = predict(path, method, base.step_s, s)
    first = 1000 * s["first_chunk_wait_s"] / s["items_done"] if method.parallel and s["items_done"] else None
    return BenchRow(run.label, run.method, run.strategy or method.default_strategy, method.parallel, items,
                    identical, s["mean_accepted_tokens"], s["acceptance_rate"], s["tau_hat"], s["gamma"], wall, decode,
                    pred.theory, decode / pred.theory if pred.theory else None, s["tokens_per_s"], pred.t_p_ms,
                    pred.t_q_ms, pred.overhead_ms, first, len(paths), code)


def format_table(rows: list[BenchRow]) -> str:
    def num(v: float | None, width: int, spec: str, suffix: str = "") -> str:
        return (format(v, spec) + suffix if v is not None else "-").rjust(width)

    head = (f"{'run':<20}{'mode':<9}{'strategy':<14}{'gamma':>6}{'MAT':>6}{'tau':>6}{'wall x':>8}{'decode x':>9}"
            f"{'theory':>8}{'effic.':>7}{'T_p ms':>8}{'T_q ms':>8}{'ovh ms':>7}{'1st ms':>7}{'same as ar':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.label:<20}{'parallel' if r.parallel else 'serial':<9}{r.strategy:<14}{num(r.gamma, 6, '.1f')}"
            f"{num(r.mat, 6, '.2f')}{num(r.tau_hat if r.gamma else None, 6, '.2f')}{num(r.speedup, 8, '.2f', 'x')}"
            f"{num(r.decode_speedup, 9, '.2f', 'x')}{num(r.theory_speedup, 8, '.2f', 'x')}{num(r.efficiency, 7, '.2f')}"
            f"{num(r.t_target_ms, 8, '.1f')}{num(r.t_draft_ms, 8, '.1f')}{num(r.overhead_ms, 7, '.2f')}"
            f"{num(r.first_chunk_ms, 7, '.0f')}{f'{r.identical}/{r.items}':>11}"
        )
    return "\n".join(lines)


def format_table3(rows: list[BenchRow]) -> str:
    """HIPPO Table 3 as a decomposition of this bench's rows, when it ran all four: each step's wall speedup
    next to the paper's, and which term of App. C it moved: the draft's cost (T_q, and the window gamma that
    follows it under auto) or its agreement (MAT); the first step moves neither, only the first chunk's wait."""
    by = {r.label: r for r in rows}
    if not all(label in by for label, _, _ in TABLE3):
        return ""
    lines = ["HIPPO Table 3 as steps (paper: VideoMME, video-SALMONN2+ 7B/72B)",
             f"{'step':<24}{'wall x':>8}{'paper':>7}{'1st ms':>8}{'T_q ms':>8}{'gamma':>7}{'MAT':>6}  moved"]
    prev = None
    for label, name, paper in TABLE3:
        r = by[label]
        moved = "" if prev is None else _moved(prev, r)
        lines.append(f"{name:<24}{r.speedup:>7.2f}x{paper:>6.2f}x{r.first_chunk_ms or 0:>8.0f}"
                     f"{r.t_draft_ms or 0:>8.1f}{r.gamma or 0:>7.1f}{r.mat:>6.2f}  {moved}")
        prev = r
    return "\n".join(lines)


def _moved(before: BenchRow, after: BenchRow) -> str:
    """The terms that changed by more than 5% from one step to the next, as ratios after / before."""
    terms = {"1st chunk wait": (before.first_chunk_ms, after.first_chunk_ms), "T_q": (before.t_draft_ms, after.t_draft_ms),
             "gamma": (before.gamma, after.gamma), "MAT": (before.mat, after.mat)}
    out = [f"{name} x{b / a:.2f}" for name, (a, b) in terms.items() if a and b and abs(b / a - 1) > 0.05]
    return ", ".join(out) or "none above 5%"


def plot(rows: list[BenchRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.55 * len(rows)), 7), sharex=True)
    ax1.bar([i - 0.27 for i in x], [r.speedup for r in rows], width=0.27, label="measured, wall")
    ax1.bar(list(x), [r.decode_speedup for r in rows], width=0.27, label="measured, decode only")
    ax1.bar([i + 0.27 for i in x], [r.theory_speedup or 0 for r in rows], width=0.27,
            label="decode, theory (ParallelVLM App. C)")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("speedup over ar")
    ax1.legend()
    ax2.bar(list(x), [r.mat for r in rows], color="tab:green")
    ax2.set_ylabel("mean accepted tokens")
    ax2.set_xticks(list(x), labels, rotation=60, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(a: argparse.Namespace, rows: list[BenchRow], base: Baseline, ar_runs: list[str]) -> None:
    """The table (printed, and OUT/bench.txt), OUT/bench.csv, bench.json and bench.png."""
    table = format_table(rows)
    table += (f"\nbaseline: median of {len(ar_runs)} interleaved ar runs ({1000 * base.step_s:.1f} ms per token); "
              f"their totals spread {base.noise:.0%} (this run's timing noise)")
    if table3 := format_table3(rows):
        table += "\n\n" + table3
    write_report(a.out, "bench", table, rows, {"config": a.config, "manifest": a.manifest, "repeats": a.repeats,
                                                "ar_runs": ar_runs, "noise": base.noise, "ar_step_s": base.step_s})
    plot(rows, a.out / "bench.png")


def write_report(out: Path, name: str, table: str, rows: list, meta: dict) -> None:
    """A bench's table, printed and in OUT/NAME.txt, its rows in NAME.csv, and `meta` with the rows in NAME.json."""
    print()
    print(table)
    (out / f"{name}.txt").write_text(table + "\n")
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    (out / f"{name}.json").write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench methods", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/world_qwen2_5_vl_scaled.yaml")
    p.add_argument("--manifest", required=True)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--methods", help="comma-separated (default: all)")
    p.add_argument("--strategies", help="comma-separated pruning strategies run in the baseline method (default: all)")
    p.add_argument("--baseline-method", default="hippo", help="parallel method the strategies run in")
    p.add_argument("--repeats", type=int, default=1, help="rounds over every row, each opened by an ar run")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--torchrun", default="--standalone", help="torchrun options (quoted)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    a = p.parse_args(argv)
    if not Path(a.manifest).is_file():  # before a job runs: each would refuse it, one after another
        p.error(f"--manifest {a.manifest}: no such file")
    split = lambda v: [x for x in v.split(",") if x] if v is not None else None  # noqa: E731
    runs = default_runs(a.baseline_method, split(a.methods), split(a.strategies))
    ar, rows_to_run = runs[0], runs[1:]
    torchrun = a.torchrun.split() + ["--nproc-per-node", str(a.nproc)]
    extra = [f"--set={kv}" for kv in a.set]
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # Rounds: ar, every row; ar, every row; ...; ar. Each row's repeats are spread over the whole bench, and
    # ar brackets them, so drift (thermal, a neighbour's load) lands on the baseline as much as on the rows.
    schedule = [(run, rep) for rep in range(a.repeats) for run in [ar] + rows_to_run] + [(ar, a.repeats)]
    dirs, codes = run_schedule(schedule, a.config, a.manifest, a.out, torchrun, extra)
    base = Baseline(dirs["ar"])
    rows = [measure(run, dirs[run.label], base, codes[run.label]) for run in runs]
    write_outputs(a, rows, base, [d.name for d in dirs["ar"]])
    print(f"\nwrote {a.out}/bench.txt, bench.csv, bench.json, bench.png  ({(time.time() - t0) / 60:.1f} min)")
    bad = [r.label for r in rows if r.identical != r.items or r.exit_code != 0 or r.items == 0]
    if not base.consistent:
        bad.append("ar (its runs disagree with each other)")
    if bad:
        print(f"vpsd bench: runs that failed or differ from ar: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

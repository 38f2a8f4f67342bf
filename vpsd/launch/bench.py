"""The method benchmark: every method, pruning baseline and ablation on one manifest, in one run.

    python -m vpsd.launch.bench --config configs/world_qwen2_5_vl.yaml --manifest M --out runs/bench

Each row is a real torchrun job of `vpsd.launch.entry` (the same launcher users run), writing its own run
directory under --out. Rows: the methods (`ar` first, and once more at the very end: the faster of the two
is the baseline every speedup is measured against, in this same invocation, and their gap is printed as
the run's timing noise), then each pruning strategy in the parallel pipeline (`--baseline-method`,
default `hippo`) at the config's ratio. Per row the table shows mean accepted tokens (MAT) and acceptance
rate from the results, the measured speedup over `ar` (sum of item wall times on the ids both finished),
whether every output equals `ar`'s, and the speedup ParallelVLM Appendix C predicts from this row's own
measured T_p (mean target verify forward), T_q (mean draft forward) and acceptance (`pipeline/theory.py`:
Theorem 6 for parallel methods, Theorem 4 for serial ones), so the gap to the ideal is visible.
Writes OUT/bench.csv, OUT/bench.json and OUT/bench.png; exits 1 if any output differs from `ar`.
A bench measures, it never resumes: each row's run directory is emptied before its job starts, so no row
reuses results (or timings) that an earlier invocation, maybe with other weights, left there.
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

from vpsd.config import load_config
from vpsd.launch.summary import compare, summarize
from vpsd.launch.timeline import load_spans
from vpsd.pipeline.methods import METHODS, get_method
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.pipeline.theory import parallel_sd_rollback_speedup, serial_sd_speedup


@dataclass(frozen=True)
class BenchRun:
    label: str
    method: str
    strategy: str | None = None  # None: the method's own default

    def args(self) -> list[str]:
        return ["--method", self.method] + (["--pruning", self.strategy] if self.strategy else [])


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
    speedup: float
    tokens_per_s: float
    t_target_ms: float | None  # mean verify forward
    t_draft_ms: float | None  # mean draft forward (one token)
    theory_speedup: float | None
    exit_code: int


def default_runs(baseline_method: str = "hippo", methods: list[str] | None = None,
                 strategies: list[str] | None = None) -> list[BenchRun]:
    names = methods if methods is not None else list(METHODS)
    runs = [BenchRun("ar", "ar")] + [BenchRun(m, m) for m in names if m != "ar"]
    default = get_method(baseline_method).default_strategy
    for s in strategies if strategies is not None else list(STRATEGIES):
        if s != default:
            runs.append(BenchRun(f"{baseline_method}+{s}", baseline_method, s))
    return runs


def run_one(run: BenchRun, config: str, manifest: str, out: Path, torchrun: list[str], extra: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "vpsd.launch.entry", "--config", config,
           "--manifest", manifest, "--out", str(out), *run.args(), *extra]
    if out.exists():
        shutil.rmtree(out)  # the job would resume from an old results.jsonl and skip every item
    out.mkdir(parents=True)
    with open(out / "launch.log", "w") as log:
        # Its own control-plane secret, as ./torchrun.sh makes one (vpsd/transport/auth.py).
        env = {**os.environ, "VPSD_JOB_SECRET": os.environ.get("VPSD_JOB_SECRET") or secrets.token_hex(32)}
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def run_dir(out: Path, run: BenchRun) -> Path:
    return out / run.label.replace("+", "_")


def mean_span_ms(spans, role: str, name: str) -> float | None:
    durs = [s.dur for s in spans if s.role == role and s.name == name and s.kind == "span"]
    return 1000 * statistics.mean(durs) if durs else None


def measure(run: BenchRun, path: Path, ar_dir: Path, gamma: int, code: int) -> BenchRow:
    method = get_method(run.method)
    s = summarize(path)
    cmp = compare(ar_dir, path)
    spans = load_spans(path)
    t_p = mean_span_ms(spans, "target", "verify")
    t_q = mean_span_ms(spans, "draft", "draft_step") or mean_span_ms(spans, "target", "draft_step")
    theory = None
    if method.uses_draft and t_p and t_q:
        c, tau = t_p / t_q, s["acceptance_rate"]
        theory = parallel_sd_rollback_speedup(c, gamma, tau) if method.parallel else serial_sd_speedup(c, gamma, tau)
    elif not method.uses_draft:
        theory = 1.0
    strategy = run.strategy or method.default_strategy
    return BenchRow(run.label, run.method, strategy, method.parallel, s["items_done"], cmp["identical_outputs"],
                    s["mean_accepted_tokens"], s["acceptance_rate"], cmp["speedup_vs_baseline"], s["tokens_per_s"],
                    t_p, t_q, theory, code)


def format_table(rows: list[BenchRow]) -> str:
    def num(v: float | None, width: int, spec: str, suffix: str = "") -> str:
        return (format(v, spec) + suffix if v is not None else "-").rjust(width)

    head = (f"{'run':<22}{'mode':<10}{'strategy':<16}{'MAT':>6}{'accept':>8}{'speedup':>9}{'theory':>8}"
            f"{'T_p ms':>8}{'T_q ms':>8}{'same as ar':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.label:<22}{'parallel' if r.parallel else 'serial':<10}{r.strategy:<16}{num(r.mat, 6, '.2f')}"
            f"{num(r.acceptance, 8, '.1%')}{num(r.speedup, 9, '.2f', 'x')}{num(r.theory_speedup, 8, '.2f', 'x')}"
            f"{num(r.t_target_ms, 8, '.1f')}{num(r.t_draft_ms, 8, '.1f')}{f'{r.identical}/{r.items}':>12}"
        )
    return "\n".join(lines)


def plot(rows: list[BenchRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.55 * len(rows)), 7), sharex=True)
    ax1.bar([i - 0.2 for i in x], [r.speedup for r in rows], width=0.4, label="measured")
    ax1.bar([i + 0.2 for i in x], [r.theory_speedup or 0 for r in rows], width=0.4, label="theory (ParallelVLM App. C)")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("speedup over ar")
    ax1.legend()
    ax2.bar(list(x), [r.mat for r in rows], color="tab:green")
    ax2.set_ylabel("mean accepted tokens")
    ax2.set_xticks(list(x), labels, rotation=60, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/world_qwen2_5_vl.yaml")
    p.add_argument("--manifest", required=True)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--methods", help="comma-separated (default: all)")
    p.add_argument("--strategies", help="comma-separated pruning strategies run in the baseline method (default: all)")
    p.add_argument("--baseline-method", default="hippo", help="parallel method the strategies run in")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--torchrun", default="--standalone", help="torchrun options (quoted)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    a = p.parse_args(argv)
    split = lambda v: [x for x in v.split(",") if x] if v is not None else None  # noqa: E731
    runs = default_runs(a.baseline_method, split(a.methods), split(a.strategies))
    gamma = load_config(a.config).decoding.gamma
    torchrun = a.torchrun.split() + ["--nproc-per-node", str(a.nproc)]
    extra = [f"--set={kv}" for kv in a.set]
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # ar runs first and again last: the faster of the two is the baseline (the conservative choice), and
    # their spread shows how noisy this machine was during the benchmark.
    runs.append(BenchRun("ar_again", "ar"))
    codes: dict[str, int] = {}
    for i, run in enumerate(runs, 1):
        t = time.time()
        codes[run.label] = run_one(run, a.config, a.manifest, run_dir(a.out, run), torchrun, extra)
        print(f"[{i}/{len(runs)}] {run.label:<22} exit {codes[run.label]}  ({time.time() - t:.0f} s)", flush=True)
    walls = {label: summarize(a.out / label)["decode_wall_s"] for label in ("ar", "ar_again")}
    base = a.out / min(walls, key=lambda k: walls[k] or float("inf"))
    rows = [measure(run, run_dir(a.out, run), base, gamma, codes[run.label]) for run in runs[:-1]]
    spread = abs(walls["ar"] - walls["ar_again"]) / max(min(walls.values()), 1e-9)
    print()
    table = format_table(rows)
    table += (f"\nbaseline: {base.name} (ar wall {walls['ar']:.2f} s first, {walls['ar_again']:.2f} s last: "
              f"{spread:.0%} apart, the timing noise of this run)")
    print(table)
    (a.out / "bench.txt").write_text(table + "\n")
    with open(a.out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    (a.out / "bench.json").write_text(json.dumps({"config": a.config, "manifest": a.manifest, "gamma": gamma,
                                                  "ar_wall_s": walls, "baseline": base.name,
                                                  "rows": [asdict(r) for r in rows]}, indent=1))
    plot(rows, a.out / "bench.png")
    print(f"\nwrote {a.out}/bench.csv, bench.json, bench.png  ({(time.time() - t0) / 60:.1f} min)")
    bad = [r.label for r in rows if r.identical != r.items or r.exit_code != 0 or r.items == 0]
    if bad:
        print(f"vpsd bench: runs that failed or differ from ar: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sampling benchmark: the position-keyed rule against the rejection rule, at each temperature, in one run.

    vpsd bench sampling --config C --manifest M [--method hippo] [--temperatures 0.7,1.0] [--repeats 2]

Per temperature three rows, each a real torchrun job: `ar`, the method under `decoding.sampling: keyed` (the
default) and under `rejection` (min(1, p/q) and the residual). Rounds interleave every row of every temperature,
each row's repeats spread over the run, and the medians are reported with the spread of the `ar` runs (this run's
timing noise). Per row: MAT, acceptance, tokens per second over that temperature's `ar` (wall: tokens over the
items' vision + prefill + decode; decode: tokens after each item's first over its decode time), and how many
outputs equal `ar`'s sample at the seed: every one under the keyed rule (exit 1 otherwise), by chance only under
the rejection rule, whose draws depend on the windows. Rates, not summed times: a rejection run's outputs are other
samples than `ar`'s, of other lengths, and a ratio of summed times would compare other work. What is compared is what the rules cost: the keyed
rule accepts a drafted token when it is the target's own keyed sample (probability at least (1 - TV) / (1 + TV)
a token, Daliri et al. 2024), the rejection rule with min(1, p/q) (1 - TV).
Writes OUT/sampling.txt, .csv and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vpsd.bench.methods import BenchRun, Baseline, run_schedule, write_report
from vpsd.reports.summary import summarize


@dataclass
class SamplingRow:
    temperature: float
    rule: str
    items: int
    identical: int  # outputs equal to ar's sample at the seed
    mat: float
    acceptance: float
    speedup: float  # tokens/s (wall) over the temperature's ar, median of the repeats
    decode_speedup: float  # decode tokens/s over ar's
    repeats: int
    exit_code: int


def runs_for(method: str, temperature: float) -> list[BenchRun]:
    t = [f"decoding.temperature={temperature}"]
    return [BenchRun(f"ar@{temperature}", "ar", settings=tuple(t)),
            BenchRun(f"keyed@{temperature}", method, settings=(*t, "decoding.sampling=keyed")),
            BenchRun(f"rejection@{temperature}", method, settings=(*t, "decoding.sampling=rejection"))]


def measure(run: BenchRun, temperature: float, paths: list[Path], base: Baseline, ar: list[dict],
            code: int) -> SamplingRow:
    """A row from its repeats' run directories; `ar`: the summaries of the temperature's ar runs."""
    s = summarize(paths[0])
    runs = [summarize(p) for p in paths]
    same = [base.speedups(p) for p in paths]
    ar_rate = statistics.median(a["tokens_per_s"] for a in ar)
    ar_step = statistics.median(a["decode_s_per_token"] for a in ar)
    return SamplingRow(temperature, run.label.split("@")[0], min(r[2] for r in same), min(r[3] for r in same),
                       s["mean_accepted_tokens"], s["acceptance_rate"],
                       statistics.median(r["tokens_per_s"] for r in runs) / ar_rate if ar_rate else 0.0,
                       ar_step / statistics.median(r["decode_s_per_token"] for r in runs) if ar_step else 0.0,
                       len(paths), code)


def format_table(rows: list[SamplingRow], noise: dict[float, float]) -> str:
    head = f"{'T':>5}  {'rule':<10}{'MAT':>7}{'accept':>8}{'tok/s x':>9}{'decode x':>9}{'same as ar':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.temperature:>5.2f}  {r.rule:<10}{r.mat:>7.2f}{r.acceptance:>8.3f}{r.speedup:>8.2f}x"
                     f"{r.decode_speedup:>8.2f}x{f'{r.identical}/{r.items}':>12}")
    for t, n in noise.items():
        lines.append(f"T {t}: the ar runs' totals spread {n:.0%} (this run's timing noise)")
    by = {(r.temperature, r.rule): r for r in rows}
    for t in noise:
        k, rj = by.get((t, "keyed")), by.get((t, "rejection"))
        if k and rj and rj.mat:
            lines.append(f"T {t}: keyed MAT / rejection MAT = {k.mat / rj.mat:.3f}, "
                         f"keyed / rejection tokens/s = {k.speedup / rj.speedup:.3f} (decode {k.decode_speedup / rj.decode_speedup:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/world_qwen2_5_vl_scaled.yaml")
    p.add_argument("--manifest", required=True)
    p.add_argument("--out", type=Path, default=Path("runs/bench_sampling"))
    p.add_argument("--method", default="hippo")
    p.add_argument("--temperatures", default="0.7,1.0", help="comma-separated")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--torchrun", default="--standalone", help="torchrun options (quoted)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    a = p.parse_args(argv)
    if not Path(a.manifest).is_file():
        p.error(f"--manifest {a.manifest}: no such file")
    temps = [float(t) for t in a.temperatures.split(",") if t]
    torchrun = a.torchrun.split() + ["--nproc-per-node", str(a.nproc)]
    extra = [f"--set={kv}" for kv in a.set]
    a.out.mkdir(parents=True, exist_ok=True)
    schedule = [(run, rep) for rep in range(a.repeats) for t in temps for run in runs_for(a.method, t)]
    t0 = time.time()
    dirs, codes = run_schedule(schedule, a.config, a.manifest, a.out, torchrun, extra)
    rows, noise = [], {}
    for temp in temps:
        ar, *methods = runs_for(a.method, temp)
        base = Baseline(dirs[ar.label])
        noise[temp] = base.noise
        ar_runs = [summarize(p) for p in dirs[ar.label]]
        rows += [measure(run, temp, dirs[run.label], base, ar_runs, codes[run.label]) for run in methods]
    write_report(a.out, "sampling", format_table(rows, noise), rows,
                 {"config": a.config, "manifest": a.manifest, "method": a.method, "repeats": a.repeats})
    print(f"\nwrote {a.out}/sampling.txt, .csv, .json  ({(time.time() - t0) / 60:.1f} min)")
    bad = [f"{r.rule}@{r.temperature}" for r in rows
           if r.exit_code != 0 or r.items == 0 or (r.rule == "keyed" and r.identical != r.items)]
    if bad:
        print(f"vpsd bench sampling: runs that failed, or keyed runs that differ from ar: {', '.join(bad)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The throughput benchmark: every method at every batch size, against batched `ar` at the same size, in one run.

    vpsd bench throughput --batch 1,2,4,8,16 --manifest M [--methods ar,sd,hippo] [--tile 4] [--repeats 3] [--out DIR]
    vpsd bench throughput --report-only --out DIR     (the table again from DIR's runs, as DIR/schedule.json lists them)

Each cell (method, B) is a real torchrun job of `vpsd.launch.entry --batch B` (B = 1: the method's own path, the
roles for a parallel method; B > 1: continuous batching, engine/engine.py; a method written METHOD:pipelined
runs with `batching.pipelined`, draft and target overlapping on their own ranks, roles/target.py; METHOD:thread with
its draft and pruner on threads of the target's process, launch/in_process.py; both: METHOD:pipelined+thread). `--tile K` repeats the manifest K
times (new ids, the same videos) so a batch of 16 has items to keep it full. Timing is measured side by side:
the whole grid runs `--repeats` times in rounds, each round every B, each B `ar` first; a cell reports the median
over its repeats, and the spread of the `ar` runs at each B is printed as that B's timing noise.

Per cell:
- items/hour: items over the job's item loop (models loaded, summary.json's `run.loop_s`);
- decode tokens/s: tokens after each item's first (which its prefill gives) over the decode time: the batch's
  rounds (the next items' vision + prefill run beside them, engine/prefill_ahead.py), or at batch 1 the items'
  decode phases (after each one's prefill);
- both less the one-time cost of captured steps in the target's process (`run.capture_s`: each graph traced
  and recorded once, in the first items), which a line under the table gives cell by cell;
- per-item latency p50 / p95: an item's vision + prefill + time in flight;
- x ar(B): items/hour over batched `ar` at the same B; x ar(1): over batch-1 `ar` (items/hour) and, for decode
  tokens/s, the same two ratios;
- theory: decode tokens/s ParallelVLM App. C predicts for a batch from the run's own measured forwards, over
  the same for `ar` at that B: B (1 + E[X](tau_hat, gamma)) / (gamma T_q(B) + T_p(B, gamma + 1)) against
  B / T_p(B, 1) (pipeline/cost.py); batched rows only;
- spread: (max - min) / median of the row's own items/hour over its repeats (the noise line under the table is
  the `ar` rows', the baseline every ratio divides by);
- P ms: an item's vision + prefill (the target's, and for a batched speculative run the draft's pruned one),
  which neither batching nor speculation shortens; cap: the items/hour this machine could reach if decoding
  cost nothing, its cores all prefilling (cores x 3600 / P), and "of cap", the row's share of it. Where
  a row is near its cap the job is prefill-bound, and a faster decoder can only move it by the rest;
- peak RSS of the target's rank (MiB), and whether every output equals batch-1 `ar`'s.
Under the table: the `ar` rows' spread at each B (the timing noise), the runs where one item's vision + prefill
took over STALL_FACTOR x its row's P (a stall, or a run's cold first item), and the prefill cap.
Writes OUT/throughput.txt, .csv, .json and .png; exits 1 if an output differs or a job failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vpsd.pipeline.theory import serial_round_token_time
from vpsd.pipeline.theory import parallel_sd_rollback_token_time
from vpsd.bench.methods import BenchRun, run_one, write_report
from vpsd.bench.tiling import tile_manifest
from vpsd.reports.summary import read_rows


# A method's variants, `--methods hippo:pipelined`: the settings that make them.
VARIANTS = {"": [], "pipelined": ["--set=batching.pipelined=true"], "thread": ["--set=draft_on=thread"]}


@dataclass
class Cell:
    """One job's measurements."""

    items: int
    failed: int
    items_per_hour: float
    decode_tokens_per_s: float
    p50_s: float
    p95_s: float
    peak_rss_mib: float | None
    batching: dict | None
    outputs: dict[str, list[int]]
    prefill_s: float  # mean per item: vision + prefill
    slowest_prefill_s: float = 0.0  # the slowest item's: far above the mean, a stall (STALL_FACTOR)
    capture_s: float = 0.0  # captured steps' one-time cost in the target's process, out of both rates
    draft_capture_s: float = 0.0  # the draft role's own (its rank's or thread's), listed, not left out


def variant_args(method: str) -> list[str]:
    """The settings of METHOD:VARIANT[+VARIANT...]."""
    return [arg for v in method.partition(":")[2].split("+") for arg in VARIANTS[v]]


def read_cell(path: Path) -> Cell:
    rows = [r for r in read_rows(path) if r.get("error") is None]
    run = json.loads((path / "summary.json").read_text())["run"] if (path / "summary.json").exists() else {}
    # Captured steps' one-time cost (each graph traced and recorded once a process, during its first items'
    # steps: models/captured.py) is left out of both rates and shown as its own column: a job of 8 items would
    # otherwise be timing its graphs (seconds a trace of a 28-layer model), not its steps.
    capture = float(run.get("capture_s") or 0.0)
    draft_capture = draft_capture_s(path)
    loop = max(float(run.get("loop_s") or 0.0) - capture, 0.0)
    # Decode time: the batch's rounds (prefills run beside them, on a thread of their own), or at batch 1 the
    # items' decode phases, one after the other; the captures ran inside it.
    batching = run.get("batching") or {}
    decode = max((batching.get("decode_s") or sum(r["stats"].get("decode_s", 0.0) for r in rows)) - capture, 0.0)
    decoded = sum(max(len(r["token_ids"]) - 1, 0) for r in rows)
    lat = sorted(r["stats"].get("wall_s", 0.0) for r in rows)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0.0  # noqa: E731
    return Cell(len(rows), len(read_rows(path)) - len(rows), 3600 * len(rows) / loop if loop else 0.0,
                decoded / decode if decode else 0.0, q(0.5), q(0.95), run.get("peak_rss_mib"),
                run.get("batching"), {r["id"]: r["token_ids"] for r in rows},
                statistics.mean(r["stats"].get("prefill_s", 0.0) for r in rows) if rows else 0.0,
                max((r["stats"].get("prefill_s", 0.0) for r in rows), default=0.0), capture, draft_capture)


def draft_capture_s(run_dir: Path) -> float:
    """The draft role's own captured-step cost, from its trace's `captured_steps` (roles/draft.py): not left out
    of a cell's rates, since the target waited through it only in part (while tracing its own, it did not)."""
    total = 0.0
    for trace in (run_dir / "traces").glob("*.jsonl") if (run_dir / "traces").is_dir() else ():
        with trace.open() as lines:  # a rank's trace holds every span: read line by line, not whole
            events = (json.loads(line) for line in lines if '"captured_steps"' in line)
            total += sum(float(e.get("capture_s") or 0.0) for e in events if e.get("role") == "draft")
    return total


@dataclass
class Row:
    method: str
    batch: int
    items: int
    identical: int
    items_per_hour: float
    decode_tokens_per_s: float
    p50_s: float
    p95_s: float
    x_ar_b: float  # items/hour over batched ar at the same B
    x_ar_1: float  # items/hour over batch-1 ar
    decode_x_ar_b: float
    decode_x_ar_1: float
    theory_decode_x_ar_b: float | None
    mean_batch: float | None
    gamma: float | None
    tau_hat: float | None
    peak_rss_mib: float | None
    repeats: int
    prefill_ms: float
    cap_items_per_hour: float  # cores x 3600 / P: no decoder on this machine passes it
    spread: float  # (max - min) / median of the row's items/hour over its repeats: its own timing noise
    stalled_runs: int = 0  # repeats where one item's prefill took over STALL_FACTOR x the row's P
    slowest_prefill_ms: float = 0.0
    ties: int = 0  # outputs that differ from batch-1 `ar`'s at a tie of the target's (judge_differences)
    capture_s: float = 0.0  # median over the repeats of the cells' one-time captured-step cost (out of the rates)
    draft_capture_s: float = 0.0  # the same for the draft role's own, listed under the table only

    @property
    def same(self) -> str:
        """"8/8", or "6/8 +2 ties" where two differ at a tie in float noise (README, "What lossless means")."""
        return f"{self.identical}/{self.items}" + (f" +{self.ties} ties" if self.ties else "")


# An item's vision + prefill varies with its length by tens of percent; one that takes several times the row's
# mean was held up, not long (the tail stall that PrefillAhead.steal_if_thin once caused was
# 5-15x). The table names such runs, so a spread is explained rather than averaged away.
STALL_FACTOR = 3.0


def predicted_tokens_per_s(batching: dict | None) -> float | None:
    """App. C over a batch: committed tokens per second of the run's mean round, every item of it: the serial
    round the batched engine's window prices (theory.serial_round_token_time), Theorem 6's for a pipelined batch, where
    the draft's gamma forwards overlap the target's verify (2 max(gamma T_q, T_p) per round pair, rollbacks
    counted)."""
    if not batching or not batching.get("t_p_s") or not batching.get("mean_batch"):
        return None
    gamma = round(batching.get("mean_gamma") or 0)
    t_q = batching.get("t_q_s") or 0.0
    tau = batching.get("tau_hat") or 0.0
    if batching.get("pipelined"):
        return batching["mean_batch"] / parallel_sd_rollback_token_time(t_q, batching["t_p_s"], gamma, tau)
    return batching["mean_batch"] / serial_round_token_time(t_q, batching["t_p_s"], gamma, tau)


def batch_sizes(text: str) -> list[int]:
    """`--batch 1,2,4,8` of the benches that run jobs at several batch sizes (throughput, tune)."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"need batch sizes >= 1, comma-separated (e.g. 1,2,4,8), got {text!r}")
    return sizes


# What a bench run scheduled, so that `--report-only` re-reads exactly those runs (given other flags it read
# other cells, or the ones it found under other names, and overwrote throughput.txt with a wrong table).
SCHEDULE = "schedule.json"


def write_schedule(out: Path, config: str, manifest: Path, batches: list[int], methods: list[str], repeats: int) -> None:
    (out / SCHEDULE).write_text(json.dumps({"config": config, "manifest": str(manifest), "batches": batches,
                                            "methods": methods, "repeats": repeats}, indent=1))


def read_schedule(out: Path) -> dict | None:
    path = out / SCHEDULE
    return json.loads(path.read_text()) if path.exists() else None


def summarize_cells(method: str, batch: int, cells: list[Cell], ar_b: list[Cell], ar_1: list[Cell],
                    reference: dict[str, list[int]], cores: int) -> Row:
    med = lambda cs, f: statistics.median(f(c) for c in cs) if cs else 0.0  # noqa: E731
    iph, dts = med(cells, lambda c: c.items_per_hour), med(cells, lambda c: c.decode_tokens_per_s)
    ratio = lambda a, b: a / b if b else 0.0  # noqa: E731
    first = cells[0]
    same = sum(first.outputs.get(i) == toks for i, toks in reference.items() if i in first.outputs)
    theory = None
    mine, theirs = predicted_tokens_per_s(first.batching), predicted_tokens_per_s(ar_b[0].batching if ar_b else None)
    if mine and theirs:
        theory = mine / theirs
    b = first.batching or {}
    prefill = med(cells, lambda c: c.prefill_s)
    per_hour = [c.items_per_hour for c in cells]
    return Row(method, batch, first.items, same, iph, dts, med(cells, lambda c: c.p50_s), med(cells, lambda c: c.p95_s),
               ratio(iph, med(ar_b, lambda c: c.items_per_hour)), ratio(iph, med(ar_1, lambda c: c.items_per_hour)),
               ratio(dts, med(ar_b, lambda c: c.decode_tokens_per_s)),
               ratio(dts, med(ar_1, lambda c: c.decode_tokens_per_s)), theory, b.get("mean_batch"),
               b.get("mean_gamma"), b.get("tau_hat"), first.peak_rss_mib, len(cells), 1e3 * prefill,
               cores * 3600 / prefill if prefill else 0.0,
               (max(per_hour) - min(per_hour)) / iph if iph and len(cells) > 1 else 0.0,
               sum(c.slowest_prefill_s > STALL_FACTOR * prefill for c in cells) if prefill else 0,
               1e3 * max(c.slowest_prefill_s for c in cells), capture_s=med(cells, lambda c: c.capture_s),
               draft_capture_s=med(cells, lambda c: c.draft_capture_s))


def judge_differences(a: argparse.Namespace, manifest: Path, rows: list[Row], ar_dir: Path,
                      run_dirs: dict[tuple[str, int], Path]) -> list[str]:
    """Where a row's outputs differ from batch-1 `ar`'s (a batch's or a verify's kernels differ from `ar`'s
    one-row forwards by float noise: in bf16 enough to flip a near-tie), the target's top-2 margin at each first
    difference, from `python -m vpsd.launch.lossless` run on the rows' results (a job of its own, as the cells
    are: reports read what jobs wrote); a tie is counted in the row's `ties`, anything else stays a difference
    and fails the bench. Returns the lines that say so (none when every output is identical)."""
    differing = {(r.method, r.batch): run_dirs[r.method, r.batch] for r in rows if r.identical < r.items}
    if not differing:
        return []
    verdicts = a.out / "differences.json"
    cmd = [sys.executable, "-m", "vpsd.launch.lossless", "--config", str(a.config), "--manifest", str(manifest),
           "--ar", str(ar_dir), "--runs", *map(str, differing.values()), "--json", str(verdicts),
           *(f"--set={kv}" for kv in a.set)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not verdicts.exists():  # the table stands without the margins; the differences stay failures
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"differences from batch-1 ar not judged ({why}); they count as differences"]
    found = json.loads(verdicts.read_text())
    lines = [f"differences from batch-1 ar, judged by the target's top-2 margin where each first differs "
             f"(a tie: under {found['tolerance']:g}, float noise of its dtype):"]
    for r in rows:
        if (r.method, r.batch) not in differing:
            continue
        diffs = found["runs"].get(str(differing[r.method, r.batch]), [])
        r.ties = sum(d["tie"] for d in diffs)
        lines += [f"  {r.method} B={r.batch} {d['item_id']}: differs at token {d['position']} ({d['ar_token']} vs "
                  f"{d['other_token']}), top-2 margin {d['margin']:.4g} -> {'tie' if d['tie'] else 'REAL DIVERGENCE'}"
                  for d in diffs]
    return lines


def format_table(rows: list[Row], noise: dict[int, float], notes: list[str] = ()) -> str:
    def num(v, width, spec, suffix=""):
        return (format(v, spec) + suffix if v is not None else "-").rjust(width)

    head = (f"{'method':<13}{'B':>3}{'items/h':>9}{'spread':>7}{'dec tok/s':>10}{'p50 s':>7}{'p95 s':>7}{'x ar(B)':>8}{'x ar(1)':>8}"
            f"{'dec x ar(B)':>12}{'dec x ar(1)':>12}{'theory':>8}{'in flight':>10}{'gamma':>6}{'tau':>6}"
            f"{'P ms':>6}{'of cap':>7}{'RSS MiB':>8}  same as ar(1)")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.method:<13}{r.batch:>3}{num(r.items_per_hour, 9, '.0f')}{num(100 * r.spread, 7, '.0f', '%')}{num(r.decode_tokens_per_s, 10, '.1f')}"
                     f"{num(r.p50_s, 7, '.2f')}{num(r.p95_s, 7, '.2f')}{num(r.x_ar_b, 8, '.2f', 'x')}"
                     f"{num(r.x_ar_1, 8, '.2f', 'x')}{num(r.decode_x_ar_b, 12, '.2f', 'x')}"
                     f"{num(r.decode_x_ar_1, 12, '.2f', 'x')}{num(r.theory_decode_x_ar_b, 8, '.2f', 'x')}"
                     f"{num(r.mean_batch, 10, '.1f')}{num(r.gamma, 6, '.1f')}{num(r.tau_hat, 6, '.2f')}"
                     f"{num(r.prefill_ms, 6, '.0f')}{num(100 * r.items_per_hour / r.cap_items_per_hour if r.cap_items_per_hour else None, 7, '.0f', '%')}"
                     f"{num(r.peak_rss_mib, 8, '.0f')}  {r.same}")
    lines.append("noise (spread of the ar runs' items/hour at each B): "
                 + ", ".join(f"B={b}: {v:.0%}" for b, v in sorted(noise.items())))
    stalled = [f"{r.method} B={r.batch}: {r.stalled_runs} of {r.repeats} runs (slowest {r.slowest_prefill_ms:.0f} ms, "
               f"P {r.prefill_ms:.0f} ms)" for r in rows if r.stalled_runs]
    lines.append(f"slow prefills (an item's vision + prefill over {STALL_FACTOR:.0f}x its row's P: a stall or a cold start): "
                 + ("; ".join(stalled) if stalled else "none"))
    captured = [f"{r.method} B={r.batch}: {r.capture_s:.1f} s"
                + (f" (its draft's own {r.draft_capture_s:.1f} s, left in: the target waited through it in part)"
                   if r.draft_capture_s else "") for r in rows if r.capture_s or r.draft_capture_s]
    if captured:
        lines.append("captured steps' one-time cost (tracing and recording each graph, in a job's first items), "
                     "left out of items/h and dec tok/s: " + "; ".join(captured))
    caps = [r.cap_items_per_hour for r in rows if r.cap_items_per_hour]
    if caps:
        lines.append(f"cap: items/hour with decoding free, every core prefilling (cores x 3600 / P): "
                     f"{min(caps):.0f}-{max(caps):.0f}")
    return "\n".join(lines + list(notes))


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        ax1.plot([r.batch for r in mine], [r.items_per_hour for r in mine], marker="o", label=method)
        ax2.plot([r.batch for r in mine], [r.decode_tokens_per_s for r in mine], marker="o", label=method)
    caps = sorted(r.cap_items_per_hour for r in rows if r.cap_items_per_hour)
    if caps:  # the prefill bound: where the items/hour curves flatten, decoding is no longer the term that counts
        ax1.axhspan(caps[0], caps[-1], color="grey", alpha=0.25, label="prefill cap (decoding free)")
        ax1.set_ylim(0, caps[-1] * 1.08)
    for ax, label in ((ax1, "items / hour"), (ax2, "decode tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("items in flight (B)")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vpsd bench throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/world_qwen2_5_vl_scaled.yaml")
    p.add_argument("--manifest", type=Path, help="required unless --report-only")
    p.add_argument("--out", type=Path, default=Path("runs/throughput"))
    p.add_argument("--batch", type=batch_sizes,
                   help="comma-separated batch sizes, e.g. 1,2,4,8,16 (required unless --report-only)")
    p.add_argument("--methods", default="ar,sd,hippo",
                   help="comma-separated; ar is always run; METHOD:pipelined runs a parallel method over a batch "
                        "with draft and target on their own ranks (batching.pipelined); METHOD:thread its draft and "
                        "pruner on threads of the target's process (draft_on: thread)")
    p.add_argument("--tile", type=int, default=1, help="repeat the manifest this many times (new ids)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--torchrun", default="--standalone")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    p.add_argument("--report-only", action="store_true",
                   help="re-read the runs already in --out, as the bench that ran them scheduled them; run nothing")
    return p


def _plan(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[Path, list[int], list[str], int]:
    """(manifest, batch sizes, methods, repeats): a finished bench's schedule (--report-only), or this one's."""
    plan = read_schedule(a.out) if a.report_only else None
    if plan is not None:
        a.config = plan["config"]
        return Path(plan["manifest"]), plan["batches"], plan["methods"], plan["repeats"]
    if a.report_only and a.batch is None:
        p.error(f"--report-only: no {a.out / SCHEDULE} (is --out a finished bench's directory? one written "
                "before schedules were kept needs its --batch, --methods, --repeats and --manifest again)")
    if a.batch is None or a.manifest is None:
        p.error("--batch and --manifest are required (unless --report-only)")
    if not a.manifest.is_file():  # before a job runs: each would refuse it, one after another
        p.error(f"--manifest {a.manifest}: no such file")
    methods = ["ar"] + [m for m in a.methods.split(",") if m and m != "ar"]
    unknown = [m for m in methods if any(v not in VARIANTS for v in m.partition(":")[2].split("+"))]
    if unknown:
        p.error(f"unknown variant in {', '.join(unknown)}; known: {', '.join(v for v in VARIANTS if v)}")
    a.out.mkdir(parents=True, exist_ok=True)
    manifest = tile_manifest(a.manifest, a.tile, a.out)
    if not a.report_only:
        write_schedule(a.out, a.config, manifest, a.batch, methods, a.repeats)
    return manifest, a.batch, methods, a.repeats


def _run_cells(a: argparse.Namespace, manifest: Path, batches: list[int], methods: list[str], repeats: int
               ) -> tuple[dict[tuple[str, int], list[Cell]], dict[tuple[str, int], int]]:
    """Every (method, batch) cell, repeats interleaved in rounds; with --report-only, read back instead."""
    torchrun = a.torchrun.split() + ["--nproc-per-node", str(a.nproc)]
    extra = [f"--set={kv}" for kv in a.set]
    schedule = [(rep, b, m) for rep in range(repeats) for b in batches for m in methods]
    cells: dict[tuple[str, int], list[Cell]] = {}
    codes: dict[tuple[str, int], int] = {}
    for i, (rep, b, m) in enumerate(schedule, 1):
        t = time.time()
        path = a.out / f"{m.replace(':', '-')}_b{b}" / f"r{rep + 1}"
        if a.report_only:
            codes[m, b] = 0
        else:
            code = run_one(BenchRun(m, m.split(":")[0]), a.config, str(manifest), path, torchrun,
                           extra + variant_args(m) + ["--batch", str(b)])
            codes[m, b] = max(codes.get((m, b), 0), code)
            print(f"[{i}/{len(schedule)}] {m} B={b} r{rep + 1}  exit {code}  ({time.time() - t:.0f} s)", flush=True)
        cells.setdefault((m, b), []).append(read_cell(path))
    return cells, codes


def _write_report(a: argparse.Namespace, manifest: Path, repeats: int, rows: list, noise: dict,
                  notes: list[str]) -> None:
    write_report(a.out, "throughput", format_table(rows, noise, notes), rows,
                 {"config": a.config, "manifest": str(manifest), "repeats": repeats, "noise": noise})
    plot(rows, a.out / "throughput.png")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    manifest, batches, methods, repeats = _plan(p, a)
    t0 = time.time()
    cells, codes = _run_cells(a, manifest, batches, methods, repeats)
    ar_ref = 1 if ("ar", 1) in cells else batches[0]  # every output is compared with this `ar` cell's
    ar_1 = cells["ar", ar_ref]
    reference = ar_1[0].outputs
    cores = len(os.sched_getaffinity(0))  # what the jobs' ranks share
    rows = [summarize_cells(m, b, cells[m, b], cells["ar", b], ar_1, reference, cores) for b in batches for m in methods]
    noise = {}
    for b in batches:
        v = [c.items_per_hour for c in cells["ar", b]]
        noise[b] = (max(v) - min(v)) / statistics.median(v) if len(v) > 1 and statistics.median(v) else 0.0
    run_dirs = {(m, b): a.out / f"{m.replace(':', '-')}_b{b}" / "r1" for b in batches for m in methods}
    notes = judge_differences(a, manifest, rows, run_dirs["ar", ar_ref], run_dirs)
    _write_report(a, manifest, repeats, rows, noise, notes)
    print(f"\nwrote {a.out}/throughput.txt, .csv, .json, .png  ({(time.time() - t0) / 60:.1f} min)")
    bad = [f"{r.method} B={r.batch}" for r in rows
           if r.identical + r.ties != r.items or r.items == 0 or codes[r.method, r.batch]]
    if bad:
        print(f"vpsd bench: runs that failed or differ from ar: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`vpsd tune`: which method, pruning, window, draft placement and batch size run a config fastest on this machine,
losslessly, found on a sample of a manifest; written as the config to run with `--method auto`.

    vpsd tune --config C --manifest M --out tuned.yaml [--items 4] [--batch 1,8] [--methods a,b:thread,...]
              [--strategies ...] [--ratios 0.75,0.9,0.95] [--gammas auto,best] [--placements rank,thread]
              [--confirm 3] [--repeats 1] [--time-budget 10m] [--work DIR] [--set KEY=VALUE ...]

1. Measure (measure.py), in this process, on `--items` items of the manifest: the target's vision, prefill, steps
   and verifies, each draft's prefill, steps and agreement with the target's own output (one target pass an item,
   one teacher-forced draft pass a pruning strategy and ratio), forwards over each batch size, the messaging of
   each draft placement.
2. Predict (predict.py) every candidate's items/hour (candidates.py: the grid), from those, with ParallelVLM App. C
   and the engine's own cost model.
3. Confirm (confirm.py) the best `--confirm` at each batch size as real jobs, interleaved with `ar`, within the
   time budget; a candidate whose outputs differ from `ar`'s is never chosen.
4. Write `--out`: the user's config with the winner's settings and a `tuned:` block (vpsd/launch/tuned.py: the
   choice at each batch size, what it was tuned on); and the report (report.py) in the work folder.
Exit status: 0 a config written; 1 nothing ran losslessly; 2 refused (bad settings, manifest or options).
It lives among the benchmarks because its confirmation is one: real jobs of the launcher users run, read as the
throughput bench reads them, the only layer that may start them from outside a job (tests/unit/test_layering.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from vpsd.config import ConfigError, parse_overrides

DEFAULT_ITEMS = 4


def _seconds(text: str) -> float:
    """`10m`, `90s`, `1h` or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        return float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"need a duration such as 10m, 90s or 600, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    from vpsd.bench.throughput import batch_sizes

    p = argparse.ArgumentParser(prog="vpsd tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path, help="the tuned config to write (YAML)")
    p.add_argument("--items", type=int, default=DEFAULT_ITEMS, help="items of the manifest to tune on (spread evenly)")
    p.add_argument("--first", action="store_true", help="tune on the manifest's first items instead")
    p.add_argument("--batch", type=batch_sizes, default=[1], help="batch sizes to tune at, e.g. 1,8 (default 1)")
    p.add_argument("--methods", default=None,
                   help="comma-separated (default: every method); METHOD:thread, METHOD:pipelined as in vpsd bench throughput")
    p.add_argument("--strategies", default=None, help="pruning strategies tried in the baseline method (default: all)")
    p.add_argument("--baseline-method", default="hippo", help="the parallel method the strategies run in")
    p.add_argument("--ratios", default=None, help="pruning ratios (default: 0.75, the config's, 0.95)")
    p.add_argument("--gammas", default="auto,best", help="windows: auto, best (the best fixed one predicted), ints")
    p.add_argument("--placements", default="rank,thread", help="where a parallel method's draft runs at batch 1")
    p.add_argument("--confirm", type=int, default=3, help="candidates run as real jobs at each batch size")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the confirming jobs, each opened by ar")
    p.add_argument("--time-budget", type=_seconds, default=600.0, help="the whole tune's time, e.g. 10m (default)")
    p.add_argument("--forward-repeats", type=int, default=3, help="timed calls a measured forward (median)")
    p.add_argument("--work", type=Path, default=None, help="jobs and report (default: OUT's name + .tune/)")
    p.add_argument("--torchrun", default="--standalone", help="torchrun options of the jobs (quoted)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, every run")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if not a.manifest.is_file():
        p.error(f"--manifest {a.manifest}: no such file")
    if a.items < 1 or a.confirm < 1 or a.repeats < 1:
        p.error("--items, --confirm and --repeats must be >= 1")
    try:
        return 0 if tune(a) is not None else 1
    except (ConfigError, ValueError, FileNotFoundError) as e:
        for line in (e.problems if isinstance(e, ConfigError) else [str(e)]):
            print(f"vpsd tune: {line}", file=sys.stderr)
        return 2


def say(line: str) -> None:
    print(f"vpsd tune: {line}", file=sys.stderr, flush=True)


def tune(a: argparse.Namespace) -> Path | None:
    """The whole tune (module docstring); the tuned config's path, or None when nothing ran losslessly."""
    from vpsd.bench.tune.candidates import grid
    from vpsd.bench.tune.confirm import JobPlan, confirm
    from vpsd.bench.tune.measure import measure
    from vpsd.bench.tune.predict import predict_all
    from vpsd.bench.tune.sample import grid_spec, sample_items, write_samples
    from vpsd.launch.settings import run_config

    started = time.time()
    sets = list(a.set) + ["tuned=null"]  # the user's config as it is, tuned before or not
    cfg = run_config(a.config, "ar", overrides=parse_overrides(sets), local_world=1)
    work = a.work or a.out.with_name(a.out.stem + ".tune")
    work.mkdir(parents=True, exist_ok=True)
    items = sample_items(a.manifest, a.items, a.first)
    manifests = write_samples(a.manifest, items, a.batch, work)
    candidates = grid(grid_spec(a, cfg))
    keys = list(dict.fromkeys(k for c in candidates if (k := c.draft_key(cfg)) is not None))
    say(f"{len(candidates)} candidates, {len(keys)} drafts to measure on {len(items)} items")
    measured = measure(cfg, items, keys, a.batch, _target_widths(cfg, candidates), a.forward_repeats, say,
                       placements=any(c.overlapped for c in candidates))
    (work / "measured.json").write_text(json.dumps(asdict(measured)))
    predictions = predict_all(measured, cfg, candidates)
    ar = {p.candidate.batch: p for p in predictions if p.candidate.method == "ar"}
    say(f"measured and predicted in {time.time() - started:.0f} s; confirming the best as jobs")
    plan = JobPlan(str(a.config), manifests, work / "jobs", a.torchrun.split(), sets, a.repeats, a.time_budget,
                   started)
    rows, noise, skipped = confirm(plan, predictions, a.confirm, ar, say)
    predictions, ar = _calibrated(predictions, ar, rows)
    return _conclude(a, cfg, work, measured, predictions, ar, rows, noise, skipped, started)


def _calibrated(predictions, ar, rows):
    """The predictions times each batch size's job factor, from its first `ar` job (predict.py job_factor), and
    `ar`'s own again."""
    from vpsd.bench.tune.confirm import ar_at
    from vpsd.bench.tune.predict import job_factor, with_job_factor

    factor = {}
    for b, pred in ar.items():
        row = next((r for r in rows if r.candidate == ar_at(b) and r.cells), None)
        if row is not None:
            factor[b] = job_factor(pred.items_per_hour, row.cells[0].items_per_hour)
    predictions = with_job_factor(predictions, factor)
    return predictions, {p.candidate.batch: p for p in predictions if p.candidate.method == "ar"}


def _target_widths(cfg, candidates) -> list[int]:
    """The verify widths the predictions read: windows up to gamma_max + 1 and each tree's nodes + 1 (between
    them a forward's cost is interpolated: on a CPU it grows about linearly with its rows)."""
    from vpsd.pipeline.methods import get_method

    top = cfg.decoding.gamma_max + 1
    widths = {1, 2, 4, 8, top} | ({16} if top > 20 else set())  # a point between 8 and a far top
    for c in candidates:
        tree = get_method(c.method).draft_tree(cfg.decoding.tree)
        if tree is not None:
            widths.add(tree.num_nodes + 1)
    return sorted(widths)


def _conclude(a, cfg, work: Path, measured, predictions, ar, rows, noise, skipped, started: float) -> Path | None:
    """The report, printed and written, and the tuned config when a candidate ran losslessly."""
    from vpsd.bench.tune import report
    from vpsd.launch.tuned import Choice, write_tuned

    verdict = report.decide(rows)
    preds = {p.candidate: p for p in predictions}
    head = (f"vpsd tune: {a.config} on {len(measured.items)} items of {a.manifest} at B={','.join(map(str, a.batch))}, "
            f"{measured.cores} cores; measured in {measured.seconds:.0f} s, {len(predictions)} candidates predicted, "
            f"{sum(r.candidate.method != 'ar' for r in rows)} confirmed; {time.time() - started:.0f} s in all")
    factor = {p.candidate.batch: p.job_factor for p in ar.values()}
    head += ("\njob factor (ar's forwards played out over its first job's items/hour; the predictions of candidates "
             "run in the target's process as ar is are divided by it, ar's pred/meas 1 by it): "
             + ", ".join(f"B={b}: {v:.2f}" for b, v in sorted(factor.items())))
    text = "\n\n".join([head, "predicted (the measured forwards over each item's replayed rounds, the job played out):\n"
                        + report.predictions_table(predictions, ar),
                        "confirmed as jobs, interleaved with ar:\n" + report.confirmed_table(rows, preds, noise, skipped),
                        "\n".join(report.verdict_lines(verdict, noise))])
    report.write(work, text, {"config": str(a.config), "manifest": str(a.manifest), "batches": a.batch,
                              "noise": noise, "seconds": time.time() - started}, predictions, rows, skipped)
    short = "\n\n".join([head, report.predictions_table(predictions, ar, limit=12),
                         report.confirmed_table(rows, preds, noise, skipped),
                         "\n".join(report.verdict_lines(verdict, noise))])
    print(short)
    if verdict.winner is None:
        return None
    w = verdict.winner.candidate
    choices = [{"batch": b, "method": r.candidate.method, "settings": r.candidate.settings(),
                "items_per_hour": round(r.items_per_hour, 1), "x_ar": round(r.x_ar, 3), "noise": round(noise[b], 3)}
               for b, r in sorted(verdict.by_batch.items())]
    out = write_tuned(a.config, a.out, list(a.set), Choice(w.method, w.batch, w.settings()), choices, cfg,
                      {"report": str(work / "tune.txt")})
    print(f"\nwrote {out} (run it with --method auto) and {work}/tune.txt, tune.json")
    return out


def for_job(job: list[str], out: Path | None) -> list[str] | int:
    """`./torchrun.sh run --method auto` on a config without a tuned: block: a tune on the job's first items
    (DEFAULT_ITEMS, at its --batch, the best 2 confirmed, within 5 minutes) into OUT/tuned.yaml, and the job's
    command line on that config; a rerun reuses OUT/tuned.yaml while the config and its --set are the same, so the
    job resumes with the same choice. Any other command line as it is (the ranks resolve `auto` from a tuned
    config's block, launch/arguments.py); an int: the exit status of a refusal, said."""
    import yaml

    from vpsd.config import load_config
    from vpsd.launch.say import say as vpsd_say
    from vpsd.launch.tuned import source_stamp

    p = argparse.ArgumentParser(add_help=False)
    for name in ("--method", "--config", "--manifest", "--batch"):
        p.add_argument(name)
    p.add_argument("--set", action="append", default=[])
    a, _ = p.parse_known_args(job)
    if a.method != "auto" or not a.config or not a.manifest or out is None:
        return job
    try:
        if load_config(a.config, parse_overrides(a.set)).tuned:
            return job
    except (ConfigError, OSError):
        return job  # the ranks refuse it, each problem said once
    tuned = out / "tuned.yaml"
    stamp = source_stamp(a.config, a.set)["sha"]
    done_before = tuned.is_file() and ((yaml.safe_load(tuned.read_text()) or {}).get("tuned") or {}).get(
        "source", {}).get("sha") == stamp
    if not done_before:
        vpsd_say(f"--method auto: {a.config} holds no tuned: block; tuning on the first {DEFAULT_ITEMS} items of "
                 f"{a.manifest} first (vpsd tune; the report in {out / 'tune'})")
        argv = ["--config", a.config, "--manifest", a.manifest, "--out", str(tuned), "--first", "--batch",
                a.batch or "1", "--confirm", "2", "--time-budget", "5m", "--work", str(out / "tune"),
                *(f"--set={kv}" for kv in a.set)]
        try:
            made = tune(parser().parse_args(argv))
        except (ConfigError, ValueError, FileNotFoundError, SystemExit) as e:
            vpsd_say(f"--method auto: the tune failed: {e}")
            return 2
        if made is None:
            vpsd_say("--method auto: no candidate ran losslessly on the first items; give a --method")
            return 2
    return _with_config(job, str(tuned))


def _with_config(job: list[str], config: str) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(job):
        if skip:
            skip = False
            continue
        if arg == "--config" and i + 1 < len(job):
            out += ["--config", config]
            skip = True
        elif arg.startswith("--config="):
            out.append(f"--config={config}")
        else:
            out.append(arg)
    return out

"""Run summaries: what a results.jsonl adds up to, and how a run compares with an `ar` run.

    python -m vpsd.reports.summary RUN_DIR [--baseline AR_RUN_DIR]
    python -m vpsd.reports.summary RUN_DIR --status   # exit 3 if the results hold failed items, else 0

The comparison is measured, never claimed: on the ids both finished, `speedup_vs_baseline` is the
baseline's total wall time per item (vision + prefill + decode) over the run's, `decode_speedup_vs_baseline`
the same for the decode phase alone (after the target's prefill); the lossless check counts ids whose
tokens differ.

`summarize(dir, method)` adds up the results file's rows of one method (all of them without one), whatever
number of runs wrote them; reading the videos is reported apart from decoding: `video_read_s` (demux +
decode), `preprocess_s` (scaling, patchify, fitting the context) and `video_wait_s` (the part of both that the
model waited for, i.e. that the read-ahead did not hide).

summary.json (`job_summary`): the top level adds up the method of the run that wrote it last; `methods` holds
every method's sums when several share the directory (a bench's runs, ar beside hippo), and `runs` the last
run of each method (its total time, items run, failures, restarts: the `run` section is the last of them).
So one method's failures never count against another's, and `--status` reads the last run's method alone. A
summary.json written before it had `methods` and `runs` still reads: its top level is all the rows'.
The run's prefix reuse (`run.reuse`, the targets' prefix caches summed; absent or null when off) prints as one
line: `prefix reuse  8 hits / 12 prefills (67%), 4 misses, 210 MiB held`; the decoded frames kept beside it
(`run.frames_cache`, video/frame_cache.py) as another: `frames cache  8 hits / 12 reads (67%), 4 misses, 30 MiB held`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vpsd.pipeline.methods import METHODS, get_method
from vpsd.reports.accounting import predict
from vpsd.pipeline.theory import tau_hat
from vpsd.provenance import changes, describe


def read_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "results.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


VIDEO_TIMINGS = ("video_read_s", "preprocess_s", "video_wait_s")
# The job's exit status when it ran to the end but some items have errors. The ranks themselves exit 0
# then (torchrun reports any other code as a crash, 1, and restarts the job if it may); ./torchrun.sh
# turns the finished job's summary into this status with `--status`.
EXIT_ITEMS_FAILED = 3


def summarize(run_dir: Path, method: str | None = None) -> dict:
    return summarize_rows([r for r in read_rows(run_dir) if method is None or r.get("method") == method])


def summarize_rows(rows: list[dict]) -> dict:
    """The sums of result rows (results.jsonl's form: method, token_ids, stats, error) of one method."""
    ok = [r for r in rows if r.get("error") is None]
    rounds = sum(r["stats"]["rounds"] for r in ok)
    tokens = sum(len(r["token_ids"]) for r in ok)
    wall = sum(r["stats"]["wall_s"] for r in ok)
    decode = sum(r["stats"].get("decode_s", 0.0) for r in ok)
    drafted_accepted = [(r["stats"]["acceptance_rate"], r["stats"]["rounds"]) for r in ok]
    accepted = sum(r["stats"].get("accepted_tokens", 0) for r in ok)
    rejections = sum(r["stats"].get("rejections", 0) for r in ok)
    gammas = [(r["stats"]["gamma"], r["stats"]["rounds"]) for r in ok if r["stats"].get("gamma") is not None]
    # An item of a method with a draft that reports no kept set was decoded plain (the drafting policy chose
    # the target alone, as `ar`: pipeline/drafting_policy.py).
    drafting = [r for r in ok if r.get("method") in METHODS and METHODS[r["method"]].uses_draft]
    return {
        "items_done": len(ok),
        "items_failed": len(rows) - len(ok),
        "items_plain": sum(r["stats"].get("num_kept") is None for r in drafting),
        "tokens": tokens,
        "rounds": rounds,
        "mean_accepted_tokens": tokens / rounds if rounds else 0.0,
        "acceptance_rate": (sum(a * n for a, n in drafted_accepted) / rounds) if rounds else 0.0,
        "tau_hat": tau_hat(accepted, rejections),
        "gamma": (sum(g * n for g, n in gammas) / sum(n for _, n in gammas)) if gammas and rounds else None,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "decode_wall_s": wall,
        "decode_s": decode,
        # Seconds per token produced after the prefill (its logits give the first token for free). For `ar`
        # this is one target step: the per-token cost every speedup is measured against.
        "decode_s_per_token": decode / max(tokens - len(ok), 1) if ok else 0.0,
        "prefill_s": sum(r["stats"]["prefill_s"] for r in ok),
        "first_chunk_wait_s": sum(r["stats"].get("first_chunk_wait_s", 0.0) for r in ok),
        **{key: sum(float((r.get("stats") or {}).get(key, 0.0)) for r in rows) for key in VIDEO_TIMINGS},
    }


def job_summary(run_dir: Path, method: str, run: dict) -> dict:
    """summary.json after a run of `method` (module docstring): its sums, every method's, every method's last run."""
    previous = read_summary(run_dir)
    runs = {**(previous.get("runs") or {}), method: run}
    methods = sorted({r.get("method") for r in read_rows(run_dir)} - {None})
    out = {**summarize(run_dir, method), "method": method, "run": run, "runs": runs}
    if len(methods) > 1:
        out["methods"] = {m: summarize(run_dir, m) for m in methods}
    return out


def read_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def last_method(run_dir: Path) -> str | None:
    """The method of the run that wrote summary.json last (None: an old summary, or none)."""
    return read_summary(run_dir).get("method")


def compare(baseline_dir: Path, run_dir: Path) -> dict:
    return compare_rows(read_rows(baseline_dir), read_rows(run_dir))


def compare_rows(baseline: list[dict], rows: list[dict]) -> dict:
    """A run's rows against a baseline's (module docstring: on the ids both finished)."""
    base = {r["id"]: r for r in baseline if r.get("error") is None}
    run = {r["id"]: r for r in rows if r.get("error") is None}
    common = sorted(set(base) & set(run))

    def ratio(key: str) -> float:
        mine = sum(run[i]["stats"].get(key, 0.0) for i in common)
        return sum(base[i]["stats"].get(key, 0.0) for i in common) / mine if mine else 0.0

    return {
        "items_compared": len(common),
        "identical_outputs": sum(base[i]["token_ids"] == run[i]["token_ids"] for i in common),
        "speedup_vs_baseline": ratio("wall_s"),
        "decode_speedup_vs_baseline": ratio("decode_s"),
    }


def reuse_line(reuse: dict) -> str:
    """summary.json's `run.reuse` (the targets' prefix caches, engine/prefix_cache.py ReuseStats) in words:
    `8 hits / 12 prefills (67%), 4 misses, 210 MiB held`; prefills are the requests that went through the cache."""
    hits, misses = int(reuse.get("hits") or 0), int(reuse.get("misses") or 0)
    prefills = max(int(reuse.get("requests") or 0), hits + misses)
    rate = f"{100 * hits / prefills:.0f}%" if prefills else "-"
    return (f"{hits} hits / {prefills} prefills ({rate}), {misses} misses, "
            f"{(reuse.get('bytes') or 0) / 2**20:.0f} MiB held")


def frames_cache_line(stats: dict) -> str:
    """summary.json's `run.frames_cache` (the targets' frame caches, video/frame_cache.py FrameCacheStats) in words:
    `8 hits / 12 reads (67%), 4 misses, 30 MiB held`; a read that waited for the same frames being read counts as
    a hit (it decoded nothing)."""
    hits, misses = int(stats.get("hits") or 0) + int(stats.get("joined") or 0), int(stats.get("misses") or 0)
    reads = max(int(stats.get("reads") or 0), hits + misses)
    rate = f"{100 * hits / reads:.0f}%" if reads else "-"
    return f"{hits} hits / {reads} reads ({rate}), {misses} misses, {(stats.get('bytes') or 0) / 2**20:.0f} MiB held"


def recorded_stack(run_dir: Path) -> dict | None:
    """The software stack the last run in `run_dir` recorded (summary.json's run section), if any."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return None
    return (json.loads(path.read_text()).get("run") or {}).get("stack")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd.reports.summary")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--baseline", type=Path, default=None, help="an `ar` run of the same manifest")
    p.add_argument("--status", action="store_true",
                   help=f"print nothing; exit {EXIT_ITEMS_FAILED} if the results hold failed items, else 0")
    args = p.parse_args(argv)
    for d in (args.run_dir, args.baseline):
        if d is not None and not any((d / f).is_file() for f in ("results.jsonl", "summary.json")):
            p.error(f"{d} holds no results.jsonl or summary.json: not a job's --out directory")
    method = last_method(args.run_dir)
    if args.status:
        return EXIT_ITEMS_FAILED if summarize(args.run_dir, method)["items_failed"] else 0
    summary = summarize(args.run_dir, method)
    previous = read_summary(args.run_dir)
    for key in ("method", "run", "runs"):
        if previous.get(key) is not None:
            summary[key] = previous[key]
    methods = sorted({r.get("method") for r in read_rows(args.run_dir)} - {None})
    if len(methods) > 1:
        summary["methods"] = {m: summarize(args.run_dir, m) for m in methods}
    if args.baseline is not None:
        summary.update(compare(args.baseline, args.run_dir))
        methods = {r.get("method") for r in read_rows(args.run_dir)} - {None}
        if len(methods) == 1 and methods <= set(METHODS):  # the run's Appendix C prediction against this baseline's per-token time
            theory = predict(args.run_dir, get_method(methods.pop()), summarize(args.baseline)["decode_s_per_token"],
                             summary).theory
            summary["theory_decode_speedup"] = theory
            summary["efficiency"] = summary["decode_speedup_vs_baseline"] / theory if theory else None
    (args.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    width = max(map(len, [*summary, *("method " + m for m in summary.get("methods") or {})]))
    for k, v in summary.items():
        if v is None:
            v = "-"
        if k in ("methods", "runs"):
            continue  # a line per method below
        if k == "run" and isinstance(v, dict):  # stack and the caches: printed on their own lines below
            v = {name: x for name, x in v.items() if name not in ("stack", "reuse", "frames_cache")}
        if isinstance(v, dict):
            v = " ".join(f"{name}={x:.3f}" if isinstance(x, float) else f"{name}={x}" for name, x in v.items())
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    for m, sums in (summary.get("methods") or {}).items():
        print(f"{'method ' + m:<{width}}  items {sums['items_done']} done, {sums['items_failed']} failed, "
              f"{sums['tokens_per_s']:.1f} tokens/s, MAT {sums['mean_accepted_tokens']:.2f}")
    reuse = (summary.get("run") or {}).get("reuse")
    if isinstance(reuse, dict):
        print(f"{'prefix reuse':<{width}}  {reuse_line(reuse)}")
    frames_cache = (summary.get("run") or {}).get("frames_cache")
    if isinstance(frames_cache, dict):
        print(f"{'frames cache':<{width}}  {frames_cache_line(frames_cache)}")
    mine = (summary.get("run") or {}).get("stack")
    print(f"{'stack':<{width}}  {describe(mine) if mine else 'not recorded (a run before vpsd recorded it)'}")
    if args.baseline is not None:
        theirs = recorded_stack(args.baseline)
        if mine and theirs and changes(theirs, mine):
            print(f"{'stack changed':<{width}}  since the baseline: {'; '.join(changes(theirs, mine))}")
    if args.baseline is not None and summary["identical_outputs"] != summary["items_compared"]:
        print("vpsd: outputs differ from the baseline", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

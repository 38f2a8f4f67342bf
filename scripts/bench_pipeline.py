"""Pipeline benchmark (a script, not a test): ar, sd and pearl on the same manifest, in one run.

    python scripts/bench_pipeline.py [--config configs/bench_qwen2_5_vl.yaml] [--items 4] [--out runs/bench]

Prints speedup of pearl over sd and over ar, mean accepted tokens, acceptance rate, and pearl's
per-round pipeline overhead: the target's decode time not spent in verify forwards, per round, as a
fraction of its mean verify time. Two drafts are measured: the config's smaller draft, and the target
itself unpruned (`draft=self`, every draft accepted: the pipeline's best case).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vpsd.reports.summary import compare, summarize  # noqa: E402
from vpsd.reports.timeline import load_spans  # noqa: E402


def run(config: str, manifest: Path, out: Path, method: str, *extra: str) -> None:
    cmd = [str(ROOT / "torchrun.sh"), "run", "--config", config, "--manifest", str(manifest), "--out", str(out),
           "--method", method, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed:\n{proc.stderr[-3000:]}")


def overhead(out: Path) -> tuple[float, float]:
    """(per-round overhead in ms, as a fraction of the mean verify time) for the target of a run."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    verify = [s for s in load_spans(out) if s.role == "target" and s.name == "verify"]
    rounds = sum(r["stats"]["rounds"] for r in rows)
    decode = sum(r["stats"]["decode_s"] for r in rows)
    verify_s = sum(s.dur for s in verify)
    per_round = (decode - verify_s) / rounds
    return per_round * 1e3, per_round / (verify_s / len(verify))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/bench_qwen2_5_vl.yaml")
    p.add_argument("--items", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    args = p.parse_args()
    from vpsd.world.dataset import write_manifest

    manifest = write_manifest(args.out / "data", seeds=list(range(500, 500 + args.items)), num_frames=16,
                              size=(224, 224), max_new_tokens=64)
    for draft in ["smaller", "self"]:
        extra = ["--set", "draft=self"] if draft == "self" else []
        dirs = {}
        for method in ["ar", "sd", "pearl"]:
            dirs[method] = args.out / f"{draft}-{method}"
            run(args.config, manifest, dirs[method], method, *extra)
        print(f"\n== draft: {draft}")
        print(f"{'method':<8}{'MAT':>7}{'accept':>8}{'tok/s':>8}{'vs ar':>8}{'vs sd':>8}{'lossless':>10}")
        for method, d in dirs.items():
            s = summarize(d)
            vs_ar, vs_sd = compare(dirs["ar"], d), compare(dirs["sd"], d)
            lossless = f"{vs_ar['identical_outputs']}/{vs_ar['items_compared']}"
            print(f"{method:<8}{s['mean_accepted_tokens']:>7.2f}{s['acceptance_rate']:>8.2f}{s['tokens_per_s']:>8.1f}"
                  f"{vs_ar['speedup_vs_baseline']:>8.2f}{vs_sd['speedup_vs_baseline']:>8.2f}{lossless:>10}")
        ms, frac = overhead(dirs["pearl"])
        print(f"pearl per-round pipeline overhead: {ms:.2f} ms = {frac:.2f} x the target's mean verify time")


if __name__ == "__main__":
    main()

"""`python -m vpsd.launch.lossless`: speculative runs against an `ar` run, with the target's top-2 margin
wherever an output differs (the judgement itself is vpsd/decoders/lossless.py, README "What lossless means").

    python -m vpsd.launch.lossless --config CONFIG --manifest M --ar AR_DIR --runs DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from vpsd.config import RunConfig, load_config, parse_overrides
from vpsd.decoders.lossless import TIE_TOLERANCE, Divergence, first_divergence, judge
from vpsd.launch.manifest import load_manifest
from vpsd.models.registry import load_adapter
from vpsd.video.item import load_item_frames


@dataclass(frozen=True)
class Difference:
    """An item whose output differs from `ar`'s: where, and whether the target's own margin there makes it a tie."""

    item_id: str
    divergence: Divergence
    tie: bool

    def describe(self) -> str:
        d = self.divergence
        return (f"{self.item_id}: differs at token {d.position} ({d.ar_token} vs {d.other_token}), top-2 margin "
                f"{d.margin:.4g} -> {'tie' if self.tie else 'REAL DIVERGENCE'}")


def judge_runs(cfg: RunConfig, manifest: str | Path, reference: dict[str, list[int]],
               runs: dict[str, dict[str, list[int]]]) -> tuple[dict[str, list[Difference]], float]:
    """Every output of `runs` (label -> item id -> tokens) that differs from `reference` (`ar`'s), judged by the
    target's top-2 margin where it first differs (decoders/lossless.py); and the tie tolerance of the target's
    dtype. Loads the target (cfg.target) only when some output differs."""
    pending = {label: [i for i, toks in out.items() if i in reference and toks != reference[i]]
               for label, out in runs.items()}
    if not any(pending.values()):
        return {label: [] for label in runs}, 0.0
    target = load_adapter(cfg.family, cfg.target)
    tolerance = TIE_TOLERANCE[target.model.dtype]
    items = {it.id: it for it in load_manifest(manifest)[0]}
    found: dict[str, list[Difference]] = {}
    for label, ids in pending.items():
        found[label] = []
        for item_id in ids:
            it = items[item_id]
            frames, times = load_item_frames(it.video, it.num_frames or cfg.video.num_frames,
                                             it.fps or cfg.video.fps, cfg.video.max_side, cfg.video.seek)
            d = first_divergence(target, frames, it.prompt, reference[item_id], runs[label][item_id], times)
            found[label].append(Difference(item_id, d, judge(d, tolerance)))
    return found, tolerance


def _results(out: Path) -> dict[str, list[int]]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["id"]: r["token_ids"] for r in rows if r.get("error") is None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="identity of speculative outputs with ar, with top-2 margins")
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--ar", type=Path, required=True, help="results directory of the ar run")
    p.add_argument("--runs", type=Path, nargs="+", required=True)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides (as the runs had)")
    p.add_argument("--json", type=Path, help="also write every difference here (what `vpsd bench throughput` reads)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, parse_overrides(args.set))
    ar = _results(args.ar)
    runs = {str(run): _results(run) for run in args.runs}
    found, tolerance = judge_runs(cfg, args.manifest, ar, runs)
    if args.json:
        args.json.write_text(json.dumps({"tolerance": tolerance, "runs": {
            label: [{"item_id": d.item_id, "tie": d.tie, **asdict(d.divergence)} for d in diffs]
            for label, diffs in found.items()}}))
    real = 0
    for label, out in runs.items():
        print(f"{label}: {len(out) - len(found[label])}/{len(out)} identical to ar"
              + (f" (tie tolerance {tolerance})" if found[label] else ""))
        for diff in found[label]:
            print("  " + diff.describe())
            real += not diff.tie
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m vpsd.launch.lossless`: speculative runs against an `ar` run, with the target's top-2 margin
wherever an output differs (the judgement itself is vpsd/decoders/lossless.py, README "What lossless means").

    python -m vpsd.launch.lossless --config CONFIG --manifest M --ar AR_DIR --runs DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vpsd.config import load_config, parse_overrides
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.launch.manifest import load_manifest
from vpsd.models.registry import load_adapter
from vpsd.video.item import load_item_frames


def _results(out: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["id"]: r for r in rows if r.get("error") is None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="identity of speculative outputs with ar, with top-2 margins")
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--ar", type=Path, required=True, help="results directory of the ar run")
    p.add_argument("--runs", type=Path, nargs="+", required=True)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides (as the runs had)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, parse_overrides(args.set))
    target = load_adapter(cfg.family, cfg.target)
    tolerance = TIE_TOLERANCE[target.model.dtype]
    items = {it.id: it for it in load_manifest(args.manifest)[0]}
    ar = _results(args.ar)
    for run in args.runs:
        rows = _results(run)
        same, report = 0, []
        for item_id, row in rows.items():
            if row["token_ids"] == ar[item_id]["token_ids"]:
                same += 1
                continue
            it = items[item_id]
            frames, times = load_item_frames(it.video, it.num_frames or cfg.video.num_frames, it.fps or cfg.video.fps,
                                             cfg.video.max_side)
            d = first_divergence(target, frames, it.prompt, ar[item_id]["token_ids"], row["token_ids"], times)
            report.append(f"  {item_id}: differs at token {d.position} ({d.ar_token} vs {d.other_token}), "
                          f"top-2 margin {d.margin:.4g} -> {'tie' if judge(d, tolerance) else 'REAL DIVERGENCE'}")
        print(f"{run}: {same}/{len(rows)} identical to ar ({target.model.dtype}, tie tolerance {tolerance})")
        print("\n".join(report))


if __name__ == "__main__":
    main()

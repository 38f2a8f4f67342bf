"""What capturing the pruning signals adds to the target's prefill: plain prefill vs the hooked one, side by side.

The target scores the text-to-video attention itself, layer by layer inside its prefill (models/signals.py), so
that work is on the target's critical path. This measures by how much: for each manifest item, in rounds that
alternate the order, a plain `adapter.prefill` and `prefill_for_strategy` with the config's strategy as a
parallel run captures it (the streamed layers) and as a serial run does (every layer); it prints the median
ratio over items and rounds, and the spread of the plain prefill's own times (the noise).

One core, as the target runs in the demo:
  vpsd bench signals --config configs/world_qwen2_5_vl_scaled.yaml \
      --manifest examples/world/manifest.jsonl [--items 4 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from vpsd.config import load_config
from vpsd.models.registry import load_adapter
from vpsd.engine.pair_prefill import prefill_for_strategy
from vpsd.video.item import load_item_frames


def _timed(fn) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench signals", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--items", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    target = load_adapter(cfg.family, cfg.target)
    manifest = Path(args.manifest)
    items = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()][: args.items]
    runs = {
        "plain": lambda emb: target.prefill(emb),
        "parallel": lambda emb: prefill_for_strategy(target, emb, cfg.pruning, parallel=True),
        "serial": lambda emb: prefill_for_strategy(target, emb, cfg.pruning, parallel=False),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    ratios: dict[str, list[float]] = {"parallel": [], "serial": []}
    for item in items:
        frames, times_s = load_item_frames(manifest.parent / item["video"], cfg.video.num_frames, cfg.video.fps,
                                           cfg.video.max_side)
        emb = target.embed(target.prepare(frames, item["prompt"], times_s))
        _timed(lambda: runs["plain"](emb))  # warm-up
        for r in range(args.repeats):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            got = {name: _timed(lambda name=name: runs[name](emb)) for name in order}
            for name, t in got.items():
                times[name].append(t)
            for name in ratios:
                ratios[name].append(got[name] / got["plain"])
    plain = times["plain"]
    noise = (max(plain) - min(plain)) / statistics.median(plain)
    print(f"{cfg.pruning.strategy}: {len(items)} items x {args.repeats} rounds, {emb.seq_len} tokens "
          f"({emb.layout.num_tokens} video), target layers {len(target.language_model.layers)}, "
          f"streamed after {cfg.pruning.signal_layers(True)}")
    print(f"plain prefill  median {statistics.median(plain) * 1e3:8.1f} ms (spread {noise:.0%} of the median)")
    for name in ratios:
        print(f"{name:8s} hooked median {statistics.median(times[name]) * 1e3:8.1f} ms, "
              f"x{statistics.median(ratios[name]):.3f} the plain prefill "
              f"(ratios {min(ratios[name]):.3f}..{max(ratios[name]):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

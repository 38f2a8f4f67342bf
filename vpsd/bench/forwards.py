"""What a config's target and draft cost on long-world items: prefill, a one-row step and an 8-row verify, with
all of the video and with 10% of it (a uniform lattice: the cost depends on how many tokens are kept, not which).

    vpsd bench forwards --config configs/world_long_scaled.yaml [--seeds 100004,100006] [--set K=V ...]

fp32 as configured, one thread, vpsd's own adapters and cache; medians of 9 calls (3 for prefill), each step
rolled back so every call sees the same context. c = T_p / T_q is the target's step over the draft's."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from vpsd.config import load_config, parse_overrides
from vpsd.models.registry import load_adapter, load_draft
from vpsd.pipeline.pruning.select import uniform_keep
from vpsd.video.item import load_item_frames
from vpsd.world.dataset import write_long_manifest


def median_ms(call: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def costs(model, emb, keep) -> tuple[float, float, float, int]:
    """(prefill ms, step ms, 8-row ms, context length) of one model on one item's embeddings."""
    prefill = median_ms(lambda: model.prefill(emb, keep), 3)
    state = model.prefill(emb, keep).state
    length = state.length

    def rows(n: int) -> None:
        model.step(state, torch.tensor([5] * n))
        model.rollback(state, length)

    return prefill, median_ms(lambda: rows(1), 9), median_ms(lambda: rows(8), 9), length


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench forwards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--seeds", default="100004,100006", help="long-world seeds (held out from 100000 on)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(a.config, parse_overrides(a.set))
    target = load_adapter(cfg.family, cfg.target)
    draft = load_draft(cfg.family, cfg.draft, target)
    work = Path(tempfile.mkdtemp(prefix="vpsd-costs-"))
    manifest = write_long_manifest(work, [int(s) for s in a.seeds.split(",")])
    print("item          model  video  seen  context   prefill ms  step ms  8 rows ms")
    for item in (json.loads(line) for line in manifest.read_text().splitlines()):
        frames, times = load_item_frames(work / item["video"], cfg.video.num_frames, cfg.video.fps, cfg.video.max_side)
        for name, model in (("target", target), ("draft", draft)):
            emb = model.embed(model.prepare(frames, item["prompt"], times))
            for seen, keep in (("all", None), ("10%", uniform_keep(emb.layout, 0.9))):
                pf, step, eight, length = costs(model, emb, keep)
                print(f"{item['id']:<13} {name:<6} {emb.layout.num_tokens:>5} {seen:>5} {length:>8} {pf:>12.1f}"
                      f" {step:>8.2f} {eight:>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

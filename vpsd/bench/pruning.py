"""The pruning benchmark: every pruning strategy on the same inputs, in one run.

    vpsd bench pruning --config CONFIG --manifest MANIFEST [--out DIR] [--ratio R]
                       [--strategies a,b,...] [--items N] [--max-new-tokens N] [--repeats 3]
                       [--set KEY=VALUE ...]

Per item the target's signals are captured once (one full prefill with hooks on its first `pruning.layers`
layers, all by default as in a serial run: the text-to-video attention scored on the target, hidden-state rows, and the visual embeddings), packed and unpacked exactly as
they travel to the pruner rank (roles/signals_wire.py), and reused for every strategy, so each strategy
selects from the same input. For each strategy:

- pruning time: the pruner's `strategy.select(signals, layout, ratio, seed)` alone (the best of `--repeats`
  calls per item, after one warm-up call), scaled to 10k video tokens, median over items;
- MAT: the serial speculative decoder (decoders/sd.py, greedy) with the draft prefilled on that strategy's
  kept set; each output is checked token for token against the target's plain autoregressive output (`ar`).
  MAT pools the rounds of every item (stats.py: tokens committed per round, the target's own token included).

Kept sets are checked against the contract (sorted, unique, exactly the budget) and appended to
DIR/kept.jsonl, so `vpsd bias DIR` compares the strategies' position bias on the same items.
Writes DIR/bench_pruning.csv and DIR/bench_pruning.json; exits 1 if any output differs from `ar`.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vpsd.config import DecodingConfig, RunConfig, load_config, parse_overrides
from vpsd.tracing import configure_tracing
from vpsd.decoders.ar import decode_ar
from vpsd.decoders.sd import decode_sd
from vpsd.reports.kept_log import FILENAME, KeptRecord, append_kept
from vpsd.launch.manifest import load_manifest
from vpsd.models.base import VideoLMAdapter
from vpsd.models.registry import load_adapter, load_draft
from vpsd.models.signals import prefill_with_signals
from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.strategies import STRATEGIES, PruningSignals
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.roles.pruner import check_keep
from vpsd.roles.signals_wire import pack, unpack
from vpsd.video.item import load_item_frames


@dataclass
class Captured:
    """One item's inputs, shared by every strategy."""

    item_id: str
    frames: object  # (T, H, W, 3) uint8
    times: object  # (T,) seconds each frame was taken
    prompt: str
    signals: PruningSignals
    layout: VideoTokenLayout
    ar_tokens: list[int]
    max_new_tokens: int


@dataclass
class StrategyRow:
    strategy: str
    ratio: float
    items: int
    prune_ms_per_10k: float  # median over items
    mean_accepted_tokens: float  # pooled over the rounds of every item
    acceptance_rate: float
    lossless: bool  # every output equals ar
    mean_kept: float
    per_item_prune_ms: list[float] = field(default_factory=list)


def capture(target: VideoLMAdapter, cfg: RunConfig, it, max_new_tokens: int | None) -> Captured:
    frames, times = load_item_frames(it.video, it.num_frames or cfg.video.num_frames, it.fps, cfg.video.max_side)
    emb = target.embed(target.prepare(frames, it.prompt, times))
    pre = prefill_with_signals(target, emb, cfg.pruning.layers, attention=True, hidden=True)
    measured = {"visual_embeds": emb.visual_embeds.float(), **pre.signals.as_tensors()}
    # Through the wire format, so a strategy sees exactly what the pruner rank would receive.
    signals, layout = unpack(*pack(measured, emb.layout))
    budget = max_new_tokens or it.max_new_tokens or cfg.decoding.max_new_tokens
    dec = DecodingConfig(gamma=cfg.decoding.gamma, max_new_tokens=budget, temperature=0.0)
    ar = decode_ar(target, frames, it.prompt, dec, times).token_ids
    return Captured(it.id, frames, times, it.prompt, signals, layout, ar, budget)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_select(name: str, item: Captured, ratio: float, seed: int, repeats: int) -> tuple[torch.Tensor, float]:
    """(kept indices, best time in seconds of `repeats` calls after one warm-up call)."""
    select = STRATEGIES[name].select
    keep = select(item.signals, item.layout, ratio, seed)
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        select(item.signals, item.layout, ratio, seed)
        _sync()
        best = min(best, time.perf_counter() - t0)
    return keep.long().cpu(), best


def bench(target, draft, cfg: RunConfig, items: list[Captured], strategies: list[str], ratio: float,
          repeats: int, out: Path) -> list[StrategyRow]:
    rows = []
    for name in strategies:
        r = 0.0 if name == "none" else ratio
        times, kept, stats, lossless = [], [], AcceptanceStats(), True
        for item in items:
            keep, secs = time_select(name, item, r, cfg.pruning.seed, repeats)
            check_keep(keep, item.layout, r)
            append_kept(out, KeptRecord(item.item_id, name, r, keep, item.layout))
            times.append(secs * 1e3 * 10_000 / item.layout.num_tokens)
            kept.append(int(keep.numel()))
            dec = DecodingConfig(gamma=cfg.decoding.gamma, max_new_tokens=item.max_new_tokens, temperature=0.0)
            res = decode_sd(target, draft, item.frames, item.prompt, dec, lambda t_emb, t_pre, d_emb, seed, k=keep: k,
                            frame_times=item.times)
            lossless &= res.token_ids == item.ar_tokens
            stats.extend(res.stats)
        rows.append(StrategyRow(name, r, len(items), statistics.median(times), stats.mean_accepted_tokens,
                                stats.acceptance_rate, lossless, statistics.fmean(kept), times))
        print(f"  {name}: done", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[StrategyRow]) -> str:
    head = f"{'strategy':<14} {'ratio':>5} {'prune ms/10k tok':>16} {'MAT':>6} {'accept':>7} {'kept':>7} {'== ar':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.strategy:<14} {r.ratio:>5.2f} {r.prune_ms_per_10k:>16.3f} {r.mean_accepted_tokens:>6.3f} "
                     f"{r.acceptance_rate:>7.3f} {r.mean_kept:>7.1f} {'yes' if r.lossless else 'NO':>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench pruning", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--out", type=Path, default=Path("runs/bench_pruning"))
    p.add_argument("--ratio", type=float, default=None, help="pruning ratio (default: the config's)")
    p.add_argument("--strategies", default=None, help="comma-separated subset of the registry (default: all)")
    p.add_argument("--items", type=int, default=None, help="only the first N items of the manifest")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the items' token budget")
    p.add_argument("--repeats", type=int, default=3, help="timed select calls per item and strategy (best kept)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    args = p.parse_args(argv)
    configure_tracing(None, "bench_pruning", 0)  # the decoders' spans are trace data, not console output

    overrides = parse_overrides(args.set)
    if args.ratio is not None:
        overrides["pruning.ratio"] = args.ratio
    cfg = load_config(args.config, overrides)
    ratio = cfg.pruning.ratio
    if ratio == 0.0:
        print("bench_pruning: pruning ratio is 0 (every strategy keeps every token); pass --ratio", file=sys.stderr)
    strategies = args.strategies.split(",") if args.strategies else list(STRATEGIES)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; known: {sorted(STRATEGIES)}")
    items, problems = load_manifest(args.manifest)
    if problems:
        raise SystemExit(f"{args.manifest}: " + "; ".join(f"line {q.line}: {q.message}" for q in problems))
    items = items[: args.items] if args.items else items

    target = load_adapter(cfg.family, cfg.target)
    draft = load_draft(cfg.family, cfg.draft, target)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / FILENAME).unlink(missing_ok=True)  # kept.jsonl holds this run only
    print(f"capturing signals of {len(items)} items", file=sys.stderr)
    captured = [capture(target, cfg, it, args.max_new_tokens) for it in items]
    rows = bench(target, draft, cfg, captured, strategies, ratio, args.repeats, args.out)

    table = format_table(rows)
    tokens = statistics.fmean(c.layout.num_tokens for c in captured)
    depth = len(target.language_model.layers)
    layers = depth if cfg.pruning.layers is None else min(cfg.pruning.layers, depth)
    print(f"\n{cfg.family}, {len(captured)} items, {tokens:.0f} video tokens per item, ratio {ratio}, "
          f"gamma {cfg.decoding.gamma}, signals from {layers} target layers\n{table}")
    with (args.out / "bench_pruning.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in asdict(rows[0]) if k != "per_item_prune_ms"])
        writer.writeheader()
        for r in rows:
            writer.writerow({k: v for k, v in asdict(r).items() if k != "per_item_prune_ms"})
    (args.out / "bench_pruning.json").write_text(json.dumps({
        "config": str(args.config), "manifest": str(args.manifest), "items": [c.item_id for c in captured],
        "video_tokens_per_item": [c.layout.num_tokens for c in captured], "ratio": ratio,
        "rows": [asdict(r) for r in rows],
    }, indent=2))
    print(f"wrote {args.out / 'bench_pruning.csv'}, {args.out / 'bench_pruning.json'} and {args.out / FILENAME}")
    return 0 if all(r.lossless for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tree vs chain accept length (SpecVLM Table 4's comparison), in one process, no timing.

    vpsd bench trees [--config configs/world_qwen2_5_vl.yaml] [--manifest examples/world/manifest.jsonl]
                     [--ratio 0.9] [--tree eagle --tree '[4,2,1]' ...] [--items N] [--set KEY=VALUE ...]

Runs the serial decoders (decoders/serial.py, the code the target rank runs for serial methods) greedily on
every manifest item: `ar`, then vanilla SD (a chain of gamma), SD-tree, SpecVLM-chain and SpecVLM (tree), each
tree row once per `--tree` (a name, branching factors or node paths, as `decoding.tree` takes). Per row: MAT
(tokens committed per target verification, the target's own token included), the draft tokens one verify
forward checks (a chain's gamma, a tree's every node: what a verify costs where k rows cost k times one), the
draft forwards per round (gamma, or the tree's depth), and how many outputs equal `ar`'s. Exits 1 if one differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from vpsd.config import load_config, parse_overrides
from vpsd.decoders.serial import decode_serial
from vpsd.launch.manifest import load_manifest
from vpsd.models.registry import load_adapter, load_draft
from vpsd.pipeline.methods import get_method
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.tree import parse_tree
from vpsd.tracing import configure_tracing


@dataclasses.dataclass
class Row:
    label: str
    method: str
    tree: object  # the decoding.tree setting: "chain" or a tree
    strategy: str
    ratio: float
    stats: AcceptanceStats = dataclasses.field(default_factory=AcceptanceStats)
    identical: int = 0
    items: int = 0

    @property
    def fed_per_verify(self) -> float:
        """Tokens a verify forward feeds besides the pending ones (drafted chain tokens or tree nodes)."""
        t = parse_tree(self.tree)
        if t is None:
            return statistics.fmean(self.stats.drafted_per_round)
        return float(t.num_nodes)


def rows_for(trees: list[str], ratio: float) -> list[Row]:
    rows = [Row("SD (chain)", "sd", "chain", "none", 0.0)]
    rows += [Row(f"SD-tree ({t})", "sd-tree", t, "none", 0.0) for t in trees]
    rows += [Row("SpecVLM-chain", "specvlm", "chain", "specvlm", ratio)]
    rows += [Row(f"SpecVLM ({t})", "specvlm", t, "specvlm", ratio) for t in trees]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench trees", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/world_qwen2_5_vl.yaml")
    p.add_argument("--manifest", default="examples/world/manifest.jsonl")
    p.add_argument("--ratio", type=float, default=None, help="SpecVLM's pruning ratio (default: the config's)")
    p.add_argument("--tree", action="append", default=None, help="a tree setting, YAML (default: eagle); repeatable")
    p.add_argument("--items", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    args = p.parse_args(argv)
    configure_tracing(None, "tree_mat", 0)  # the decoders' spans are trace data, not console output

    cfg = load_config(args.config, parse_overrides(args.set))
    ratio = cfg.pruning.ratio if args.ratio is None else args.ratio
    trees = [parse_overrides([f"tree={t}"])["tree"] for t in args.tree or ["eagle"]]
    for t in trees:
        try:
            parse_tree(t)  # a bad shape fails before any model loads
        except ValueError as e:
            raise SystemExit(f"tree_mat: {e}") from None
    items, problems = load_manifest(args.manifest)
    if problems:
        raise SystemExit(f"{args.manifest}: " + "; ".join(f"line {q.line}: {q.message}" for q in problems))
    items = items[: args.items] if args.items else items

    from vpsd.video.item import load_item_frames

    target = load_adapter(cfg.family, cfg.target)
    draft = load_draft(cfg.family, cfg.draft, target)
    rows = rows_for(trees, ratio)
    for it in items:
        frames, times = load_item_frames(it.video, it.num_frames or cfg.video.num_frames, it.fps, cfg.video.max_side)
        budget = it.max_new_tokens or cfg.decoding.max_new_tokens
        base = dataclasses.replace(cfg.decoding, max_new_tokens=budget, temperature=0.0)
        ar = decode_serial(get_method("ar"), target, None, frames, it.prompt, base, cfg.pruning, times).token_ids
        for row in rows:
            dec = dataclasses.replace(base, tree=row.tree)
            pruning = dataclasses.replace(cfg.pruning, strategy=row.strategy, ratio=row.ratio)
            res = decode_serial(get_method(row.method), target, draft, frames, it.prompt, dec, pruning, times)
            row.stats.extend(res.stats)
            row.identical += int(res.token_ids == ar)
            row.items += 1
        print(f"  {it.id}: done", file=sys.stderr, flush=True)

    head = f"{'method':<26} {'ratio':>5} {'MAT':>5} {'checked/verify':>14} {'draft fwd/round':>15} {'== ar':>6}"
    print(f"\n{cfg.family}, {len(items)} items, gamma {cfg.decoding.gamma}, greedy\n{head}\n{'-' * len(head)}")
    for r in rows:
        t = parse_tree(r.tree)
        fwd = statistics.fmean(r.stats.drafted_per_round) if t is None else t.depth
        print(f"{r.label:<26} {r.ratio:>5.2f} {r.stats.mean_accepted_tokens:>5.2f} {r.fed_per_verify:>14.1f} "
              f"{fwd:>15.1f} {r.identical:>3}/{r.items:<2}")
    return 0 if all(r.identical == r.items for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

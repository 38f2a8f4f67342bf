"""`vpsd plan`: what a config's layout needs of each rank's memory, printed without launching or loading anything.

    vpsd plan --config C [--method M] [--batch N] [--set KEY=VALUE ...] [--gpu-gib G] [--ranks-per-node L]

One pipeline's ranks (launch/layout.py: the roles', then the split target's followers), each with its weights,
KV cache per token, the KV of one item at the full context, the activations' peak and the runtime
(launch/memory.py, models/memory_plan.py), read from the checkpoints' config.json alone. Then whether it fits:
GPU ranks against --gpu-gib each (default: this machine's first GPU's free memory), the host's ranks against
its available memory (--ranks-per-node: the ranks a node runs, default one pipeline's), the line a launch would
refuse with, and the KV budget a launch would default to. Exit 0 if it fits, 1 if not, 2 on a bad config.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from vpsd.config import ConfigError, load_config, parse_overrides
from vpsd.launch.memory import Memory, host_available, kv_budget_mib, launch_plan, refusal
from vpsd.models.memory_plan import CACHE_SPARE, GIB, gib
from vpsd.models.shapes import ShapeError
from vpsd.pipeline.methods import get_method


def table(lp) -> list[str]:
    rows = [f"{'rank':>4}  {'role':<16}{'device':<8}{'weights':>11}{'KV/token':>10}{'KV/item':>11}"
            f"{'activations':>13}{'runtime':>10}{'total':>11}"]
    for n in lp.needs:
        kv_item = int(lp.context * n.kv_per_token * CACHE_SPARE)
        rows.append(f"{n.rank:>4}  {n.role:<16}{lp.devices[n.rank]:<8}{gib(n.weights):>11}{n.kv_per_token / 1024:>7.0f} KiB"
                    f"{gib(kv_item):>11}{gib(n.activations):>13}{gib(n.runtime):>10}{gib(n.with_tokens(lp.context)):>11}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd plan", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--method", default="hippo")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gpu-gib", type=float, default=None, help="memory of each GPU rank (default: this machine's)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks a node runs (default: one pipeline)")
    args = p.parse_args(argv)
    method = get_method(args.method)
    try:
        overrides = parse_overrides(args.set)
        if args.batch is not None:
            overrides["batching.size"] = args.batch
        overrides.setdefault("pruning.strategy", method.default_strategy)
        cfg = load_config(args.config, overrides)
        lp = launch_plan(cfg, method)
    except (ConfigError, ShapeError, ValueError, OSError) as e:
        print(f"vpsd plan: {e}", file=sys.stderr)
        return 2
    local = args.ranks_per_node or len(lp.needs)
    gpu = int(args.gpu_gib * GIB) if args.gpu_gib is not None else _this_gpu(local)
    memory = Memory(gpu, host_available(), max(1, local // len(lp.needs)),
                    "--gpu-gib" if args.gpu_gib is not None else "this machine's GPU")
    k = cfg.target.tensor_parallel
    print(f"{args.config}: {method.name}, batch {cfg.batching.size}, target over {k} rank{'s' if k > 1 else ''} "
          f"({cfg.target.dtype}), context {lp.context} tokens")
    print("\n".join(table(lp)))
    line = refusal(cfg, method, lp, memory)
    gpu_text = f"GPU ranks {gib(gpu)} each" if gpu is not None else "GPU ranks: unknown (--gpu-gib)"
    print(f"has: {gpu_text}; host {gib(memory.host)} available for {local} rank{'s' if local > 1 else ''}")
    if line:
        print(line)
        return 1
    budget = kv_budget_mib(lp, memory)
    leader = next(n for n in lp.needs if n.role == "target")
    if budget is not None:
        tokens = budget * 2**20 / leader.kv_per_token
        print(f"fits; batching.kv_budget_mib defaults to {budget:.0f} (KV for {tokens:.0f} tokens in flight: "
              f"{tokens / lp.context:.1f} items at the full context)")
    else:
        print("fits where memory is known")
    return 0


def _this_gpu(local: int) -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(0)[0] // max(1, -(-local // torch.cuda.device_count()))


if __name__ == "__main__":
    sys.exit(main())

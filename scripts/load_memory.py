"""Peak memory and time of loading a target split over the ranks of a torchrun launch, against the memory plan.

    torchrun --standalone --nproc-per-node K scripts/load_memory.py CKPT [--way sharded|whole] [--dtype bfloat16]
                                                                      [--prefill N]

--way sharded   vpsd's load (models/sharded_load.py): each rank reads its share of the checkpoint in place
--way whole     the load before it: every rank reads the whole model (from_pretrained), then keeps its share
--prefill N     then the leader prefills N tokens (the others follow): the activations' peak
Each rank resets its peak resident memory (VmHWM, via /proc/self/clear_refs) before each phase and prints one
JSON line: the phase's peak and its growth over the resident memory before it, the seconds, the bytes of the
parameters it holds (its share of the split layers plus the whole parts), and the plan's numbers for it
(models/memory_plan.py: weights and runtime for the load; for the prefill its activations, the leader's
embeddings and the prefill's KV cache). Run with MALLOC_MMAP_THRESHOLD_=65536 to measure a prefill: glibc
otherwise keeps freed blocks under 32 MiB in its heap, and the peak is the allocator's, not the tensors'.
A measurement, not a test: docs/design.md ("A target across ranks") has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from vpsd.models.grown_checkpoint import checkpoint_family  # noqa: E402
from vpsd.models.memory_plan import DTYPE_BYTES, Held, rank_need  # noqa: E402
from vpsd.models.families import DTYPES, family  # noqa: E402
from vpsd.models.registry import load_adapter  # noqa: E402
from vpsd.models.shapes import model_shape  # noqa: E402
from vpsd.models.spec import ModelSpec  # noqa: E402
from vpsd.models.tensor_parallel import Mirror, follow, shard_language_model  # noqa: E402

MIB = 2**20


def memory() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    return memory()["VmRSS"]


def held_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def load(args, group):
    """vpsd's load, or the one before it (from_pretrained whole, then the scatter of the leader's share)."""
    fam = checkpoint_family(args.ckpt)
    if args.way == "sharded":
        return load_adapter(fam, ModelSpec(path=str(args.ckpt), dtype=args.dtype), group=group)
    model = family(fam).model_class.from_pretrained(args.ckpt, dtype=DTYPES[args.dtype]).eval()
    if group is not None:
        shard_language_model(model.model.language_model, group, "cpu")
    from transformers import AutoTokenizer

    return family(fam).adapter(model, AutoTokenizer.from_pretrained(args.ckpt))


def prefill(adapter, tokens: int, rank: int, group) -> None:
    """A prefill of `tokens` random embeddings (the language model's forward, as the engine's prefill runs it:
    logits of the last position only); the leader sends it, the others follow."""
    if rank != 0:
        follow(adapter, group, leader=0)
        return
    if group is not None:
        adapter.mirror = Mirror(group, 0, adapter.device)
    hidden = adapter.model.config.get_text_config().hidden_size
    embeds = torch.randn(1, tokens, hidden, dtype=adapter.model.dtype)
    positions = torch.arange(tokens).view(1, 1, -1).expand(adapter.position_rows, 1, -1)
    with torch.inference_mode():
        out = adapter.run_language_model(adapter.new_cache(), inputs_embeds=embeds,
                                         position_ids=positions if adapter.position_rows > 1 else positions[0])
        adapter.model.lm_head(out.last_hidden_state[:, -1])
    if group is not None:
        adapter.mirror.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("--way", choices=["sharded", "whole"], default="sharded")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--prefill", type=int, default=0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, k = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(k))) if k > 1 else None  # one rank: a target that is not split
    shape = model_shape(checkpoint_family(args.ckpt), json.loads((args.ckpt / "config.json").read_text()))
    # No vision tower runs here (the prefill takes random embeddings): the plan's language-model part, plus the
    # leader's embeddings, is what the measured prefill is compared with.
    planned = rank_need(rank, "target", [Held(shape, DTYPE_BYTES[args.dtype], k, embeds=False)], args.prefill, 0, "cpu")
    embeds = args.prefill * shape.hidden * DTYPE_BYTES[args.dtype] if rank == 0 else 0
    report = {"rank": rank, "ranks": k, "way": args.way, "params_gib_whole_model": shape.params * DTYPE_BYTES[args.dtype] / 2**30}
    before = reset_peak()
    start = time.perf_counter()
    adapter = load(args, group)
    report["load_s"] = time.perf_counter() - start
    after = memory()
    report.update(rss_before_mib=before / MIB, load_peak_mib=after["VmHWM"] / MIB,
                  load_growth_mib=(after["VmHWM"] - before) / MIB, rss_after_mib=after["VmRSS"] / MIB,
                  held_mib=held_bytes(adapter.model) / MIB, plan_weights_mib=planned.weights / MIB,
                  plan_runtime_mib=planned.runtime / MIB)
    if args.prefill:
        dist.barrier()
        before = reset_peak()
        start = time.perf_counter()
        prefill(adapter, args.prefill, rank, group)
        report.update(prefill_tokens=args.prefill, prefill_s=time.perf_counter() - start,
                      prefill_growth_mib=(memory()["VmHWM"] - before) / MIB,
                      plan_prefill_mib=(planned.activations + embeds + args.prefill * planned.kv_per_token) / MIB)
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

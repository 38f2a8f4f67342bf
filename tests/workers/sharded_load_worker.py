"""Two ranks load one target checkpoint split between them (models/sharded_load.py), for each family named:
rank 0 first writes the family's tiny target as a published-layout checkpoint in several safetensors shards
(with an index). Each rank then compares its share with the unsplit model's slices and with today's split of a
model built whole (`shard`), and rank 0 decodes items with the split target (rank 1 following) against the
unsplit one. Rank r writes OUT/rank{r}.json; the test reads them."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.conftest import config_path  # noqa: E402
from tests.engine_harness import requests  # noqa: E402
from tests.official_layout import official_checkpoint  # noqa: E402
from vpsd.config import DecodingConfig, load_config  # noqa: E402
from vpsd.decoders.ar import decode_ar  # noqa: E402
from vpsd.models.memory_plan import Held, weight_bytes  # noqa: E402
from vpsd.models.registry import load_adapter, tiny_tokenizer  # noqa: E402
from vpsd.models.shapes import model_shape  # noqa: E402
from vpsd.models.spec import ModelSpec  # noqa: E402
from vpsd.models.tensor_parallel import Mirror, follow  # noqa: E402


def compare(split, whole, built, rank: int) -> dict:
    """Per parameter: the split model's local tensor against the unsplit model's slice (this rank's chunk of the
    split dim) and against the model built whole and split by `shard` (today's way)."""
    wp, bp = dict(whole.model.named_parameters()), dict(built.model.named_parameters())
    report = {"params": 0, "split": 0, "unequal_to_slice": [], "unequal_to_built": [], "local_bytes": 0, "whole_bytes": 0}
    for name, p in split.model.named_parameters():
        report["params"] += 1
        ref = wp[name].detach()
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor) and p.placements[0].is_shard():
            report["split"] += 1
            ref = ref.chunk(p.device_mesh.size(), dim=p.placements[0].dim)[rank]
        if local.shape != ref.shape or not torch.equal(local.detach(), ref):
            report["unequal_to_slice"].append(name)
        b = bp[name]
        if not torch.equal(local.detach(), (b.to_local() if isinstance(b, DTensor) else b).detach()):
            report["unequal_to_built"].append(name)
        report["local_bytes"] += local.numel() * local.element_size()
        report["whole_bytes"] += wp[name].numel() * wp[name].element_size()
    return report


def one_family(family: str, out: Path, group, rank: int, tok) -> dict:
    cfg = load_config(config_path(family))
    ckpt = out / family
    if rank == 0:
        official_checkpoint(load_adapter(family, cfg.target, tok), family, ckpt, max_shard_size="40KB")
    dist.barrier()
    spec = ModelSpec(path=str(ckpt))
    split, whole = load_adapter(family, spec, tok, group=group), load_adapter(family, spec, tok)
    report = {"shards": len(list(ckpt.glob("*.safetensors"))), "index": (ckpt / "model.safetensors.index.json").is_file()}
    report.update(compare(split, whole, load_adapter(family, cfg.target, tok, group=group), rank))
    # what the memory plan says a rank of 2 holds, from config.json alone (models/memory_plan.py)
    report["plan_bytes"] = weight_bytes(Held(model_shape(family, json.loads((ckpt / "config.json").read_text())), 4, 2))
    if rank == 1:
        report["forwards"] = follow(split, group, leader=0)
        return report
    split.mirror = Mirror(group, 0, split.device)
    item = requests(1)[0]  # one item, a few tokens: a split step costs ~0.25 s on this CPU (DTensor dispatch)
    for name, model in (("split_tokens", split), ("whole_tokens", whole)):
        report[name] = decode_ar(model, item.frames, item.prompt, DecodingConfig(max_new_tokens=6)).token_ids
    emb = whole.embed(whole.prepare(item.frames, item.prompt))
    with torch.inference_mode():
        report["prefill_logit_diff"] = float((whole.prefill(emb).logits - split.prefill(emb).logits).abs().max())
    split.mirror.stop()
    return report


def main() -> None:
    out, families = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    tok = tiny_tokenizer()  # the families' tiny models share it
    report = {}
    for family in families:
        t = time.perf_counter()
        report[family] = one_family(family, out, group, rank, tok)
        report[family]["seconds"] = time.perf_counter() - t
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Two ranks, one target split between them (models/tensor_parallel.py): rank 0 leads (the engine decodes with
the sharded target, its forwards and cache ops mirrored), rank 1 follows. Rank 0 also decodes each item with
an unsharded copy and writes both to OUT/tp.json; the test compares them."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.conftest import config_path  # noqa: E402
from tests.engine_harness import local_engine, requests, run  # noqa: E402
from vpsd.config import DecodingConfig, PruningConfig, load_config  # noqa: E402
from vpsd.decoders.ar import decode_ar  # noqa: E402
from vpsd.models.registry import load_adapter, tiny_tokenizer  # noqa: E402
from vpsd.models.signals import prefill_with_signals  # noqa: E402
from vpsd.models.tensor_parallel import Mirror, follow, shard  # noqa: E402


def main() -> None:
    family, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    cfg = load_config(config_path(family))
    tok = tiny_tokenizer()
    target = load_adapter(family, cfg.target, tok)
    shard(target, group)
    if rank == 1:
        forwards = follow(target, group, leader=0)
        (out / "follower.json").write_text(json.dumps({"forwards": forwards}))
        dist.destroy_process_group()
        return
    target.mirror = Mirror(group, 0, target.device)
    whole = load_adapter(family, cfg.target, tok)
    kv = target.language_model.layers[0].self_attn.k_proj.weight
    report = {"local_kv_rows": int(kv.to_local().shape[0]) if hasattr(kv, "to_local") else int(kv.shape[0]),
              "whole_kv_rows": int(whole.language_model.layers[0].self_attn.k_proj.weight.shape[0])}
    todo = requests(2, max_new=12)
    dec = DecodingConfig(gamma=3, max_new_tokens=12, temperature=0.0)
    cases = {"ar_b1": (None, None, 1), "ar_b2": (None, None, 2),
             # the target drafting for itself on half the video: its draft's forwards are mirrored too
             "self_sd_b2": (target, PruningConfig("uniform", 0.5, seed=3), 2)}
    for name, (draft, pruning, size) in cases.items():
        got = run(local_engine(target, draft, dec, pruning, size)[1], todo)
        report[name] = {it.id: got[it.id].token_ids for it in todo}
        if draft is not None:
            report[name + "_accepted"] = sum(sum(got[it.id].stats.accepted_per_round) for it in todo)
    report["reference"] = {it.id: decode_ar(whole, it.frames, it.prompt, dataclasses.replace(
        dec, max_new_tokens=it.max_new_tokens)).token_ids for it in todo}
    emb = whole.embed(whole.prepare(todo[0].frames, todo[0].prompt))
    with torch.inference_mode():
        report["prefill_logit_diff"] = float((whole.prefill(emb).logits - target.prefill(emb).logits).abs().max())
    # HIPPO's and UV-Prune's signals of a split prefill: every rank's heads scored, gathered on the leader
    ref = prefill_with_signals(whole, emb, None, attention=True, hidden=True).signals
    got = prefill_with_signals(target, emb, None, attention=True, hidden=True).signals
    report["attention_shape"] = [list(ref.video_attention.shape), list(got.video_attention.shape)]
    report["signal_diff"] = max(float((getattr(ref, f) - getattr(got, f)).abs().max())
                                for f in ("video_attention", "video_hidden", "text_hidden"))
    report["mirrored_forwards"] = target.mirror.forwards
    target.mirror.stop()
    (out / "leader.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

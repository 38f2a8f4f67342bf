"""The pruner role: turns the target's signals into kept video-token indices for the draft.

Loop: JobStart (from the target) -> signals announced by the target -> strategy.select -> kept
indices sent to the draft. It runs while the target is still prefilling, so the draft's pruned
prefill overlaps the target's full one (synchronous draft-target prefill).
"""

from __future__ import annotations

import torch

from vpsd.pipeline.messages import ItemDone, JobStart, Shutdown, TensorAnnounce
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.signals_wire import unpack
from vpsd.tracing import get_logger, span

log = get_logger()


def run_pruner(ctx: RoleContext) -> None:
    cfg = ctx.config.pruning
    strategy = STRATEGIES[cfg.strategy]
    while True:
        _, msg = ctx.recv("target", timeout_s=ctx.extra.get("idle_timeout_s"))
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, ItemDone):
            continue
        if not isinstance(msg, JobStart):
            raise RoleFailure(f"pruner: unexpected {type(msg).__name__} between items")
        ctx.item_id = msg.item_id
        _, announce = ctx.recv("target")
        if isinstance(announce, ItemDone):
            continue  # the target gave the item up before sending signals
        if not isinstance(announce, TensorAnnounce):
            raise RoleFailure(f"pruner: expected the signals of item {msg.item_id}, got {type(announce).__name__}")
        tensors = ctx.tensors.recv_announced(announce)
        signals, layout = unpack(announce.tag, tensors)
        with span("prune", item=msg.item_id, strategy=cfg.strategy, tokens=layout.num_tokens):
            if cfg.strategy == "none" or cfg.ratio == 0.0:
                keep = torch.arange(layout.num_tokens)
            else:
                keep = strategy.select(signals, layout, cfg.ratio, cfg.seed + msg.seed)
        with span("send", item=msg.item_id, what="keep"):
            ctx.tensors.send(ctx.ranks["draft"], [keep.long()], tag=f"keep:{msg.item_id}").wait()

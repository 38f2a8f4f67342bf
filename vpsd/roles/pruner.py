"""The pruner role: turns the target's signals into kept video-token indices for the draft.

Loop: JobStart (from the target) -> signals announced by the target -> strategy.select -> kept
indices sent to the draft (with the target's token grid, which the draft checks) -> a KeepIndices report (the count) to the target. The target streams the
signals from inside its prefill (right after layer L), so this runs while the target is still
prefilling and the draft's pruned prefill overlaps the target's full one (synchronous draft-target
prefill). Before anything leaves, the kept set is checked against the contract of
pipeline/pruning/select.py (sorted, unique, every non-prunable token plus exactly the budget). When the
run has an output directory (ctx.out) each item's kept set and layout are appended to
RUN_DIR/kept.jsonl (reports/kept_log.py) for `vpsd bias`.
"""

from __future__ import annotations

import torch


from vpsd.decoders.keep import configured_strategy
from vpsd.reports.kept_log import KeptRecord, append_kept
from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.messages import ItemDone, JobStart, KeepIndices, Shutdown, TensorAnnounce
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.signals_wire import unpack
from vpsd.tracing import get_logger, span

log = get_logger()


def run_pruner(ctx: RoleContext) -> None:
    cfg = ctx.config.pruning
    strategy = configured_strategy(cfg, ctx.config.family)
    while True:
        _, msg = ctx.recv("target")
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
        ratio = cfg.applied_ratio
        with span("prune", item=msg.item_id, strategy=cfg.strategy, tokens=layout.num_tokens):
            if ratio == 0.0:
                keep = torch.arange(layout.num_tokens)
            else:
                keep = strategy.select(signals, layout, ratio, cfg.seed + msg.seed)
        keep = keep.long()
        check_keep(keep, layout, ratio)
        with span("send", item=msg.item_id, what="keep"):
            # With the target's token grid, which the draft checks its own against.
            grid = torch.tensor(layout.grid, dtype=torch.long)
            ctx.tensors.send(ctx.ranks["draft"], [keep, grid], tag=f"keep:{msg.item_id}").wait()
        ctx.send("target", KeepIndices(msg.item_id, int(keep.numel())))
        if ctx.out is not None:
            append_kept(ctx.out, KeptRecord(msg.item_id, cfg.strategy, ratio, keep, layout))


def check_keep(keep: torch.Tensor, layout: VideoTokenLayout, ratio: float) -> None:
    """Raises RoleFailure unless `keep` is sorted, unique, in range, and holds every non-prunable token
    plus exactly `layout.budget(ratio)` prunable ones (the contract of pipeline/pruning/select.py)."""
    n = layout.num_tokens
    problem = None
    if keep.dim() != 1 or keep.dtype != torch.long:
        problem = f"shape {tuple(keep.shape)} dtype {keep.dtype}"
    elif keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= n):
        problem = f"indices outside [0, {n})"
    elif keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
        problem = "not sorted and unique"
    else:
        prunable = layout.prunable.cpu()[keep]
        if int((~prunable).sum()) != n - layout.num_prunable:
            problem = "non-prunable tokens missing"
        elif int(prunable.sum()) != layout.budget(ratio):
            problem = f"{int(prunable.sum())} prunable tokens kept, budget {layout.budget(ratio)}"
    if problem is not None:
        raise RoleFailure(f"pruner: kept indices break the contract: {problem}")


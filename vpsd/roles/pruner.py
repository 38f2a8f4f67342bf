"""The pruner role: turns the target's signals into kept video-token indices for the draft.

Loop: JobStart (from the target) -> signals announced by the target -> strategy.select -> kept
indices sent to the draft (with the target's token grid, which the draft checks) -> a KeepIndices report (the
count) to the target. The target streams the
signals from inside its prefill (right after layer L), so this runs while the target is still
prefilling and the draft's pruned prefill overlaps the target's full one (synchronous draft-target
prefill). Before anything leaves, the kept set is checked against the contract of
pipeline/pruning/select.py (sorted, unique, every non-prunable token plus exactly the budget). When the
run has an output directory (ctx.out) each item's kept set and layout are appended to
RUN_DIR/kept.jsonl (reports/kept_log.py) for `vpsd bias`.
"""

from __future__ import annotations

import time

import torch

from vpsd.activity import doing
from vpsd.engine.keep import configured_strategy
from vpsd.reports.kept_log import KeptRecord, append_kept
from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.seeds import pruning_seed
from vpsd.config import RunConfig
from vpsd.pipeline.messages import ItemDone, JobStart, KeepIndices, Message, Ready, Shutdown, TensorAnnounce
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.link import Link, RankLink
from vpsd.roles.signals_wire import unpack
from vpsd.tracing import get_logger, span

log = get_logger()


class PrunerWorker:
    """The pruner's state and events: a JobStart names the item whose signals come next (`on_job`); the signals
    become kept indices for the draft and a KeepIndices report for the target (`on_signals`). Items are served
    in the order the target starts them, one or many in flight alike."""

    def __init__(self, link: Link, cfg: RunConfig, out=None) -> None:
        self.link, self.cfg, self.out = link, cfg.pruning, out
        self.strategy = configured_strategy(cfg.pruning, cfg.family)
        self.job: JobStart | None = None  # the item whose signals come next
        self.stopped = False

    def handle(self, src: str, msg: Message) -> None:
        if isinstance(msg, Shutdown):
            self.stopped = True
        elif isinstance(msg, JobStart):
            self.on_job(msg)
        elif isinstance(msg, TensorAnnounce) and self.job is not None:
            self.on_signals(msg)
        elif isinstance(msg, ItemDone):
            if self.job is not None and msg.item_id == self.job.item_id:
                self.job = None  # the target gave the item up before sending its signals
        else:
            raise RoleFailure(f"pruner: unexpected {type(msg).__name__} from {src}")

    def on_job(self, job: JobStart) -> None:
        self.job = job

    def on_signals(self, announce: TensorAnnounce) -> None:
        job, self.job = self.job, None
        tensors = self.link.recv_tensors(announce)
        signals, layout = unpack(announce.names, tensors)
        cfg = self.cfg
        ratio = cfg.applied_ratio
        with doing("prune", job.item_id, layout.num_tokens), \
                span("prune", item=job.item_id, strategy=cfg.strategy, tokens=layout.num_tokens):
            if ratio == 0.0:
                keep = torch.arange(layout.num_tokens)
            else:
                keep = self.strategy.select(signals, layout, ratio, pruning_seed(cfg.seed, job.seed))
        keep = keep.long()
        check_keep(keep, layout, ratio)
        with span("send", item=job.item_id, what="keep"):
            # With the target's token grid, which the draft checks its own against.
            grid = torch.tensor(layout.grid, dtype=torch.long)
            self.link.send_tensors("draft", [keep, grid], tag="keep", item_id=job.item_id).wait()
        self.link.send("target", KeepIndices(job.item_id, int(keep.numel())))
        if self.out is not None:
            append_kept(self.out, KeptRecord(job.item_id, cfg.strategy, ratio, keep, layout))


def pruner_role(link: Link, cfg: RunConfig, out, started: float) -> None:
    """The pruner role over any carrier (its rank's, or a thread's): Ready, then the target's messages until its
    Shutdown."""
    worker = PrunerWorker(link, cfg, out)
    link.send("target", Ready("pruner", link.rank, time.monotonic() - started))
    while not worker.stopped:
        worker.handle(*link.recv("target"))


def run_pruner(ctx: RoleContext) -> None:
    """The pruner rank: the role over the rank's transport."""
    pruner_role(RankLink(ctx), ctx.config, ctx.out, ctx.started)


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


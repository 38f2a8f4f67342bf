"""The target role: the single source of truth. Full prefill, verification, what is committed.

Per item: read the video, run the vision tower, send the pruner its signals (before the prefill,
so pruning and the draft's prefill overlap the target's own prefill), prefill, then verify draft
chunks until the TargetMachine is done. Serial methods (`ar`, `sd`, `specvlm`) run here alone,
through the reference decoders, so every method is measured through the same launcher.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vpsd.decoders.ar import decode_ar
from vpsd.decoders.keep import keep_policy_for
from vpsd.decoders.result import DecodeResult
from vpsd.decoders.sd import decode_sd
from vpsd.models.base import VideoLMAdapter
from vpsd.models.signals import prefill_for_strategy
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.messages import DraftChunk, ItemDone, JobStart, TensorAnnounce, VerifyResult
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.pipeline.state_machine import Drop, TargetMachine
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.verification import verify_chunk
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.signals_wire import pack
from vpsd.tracing import get_logger, mark, span

log = get_logger()


@dataclass
class WorkItem:
    """One manifest item as the target needs it (the launcher builds these, video already read)."""

    id: str
    prompt: str
    max_new_tokens: int
    frames: np.ndarray  # (T, H, W, 3) uint8, read, scaled and fitted to the context by the launcher
    # How the draft reads the same frames, and the next item's so it can read that one ahead
    # (vpsd.video.item.FrameRequest.to_wire; see vpsd.video.prefetch).
    video: dict = field(default_factory=dict)
    next_video: dict | None = None
    extra: dict = field(default_factory=dict)


def decode_item(ctx: RoleContext, target: VideoLMAdapter, draft: VideoLMAdapter | None, item: WorkItem) -> DecodeResult:
    """Decodes one item with the run's method."""
    cfg = ctx.config
    dec = cfg.decoding.__class__(**{**cfg.decoding.__dict__, "max_new_tokens": item.max_new_tokens})
    frames = item.frames
    if not ctx.method.parallel:
        with span("item", item=item.id, method=ctx.method.name):
            if not ctx.method.uses_draft:
                return decode_ar(target, frames, item.prompt, dec)
            return decode_sd(target, draft or target, frames, item.prompt, dec, keep_policy_for(cfg.pruning), cfg.pruning)
    return _decode_parallel(ctx, target, frames, item, dec)


def _decode_parallel(ctx: RoleContext, target: VideoLMAdapter, frames, item: WorkItem, dec) -> DecodeResult:
    t0 = time.perf_counter()
    seed = int(dec.seed)
    job = JobStart(
        job_id=ctx.extra.get("job_id", ""),
        item_id=item.id,
        seed=seed,
        max_new_tokens=item.max_new_tokens,
        gamma=dec.gamma,
        mode="optimistic",
        extra={"video": item.video, "next_video": item.next_video, "prompt": item.prompt},
    )
    ctx.send("draft", job)
    ctx.send("pruner", job)
    with span("item", item=item.id, method=ctx.method.name):
        with span("vision", item=item.id):
            emb = target.embed(target.prepare(frames, item.prompt))
        strategy = STRATEGIES[ctx.config.pruning.strategy]
        signals = {"visual_embeds": emb.visual_embeds.float()} if strategy.needs_visual_embeds else {}
        # Signals measured by the prefill itself (attention, hidden states) go out after it; the
        # others before it, so pruning and the draft's prefill overlap the target's prefill.
        needs_prefill = strategy.needs_attention or strategy.needs_hidden_states
        if needs_prefill:
            with span("prefill", item=item.id, tokens=emb.seq_len):
                pre = prefill_for_strategy(target, emb, ctx.config.pruning)
            signals.update(pre.signals.as_tensors() if pre.signals is not None else {})
            pre.signals = None
        tag, tensors = pack(signals, emb.layout)
        with span("send", item=item.id, what="signals"):
            ctx.tensors.send(ctx.ranks["pruner"], tensors, tag=tag).wait()
        if not needs_prefill:
            with span("prefill", item=item.id, tokens=emb.seq_len):
                pre = target.prefill(emb)
        t1 = time.perf_counter()
        result = _verify_loop(ctx, target, pre, item, dec)
    result.prefill_s = t1 - t0
    result.decode_s = time.perf_counter() - t1
    result.num_video_tokens = emb.layout.num_tokens
    return result


def _recv_chunk(ctx: RoleContext) -> tuple[DraftChunk, torch.Tensor | None]:
    """Next draft chunk with its probabilities (tensors of stale chunks are received too: they are on the wire)."""
    while True:
        with span("recv_wait", item=ctx.item_id):
            _, msg = ctx.recv("draft")
        if isinstance(msg, DraftChunk):
            q = None
            if msg.has_probs:
                _, announce = ctx.recv("draft")
                if not isinstance(announce, TensorAnnounce):
                    raise RoleFailure(f"target: chunk announced probabilities, got {type(announce).__name__}")
                q = ctx.tensors.recv_announced(announce)[0]
            return msg, q
        log.warning("unexpected_message", type=type(msg).__name__, item=ctx.item_id)


def _verify_loop(ctx: RoleContext, target: VideoLMAdapter, pre, item: WorkItem, dec) -> DecodeResult:
    machine = TargetMachine(max_new_tokens=item.max_new_tokens, eos_token_ids=frozenset(target.eos_token_ids))
    cursor = CacheCursor(pre.state.length)
    kept_row = pre.logits  # the target's row for position len(committed)
    gen = torch.Generator().manual_seed(int(dec.seed))
    stats = AcceptanceStats()
    while not machine.done:
        chunk, q = _recv_chunk(ctx)
        if chunk.item_id != item.id:
            continue  # the tail of an earlier item
        decision = machine.on_chunk(chunk.epoch, chunk.start, len(chunk.token_ids))
        if isinstance(decision, Drop):
            log.debug("chunk_dropped", item=item.id, reason=decision.reason, epoch=chunk.epoch, start=chunk.start)
            continue
        tokens = list(chunk.token_ids)
        with span("verify", item=item.id, round=stats.rounds, start=chunk.start, tokens=len(tokens), epoch=machine.epoch):
            if decision.use_kept_row:
                rows = torch.cat([kept_row[None], target.step(pre.state, torch.tensor(tokens))])
                cursor.feed(tokens)
            else:
                length, pending = cursor.sync(machine.committed)
                target.rollback(pre.state, length)
                rows = target.step(pre.state, torch.tensor(pending + tokens))[len(pending) - 1 :]
                cursor.feed(pending + tokens)
            v = verify_chunk(tokens, q, rows, dec.temperature, gen)
            verdict = machine.on_verified(tokens, v.num_accepted, v.next_token)
        if not verdict.rollback:
            kept_row = rows[-1]
        stats.record(v.num_accepted, v.num_drafted)
        if verdict.rollback:
            stats.rollbacks += 1
            mark("rollback", item=item.id, epoch=verdict.epoch, committed=verdict.committed_len)
        ctx.send(
            "draft",
            VerifyResult(item.id, verdict.epoch, verdict.start, verdict.num_accepted, verdict.next_token,
                         verdict.committed_len, verdict.mode.value, verdict.rollback),
        )
    return DecodeResult(token_ids=machine.output(), stats=stats)


def finish_item(ctx: RoleContext, item_id: str, token_ids: list[int], error: dict | None) -> None:
    """Tells the other roles the item is over (they drop whatever of it is still in flight)."""
    if ctx.method.parallel:
        done = ItemDone(item_id, token_ids, error)
        ctx.send("draft", done)
        ctx.send("pruner", done)

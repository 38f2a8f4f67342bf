"""The target role: the single source of truth. Full prefill, verification, what is committed.

Per item: read the video, run the vision tower, prefill while streaming the pruner its signals (before
the prefill, or from inside it once layer L has run, so pruning and the draft's prefill overlap the
target's own prefill), then verify draft chunks until the TargetMachine is done, and take the pruner's
KeepIndices report (num_kept for the results). Serial methods (`ar`, `sd`, `specvlm`) run here alone,
through the reference decoders, so every method is measured through the same launcher.
"""

from __future__ import annotations

import time

import torch

from vpsd.decoders.result import DecodeResult
from vpsd.decoders.serial import decode_serial
from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.messages import DraftChunk, Error, ItemDone, KeepIndices, TensorAnnounce
from vpsd.pipeline.sampling import probs_from_logits
from vpsd.pipeline.state_machine import Drop, TargetMachine
from vpsd.reports.kept_log import KeptRecord, append_kept
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.verification import verify_chunk, window_rows
from vpsd.pipeline.window import WindowController
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.link import RankLink
from vpsd.roles.starting import WorkItem, job_start, prefill_streaming_signals
from vpsd.tracing import get_logger, mark, span
from vpsd.models.timing import settled_clock

log = get_logger()


def decode_item(ctx: RoleContext, target: VideoLMAdapter, draft: VideoLMAdapter | None, item: WorkItem) -> DecodeResult:
    """Decodes one item with the run's method."""
    cfg = ctx.config
    dec = cfg.decoding.__class__(**{**cfg.decoding.__dict__, "max_new_tokens": item.max_new_tokens})
    frames = item.frames
    if not ctx.method.parallel:
        with span("item", item=item.id, method=ctx.method.name):
            result = decode_serial(ctx.method, target, draft, frames, item.prompt, dec, cfg.pruning, item.frame_times)
        if ctx.method.uses_draft:
            result.gamma = float(dec.serial_gamma())
        if result.kept is not None and ctx.out is not None:
            # The pruner rank logs a parallel run's kept tokens; a serial run chose them here.
            append_kept(ctx.out, KeptRecord(item.id, cfg.pruning.strategy, cfg.pruning.applied_ratio,
                                                           result.kept, result.layout))
        return result
    return _decode_parallel(ctx, target, frames, item, dec)


def _decode_parallel(ctx: RoleContext, target: VideoLMAdapter, frames, item: WorkItem, dec) -> DecodeResult:
    t0 = time.perf_counter()
    seed = int(dec.seed)
    # One window for the whole job: what the last item measured is where the next one starts.
    if ctx.window is None:
        ctx.window = dec.window()
    window = ctx.window
    job = job_start(ctx.job_id, item, seed, window.gamma, target)
    ctx.send("draft", job)
    ctx.send("pruner", job)
    with span("item", item=item.id, method=ctx.method.name):
        with span("vision", item=item.id):
            emb = target.embed(target.prepare(frames, item.prompt, item.frame_times))
        pre = prefill_streaming_signals(RankLink(ctx), ctx.config.pruning, target, emb, item.id, ctx.timeout_s)
        t1 = time.perf_counter()
        result = _verify_loop(ctx, target, pre, item, dec, window)
        with span("recv_wait", item=item.id, what="keep_report"):
            result.num_kept = _recv_keep_report(ctx, item.id)
    result.prefill_s = t1 - t0
    result.decode_s = time.perf_counter() - t1
    result.num_video_tokens = emb.layout.num_tokens
    return result


def _recv_keep_report(ctx: RoleContext, item_id: str) -> int:
    """How many video tokens the pruner gave the draft for this item (its KeepIndices report)."""
    while True:
        _, msg = ctx.recv("pruner")
        if isinstance(msg, KeepIndices) and msg.item_id == item_id:
            return msg.num_kept
        # anything else is the report of an earlier item that failed after its signals went out


def _recv_chunk(ctx: RoleContext, limit_s: float | None = None) -> tuple[DraftChunk, torch.Tensor | None]:
    """Next draft chunk with its probabilities (tensors of stale chunks are received too: they are on the wire).
    `limit_s`: how long a live draft may send nothing (None: the idle limit)."""
    while True:
        with span("recv_wait", item=ctx.item_id):
            _, msg = ctx.recv("draft", timeout_s=limit_s)
        if isinstance(msg, DraftChunk):
            q = None
            if msg.has_probs:
                _, announce = ctx.recv("draft")
                if not isinstance(announce, TensorAnnounce):
                    raise RoleFailure(f"target: chunk announced probabilities, got {type(announce).__name__}")
                q = ctx.tensors.recv_announced(announce)[0]
            return msg, q
        if isinstance(msg, Error) and msg.item_id == ctx.item_id:
            raise ValueError(f"{msg.role} (rank {msg.rank}): {msg.message}")  # the item fails, the job goes on
        log.warning("unexpected_message", type=type(msg).__name__, item=ctx.item_id)


def _verify_loop(ctx: RoleContext, target: VideoLMAdapter, pre, item: WorkItem, dec, window: WindowController) -> DecodeResult:
    machine = TargetMachine(item.max_new_tokens, frozenset(target.eos_token_ids), item_id=item.id)
    cursor = CacheCursor(pre.state.length)
    kept_row = pre.logits  # the target's row for position len(committed)
    gen = torch.Generator().manual_seed(int(dec.seed))
    stats = AcceptanceStats()
    with_target_probs = verdicts_carry_target_probs(ctx.method.draft, ctx.config.tabed_settings, dec.temperature)
    windows: list[int] = []  # the window each round's chunk was drafted under
    first_chunk_wait = None  # prefill end -> first chunk that could be verified (HIPPO's synchronous prefill)
    t_loop = time.perf_counter()
    while not machine.done:
        # Before the first chunk the draft may still be reading the video and prefilling (the idle limit);
        # once it drafts, a step takes milliseconds, so a live draft silent for timeout_s has stalled: the
        # job ends naming it then, not after the hour-long idle limit.
        chunk, q = _recv_chunk(ctx, None if first_chunk_wait is None else ctx.timeout_s)
        if chunk.item_id != item.id:
            continue  # the tail of an earlier item
        decision = machine.on_chunk(chunk.epoch, chunk.start, len(chunk.token_ids))
        if isinstance(decision, Drop):
            log.debug("chunk_dropped", item=item.id, reason=decision.reason, epoch=chunk.epoch, start=chunk.start)
            continue
        if first_chunk_wait is None:
            first_chunk_wait = time.perf_counter() - t_loop
            mark("first_chunk", item=item.id, wait_s=first_chunk_wait)
        window.observe_draft_step(chunk.draft_step_s)
        windows.append(window.gamma)
        tokens = list(chunk.token_ids)
        with span("verify", item=item.id, round=stats.rounds, start=chunk.start, tokens=len(tokens), epoch=machine.epoch,
                  drafted=len(tokens), mode=machine.mode.value, gamma=window.gamma) as verify_fields:
            t_fwd = time.perf_counter()
            length, feed, first = cursor.verify_feed(machine.committed, tokens)
            if decision.use_kept_row != (first < 0):
                raise RoleFailure(f"target: the cache of item {item.id} disagrees with its committed tokens")
            target.rollback(pre.state, length)
            rows = window_rows(target.step(pre.state, torch.tensor(feed), rowwise=dec.exact_verify), first, kept_row)
            fed = len(feed)
            window.observe_verify(fed, settled_clock(target.device) - t_fwd)
            v = verify_chunk(tokens, q, rows, dec.temperature, gen)
            window.observe_round(v.num_accepted, v.num_drafted)
            before = len(machine.committed)
            verdict = machine.on_verified(tokens, v.num_accepted, v.next_token, window.pre_verify(), window.gamma)
            committed = verdict.committed_len - before
            verify_fields.update(accepted=v.num_accepted, committed=committed)  # for vpsd.reports.acceptance
        if not verdict.rollback:
            kept_row = rows[-1]
        stats.record(v.num_accepted, v.num_drafted, committed)
        if verdict.rollback:
            stats.rollbacks += 1
            mark("rollback", item=item.id, epoch=verdict.epoch, committed=verdict.committed_len)
        ctx.send("draft", verdict)
        if with_target_probs:  # TABED soft labels: p at the verified positions (pipeline/ensemble.py)
            _send_target_probs(ctx, probs_from_logits(rows[: v.num_accepted + int(not v.all_accepted)], dec.temperature))
    return DecodeResult(token_ids=machine.output(), stats=stats,
                        timings={"first_chunk_wait": first_chunk_wait or 0.0},
                        gamma=sum(windows) / len(windows) if windows else float(window.gamma))


def _send_target_probs(ctx: RoleContext, rows: torch.Tensor) -> None:
    """Sends without waiting: the draft may itself be blocked sending a chunk's q to us, so waiting here
    could deadlock; the draft receives these right after each verdict. Handles stay referenced until done."""
    ctx.pending_sends = [h for h in ctx.pending_sends if not h.is_completed()]
    ctx.pending_sends.append(ctx.tensors.send(ctx.ranks["draft"], [rows], tag="target_probs"))


def finish_item(ctx: RoleContext, item_id: str, token_ids: list[int], error: dict | None) -> None:
    """Tells the other roles the item is over (they drop whatever of it is still in flight)."""
    if ctx.method.parallel:
        done = ItemDone(item_id, token_ids, error)
        ctx.send("draft", done)
        ctx.send("pruner", done)

"""The draft role: pruned prefill, then drafting ahead of the target and obeying its verdicts.

Per item: JobStart (target) -> take the video (read ahead while the previous item was drafted, see
vpsd.video.prefetch), run the draft's vision tower -> kept indices (pruner)
-> pruned prefill -> loop: apply every verdict that has arrived (rollback at once: that is the
abort of conservative mode), send ready chunks, propose one more token if the DraftMachine allows,
else block for the next verdict. Stops at ItemDone.
What it drafts with (one pruned prefix, or TABED's ensemble of views) is a drafter (roles/drafters.py).
"""

from __future__ import annotations

import time

import torch

from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.messages import DraftChunk, Error, ItemDone, JobStart, Shutdown, TensorAnnounce, VerifyResult
from vpsd.pipeline.state_machine import DraftMachine, Mode
from vpsd.pipeline.stopping import done
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.drafters import SingleDrafter, TabedDrafter
from vpsd.roles.starting import job_prompt
from vpsd.tracing import get_logger, mark, span
from vpsd.video.errors import VideoError
from vpsd.video.prefetch import FramePrefetcher

log = get_logger()


def run_draft(ctx: RoleContext, draft: VideoLMAdapter) -> None:
    videos = FramePrefetcher()  # reads the next item's video while this one is drafted
    try:
        while True:
            _, msg = ctx.recv("target")
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, (ItemDone, VerifyResult, DraftChunk)):
                continue  # leftovers of a finished item
            if not isinstance(msg, JobStart):
                raise RoleFailure(f"draft: unexpected {type(msg).__name__} between items")
            ctx.item_id = msg.item_id
            _draft_item(ctx, draft, msg, videos)
    finally:
        videos.close()


def _wait_keep(ctx: RoleContext, item_id: str) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(kept indices, the target's token grid) from the pruner; None when the target gave the item up first."""
    while True:
        src, msg = ctx.recv(awaiting="pruner")  # the target may still say ItemDone; the pruner must not fall silent
        if isinstance(msg, TensorAnnounce) and msg.tag == f"keep:{item_id}":
            keep, grid = ctx.tensors.recv_announced(msg)
            return keep, tuple(int(v) for v in grid)
        if isinstance(msg, ItemDone) and msg.item_id == item_id:
            return None
        if isinstance(msg, Shutdown):
            raise RoleFailure("draft: shutdown while waiting for kept indices")


def _draft_item(ctx: RoleContext, draft: VideoLMAdapter, job: JobStart, videos: FramePrefetcher) -> None:
    cfg = ctx.config
    emb = None
    try:
        frames, times, _ = videos.take(job.video)  # the target's frames: same request, same cap
    except VideoError:
        frames = None  # the target read the same file and reports any error; wait for its ItemDone
    videos.ahead(job.next_video)  # read the next item's video while this one is drafted
    if frames is not None:
        with span("vision", item=job.item_id):
            emb = draft.embed(draft.prepare(frames, job_prompt(job), times))
    got = _wait_keep(ctx, job.item_id)
    if got is None or emb is None:
        _drain_until_done(ctx, job.item_id)
        return
    keep, target_grid = got
    try:
        emb.layout.check_same_grid(target_grid)  # the serial path's check (decoders/sd.py)
    except ValueError as e:
        # The target fails the item with this message and tells us (ItemDone); the job goes on.
        ctx.send("target", Error("draft", ctx.rank, job.item_id, str(e)))
        _drain_until_done(ctx, job.item_id)
        return
    method = ctx.method
    tabed = cfg.tabed_settings
    with span("prefill", item=job.item_id, kept=int(keep.numel()), draft=method.draft):
        if method.draft == "views":
            drafter = TabedDrafter(draft, emb, keep, tabed, job.gamma)
        else:
            drafter = SingleDrafter(draft, emb, keep)
    temperature = cfg.decoding.temperature
    with_target_probs = verdicts_carry_target_probs(method.draft, tabed, temperature)
    gen = torch.Generator().manual_seed(cfg.decoding.seed + job.seed + 1)
    dec = cfg.decoding
    machine = DraftMachine(gamma=job.gamma, lookahead=dec.lookahead_for(job.gamma), eager_when_idle=dec.eager_when_idle)
    step_s = 0.0  # running mean of one draft step (propose + forward): T_q for the target's window (Eq. 6)
    cursor = CacheCursor(drafter.length)
    eos = set(job.eos_token_ids)  # the target's: it decides where the output ends
    probs: dict[int, torch.Tensor] = {}  # position -> q row, only when sampling

    def stopped() -> bool:
        return done(machine.sequence, job.max_new_tokens, eos)

    def send_ready() -> None:
        while (chunk := machine.ready_chunk(flush=stopped())) is not None:
            start, tokens = chunk
            has_probs = temperature > 0
            with span("send", item=job.item_id, what="chunk", start=start, tokens=len(tokens), epoch=machine.epoch):
                ctx.send("target", DraftChunk(job.item_id, machine.epoch, start, tokens, has_probs, step_s))
            if has_probs:
                q = torch.stack([probs[start + i] for i in range(len(tokens))])
                ctx.tensors.send(ctx.ranks["target"], [q], tag="draft_probs", epoch=machine.epoch).wait()

    while True:
        # 1. Verdicts first: a rollback must abort drafting at once.
        while ctx.ctrl.poll(0.0, src=ctx.ranks["target"]):
            _, msg = ctx.recv("target")
            if isinstance(msg, ItemDone) and msg.item_id == job.item_id:
                if isinstance(drafter, TabedDrafter):  # w* of every block: how the views were weighed
                    log.info("tabed_weights", item=job.item_id, views=list(drafter.cfg.views), blocks=drafter.weight_log)
                return
            if isinstance(msg, Shutdown):
                raise RoleFailure("draft: shutdown in the middle of an item")
            if isinstance(msg, VerifyResult) and msg.item_id == job.item_id:
                target_probs = _recv_target_probs(ctx) if with_target_probs else None
                if msg.epoch >= machine.epoch:  # verified positions: the accepted ones and the rejected one
                    labels = machine.sequence[msg.start : msg.start + msg.num_accepted]
                    drafter.observe(msg.start, labels + ([msg.next_token] if msg.rollback else []), target_probs)
                if msg.gamma and msg.gamma != machine.gamma:  # the target re-matched the window (gamma auto)
                    machine.set_gamma(msg.gamma, dec.lookahead_for(msg.gamma))
                    if isinstance(drafter, TabedDrafter):  # its drafting blocks are windows too
                        drafter.gamma = msg.gamma
                if machine.on_verdict(msg.epoch, msg.committed_len, msg.next_token, msg.rollback, Mode(msg.mode)):
                    mark("rollback", item=job.item_id, epoch=msg.epoch, committed=msg.committed_len)
                    drafter.forget_from(msg.committed_len - 1)
                    with span("rollback", item=job.item_id, epoch=msg.epoch):
                        length, pending = cursor.sync(machine.sequence)
                        drafter.rollback(length)
                        drafter.feed(pending)
                        cursor.feed(pending)
        # 2. Everything ready goes out.
        send_ready()
        # 3. Draft one more token, or wait for the target.
        if machine.may_draft() and not stopped():
            pos = len(machine.sequence)
            t_step = time.perf_counter()
            with span("draft_step", item=job.item_id, pos=pos, epoch=machine.epoch):
                token, q = drafter.propose(pos, temperature, gen)
                if q is not None:
                    probs[pos] = q
                machine.record_proposal(token)
                # The token is known before the forward that feeds it: send the chunk it completes now, so the
                # target verifies while we feed (the feed only prepares the NEXT proposal; sending after it
                # kept a waiting target idle one more draft step per round).
                send_ready()
                drafter.feed([token])
                cursor.feed([token])
            dt = time.perf_counter() - t_step
            step_s = dt if step_s == 0.0 else 0.8 * step_s + 0.2 * dt
        else:
            with span("recv_wait", item=job.item_id):
                ctx.wait("target")  # RoleFailure naming the target if it falls silent


def _recv_target_probs(ctx: RoleContext) -> torch.Tensor:
    """The target's p rows that follow a VerifyResult (TABED's soft labels, see pipeline/ensemble.py)."""
    _, announce = ctx.recv("target")
    if not isinstance(announce, TensorAnnounce) or announce.tag != "target_probs":
        raise RoleFailure(f"draft: a verdict announced the target's probabilities, got {type(announce).__name__}")
    with span("recv", item=ctx.item_id, what="target_probs", shape=announce.shapes[0]):
        return ctx.tensors.recv_announced(announce)[0]


def _drain_until_done(ctx: RoleContext, item_id: str) -> None:
    while True:
        _, msg = ctx.recv("target")
        if isinstance(msg, ItemDone) and msg.item_id == item_id:
            return

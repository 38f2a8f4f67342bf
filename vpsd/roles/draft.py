"""The draft role: pruned prefill, then drafting ahead of the target and obeying its verdicts; one item in flight
or many, every row in one forward per step.

The draft rank drafts while the target rank verifies (roles/target.py), so the two overlap; with `--batch N` and
`batching.pipelined: true` each of their forwards carries every item in flight. Per item: a JobStart from the
target, its frames (sent by the target right behind it, `video.share_frames`: roles/frames_wire.py; else the video
read by the same request, read ahead while the previous items are drafted), the draft's vision tower, the kept
indices from the pruner, the pruned prefill through the method's proposer (engine/proposers.py: a row of the
draft model's batched cache, or TABED's ensemble of views), then chunks out and verdicts in, each
applied by the item's own `DraftMachine` (optimistic and conservative modes, epochs, rollback), until the
target's ItemDone. What is batched is only the forward:

  step():  1. every row that may draft proposes its next token from its last logits row (greedy, or sampled
              by its own sampler, seeded as its batch-1 run seeds it) and sends what is ready;
           2. ONE forward feeds every row what its cache lacks: the token it just proposed, or after a
              rollback the target's token (`CacheCursor.sync`, a per-row rollback in the batch);
           3. each row's last logits row is what its next proposal reads.

Proposing before the forward is the batch-1 order too: a chunk leaves the moment its last token is known,
and the forward only prepares the next proposal. A row that has drafted `lookahead` tokens past what the
target confirmed, or reached its item's end, waits (no forward) for its verdicts; the step runs the rows that
can move. Events arrive through `handle` (one method per message kind) and `step` is the work between them:
the role's loop (`serve_draft`) and the in-process tests drive the same worker. A batch of one row is stepped by
the batch-1 forward itself (models/batch.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from vpsd.activity import doing
from vpsd.config import RunConfig
from vpsd.engine.drafters.chain import feed_rows, lacking
from vpsd.engine.prefix_cache import draft_embed, draft_prefill, reuse_for
from vpsd.engine.proposers import ModelProposer, TabedProposer
from vpsd.models.base import SequenceEmbeddings, VideoLMAdapter
from vpsd.models.timing import Stopwatch
from vpsd.pipeline.cost import running_mean
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.messages import (DraftChunk, Error, ItemDone, JobStart, Message, Ready, Shutdown, TensorAnnounce,
                                   VerifyResult)
from vpsd.pipeline.sampling import ItemSampler
from vpsd.pipeline.seeds import draft_sampler
from vpsd.pipeline.state_machine import DraftMachine, Mode
from vpsd.pipeline.stopping import done
from vpsd.roles import frames_wire
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.roles.link import Link, RankLink, recv_announced
from vpsd.roles.starting import job_prompt
from vpsd.tracing import get_logger, mark, span
from vpsd.video.errors import VideoError
from vpsd.video.frame_cache import cache_for
from vpsd.video.prefetch import FramePrefetcher, frame_pool

log = get_logger()


class FrameSource(Protocol):
    """Frames by the target's wire request (vpsd.video.prefetch.FramePrefetcher on a rank)."""

    def take(self, wire: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]: ...

    def ahead(self, wire: dict[str, Any] | None) -> None: ...


@dataclass
class DraftRow:
    """One item being drafted for: its machine, its cache's bookkeeping and its sampler."""

    job: JobStart
    machine: DraftMachine
    cursor: CacheCursor
    sampler: ItemSampler
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> q, under the rejection rule

    def stopped(self) -> bool:
        return done(self.machine.sequence, self.job.max_new_tokens, self.job.eos_token_ids)


class DraftWorker:
    """The draft rank's state over a batch (see the module docstring)."""

    def __init__(self, link: Link, draft: VideoLMAdapter, cfg: RunConfig, videos: FrameSource,
                 drafts_from: str = "pruned_input") -> None:
        self.link, self.draft, self.cfg, self.videos = link, draft, cfg, videos
        # What drafts (Method.draft): the draft model fed the kept video, or TABED's ensemble of views; and, when
        # TABED's distance needs them, the target's p rows follow every verdict (pipeline/ensemble.py).
        self.proposer = TabedProposer(draft, cfg.tabed_settings) if drafts_from == "views" else ModelProposer(draft)
        self.kind = drafts_from
        self.target_probs = verdicts_carry_target_probs(drafts_from, cfg.tabed_settings, cfg.decoding.temperature)
        self.rows: dict[str, DraftRow] = {}
        self.waiting: dict[str, tuple[JobStart, SequenceEmbeddings | None]] = {}  # vision done, kept set not yet
        # Kept sets that arrived before their JobStart: the pruner's messages and the target's travel on separate
        # connections, ordered each on its own only, so the pruner's answer can overtake the target's JobStart.
        self.early: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.finished: set[str] = set()  # items ended by the target: a kept set arriving now is dropped
        self.step_s = 0.0  # running mean of one batched step: T_q(B), sent with every chunk (pipeline/cost.py)
        self._watch: Stopwatch | None = None  # the last step's, until read
        self.steps = 0
        self.stopped = False
        # One video, many questions (engine/prefix_cache.py): for a video other items ask about, the draft keeps
        # its vision features, and where it is shown all of the video (pearl, a self-draft: its input up to the
        # video's end does not depend on the question) its video prefix's KV too; a pruned draft prefills what
        # the pruner keeps for each question. None: reuse off.
        budget = cfg.reuse.draft_budget_bytes
        self.reuse = reuse_for(draft, budget) if budget > 0 else None

    # ---- events -------------------------------------------------------------------------------------

    def handle(self, src: str, msg: Message) -> None:
        if isinstance(msg, Shutdown):  # the job is over: answer, so the target knows nothing more is coming
            self.stopped = True
            self.link.send("target", Shutdown("draft: done"))
        elif isinstance(msg, JobStart):
            self.on_job(msg)
        elif isinstance(msg, TensorAnnounce) and msg.tag == "keep":
            self.on_keep(msg)
        elif isinstance(msg, VerifyResult):
            self.on_verdict(msg)
        elif isinstance(msg, ItemDone):
            self.on_item_done(msg)
        elif isinstance(msg, TensorAnnounce):
            self.link.recv_tensors(msg)  # nothing else is sent to a batched draft; take it off the wire
            log.warning("unexpected_tensors", tag=msg.tag)
        else:
            log.warning("unexpected_message", type=type(msg).__name__, src=src)

    def on_job(self, job: JobStart) -> None:
        """A new item: take its frames (the target's, sent behind the JobStart; else read by the same request the
        target read) and run the vision tower now, so the pruned prefill can start the moment the kept indices
        arrive."""
        emb = None
        sent = frames_wire.follow(job)
        try:
            frames, times, timings = self._received(job) if sent else self.videos.take(job.video)
            log.info("draft_frames", item=job.item_id, source="target" if sent else "file", frames=len(frames),
                     **{k: round(v, 6) for k, v in timings.items()})
        except VideoError as e:
            # The target read the same file; if it could, the draft cannot draft this item: the target fails
            # it with this message (and its ItemDone ends it here).
            self.link.send("target", Error("draft", self.link.rank, job.item_id, f"draft could not read the video: {e}"))
            frames = None
        if not sent:  # the next item's frames will come with it otherwise
            self.videos.ahead(job.next_video)
        if frames is not None:
            with span("vision", item=job.item_id):
                inputs = self.draft.prepare(frames, job_prompt(job), times)
                emb = draft_embed(self.draft, inputs, self.reuse if job.reuse else None, job.item_id)
        self.waiting[job.item_id] = (job, emb)
        if job.item_id in self.early:
            self._join(job.item_id, *self.early.pop(job.item_id))

    def _prefill(self, item_id: str, emb: SequenceEmbeddings, keep: torch.Tensor, gamma: int) -> int:
        """The draft's prefill of the kept video tokens, a row of the batch; its cache length. Shown all of the
        video, a draft model reuses its kept prefix (engine/prefix_cache.py draft_prefill); pruned, it prefills."""
        model_row = isinstance(self.proposer, ModelProposer)  # TABED's views prefill their own rows
        pre = draft_prefill(self.draft, emb, keep, whole_prefix=model_row)
        return self.proposer.join(item_id, pre) if pre is not None else self.proposer.admit(item_id, emb, keep, gamma)

    def _received(self, job: JobStart) -> tuple[np.ndarray, np.ndarray | None, dict[str, float]]:
        """The frames the target sent right behind the JobStart: nothing read here (video_read_s 0), the receive
        is the item's video wait."""
        t0 = time.perf_counter()
        with span("frames_received", item=job.item_id) as traced:
            _, announce = self.link.recv("target")
            if not isinstance(announce, TensorAnnounce) or announce.tag != frames_wire.TAG:
                got = announce.tag if isinstance(announce, TensorAnnounce) else type(announce).__name__
                raise RoleFailure(f"draft: expected the target's frames of item {job.item_id}, got {got}")
            frames, times = frames_wire.unpack(announce.names, self.link.recv_tensors(announce))
            traced.update(frames=len(frames), mib=round(frames.nbytes / 2**20, 3))
        return frames, times, {"video_read_s": 0.0, "video_wait_s": time.perf_counter() - t0}

    def on_keep(self, announce: TensorAnnounce) -> None:
        """The pruner's kept indices: the item's pruned prefill becomes a row of the batch."""
        keep, grid = self.link.recv_tensors(announce)
        item_id = announce.item_id
        if item_id in self.finished:
            return
        if item_id not in self.waiting:
            self.early[item_id] = (keep, grid)  # its JobStart is still on the wire
            return
        self._join(item_id, keep, grid)

    def _join(self, item_id: str, keep: torch.Tensor, grid: torch.Tensor) -> None:
        job, emb = self.waiting.pop(item_id)
        if emb is None:
            return  # no video here (the target was told)
        try:
            emb.layout.check_same_grid(tuple(int(v) for v in grid))  # the serial path's check (decoders/sd.py)
        except ValueError as e:
            self.link.send("target", Error("draft", self.link.rank, item_id, str(e)))
            return
        dec = self.cfg.decoding
        machine = DraftMachine(gamma=job.gamma, lookahead=dec.lookahead_for(job.gamma), eager_when_idle=dec.eager_when_idle)
        sampler = draft_sampler(dec.rule, job.seed)  # the one rule, wherever the draft runs
        with doing("prefill", item_id, int(keep.numel())), span("prefill", item=item_id, kept=int(keep.numel()),
                                                                draft=self.kind):
            length = self._prefill(item_id, emb, keep, job.gamma)
        self.rows[item_id] = DraftRow(job, machine, CacheCursor(length), sampler)

    def on_verdict(self, v: VerifyResult) -> None:
        # TABED's p rows are on the wire after every verdict (pipeline/ensemble.py)
        target_probs = recv_announced(self.link, "target", "target_probs")[0] if self.target_probs else None
        row = self.rows.get(v.item_id)
        if row is None:
            return  # the tail of an item that has left
        machine = row.machine
        dec = self.cfg.decoding
        if v.epoch >= machine.epoch:  # the verified positions and their labels (TABED weighs its views by them)
            labels = machine.sequence[v.start : v.start + v.num_accepted]
            self.proposer.observe(v.item_id, v.start, labels + ([v.next_token] if v.rollback else []), target_probs)
        if v.gamma and v.gamma != machine.gamma:  # the target re-matched the window (gamma auto)
            machine.set_gamma(v.gamma, dec.lookahead_for(v.gamma))
            self.proposer.set_gamma(v.item_id, v.gamma)
        if machine.on_verdict(v.epoch, v.committed_len, v.next_token, v.rollback, Mode(v.mode)):
            mark("rollback", item=v.item_id, epoch=v.epoch, committed=v.committed_len)
            length, _ = row.cursor.sync(machine.sequence)  # the next step feeds what the cache lacks
            self.proposer.forget_from(v.item_id, v.committed_len - 1)
            self.proposer.rollback(v.item_id, length)

    def on_item_done(self, msg: ItemDone) -> None:
        self.waiting.pop(msg.item_id, None)
        self.early.pop(msg.item_id, None)
        self.finished.add(msg.item_id)
        if self.rows.pop(msg.item_id, None) is not None:
            weights = self.proposer.leave(msg.item_id)
            if weights is not None:  # w* of every block: how TABED's views were weighed
                log.info("tabed_weights", item=msg.item_id, views=list(self.cfg.tabed_settings.views), blocks=weights)

    # ---- work ---------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Proposes for every row that can, sends what is ready, and runs one batched forward for every row
        whose cache lacks tokens of its sequence. False when no row could move (wait for a message)."""
        proposed = 0
        self._time_last_step()  # the proposals below read its logits: waiting for it here costs nothing more
        for item_id, row in self.rows.items():
            if self._can_propose(item_id, row):
                pos = len(row.machine.sequence)
                token, q = self.proposer.propose(item_id, pos, row.sampler)
                if q is not None:
                    row.probs[pos] = q
                row.machine.record_proposal(token)
                proposed += 1
            self._send_ready(item_id, row)
        # A finished row's last proposal is never fed (as sd.draft_chunk).
        sequences = {item_id: row.machine.sequence for item_id, row in self.rows.items() if not row.stopped()}
        cursors = {item_id: self.rows[item_id].cursor for item_id in sequences}
        feed = lacking(self.proposer, cursors, sequences)
        if not feed:
            return proposed > 0
        rows = sum(len(t) for t in feed.values())
        # on a GPU the span times the launch; the watch the forward
        with doing("draft", next(iter(feed)), rows), span("draft_step", items=list(feed), rows=rows):
            self._watch = feed_rows(self.proposer, cursors, feed)
        self.steps += 1
        return True

    def _time_last_step(self) -> None:
        """The last forward's time into `step_s`, read once its proposals were (no wait on a GPU)."""
        if self._watch is not None:
            self.step_s = running_mean(self.step_s or None, self._watch.seconds)  # 0.0: nothing measured yet
            self._watch = None

    def _can_propose(self, item_id: str, row: DraftRow) -> bool:
        return (self.proposer.ready(item_id) and len(row.cursor.fed) == len(row.machine.sequence)
                and row.machine.may_draft() and not row.stopped())

    def _send_ready(self, item_id: str, row: DraftRow) -> None:
        machine = row.machine
        while (chunk := machine.ready_chunk(flush=row.stopped())) is not None:
            start, tokens = chunk
            has_probs = self.cfg.decoding.rule.needs_draft_probs
            with span("send", item=item_id, what="chunk", start=start, tokens=len(tokens), epoch=machine.epoch):
                self.link.send("target", DraftChunk(item_id, machine.epoch, start, tokens, has_probs, self.step_s))
            if has_probs:
                q = torch.stack([row.probs.pop(start + i) for i in range(len(tokens))])
                self.link.send_tensors("target", [q], tag="draft_probs", epoch=machine.epoch).wait()


def serve_draft(link: Link, worker: DraftWorker) -> None:
    """The draft rank's loop: every message that has arrived is handled (verdicts first: a rollback must abort
    drafting at once), then one step; with nothing to do, wait for the target or the pruner."""
    while not worker.stopped:
        while link.poll():
            worker.handle(*link.recv())
            if worker.stopped:
                return
        if not worker.step():
            with span("recv_wait"):
                link.wait()


def draft_role(link: Link, draft: VideoLMAdapter, cfg: RunConfig, drafts_from: str, started: float,
               videos: FrameSource | None = None) -> None:
    """The draft role over any carrier (its rank's, or a thread's: launch/in_process.py): Ready (the model is
    loaded), then the worker's loop until the target's Shutdown; videos read ahead from their files unless
    `videos` hands them over (frames already in memory)."""
    own = videos is None
    draft.pixel_memo.budget = cfg.reuse.frames_bytes  # a video's prepared pixels, for its next question
    # Its own readers (started only if a video is read here: not while the target sends the frames), keeping a
    # video's frames for its next question as the target's do (video/frame_cache.py; empty unless it reads)
    videos = FramePrefetcher(frame_pool(cfg.video, cfg.cpu_affinity, name="draft_reader",
                                        cache=cache_for(draft, cfg.reuse.frames_bytes))) if own else videos
    try:
        link.send("target", Ready("draft", link.rank, time.monotonic() - started))
        serve_draft(link, DraftWorker(link, draft, cfg, videos, drafts_from=drafts_from))
    finally:
        if own:
            videos.close()
        if draft.captured is not None:  # its one-time cost, which the target waited through in part (bench)
            # `checked`: replays checked against their trace; `why`: what sent a shape back to the trace (a failed
            # recording, or a replay that differed: models/captured.py, "check")
            log.info("captured_steps", capture_s=round(draft.captured.capture_s, 3),
                     graphs=len(draft.captured._graphs), unrecorded=len(draft.captured.unrecorded),
                     checked=draft.captured.checked, why=sorted(set(draft.captured.unrecorded.values()))[:4])


def run_draft(ctx: RoleContext, draft: VideoLMAdapter) -> None:
    """The draft rank: the role over the rank's transport."""
    draft_role(RankLink(ctx), draft, ctx.config, ctx.method.draft, ctx.started)

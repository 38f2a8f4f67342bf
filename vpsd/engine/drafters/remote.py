"""The drafter of a draft and a pruner that run beside the target, on their own ranks or threads: the target's side
of their protocol (roles/draft.py, roles/pruner.py), which draft while the target verifies.

Per request: a JobStart to both (before the target's vision tower, when the request is prefilled on the
engine's thread, so the draft reads the video and runs its tower while the target does), the target's full
prefill with the pruner's signals leaving from inside it once layer L has run (`prefill_streaming_signals`:
the pruning and the draft's pruned prefill overlap the rest of it, HIPPO's synchronous prefill), then chunks
in and verdicts out, and an ItemDone when the request leaves. A request prefilled on another thread, or under
`decoding.sync_prefill: false` (PEARL-video), holds its signals (`HeldSignals`) and sends them, with its JobStart,
when it joins. With `send_frames` (a draft rank, `video.share_frames`) the request's frames follow its JobStart on
the tensor channel (roles/frames_wire.py), so the draft does not decode the video again.

Chunks arrive whenever the draft sends them (`handle`); asked for windows, the drafter hands over the
first chunk of each request that its `TargetMachine` can verify now (a chunk from before a rollback, or not
starting at the committed length, is dropped). The verdict goes back the moment the window is committed,
with the window the draft drafts with from now on and, for TABED's distances, the target's rows. It speaks
through a `Link` (roles/link.py: the ranks' transport, a thread hub, or an in-memory hub in tests).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from vpsd.config import RunConfig
from vpsd.engine.drafters.protocol import Proposal
from vpsd.engine.pair_prefill import strategy_signal_layers
from vpsd.engine.request import Request
from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.pipeline.messages import DraftChunk, Error, ItemDone, KeepIndices, Message, Ready, Shutdown, VerifyResult
from vpsd.pipeline.sampling import probs_from_logits
from vpsd.roles.context import RoleFailure
from vpsd.roles import frames_wire
from vpsd.roles.link import Link, recv_announced
from vpsd.roles.starting import HeldSignals, job_start, prefill_streaming_signals
from vpsd.tracing import get_logger, mark, span

log = get_logger()


class RemoteDrafter:
    overlaps_verify = True
    tree = None

    def __init__(self, link: Link, target: VideoLMAdapter, cfg: RunConfig, job_id: str = "",
                 timeout_s: float = 60.0, target_probs: bool = False, send_frames: bool = False) -> None:
        """target_probs: TABED's soft labels, p at the verified positions, follow each verdict; send_frames: each
        request's frames follow its JobStart (module docstring)."""
        self.link, self.target, self.cfg, self.job_id, self.timeout_s = link, target, cfg, job_id, timeout_s
        self.target_probs, self.send_frames = target_probs, send_frames
        self.chunks: dict[str, deque] = {}  # request -> (DraftChunk, q) not yet verified, in arrival order
        self.errors: dict[str, str] = {}  # request -> why the draft cannot draft it
        self.num_kept: dict[str, int] = {}  # the pruner's reports
        self.pending_sends: list = []
        self._step: tuple[int, float] | None = None

    def await_peers(self, limit_s: float) -> None:
        """Before the first item: the draft's and the pruner's Ready (their models loaded), each waited for up to
        the start-up bound, so that no transfer of the job waits on a rank still loading."""
        took = {}
        for role in ("draft", "pruner"):
            _, msg = self.link.recv(role, limit_s=limit_s)
            if not isinstance(msg, Ready):
                raise RoleFailure(f"target: expected the {role}'s Ready before any item, got {type(msg).__name__}")
            took[role] = round(msg.startup_s, 3)
        log.info("peers_ready", **{f"{role}_startup_s": s for role, s in took.items()})

    # ---- an item's start ----------------------------------------------------------------------------

    def start(self, request: Request, gamma: int) -> None:
        if not self.cfg.decoding.sync_prefill:
            return  # PEARL-video: the draft hears of the item at its join, once the target's prefill is done
        self._start(request, gamma)

    def _start(self, request: Request, gamma: int) -> None:
        job = job_start(self.job_id, request, int(request.seed), gamma, self.target)
        if self.send_frames:
            job = frames_wire.announce(job)
        self.link.send("draft", job)
        if self.send_frames:  # right behind the JobStart: the draft takes them as it takes the JobStart
            names, tensors = frames_wire.pack(request.frames, request.frame_times)
            with span("send", item=request.id, what="frames", frames=len(request.frames)):
                self._keep(self.link.send_tensors("draft", tensors, tag=frames_wire.TAG, item_id=request.id,
                                                  names=names))
        self.link.send("pruner", job)
        self.chunks[request.id] = deque()

    def prefill_signals(self, target: VideoLMAdapter) -> tuple[int, int] | None:
        return strategy_signal_layers(target, self.cfg.pruning, parallel=True)

    def prefill(self, request: Request, emb: SequenceEmbeddings, on_engine_thread: bool) -> PrefillResult:
        streaming = on_engine_thread and self.cfg.decoding.sync_prefill
        sink = self.link if streaming else HeldSignals()
        if not streaming:
            request.draft_handle = sink
        return prefill_streaming_signals(sink, self.cfg.pruning, self.target, emb, request.id, self.timeout_s)

    def join(self, request: Request, gamma: int) -> None:
        held, request.draft_handle = request.draft_handle, None
        if isinstance(held, HeldSignals):  # prefilled on another thread, or not in sync: start and signals go now
            self._start(request, gamma)
            held.release(self.link, self.timeout_s)

    # ---- messages -----------------------------------------------------------------------------------

    def handle(self, src: str, msg: Message) -> None:
        if isinstance(msg, DraftChunk):
            q = recv_announced(self.link, "draft", "draft_probs")[0] if msg.has_probs else None
            if msg.item_id in self.chunks:  # else the tail of an item that finished
                self.chunks[msg.item_id].append((msg, q))
                self._step = (len(self.chunks), msg.draft_step_s)
        elif isinstance(msg, KeepIndices):
            self.num_kept[msg.item_id] = msg.num_kept
        elif isinstance(msg, Error):
            if msg.item_id in self.chunks:
                self.errors[msg.item_id] = f"{msg.role} (rank {msg.rank}): {msg.message}"
        else:
            log.warning("unexpected_message", type=type(msg).__name__, src=src)

    def pump(self, timeout_s: float = 0.0) -> bool:
        """Handles every message that has arrived, waiting up to `timeout_s` for the first; whether any came."""
        if timeout_s > 0:  # a straggler's chunk: waiting, traced as such (the App. C accounting reads it)
            with span("recv_wait"):
                came = self.link.poll(timeout_s=timeout_s)
        else:
            came = self.link.poll()
        if not came:
            return False
        while self.link.poll():
            self.handle(*self.link.recv())
        return True

    def wait(self) -> None:
        """Blocks until the draft or the pruner sends something (the link names a silent peer), then handles it."""
        with span("recv_wait"):  # the chunk after a rollback: the wait the bench's "ovh ms" must not count
            self.link.wait()
        self.pump()

    # ---- rounds -------------------------------------------------------------------------------------

    def has_proposal(self, request: Request) -> bool:
        """Drops the chunks at the head of the request's queue that cannot be verified; whether one is left."""
        queue = self.chunks.get(request.id)
        while queue and request.id not in self.errors:
            chunk, _ = queue[0]
            decision = request.machine.on_chunk(chunk.epoch, chunk.start, len(chunk.token_ids))
            if decision is None:
                return True
            queue.popleft()
            log.debug("chunk_dropped", item=request.id, reason=decision.reason, epoch=chunk.epoch, start=chunk.start)
        return False

    def proposals(self, requests: list[Request], gamma: int) -> dict[str, Proposal]:
        out = {}
        for r in requests:
            if not self.has_proposal(r):
                continue
            chunk, q = self.chunks[r.id].popleft()
            if r.first_chunk_wait is None:
                r.first_chunk_wait = time.perf_counter() - r.decode_start
                mark("first_chunk", item=r.id, wait_s=r.first_chunk_wait)
            out[r.id] = Proposal(list(chunk.token_ids), q, chunk.start, gamma)
        return out

    def verified(self, request: Request, verdict: VerifyResult, target_rows: torch.Tensor) -> None:
        self.link.send("draft", verdict)
        if self.target_probs:
            rows = target_rows[: verdict.num_accepted + int(verdict.rollback)]
            # Sent without waiting: the draft may itself be blocked sending a chunk's q to us; it receives these
            # right after the verdict. Handles stay referenced until done.
            self._keep(self.link.send_tensors(
                "draft", [probs_from_logits(rows, self.cfg.decoding.temperature)], tag="target_probs"))

    def _keep(self, handle) -> None:
        """A send not waited for: its handle (and its tensors) kept until it completes."""
        self.pending_sends = [h for h in self.pending_sends if not h.is_completed()]
        self.pending_sends.append(handle)

    def error(self, request: Request) -> str | None:
        return self.errors.get(request.id)

    def finish(self, request: Request, error: str | None) -> None:
        if self.chunks.pop(request.id, None) is None:
            return  # never started (failed in a prefill that did not stream): the draft never heard of it
        self.errors.pop(request.id, None)
        tokens = [] if error is not None else request.machine.output()
        done = ItemDone(request.id, tokens, None if error is None else {"type": "ValueError", "message": error})
        self.link.send("draft", done)
        self.link.send("pruner", done)
        if error is None:
            request.num_kept = self._keep_report(request.id)

    def _keep_report(self, item_id: str) -> int:
        """The pruner's count for the item; it is sent before the draft can draft, but may still be on the wire."""
        while item_id not in self.num_kept:
            self.handle(*self.link.recv("pruner"))
        return self.num_kept.pop(item_id)

    def draft_step(self) -> tuple[int, float] | None:
        step, self._step = self._step, None
        return step

    def shutdown(self) -> None:
        """After the last item: tells the pruner and the draft, then takes what the draft sent before its answer
        off the wire. A chunk drafted past an item's end can still be on its way, with probabilities the draft
        waits to hand over: a send of the draft must never wait on a target that stopped reading."""
        self.link.send("pruner", Shutdown("job finished"))
        self.link.send("draft", Shutdown("job finished"))
        while True:
            src, msg = self.link.recv("draft")
            if isinstance(msg, Shutdown):
                return
            self.handle(src, msg)

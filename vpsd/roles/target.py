"""The target role: the single source of truth. Full prefill, verification, what is committed; one item in
flight or many.

Parallel speculative decoding (pearl, parallelvlm, hippo, tabed): the draft rank drafts (roles/draft.py) while
this rank verifies, and the pruner (roles/pruner.py) picks the draft's video tokens. Per item: JobStart to the
draft and the pruner, the vision tower, the full prefill streaming the pruner its signals (from inside the
prefill once layer L has run, so the pruning and the draft's pruned prefill overlap it: HIPPO's synchronous
prefill), then the item's chunks verified in order by its own `TargetMachine` (stale epochs dropped, the kept
row of an all-accepted chunk verifying the next chunk's first token, optimistic and conservative modes), each
verdict sent back at once (with TABED's soft labels when its distance needs them), and ItemDone when its output
is complete. At `--batch 1` that is the whole pipeline (one row, stepped by the batch-1 forward itself:
models/batch.py); with `--batch N` and `batching.pipelined: true` up to N items are in flight and what is
batched is only the forward:

  step():  every item with a verifiable chunk contributes its window (and any committed token its cache
           lacks, `CacheCursor.verify_feed`); ONE forward of the target's `BatchedCache` scores every window
           (ragged rows, padded with holes); each item's window is verified on its own rows (`verify_chunk`:
           greedy, or the speculative-sampling rule with the item's own random stream, seeded as its batch-1
           run seeds it), and its verdict leaves.

An item with no chunk ready is not fed (its row is a hole in that forward) and keeps its kept row. One chunk
per item per round: a second chunk of the same item starts where the first ends, and is verified next round
(the draft only runs `lookahead` tokens ahead, so at most one more waits).

The window: one `WindowController` for the batch (pipeline/window.py, Eq. 6 and Theorem 6 per row), fed the
batch's own costs: T_q is the draft's batched step (sent with every chunk), T_p(k) the batched verify at the
current batch size. Matching gamma T_q(B) to T_p(B, gamma + 1) is Eq. 6 with both sides measured at B; as B
moves, the line follows within a few rounds (its history decays).

A round waits for items whose chunk has not come yet (after a rollback the draft answers a few ms late) while
that costs less than leaving them a round behind (`patience_s`). Where drafting does not pay, an item is
decoded plain, as a row of this batch the draft never hears of (`drafting_pays`); at batch 1 that is `ar`.

Events arrive through `handle` (one method per message kind), items arrive through `admit` (on this thread) or
`prefill` (any thread) then `join`, and `step` is the work between them: the launcher's loop (launch/batch.py)
and the in-process tests drive the same worker.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from vpsd.config import RunConfig
from vpsd.decoders.batched import kv_bytes_per_token
from vpsd.decoders.result import DecodeResult
from vpsd.models.base import PrefillResult, VideoLMAdapter
from vpsd.models.batch import BatchedCache
from vpsd.pipeline.batch_window import EXPLORE_SHARE
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.messages import DraftChunk, Error, ItemDone, KeepIndices, Message, Shutdown
from vpsd.pipeline.state_machine import Drop, TargetMachine
from vpsd.pipeline.sampling import probs_from_logits
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.theory import expected_accepted, tau_hat
from vpsd.pipeline.verification import verify_chunk, window_rows
from vpsd.pipeline.window import WindowController, running_mean
from vpsd.roles.context import RoleFailure
from vpsd.roles.link import Link, recv_announced
from vpsd.roles.starting import HeldSignals, WorkItem, job_start, prefill_streaming_signals
from vpsd.tracing import get_logger, mark, span
from vpsd.models.timing import settled_clock

log = get_logger()


@dataclass
class Prefilled:
    """An item prefilled off the role's thread (`TargetWorker.prefill`), ready to `join`."""

    item: WorkItem
    pre: PrefillResult
    signals: HeldSignals
    num_video_tokens: int
    prefill_s: float
    drafted: bool = True  # False: a plain row, decoded by the target alone (`drafting_pays`)
    kv_bytes: int = 0  # what admission reserves for it


@dataclass
class TargetRow:
    """One item in flight on the target: its machine, its cache's bookkeeping, its stream and statistics."""

    item: WorkItem
    machine: TargetMachine
    cursor: CacheCursor
    kept_row: torch.Tensor | None  # the target's row for position len(committed), when it holds one
    gen: torch.Generator
    result: DecodeResult
    decode_start: float
    chunks: deque = field(default_factory=deque)  # (DraftChunk, q or None) not yet verified, in arrival order
    windows: list[int] = field(default_factory=list)  # the window each verified chunk was drafted under
    first_chunk_wait: float | None = None
    error: str | None = None  # the draft could not draft it (its Error); the item fails with this
    plain: bool = False  # decoded by the target alone, one token a round; the draft and pruner never hear of it
    joined_round: int = 0  # the worker's round count when it joined
    kv_bytes: int = 0


class TargetWorker:
    """The target rank's state over a batch (see the module docstring)."""

    def __init__(self, link: Link, target: VideoLMAdapter, cfg: RunConfig, size: int, job_id: str = "",
                 timeout_s: float = 60.0, target_probs: bool = False) -> None:
        self.link, self.target, self.cfg, self.size = link, target, cfg, size
        # TABED's soft labels: p at the verified positions follows each verdict (pipeline/ensemble.py).
        self.target_probs = target_probs
        self.pending_sends: list = []  # those sends, still on the wire
        # `batching.kv_budget_mib` counts the target's KV here: the draft's lives on its own rank.
        self.kv_budget_bytes = cfg.batching.kv_budget_bytes
        self.job_id, self.timeout_s = job_id, timeout_s
        self.window: WindowController = cfg.decoding.window()  # one window for the job (gamma auto learns)
        self.batch = BatchedCache(target)
        self.rows: dict[str, TargetRow] = {}
        self.num_kept: dict[str, int] = {}  # the pruner's reports, by item
        self.rounds = 0
        self.batch_sizes: list[int] = []  # items verified per round
        self.gammas: list[int] = []  # the window each round was verified under
        self.verify_s: list[float] = []
        self.accepted = self.rejections = 0  # over every verified window (tau_hat's A and R)
        self.round_end = 0.0  # when the last round ended (perf_counter)
        self.plain_items = 0  # items decoded without a draft (drafting did not pay)
        self.explore_every = 8
        self._plain_streak = 0
        self.drafted_rate: float | None = None  # tokens a drafted item commits per round in flight (running mean)
        # At batch 1: seconds per decoded token of the items that finished, drafted and plain (running means), the
        # tokens an item decodes (running mean), and the exploring budget (`drafting_pays`).
        self.token_s: dict[bool, float] = {}
        self.item_tokens: float | None = None
        self.explore_budget_s = 0.0
        self._lock = threading.Lock()
        self.admit_s = 0.0  # vision + prefill of the items admitted here (the rest of the loop is decoding)

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.size

    def kv_bytes(self, item: WorkItem, prompt_tokens: int) -> int:
        """The target's KV an item can grow to: prefill + answer + one window (+ its first token), in bytes."""
        tokens = prompt_tokens + item.max_new_tokens + self.cfg.decoding.gamma_max + 1
        return tokens * kv_bytes_per_token(self.target)

    def reserved_bytes(self) -> int:
        return sum(r.kv_bytes for r in self.rows.values())

    def fits(self, need: int) -> bool:
        """Whether `need` bytes of KV fit beside the items in flight (always on an empty batch)."""
        return self.kv_budget_bytes is None or not self.rows or self.reserved_bytes() + need <= self.kv_budget_bytes

    # ---- events -------------------------------------------------------------------------------------

    def drafting_pays(self) -> bool:
        """Whether the next item should be drafted for, or decoded plain as a row of the target's batch.

        A plain row commits one token every round. A drafted row commits `drafted_rate` tokens per round it is in
        flight, measured over the items that finished (rollbacks, stale chunks and rounds it missed waiting for
        its draft included; before any finished, 1 + E[X](tau, gamma), Lemma 1's). Rows are padded to the
        longest, so a round with drafted rows costs T_p(gamma + 1) and one of plain rows T_p(1), T_p(k) the
        window's line at the current B. Drafting pays while T_p(gamma + 1) / drafted_rate < T_p(1). The draft's
        steps overlap the verify and its prefill runs on its own rank, so neither is counted (BatchWindow's rule,
        which counts both, is for the serial batch). Greedy only (a sampled item always drafts), a fixed window
        always drafts, and one plain decision in `explore_every` drafts anyway, so the rate stays measured.

        At batch 1 there are no rounds to miss: the target waits for the draft instead, after every rollback. So
        there the measure is the wall: seconds per decoded token of the drafted items that finished (verifies,
        waits and rollbacks), against the plain ones'. Until a plain item has finished, one is decoded to measure
        it, unless drafting beats half the line's T_p(1): on a CPU a forward of one row takes the matrix-vector
        path and costs less than the line through the windows' rows says (at 4x the default's video, 21 ms
        against 31-38 ms for 2-3 rows). An item decoded plain at batch 1 is `ar`'s decoding exactly. The papers
        always draft; here the pair's acceptance on this job decides: on a video the draft reads badly (the
        README's 4x-the-video table: tau 0.29) drafting made batch 1 0.8x `ar`. Where plain wins, an item drafts
        anyway once a budget covers what it is expected to lose, its tokens times the drafted items' extra
        seconds a token: every plain item adds EXPLORE_SHARE of its decode time (as the batch window's rounds
        do, pipeline/batch_window.py), so exploring costs at most 3% of the plain items' time. (One item in 8,
        as before, cost 6% at 4x the video: each drafted item there took 1.4-1.7x a plain one's time.)"""
        w = self.window
        if self.cfg.decoding.temperature > 0 or w.fixed or w.accepted + w.rejections <= 0:
            return True
        if self.size == 1:
            drafted, plain, t_plain = self.token_s.get(True), self.token_s.get(False), w.verify_time(1)
            if drafted is None:
                return True
            if plain is None:  # else the measuring item
                return t_plain is not None and drafted < t_plain / 2
            return drafted < plain or self._explore_at_batch_1(drafted - plain)
        t_plain, t_window = w.verify_time(1), w.verify_time(w.gamma + 1)
        if t_plain is None or t_window is None:
            return True
        rate = self.drafted_rate or 1.0 + expected_accepted(tau_hat(w.accepted, w.rejections), w.gamma)
        pays = t_window / rate < t_plain
        with self._lock:  # the prefill thread and the decode thread (when it steals) both ask
            if pays:
                self._plain_streak = 0
                return True
            self._plain_streak += 1
            return self._plain_streak % self.explore_every == 0

    def _explore_at_batch_1(self, extra_per_token_s: float) -> bool:
        """Whether a plain decision at batch 1 drafts anyway: once the budget covers the expected loss."""
        with self._lock:  # the prefill thread and the decode thread (when it steals) both ask
            if self.item_tokens is None or self.explore_budget_s < extra_per_token_s * self.item_tokens:
                return False
            self.explore_budget_s = 0.0
            return True

    def observe_item_at_batch_1(self, plain: bool, decode_s: float, tokens: int) -> None:
        """An item that finished at batch 1, `tokens` decoded after the prefill's first: what `drafting_pays`
        weighs there (running means), and a plain one's share of its time into the exploring budget."""
        if tokens < 1:
            return
        self.token_s[not plain] = running_mean(self.token_s.get(not plain), decode_s / tokens)
        self.item_tokens = running_mean(self.item_tokens, tokens)
        if plain:
            with self._lock:
                self.explore_budget_s += EXPLORE_SHARE * decode_s

    def admit(self, item: WorkItem) -> bool:
        """Starts an item on this thread: the draft and the pruner are told, then the vision tower and the full
        prefill run here, the pruner's signals leaving from inside it. False, and nothing happens, while its KV
        does not fit beside the items in flight. A ValueError fails the item alone (its ItemDone goes out)."""
        t0 = time.perf_counter()
        if not self.drafting_pays():
            p = self.prefill(item, drafted=False)
            self.admit_s += p.prefill_s
            return self.join(p)
        inputs = self.target.prepare(item.frames, item.prompt, item.frame_times)
        need = self._check_budget(item, inputs.seq_len)
        if not self.fits(need):
            return False
        self._announce(item)
        try:
            emb = self._embed(item, inputs)
            pre = prefill_streaming_signals(self.link, self.cfg.pruning, self.target, emb, item.id, self.timeout_s)
        except ValueError as e:
            self._item_done(item.id, [], {"type": type(e).__name__, "message": str(e)})
            raise
        self._add_row(item, pre, emb.layout.num_tokens, time.perf_counter() - t0, plain=False, kv_bytes=need)
        self.admit_s += time.perf_counter() - t0
        return True

    def prefill(self, item: WorkItem, drafted: bool | None = None) -> Prefilled:
        """The item's vision and full prefill, on any thread (it touches no transport: the signals are held);
        `join` it on this one. `drafted`: None asks `drafting_pays`. Raises ValueError (or a VideoError) for an
        item that cannot be decoded: nothing was announced, so nothing needs telling."""
        drafted = self.drafting_pays() if drafted is None else drafted
        t0 = time.perf_counter()
        emb = self._embed(item)
        need = self._check_budget(item, emb.seq_len)
        held = HeldSignals()
        if drafted:
            pre = prefill_streaming_signals(held, self.cfg.pruning, self.target, emb, item.id, self.timeout_s)
        else:
            with span("prefill", item=item.id, tokens=emb.seq_len, drafted=False):
                pre = self.target.prefill(emb)
        return Prefilled(item, pre, held, emb.layout.num_tokens, time.perf_counter() - t0, drafted, need)

    def join(self, p: Prefilled) -> bool:
        """A prefilled item joins: the draft and the pruner are told, the signals go out, its row joins (a plain
        row joins alone). False, and nothing happens, while its KV does not fit beside the items in flight (join
        it again after a round)."""
        if not self.fits(p.kv_bytes):
            log.info("item_deferred", item=p.item.id, need_mib=p.kv_bytes / 2**20,
                     reserved_mib=self.reserved_bytes() / 2**20, budget_mib=self.kv_budget_bytes / 2**20)
            return False
        t0 = time.perf_counter()
        if p.drafted:
            self._announce(p.item)
            p.signals.release(self.link, self.timeout_s)
        self._add_row(p.item, p.pre, p.num_video_tokens, p.prefill_s, plain=not p.drafted, kv_bytes=p.kv_bytes)
        self.admit_s += time.perf_counter() - t0
        return True

    def _check_budget(self, item: WorkItem, prompt_tokens: int) -> int:
        """The item's KV need; ValueError (it fails alone) when it would not fit even in an empty batch."""
        need = self.kv_bytes(item, prompt_tokens)
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise ValueError(f"item needs {need / 2**20:.1f} MiB of KV cache, over the budget of "
                             f"{self.kv_budget_bytes / 2**20:.1f} MiB (batching.kv_budget_mib)")
        return need

    def _announce(self, item: WorkItem) -> None:
        job = job_start(self.job_id, item, int(self.cfg.decoding.seed), self.window.gamma, self.target)
        self.link.send("draft", job)
        self.link.send("pruner", job)

    def _embed(self, item: WorkItem, inputs=None):
        """The item's embeddings (`inputs`: its prepared inputs, when already made)."""
        with span("vision", item=item.id):
            if inputs is None:
                inputs = self.target.prepare(item.frames, item.prompt, item.frame_times)
            return self.target.embed(inputs)

    def _add_row(self, item: WorkItem, pre, num_video_tokens: int, prefill_s: float, plain: bool,
                 kv_bytes: int = 0) -> None:
        machine = TargetMachine(item.max_new_tokens, frozenset(self.target.eos_token_ids), item_id=item.id)
        result = DecodeResult(token_ids=[], stats=AcceptanceStats(), prefill_s=prefill_s,
                              num_video_tokens=num_video_tokens)
        row = TargetRow(item, machine, CacheCursor(pre.state.length), pre.logits,
                        torch.Generator().manual_seed(int(self.cfg.decoding.seed)), result, time.perf_counter(),
                        plain=plain, joined_round=self.rounds, kv_bytes=kv_bytes)
        if plain:  # its first token, as ar draws it from the prefill (greedy: plain rows are never sampled)
            machine.committed.append(int(pre.logits.argmax()))
            result.stats.record(0, 0)
            self.plain_items += 1
        self.rows[item.id] = row
        self.batch.join(item.id, pre.state)
        log.info("item_admitted", item=item.id, in_flight=len(self.rows), drafted=not plain,
                 need_mib=kv_bytes / 2**20, reserved_mib=self.reserved_bytes() / 2**20,
                 budget_mib=None if self.kv_budget_bytes is None else self.kv_budget_bytes / 2**20)

    def handle(self, src: str, msg: Message) -> None:
        if isinstance(msg, DraftChunk):
            q = recv_announced(self.link, "draft", "draft_probs")[0] if msg.has_probs else None
            self.on_chunk(msg, q)
        elif isinstance(msg, KeepIndices):
            self.num_kept[msg.item_id] = msg.num_kept
        elif isinstance(msg, Error):
            self.on_error(msg)
        else:
            log.warning("unexpected_message", type=type(msg).__name__, src=src)

    def on_chunk(self, chunk: DraftChunk, q: torch.Tensor | None) -> None:
        row = self.rows.get(chunk.item_id)
        if row is not None:  # else the tail of an item that finished
            row.chunks.append((chunk, q))
            self.window.observe_draft_step(chunk.draft_step_s)

    def on_error(self, err: Error) -> None:
        row = self.rows.get(err.item_id)
        if row is not None:
            row.error = f"{err.role} (rank {err.rank}): {err.message}"

    # ---- work ---------------------------------------------------------------------------------------

    def _drop_stale(self, item_id: str, row: TargetRow) -> bool:
        """Drops the chunks at the head of the row's queue that cannot be verified (stale epoch, wrong start);
        True when a verifiable one is left at the head."""
        while row.chunks and row.error is None:
            chunk, _ = row.chunks[0]
            decision = row.machine.on_chunk(chunk.epoch, chunk.start, len(chunk.token_ids))
            if not isinstance(decision, Drop):
                return True
            row.chunks.popleft()
            log.debug("chunk_dropped", item=item_id, reason=decision.reason, epoch=chunk.epoch, start=chunk.start)
        return False

    def readiness(self) -> tuple[int, int]:
        """(items with something to verify now, items in flight); a plain row always has its next token."""
        return sum(r.plain or self._drop_stale(k, r) for k, r in self.rows.items()), len(self.rows)

    def patience_s(self, ready: int, waiting: int) -> float:
        """How long a round may wait for the items whose chunk has not come yet (after a rollback the draft needs a
        step or two to answer). Leaving now costs each of them a whole round, T_p; waiting w costs each ready item
        w: waiting pays while w ready < T_p waiting, capped at half a round. Not in the papers: at batch 1 the
        target has nothing else to do but wait."""
        if not self.verify_s or ready == 0:
            return 0.0
        t_p = sum(self.verify_s[-8:]) / len(self.verify_s[-8:])
        return t_p * min(0.5, waiting / ready)

    def step(self) -> tuple[bool, list[tuple[WorkItem, DecodeResult | ValueError]]]:
        """One round: every item with a verifiable chunk is verified in ONE forward. Returns (whether a forward
        ran, the items that finished with their results or the error that failed them)."""
        ready: dict[str, tuple[DraftChunk | None, torch.Tensor | None, bool]] = {}
        for item_id, row in self.rows.items():
            if row.plain and not row.machine.done:
                ready[item_id] = (None, None, False)
            elif self._drop_stale(item_id, row):
                chunk, q = row.chunks.popleft()
                ready[item_id] = (chunk, q, row.machine.holds_next_row)
        if ready:
            self._verify(ready)
        finished = []
        for item_id in [k for k, r in self.rows.items() if r.machine.done or r.error is not None]:
            finished.append(self._finish(item_id))
        self.round_end = time.perf_counter()
        return bool(ready), finished

    def _verify(self, ready: dict[str, tuple[DraftChunk | None, torch.Tensor | None, bool]]) -> None:
        dec = self.cfg.decoding
        feed, first = {}, {}
        for item_id, (chunk, _, use_kept_row) in ready.items():
            row = self.rows[item_id]
            if chunk is None:  # a plain row: the token it committed last round, as ar feeds it
                length, feed[item_id], first[item_id] = row.cursor.verify_feed(row.machine.committed, [])
                self.batch.rollback(item_id, length)
                continue
            if row.first_chunk_wait is None:
                row.first_chunk_wait = time.perf_counter() - row.decode_start
                mark("first_chunk", item=item_id, wait_s=row.first_chunk_wait)
            length, feed[item_id], first[item_id] = row.cursor.verify_feed(row.machine.committed, list(chunk.token_ids))
            if use_kept_row != (first[item_id] < 0):
                raise RoleFailure(f"target: the cache of item {item_id} disagrees with its committed tokens")
            self.batch.rollback(item_id, length)
        fed = max(len(t) for t in feed.values())
        self.batch_sizes.append(len(ready))
        gamma = self.window.gamma if any(chunk is not None for chunk, _, _ in ready.values()) else 0
        self.gammas.append(gamma)  # 0: a round of plain rows only
        with span("verify", round=self.rounds, items=list(ready), tokens=sum(len(t) for t in feed.values()),
                  rows=fed, gamma=gamma) as fields:
            t0 = settled_clock(self.target.device)  # not the admissions' copies still queued on a GPU
            logits = (self.batch.step_rowwise if dec.exact_verify else self.batch.step)(feed)
            self.verify_s.append(settled_clock(self.target.device) - t0)
            self.window.observe_verify(fed, self.verify_s[-1])
            outcome = []  # per row, in the order of `items`: what reports/acceptance.py reads
            for item_id, (chunk, q, _) in ready.items():
                row = self.rows[item_id]
                if chunk is None:
                    row.machine.committed.append(int(logits[item_id][-1].argmax()))
                    row.result.stats.record(0, 0)
                    outcome.append((0, 0, 1, None, None))
                    continue
                outcome.append(self._commit(row, chunk, q, logits[item_id], first[item_id]))
            fields.update({name: list(col) for name, col in
                           zip(("drafted", "accepted", "committed", "mode", "start"), zip(*outcome))})
        self.rounds += 1

    def _commit(self, row: TargetRow, chunk: DraftChunk, q: torch.Tensor | None, logits: torch.Tensor,
                first: int) -> tuple[int, int, int, str, int]:
        """Verifies one item's window on its rows, commits what its batch-1 run would, sends the verdict. Returns
        (drafted, accepted, committed, the mode it was verified in, where the chunk started)."""
        tokens = list(chunk.token_ids)
        mode = row.machine.mode.value
        rows = window_rows(logits, first, row.kept_row)
        v = verify_chunk(tokens, q, rows, self.cfg.decoding.temperature, row.gen)
        self.window.observe_round(v.num_accepted, v.num_drafted)
        self.accepted += v.num_accepted
        self.rejections += int(not v.all_accepted)
        row.windows.append(self.window.gamma)
        before = len(row.machine.committed)
        verdict = row.machine.on_verified(tokens, v.num_accepted, v.next_token, self.window.pre_verify(),
                                          self.window.gamma)
        row.kept_row = None if verdict.rollback else rows[-1].clone()  # not a view of the round's (B, k, V) logits
        row.result.stats.record(v.num_accepted, v.num_drafted, verdict.committed_len - before)
        if verdict.rollback:
            row.result.stats.rollbacks += 1
        self.link.send("draft", verdict)
        if self.target_probs:
            self._send_target_probs(probs_from_logits(rows[: v.num_accepted + int(not v.all_accepted)],
                                                      self.cfg.decoding.temperature))
        return v.num_drafted, v.num_accepted, verdict.committed_len - before, mode, chunk.start

    def _send_target_probs(self, rows: torch.Tensor) -> None:
        """Sends without waiting: the draft may itself be blocked sending a chunk's q to us, so waiting here could
        deadlock; the draft receives these right after the verdict. Handles stay referenced until done."""
        self.pending_sends = [h for h in self.pending_sends if not h.is_completed()]
        self.pending_sends.append(self.link.send_tensors("draft", [rows], tag="target_probs"))

    def _finish(self, item_id: str) -> tuple[WorkItem, DecodeResult | ValueError]:
        row = self.rows.pop(item_id)
        self.batch.leave(item_id)
        if row.error is not None:
            self._item_done(item_id, [], {"type": "ValueError", "message": row.error})
            return row.item, ValueError(row.error)
        tokens = row.machine.output()
        r = row.result
        r.token_ids = tokens
        r.decode_s = time.perf_counter() - row.decode_start
        if self.size == 1:
            self.observe_item_at_batch_1(row.plain, r.decode_s, len(tokens) - 1)  # the first came from the prefill
        if row.plain:
            return row.item, r  # no draft, no kept set, nobody else to tell
        self._item_done(item_id, tokens, None)
        rounds = self.rounds - row.joined_round
        if rounds > 0:
            rate = len(row.machine.committed) / rounds
            self.drafted_rate = running_mean(self.drafted_rate, rate)
        r.timings["first_chunk_wait"] = row.first_chunk_wait or 0.0
        r.gamma = sum(row.windows) / len(row.windows) if row.windows else float(self.window.gamma)
        r.num_kept = self._keep_report(item_id)
        return row.item, r

    def _keep_report(self, item_id: str) -> int:
        """The pruner's count for the item; it is sent before the draft can draft, but may still be on the wire."""
        while item_id not in self.num_kept:
            src, msg = self.link.recv("pruner")
            self.handle(src, msg)
        return self.num_kept.pop(item_id)

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
            self.handle(src, msg)  # a late chunk of a finished item: its tensors received, the chunk dropped

    def _item_done(self, item_id: str, tokens: list[int], error: dict | None) -> None:
        done = ItemDone(item_id, tokens, error)
        self.link.send("draft", done)
        self.link.send("pruner", done)

    def report(self) -> dict:
        """What the batch did, for the run's summary and the throughput bench (the keys BatchDecoder.report uses,
        where they mean the same; `pipelined` tells the bench to predict with Theorem 6, the draft overlapped)."""
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {"size": self.size, "pipelined": True, "rounds": self.rounds, "mean_batch": mean(self.batch_sizes),
                "mean_gamma": mean(self.gammas), "t_p_s": mean(self.verify_s), "t_q_s": self.window.t_q,
                "tau_hat": tau_hat(self.accepted, self.rejections), "admit_s": self.admit_s,
                "plain_items": self.plain_items, "drafted_rate": self.drafted_rate}

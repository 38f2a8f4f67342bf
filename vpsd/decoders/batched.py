"""Continuous batching: up to N items in flight through one target (and one draft), each decoded as its batch-1
decoder decodes it, `ar` (decoders/ar.py) or serial speculative decoding with any pruning strategy
(decoders/sd.py `speculate`), with every forward shared by the batch.

An item joins with its own prefills (the target's full one with the signals its strategy reads, the draft's on
the kept video tokens: `prefill_pair`, exactly the batch-1 path), then becomes a row of each model's
`BatchedCache`. One round, for every item in flight at once:
  1. draft: each row's draft cache is brought in line with what its item committed (its `CacheCursor`, a per-row
     rollback), then gamma batched draft forwards propose each row's window (a row stops at its own length:
     never past its max_new_tokens);
  2. verify: ONE target forward of every row's pending tokens and window (ragged, padded with holes), then each
     row's window is verified on its own rows of logits (`verify_chunk`: greedy, or the speculative-sampling
     rule with the item's own random streams), and the item commits what its batch-1 run would commit;
  3. the items that finished leave both batches; their slots take the next items.
`ar` is the same round with no draft: one batched forward of one token per row.

Per-item state (committed tokens, cursors, random streams, statistics) lives in a `Slot`, keyed by item id; the
batch a forward sees is built from the slots each round (vLLM v1's persistent batch, SGLang's per-phase batch).
Each item's random streams are seeded as its batch-1 run seeds them (verify: `seed`, draft: `seed + 1`), so its
sample never depends on what else is in the batch: given the same logits it draws the same tokens.

The window: `BatchWindow` (pipeline/batch_window.py) chooses gamma per round from the measured cost of the
batch's forwards and the acceptance, and falls back to plain batched decoding (gamma 0) where speculation does
not pay at this batch size. Serial, not parallel: the draft and the target take turns on this rank. At a
deployment-shaped cost ratio (c = T_p / T_q > 30 in the scaled default) the draft's share of a round is small,
so the batch, not the overlap, is the larger term; the pipelined roles over a batch are the next step.
An item whose draft prefill (the draft's vision, the pruning, its pruned prefill) would cost more than drafting
saves it over its decoding is decoded plain, as a row without a draft in the same batch
(`BatchWindow.speculation_pays`; greedy only, so that a sampled item's tokens never depend on timing).
Forward times are read after the device has finished (models/timing.py), so they hold on a GPU too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import torch

from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.keep import keep_policy_for
from vpsd.decoders.result import DecodeResult
from vpsd.decoders.sd import prefill_pair
from vpsd.models.base import DecodeState, VideoLMAdapter
from vpsd.models.batch import BatchedCache
from vpsd.pipeline.batch_window import BatchWindow
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.sampling import next_token, probs_from_logits, sample
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.stopping import cut, done
from vpsd.pipeline.theory import tau_hat
from vpsd.pipeline.verification import verify_chunk, window_rows
from vpsd.tracing import get_logger, span
from vpsd.models.timing import settled_clock

log = get_logger()


@dataclass
class BatchItem:
    """One item as the batched decoder needs it (the launcher reads the video)."""

    id: Hashable
    frames: np.ndarray  # (T, H, W, 3) uint8
    prompt: str
    max_new_tokens: int
    frame_times: np.ndarray | None = None


@dataclass
class Slot:
    """One item in flight: everything its batch-1 decoder would hold, keyed by its id in both batches."""

    item: BatchItem
    committed: list[int]
    target_cursor: CacheCursor
    draft_cursor: CacheCursor | None
    verify_gen: torch.Generator
    draft_gen: torch.Generator
    result: DecodeResult
    decode_start: float
    kv_bytes: int = 0  # what admission reserved for it
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    windows: list[int] = field(default_factory=list)  # the gamma of each round it drafted in


@dataclass
class Prefilled:
    """An item prefilled outside the batch, ready to join it (`BatchDecoder.prefill`, then `join`)."""

    item: BatchItem
    target_state: DecodeState
    draft_state: DecodeState | None
    committed: list[int]  # the first token, from the target's prefill
    verify_gen: torch.Generator  # already drew that token
    result: DecodeResult  # prefill_s, kept tokens; the rest is filled when the item finishes
    kv_bytes: int


class BatchDecoder:
    """Up to `size` items in flight; `admit` an item while there is room, `round` until none is left."""

    def __init__(self, target: VideoLMAdapter, draft: VideoLMAdapter | None, cfg: DecodingConfig,
                 pruning: PruningConfig | None, size: int, window: BatchWindow | None = None,
                 kv_budget_bytes: int | None = None, parallel_signals: bool = False) -> None:
        """parallel_signals: prune from the layers a parallel method's pipeline streams (its method is parallel:
        hippo at --batch 8 keeps exactly the video tokens hippo at --batch 1 keeps)."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        self.target, self.draft, self.cfg, self.pruning, self.size = target, draft, cfg, pruning, size
        self.window = window or BatchWindow(cfg.serial_gamma(), cfg.gamma_min, cfg.gamma_max, fixed=not cfg.auto_gamma)
        self.kv_budget_bytes = kv_budget_bytes
        self.parallel_signals = parallel_signals
        self.target_batch = BatchedCache(target)
        self.draft_batch = BatchedCache(draft) if draft is not None else None
        self.keep_policy = keep_policy_for(pruning, target.family) if pruning is not None else None
        self.slots: dict[Hashable, Slot] = {}
        self.eos = target.eos_token_ids
        self.rounds = 0
        self.batch_sizes: list[int] = []  # items per round, for the traces' and the bench's occupancy
        self.gammas: list[int] = []  # the window of each round (0: a plain batched step)
        self.verify_s: list[float] = []  # each round's target forward
        self.draft_step_s: list[float] = []  # each round's mean draft forward (rounds that drafted)
        self.accepted = self.rejections = 0  # over every row's verified window (tau_hat's A and R)
        self.decode_s = 0.0  # inside rounds: the decode thread's time (prefills run beside it)
        self.plain_items = 0  # items of a speculative run decoded without a draft (speculation did not pay)

    # ---- admission --------------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return len(self.slots) >= self.size

    def kv_bytes(self, item: BatchItem, prompt_tokens: int) -> int:
        """KV cache an item can grow to in both batches (prefill + answer + one window), in bytes. The draft's
        pruned prefill is counted at full length: the kept set is not known before the target's prefill."""
        tokens = prompt_tokens + item.max_new_tokens + self.cfg.gamma_max + 1
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        return sum(tokens * kv_bytes_per_token(m) for m in models)

    def reserved_bytes(self) -> int:
        return sum(s.kv_bytes for s in self.slots.values())

    def prefill(self, item: BatchItem) -> Prefilled:
        """The item's batch-1 prefills and first token, outside the batch. Safe on another thread while `round`
        runs (the launcher prefills the next items on a spare core: encoder-disaggregated serving in small);
        raises ValueError for an item over the KV budget on its own, a draft on another grid, a bad video."""
        t0 = time.perf_counter()
        inputs = self.target.prepare(item.frames, item.prompt, item.frame_times)
        need = self.kv_bytes(item, inputs.seq_len)
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise ValueError(f"item needs {need / 2**20:.1f} MiB of KV cache, over the budget of "
                             f"{self.kv_budget_bytes / 2**20:.1f} MiB (batching.kv_budget_mib)")
        # Sampled items always draft: whether an item drafts must not depend on timing, or its sample would.
        drafted = self.draft is not None and (self.cfg.temperature > 0 or self.window.speculation_pays(self._batch()))
        with span("item_prefill", item=str(item.id), tokens=inputs.seq_len, drafted=drafted):
            if not drafted:
                emb = self.target.embed(inputs)
                pre, draft_pre, layout, kept = self.target.prefill(emb), None, emb.layout, None
                num_kept, num_video = None, emb.layout.num_tokens
            else:
                pair = prefill_pair(self.target, self.draft, item.frames, item.prompt, self.keep_policy, self.pruning,
                                    item.frame_times, target_inputs=inputs, parallel_signals=self.parallel_signals)
                pre, draft_pre, layout, kept = pair.target, pair.draft, pair.target_emb.layout, pair.kept_indices()
                num_kept, num_video = pair.num_kept, pair.num_video_tokens
                self.window.observe_draft_prefill(pair.draft_s)
        verify_gen = torch.Generator().manual_seed(self.cfg.seed)
        committed = [next_token(pre.logits, self.cfg.temperature, verify_gen)]
        result = DecodeResult(token_ids=[], stats=AcceptanceStats(), prefill_s=time.perf_counter() - t0,
                              num_kept=num_kept, num_video_tokens=num_video,
                              kept=kept if drafted else None, layout=layout if drafted else None)
        return Prefilled(item, pre.state, draft_pre.state if draft_pre is not None else None, committed, verify_gen,
                         result, need)

    def join(self, p: Prefilled) -> tuple[str, DecodeResult | None]:
        """Adds a prefilled item to the batch: ("joined", None); ("done", result) when its first token already
        ends it; ("wait", None) when its KV would overflow the budget beside the items in flight (join it again
        after a round; never on an empty batch)."""
        item = p.item
        if item.id in self.slots:
            raise ValueError(f"item {item.id!r} is already in flight")
        if self.kv_budget_bytes is not None and self.slots and self.reserved_bytes() + p.kv_bytes > self.kv_budget_bytes:
            log.info("item_deferred", item=str(item.id), need_mib=p.kv_bytes / 2**20,
                     reserved_mib=self.reserved_bytes() / 2**20, budget_mib=self.kv_budget_bytes / 2**20)
            return "wait", None
        slot = Slot(item, p.committed, CacheCursor(p.target_state.length),
                    CacheCursor(p.draft_state.length) if p.draft_state is not None else None,
                    p.verify_gen, torch.Generator().manual_seed(self.cfg.seed + 1), p.result, time.perf_counter(),
                    p.kv_bytes)
        if p.draft_state is None:
            slot.stats.record(0, 0)  # as decode_ar counts its first token
        if done(p.committed, item.max_new_tokens, self.eos):
            return "done", self._result(slot)
        self.slots[item.id] = slot
        self.target_batch.join(item.id, p.target_state)
        if p.draft_state is not None:
            self.draft_batch.join(item.id, p.draft_state)
        log.info("item_admitted", item=str(item.id), in_flight=len(self.slots), need_mib=p.kv_bytes / 2**20,
                 reserved_mib=self.reserved_bytes() / 2**20,
                 budget_mib=None if self.kv_budget_bytes is None else self.kv_budget_bytes / 2**20)
        return "joined", None

    def admit(self, item: BatchItem) -> tuple[str, DecodeResult | None]:
        """`join(prefill(item))` on this thread; after "wait", admit the item again after a round."""
        return self.join(self.prefill(item))

    # ---- one round --------------------------------------------------------------------------------

    def round(self) -> list[tuple[BatchItem, DecodeResult]]:
        """One batched round over every item in flight; returns the items it finished, with their results."""
        if not self.slots:
            return []
        started = time.perf_counter()
        batch = len(self.slots)
        self.batch_sizes.append(batch)
        drafting = sum(s.draft_cursor is not None for s in self.slots.values())
        gamma = self.window.gamma(batch, drafting) if self.draft is not None else 0
        self.gammas.append(gamma)
        # A row without a draft (ar, or an item speculation did not pay for) never drafts.
        windows = {key: 0 if s.draft_cursor is None else max(0, min(gamma, s.item.max_new_tokens - len(s.committed) - 1))
                   for key, s in self.slots.items()}
        drafts, probs = self._draft(windows) if any(windows.values()) else ({}, {})
        with span("verify", round=self.rounds, items=[str(k) for k in self.slots], gamma=gamma,
                  tokens=sum(len(d) for d in drafts.values()) + batch) as fields:
            rows, fed = self._verify_forward(drafts)
            # Per row, in the order of `items`: drafted, accepted and committed tokens (reports/acceptance.py).
            outcome = [self._commit(key, rows[key], drafts.get(key, []), probs.get(key)) for key in self.slots]
            fields.update(rows=fed, **{name: list(col) for name, col in
                                       zip(("drafted", "accepted", "committed"), zip(*outcome))})
        self.rounds += 1
        out = []
        for key in [k for k, s in self.slots.items() if done(s.committed, s.item.max_new_tokens, self.eos)]:
            slot = self.slots.pop(key)
            self.target_batch.leave(key)
            if slot.draft_cursor is not None:
                self.draft_batch.leave(key)
            elif self.draft is not None:
                self.plain_items += 1
            self.window.observe_item(len(slot.committed))
            out.append((slot.item, self._result(slot)))
        self.decode_s += time.perf_counter() - started
        return out

    def _batch(self) -> int:
        """Items in flight an item prefilled now will most likely join: the recent rounds' mean, at most N."""
        recent = self.batch_sizes[-16:]
        return max(1, min(self.size, round(sum(recent) / len(recent)) if recent else self.size))

    def _draft(self, windows: dict[Hashable, int]) -> tuple[dict[Hashable, list[int]], dict[Hashable, torch.Tensor]]:
        """Each row's window: `windows[key]` tokens proposed by the draft from what the item committed."""
        active = [key for key, k in windows.items() if k > 0]
        feed = {}
        for key in active:
            slot = self.slots[key]
            length, pending = slot.draft_cursor.sync(slot.committed)
            self.draft_batch.rollback(key, length)
            feed[key] = pending
        tokens: dict[Hashable, list[int]] = {key: [] for key in active}
        probs: dict[Hashable, list[torch.Tensor]] = {key: [] for key in active}
        steps = 0
        t0 = settled_clock(self.draft.device)  # not the joins' copies still queued on a GPU
        with span("draft", items=list(active), gamma=max(windows.values())):
            while feed:
                logits = self.draft_batch.step(feed)
                steps += 1
                for key, pending in feed.items():
                    self.slots[key].draft_cursor.feed(pending)
                feed = {}
                for key, rows in logits.items():
                    slot, last = self.slots[key], rows[-1]
                    if self.cfg.temperature == 0.0:
                        token = int(last.argmax())
                    else:
                        q = probs_from_logits(last, self.cfg.temperature)
                        probs[key].append(q)
                        token = sample(q, slot.draft_gen)
                    tokens[key].append(token)
                    if len(tokens[key]) < windows[key]:  # the last proposal is never fed (sd.draft_chunk)
                        feed[key] = [token]
        self.draft_step_s.append((settled_clock(self.draft.device) - t0) / max(steps, 1))
        self.window.observe_draft_step(len(active), self.draft_step_s[-1])
        return tokens, {key: torch.stack(p) for key, p in probs.items() if p}

    def _verify_forward(self, drafts: dict[Hashable, list[int]]) -> tuple[dict[Hashable, torch.Tensor], int]:
        """ONE target forward: each row's committed tokens its cache lacks, then its window. Returns each row's
        logits from its last committed token on (the rows that score the window and the bonus position)."""
        feed, first = {}, {}
        for key, slot in self.slots.items():
            length, feed[key], first[key] = slot.target_cursor.verify_feed(slot.committed, drafts.get(key, []))
            self.target_batch.rollback(key, length)
        fed = max(len(t) for t in feed.values())
        t0 = settled_clock(self.target.device)
        step = self.target_batch.step_rowwise if self.cfg.exact_verify else self.target_batch.step
        logits = step(feed)
        self.verify_s.append(settled_clock(self.target.device) - t0)
        self.window.observe_verify(len(feed), fed, self.verify_s[-1])
        return {key: window_rows(logits[key], first[key]) for key in feed}, fed

    def _commit(self, key: Hashable, rows: torch.Tensor, drafts: list[int], q: torch.Tensor | None
                ) -> tuple[int, int, int]:
        """What the item's batch-1 decoder commits from these rows; returns its (drafted, accepted, committed)
        tokens."""
        slot = self.slots[key]
        if slot.draft_cursor is None:  # ar: the next token, drawn as decode_ar draws it
            slot.committed.append(next_token(rows[-1], self.cfg.temperature, slot.verify_gen))
            slot.stats.record(0, 0)
            return 0, 0, 1
        v = verify_chunk(drafts, q, rows, self.cfg.temperature, slot.verify_gen)
        slot.stats.record(v.num_accepted, v.num_drafted)
        slot.stats.rollbacks += int(not v.all_accepted)
        emitted = v.emitted(drafts)
        slot.committed += emitted
        if drafts:
            self.window.observe_round(v.num_accepted, v.num_drafted)
            slot.windows.append(len(drafts))
            self.accepted += v.num_accepted
            self.rejections += int(not v.all_accepted)
        return v.num_drafted, v.num_accepted, len(emitted)

    def _result(self, slot: Slot) -> DecodeResult:
        r = slot.result
        r.token_ids = cut(slot.committed, slot.item.max_new_tokens, self.eos)
        r.stats = slot.stats
        r.decode_s = time.perf_counter() - slot.decode_start
        if slot.draft_cursor is not None:
            r.gamma = sum(slot.windows) / len(slot.windows) if slot.windows else 0.0
        return r

    def report(self) -> dict:
        """What the batch did, for the run's summary and the throughput bench's accounting (Appendix C over a
        batch: pipeline/batch_window.py): rounds, mean items per round, mean window, mean target forward (T_p of
        the batch) and draft forward (T_q of the batch), tau_hat over every row's windows; decode_s, the time
        spent in rounds."""
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {"size": self.size, "rounds": self.rounds, "decode_s": self.decode_s, "mean_batch": mean(self.batch_sizes),
                "mean_gamma": mean(self.gammas), "plain_rounds": sum(g == 0 for g in self.gammas),
                "plain_items": self.plain_items,
                "t_p_s": mean(self.verify_s), "t_q_s": mean(self.draft_step_s),
                "tau_hat": tau_hat(self.accepted, self.rejections) if self.draft is not None else None}


def kv_bytes_per_token(adapter: VideoLMAdapter) -> int:
    """Bytes one token takes in a model's KV cache: keys and values, every layer, every KV head."""
    text = adapter.model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * adapter.model.dtype.itemsize

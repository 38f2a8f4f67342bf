"""The draft model in the target's process: draft and target take turns on the same rank.

Asked for windows, it drafts them now: each request's draft row is first brought in line with what the
request committed (its `CacheCursor`, a per-row rollback), then every row proposes its next token from one
batched forward per token (`ModelProposer`), until each has its window (never past its max_new_tokens). An
item's draft side starts with the target's prefill: the signals its strategy reads, the kept video tokens,
the draft's vision and its pruned prefill (`prefill_pair`, the serial reference's own), on whatever thread
prefills the item; its row joins the draft's batch with the request. Each request drafts from its own
sampler, seeded as its batch-1 run seeds it (pipeline/seeds.py), so a sampled item's tokens never depend on
the batch.
"""

from __future__ import annotations

import torch

from vpsd.config import DecodingConfig, PruningConfig
from vpsd.engine.keep import keep_policy_for
from vpsd.engine.pair_prefill import prefill_pair, strategy_signal_layers
from vpsd.engine.drafters.chain import feed_missing
from vpsd.engine.drafters.protocol import Proposal
from vpsd.engine.proposers import ModelProposer
from vpsd.engine.request import Request
from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.messages import VerifyResult
from vpsd.pipeline.tree import DraftTree
from vpsd.pipeline.sampling import ItemSampler
from vpsd.pipeline.seeds import draft_sampler
from vpsd.models.timing import Stopwatch
from vpsd.tracing import record_span, span


def record_draft_steps(watches: list[Stopwatch], items: list[str]) -> tuple[int, float]:
    """Each of a round's draft forwards as a `draft_step` span (what the reports read T_q from, as a draft rank
    writes them), timed once the round's tokens were read (on a GPU, earlier would wait for the forwards); returns
    (rows, mean seconds) for the cost model."""
    for w in watches:
        record_span("draft_step", w.started, w.seconds, items=items, rows=len(items))
    return len(items), sum(w.seconds for w in watches) / len(watches)


class LocalDrafter:
    overlaps_verify = False
    tree: DraftTree | None = None

    def __init__(self, target: VideoLMAdapter, draft: VideoLMAdapter, decoding: DecodingConfig,
                 pruning: PruningConfig, parallel_signals: bool = False) -> None:
        """parallel_signals: prune from the layers a parallel method's pipeline streams, so hippo here keeps
        exactly the video tokens hippo through the ranks keeps."""
        self.target, self.draft, self.decoding, self.pruning = target, draft, decoding, pruning
        self.parallel_signals = parallel_signals
        self.keep_policy = keep_policy_for(pruning, target.family)
        self.proposer = ModelProposer(draft)
        self.cursors: dict[str, CacheCursor] = {}
        self.samplers: dict[str, ItemSampler] = {}
        self._step: tuple[int, float] | None = None

    def start(self, request: Request, gamma: int) -> None:
        pass

    def pump(self, timeout_s: float = 0.0) -> bool:
        return False  # nothing arrives: windows are drafted when asked for

    def has_proposal(self, request: Request) -> bool:
        return True

    def wait(self) -> None:
        pass  # never asked: a round with drafted requests always has their windows

    def prefill(self, request: Request, emb: SequenceEmbeddings, on_engine_thread: bool) -> PrefillResult:
        pair = prefill_pair(self.target, self.draft, request.frames, request.prompt, self.keep_policy, self.pruning,
                            request.frame_times, target_emb=emb, parallel_signals=self.parallel_signals,
                            item_seed=request.seed)
        request.draft_handle = pair.draft
        request.num_kept, request.kept, request.layout = pair.num_kept, pair.kept_indices(), emb.layout
        request.draft_prefill_s = pair.draft_s
        return pair.target

    def prefill_signals(self, target: VideoLMAdapter) -> tuple[int, int] | None:
        return strategy_signal_layers(target, self.pruning, self.parallel_signals)

    def join(self, request: Request, gamma: int) -> None:
        pre, request.draft_handle = request.draft_handle, None
        self.cursors[request.id] = CacheCursor(self.proposer.join(request.id, pre))
        self.samplers[request.id] = draft_sampler(self.decoding.rule, request.seed)

    def proposals(self, requests: list[Request], gamma: int) -> dict[str, Proposal]:
        windows = {r.id: max(0, min(gamma, r.max_new_tokens - len(r.committed) - 1)) for r in requests}
        active = {r.id: r for r in requests if windows[r.id] > 0}
        if not active:
            return {}
        tokens: dict[str, list[int]] = {item: [] for item in active}
        probs: dict[str, list[torch.Tensor]] = {item: [] for item in active}
        drafting, watches = list(active), []  # the rows still short of their window
        with span("draft", items=list(active), gamma=gamma):
            while drafting:
                # One forward: the committed tokens a row's cache lacks (the first step), then its last proposal.
                # A row whose window is full leaves first: its last proposal is never fed (sd.draft_chunk).
                watch = feed_missing(self.proposer, self.cursors,
                                     {item: active[item].committed + tokens[item] for item in drafting})
                watches += [watch] if watch is not None else []
                for item in drafting:
                    pos = len(active[item].committed) + len(tokens[item])  # its output position
                    token, q = self.proposer.propose(item, pos, self.samplers[item])
                    tokens[item].append(token)
                    probs[item] += [q] if q is not None else []
                drafting = [item for item in drafting if len(tokens[item]) < windows[item]]
        self._step = record_draft_steps(watches, list(active)) if watches else None
        return {item: Proposal(tokens[item], torch.stack(probs[item]) if probs[item] else None,
                               len(r.committed), gamma) for item, r in active.items()}

    def verified(self, request: Request, verdict: VerifyResult, target_rows: torch.Tensor) -> None:
        pass  # the next proposals bring the row in line with what was committed

    def error(self, request: Request) -> str | None:
        return None

    def finish(self, request: Request, error: str | None) -> None:
        if request.id in self.cursors:
            del self.cursors[request.id], self.samplers[request.id]
            self.proposer.leave(request.id)

    def draft_step(self) -> tuple[int, float] | None:
        step, self._step = self._step, None
        return step


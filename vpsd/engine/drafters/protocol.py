"""Where the draft runs, as the engine sees it: one protocol, two places.

The engine (engine/engine.py) owns the target: its prefill, its batch, the verify forward and the commit.
A `Drafter` owns everything on the draft's side of an item and answers, each round, with the windows it
has for the requests in flight (`proposals`). The engine never knows which place it has:

- `LocalDrafter` (engine/drafters/local.py): the draft model in this process. Draft and target take turns:
  asked for windows, it drafts them now, every row in one batched forward per token.
- `RemoteDrafter` (engine/drafters/remote.py): the draft rank and the pruner rank over the link. They draft
  while the target verifies; asked for windows, it hands over the chunks that have arrived and can be
  verified now (the item's `TargetMachine` drops stale ones), possibly none for some requests.

What drafts on the draft's side (a row of the draft's batched cache, or TABED's ensemble of views) is the
draft's own plug-in (engine/proposers.py), whichever place it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from vpsd.engine.request import Request
from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.pipeline.messages import VerifyResult
from vpsd.pipeline.tree import DraftTree


@dataclass
class DraftedTree:
    """A draft tree's round: the (truncated) tree, its node tokens (node 0 the root, the last committed token)
    and, when sampling, the q each expanded node's candidates were drawn from (pipeline/tree.py)."""

    tree: DraftTree
    tokens: list[int]
    probs: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Proposal:
    """A window of draft tokens for one request, to verify after its first `start` committed tokens: a chain, or
    a tree's nodes (`tree`; token_ids are its nodes 1..N, verified together in one forward, pipeline/tree.py)."""

    token_ids: list[int]
    q: torch.Tensor | None  # (k, V) the draft's distributions, when the rejection rule samples a chain
    start: int
    gamma: int  # the window it was drafted under (a tree: its depth)
    tree: DraftedTree | None = None


class Drafter(Protocol):
    # What the engine's pacing reads (engine.window_for): whether the draft drafts while the target verifies (its
    # own rank or thread: the parallel window, Eq. 6 / Theorem 6; the target's prefill streams the pruner its
    # signals from inside) or takes turns with it (the serial window), and the static tree a round drafts (None:
    # a chain), whose rounds the serial window prices as the tree's rows.
    overlaps_verify: bool
    tree: DraftTree | None

    def start(self, request: Request, gamma: int) -> None:
        """A request is about to be prefilled on the engine's thread: tell the draft's side now (and the window
        to draft with), so that it reads the video and runs its vision tower while the target does."""

    def prefill(self, request: Request, emb: SequenceEmbeddings, on_engine_thread: bool) -> PrefillResult:
        """The target's full prefill of a drafted request, with the signals this drafter's pruning reads
        (`prefill_for_strategy`), and this side's share of the item's start (the pruned draft prefill, or the
        signals sent or held for `join`)."""

    def prefill_signals(self, target: VideoLMAdapter) -> tuple[int, int] | None:
        """The signal layers (attention layers, UV-Prune layer) its `prefill` asks of the target's prefill, which
        a result prefilled with the request's siblings must carry (engine/sibling_prefill.py); None: its prefill
        takes no such result."""

    def join(self, request: Request, gamma: int) -> None:
        """The request joins the batch (its draft row joins; held signals leave with its start)."""

    def proposals(self, requests: list[Request], gamma: int) -> dict[str, Proposal]:
        """The windows that can be verified now, by request id (a window of at most `gamma` tokens)."""

    def verified(self, request: Request, verdict: VerifyResult, target_rows: torch.Tensor) -> None:
        """The verdict on a request's window (`target_rows`: the target's logits rows that scored it)."""

    def error(self, request: Request) -> str | None:
        """Why the draft's side cannot draft the request (it fails with this), or None."""

    def finish(self, request: Request, error: str | None) -> None:
        """The request left the batch (done, or failed with `error`)."""

    def draft_step(self) -> tuple[int, float] | None:
        """(rows, seconds) of the draft's latest batched forward, for the cost model; None: nothing new."""

    # What arrives while the target works: a remote drafter's chunks; a local one drafts when asked, so it always
    # has a window and nothing ever arrives (the scheduler asks both the same way, never which place it has).

    def pump(self, timeout_s: float = 0.0) -> bool:
        """Takes what has arrived, waiting up to `timeout_s` for the first message; whether any came."""

    def has_proposal(self, request: Request) -> bool:
        """Whether a window for the request can be verified now."""

    def wait(self) -> None:
        """Blocks until the draft's side sends something (a round found nothing to verify)."""

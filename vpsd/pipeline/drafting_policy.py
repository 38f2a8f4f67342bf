"""Whether the next item is worth drafting for, or better decoded plain (as `ar`) beside the drafted ones.

The papers always draft. Here the pair's measured costs and acceptance on this job decide, per item, from one
rule: draft where drafting is predicted to save time; where it is predicted to lose `loss_s`, decode the item
plain, except when the one explore budget (pipeline/cost.py `ExploreBudget`, shared with the serial window's
rounds) covers that loss, so tau and the costs stay measured. Each plain decision earns 3% of the item's
predicted plain time. A sampled item always drafts (whether an item drafts must not depend on timing, or its
sample would), and so does every item under a fixed window.

What "predicted loss" means depends on where the draft runs, because what drafting costs does:

- serial batch (`serial_loss`): draft and target take turns on the same cores, so an item's draft prefill
  (its vision, the pruning, its pruned prefill: D) is paid there; drafting saves the decode work
  `SerialWindow.drafting_saves` and loses D minus that.
- pipelined batch (`parallel_loss`): the draft's steps and prefill run on its own rank and are not counted.
  A round with drafted rows costs T_p(gamma + 1) and commits `drafted_rate` tokens per drafted row per round
  in flight (rollbacks, stale chunks and rounds it missed waiting for its draft included; before any item
  finished, 1 + E[X]); a round of plain rows costs T_p(1) for one token each. The item's share: / B.
- batch 1 (`batch1_loss`): the target waits for the draft after every rollback, so the measure is the wall:
  seconds per decoded token of the drafted items that finished against the plain ones'. Before a plain item
  has finished, one is decoded to measure it, unless drafting beats half the line's T_p(1) (on a CPU a
  forward of one row takes the matrix-vector path and costs less than the line through the windows' rows
  says). That measurement is made on a cheap item: one whose budget is at most half the tokens an item has
  committed so far (a short answer among captions), while longer ones go on drafting; only after
  `EXPLORE_AFTER` such longer items drafted waiting for one is any item decoded plain to measure it.
  (On the long world's questions, 5 tokens of an event answer measure the rate as well as a 100-token caption
  decoded plain, which costs ~2 s of a ~37 s job.)
`predicted_loss` picks which of the three an engine's window means. Pure: the engine passes in what it measured
(`ItemMeans`).

Whether drafting pays is decided in two places, each for its own unit: an item here (drafted or plain, once,
when its prefill starts), a round by the window (pipeline/cost.py: `choose` returns 0 for a plain round of the
drafted items, `pre_verify` whether a rejection's retry is a two-row verify). The scheduler's straggler patience
and its prefill stealing decide when a round runs and on which thread a prefill does, not whether to draft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vpsd.pipeline.cost import ExploreBudget, ParallelWindow, SerialWindow, running_mean
from vpsd.pipeline.theory import expected_accepted

EXPLORE_AFTER = 4  # batch 1: long items that draft waiting for a cheap one to measure the plain rate, at most


@dataclass
class ItemMeans:
    """Running means over the job's finished items."""

    tokens: float | None = None  # N: tokens an item commits
    draft_prefill_s: float | None = None  # D: what drafting adds to an item's prefill (serial engine)
    token_s: dict[bool, float] = field(default_factory=dict)  # drafted? -> seconds per decoded token (batch 1)
    drafted_rate: float | None = None  # tokens a drafted item commits per round in flight (pipelined batch)
    # drafted? -> running means of an item's decode seconds and of its decoded tokens, whose ratio is `token_s`
    spent_s: dict[bool, float] = field(default_factory=dict)
    decoded: dict[bool, float] = field(default_factory=dict)
    # batch 1: items that drafted because the plain rate, wanted, waits for a cheap item to measure it
    deferred: int = 0

    def observe_item(self, drafted: bool, tokens: int, decode_s: float, rounds: int) -> None:
        """An item that finished: `tokens` committed (the prefill's first included) over `rounds` rounds.
        Seconds per token are a ratio of running means (decode seconds over tokens decoded), so each item weighs
        by its tokens: a 4-token answer, whose decode is mostly the draft's start, moves the rate by 4 tokens'
        worth, not as much as a 300-token caption (a mean of per-item rates did, and a few short answers then
        turned drafting off for a whole job at 2x its decode speed). What decides is time per item, i.e. the
        ratio of the means."""
        self.tokens = running_mean(self.tokens, tokens)
        if tokens > 1:
            self.spent_s[drafted] = running_mean(self.spent_s.get(drafted), decode_s)
            self.decoded[drafted] = running_mean(self.decoded.get(drafted), tokens - 1)
            self.token_s[drafted] = self.spent_s[drafted] / self.decoded[drafted]
        if drafted and rounds > 0:
            self.drafted_rate = running_mean(self.drafted_rate, tokens / rounds)

    def observe_draft_prefill(self, seconds: float) -> None:
        self.draft_prefill_s = running_mean(self.draft_prefill_s, seconds)


DraftingLoss = tuple[float, float] | None  # (loss_s of drafting the item, its plain decode time); None: draft


def serial_loss(window: SerialWindow, batch: int, means: ItemMeans) -> DraftingLoss:
    if means.tokens is None or means.draft_prefill_s is None:
        return None
    saves = window.drafting_saves(batch, means.tokens)
    plain_s = window.plain_item_s(batch, means.tokens)
    if saves is None or plain_s is None:
        return None
    return means.draft_prefill_s - saves, plain_s


def parallel_loss(window: ParallelWindow, batch: int, means: ItemMeans) -> DraftingLoss:
    t_plain, t_window = window.verify_time(1), window.verify_time(window.gamma + 1)
    if t_plain is None or t_window is None or means.tokens is None:
        return None
    rate = means.drafted_rate or 1.0 + expected_accepted(window.cost.tau, window.gamma)
    return means.tokens * (t_window / rate - t_plain) / batch, means.tokens * t_plain / batch


def batch1_loss(window: ParallelWindow, means: ItemMeans, budget: int | None = None) -> DraftingLoss:
    """`budget`: the item's max_new_tokens (None: unknown, as cheap as any)."""
    drafted, t_plain = means.token_s.get(True), window.verify_time(1)
    if drafted is None or means.tokens is None:
        return None
    plain = means.token_s.get(False)
    if plain is None:  # not measured yet: a plain item measures it unless drafting clearly wins
        if t_plain is None or drafted <= t_plain / 2:
            return None
        cheap = budget is None or budget <= means.tokens / 2
        if not cheap and means.deferred < EXPLORE_AFTER:
            means.deferred += 1  # counted here: the engine asks once an item, under its lock
            return None  # a cheap item measures it (module docstring); this one drafts meanwhile
        return math.inf, means.tokens * t_plain / 2  # to be measured: this item decodes plain
    return means.tokens * (drafted - plain), means.tokens * plain


def predicted_loss(window: SerialWindow | ParallelWindow, size: int, batch: int, means: ItemMeans,
                   budget: int | None = None) -> DraftingLoss:
    """The loss of drafting the next item (its max_new_tokens: `budget`) of an engine of `size` slots with `batch`
    requests in flight, as the place its draft runs (the window's kind) makes it (module docstring)."""
    if not window.pipelined:
        return serial_loss(window, batch, means)
    return batch1_loss(window, means, budget) if size == 1 else parallel_loss(window, batch, means)


@dataclass
class DraftingPolicy:
    """The one rule (module docstring); `always`: sampled runs and fixed windows draft every item."""

    budget: ExploreBudget = field(default_factory=ExploreBudget)
    always: bool = False

    def decide(self, prediction: DraftingLoss) -> bool:
        if self.always or prediction is None:
            return True
        loss_s, plain_s = prediction
        if loss_s <= 0 or self.budget.afford(loss_s):
            return True
        self.budget.earn(plain_s)
        return False

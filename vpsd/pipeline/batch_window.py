"""The draft window of a batch, chosen by goodput: committed tokens per second over the whole batch.

With B items in flight, one round of batched serial speculative decoding costs gamma draft forwards of the
batch and one verify forward of B rows of gamma + 1 tokens, and commits 1 + E[accepted] tokens per item:

    time per committed token (B items)  =  (gamma T_q(B) + T_p(B, gamma + 1)) / (B (1 + E[X](tau, gamma)))

E[X] = tau (1 - tau^gamma) / (1 - tau), Lemma 1 of ParallelVLM App. C (the truncated geometric length of
Theorem 6, in place of Theorem 4's tau gamma, which assumes every token is tried). gamma = 0 is plain batched
decoding (T_p(B, 1) per B tokens), so the choice falls back to it exactly when speculation does not pay at
this B: the batch is never slower than batched `ar` by more than what the exploration rounds cost. This is
SmartSpec's idea (Liu et al., 2024: pick the window that maximises goodput at the current batch size),
with Theorem 6's acceptance model.

A batch may mix rows with a draft and plain rows (items decoded without one, `speculation_pays` below). Only
the k drafting rows gain E[X], but the verify forward pads every row to gamma + 1 (`BatchedCache` is a padded
batch) and the draft forwards carry the k rows, so the round's cost per committed token, times B, is

    (gamma T_q(k) + T_p(B (gamma + 1))) / (1 + (k / B) E[X](tau, gamma))

which is the line above at k = B. (Priced as if every row drafted, one drafting row among six plain ones
made the whole round twice a plain round's cost for a third of a token: at 4x the video tokens, such rounds
were 5-8% of the decode time.)

Exploring. While gamma 0 wins, the window still speculates now and then, so tau and the costs stay measured
and the choice can come back; each such round loses, against plain decoding of the tokens it commits, its
time minus (1 + (k / B) E[X]) T_p(B). Exploring is paid from a budget: every plain round adds
`explore_share` of its time (T_p(B)), and a round explores (at the cheapest gamma > 0) once the budget covers
its predicted loss, then starts again from zero. So while speculation does not pay, exploring costs at most
`explore_share` of the plain rounds' time (3%), whatever the batch and the pair; a round with no drafting row
learns nothing and never explores. (The first version explored one round in 8, whatever it cost: at 4x the
video tokens, a padded round costs twice a plain one, 12% on top of the plain rounds.)

What is measured, live: T_p as a line in the rows a target forward computes, T_p(B k) = a + b B k
(`WeightedLine`; on this CPU a forward's cost follows its total rows: B = 8 rows of 8 tokens cost what B = 4
rows of 16 do, and on a GPU b is close to 0 up to hundreds of rows), so one fit serves every batch size the job
passes through as items join and leave; T_q(B) = a' + b' B for the draft's forward likewise; tau_hat over every
row's rounds (one acceptance model for the batch: the rows share the draft and the target). Until both lines
have seen two sizes and tau a round, the window is `initial` (the config's serial gamma). When gamma 0 wins,
a round now and then still speculates (Exploring, above). A fixed window (a user's --gamma N) never moves.
Pure: no clocks here; the decoder passes in what it measured.

Whether an item is worth drafting for at all (`speculation_pays`): speculation also costs each item the
draft's own vision, the pruning and the draft's pruned prefill before its first round, D seconds, which the
rounds' goodput above does not see. The decision is for one item among others: while the rounds speculate
(gamma* > 0), a plain row rides them, padded to gamma* + 1 rows, and commits one token where a drafted row
commits 1 + E[X]. Over an item of N tokens at B in flight, drafting then saves the decode work

    N cost(gamma*) E[X] / B               (cost: `batch_token_time`, per committed token of an item, times B)

and, where the rounds would not speculate (cost(0) <= cost(gamma*)), N (cost(0) - cost(gamma*)) / B <= 0. A job
whose cores are all busy (a batch job on this CPU is: the next items prefill beside the rounds) is faster
exactly when that exceeds D. (The first version of this rule priced a plain row at cost(0), an all-plain
round, which it never gets beside drafted rows: at B = 16 it sent 3-6 of 32 items plain, and their padded
rounds took the batch from 19 rounds to 46-50.) With a draft costing c = T_p / T_q > 30 (the scaled default) D is a few
ms and speculation always pays; with a draft grown to c ~ 9 its vision and prefill cost a fifth of the
target's, while a batch of 8 already makes plain decoding cheap, and then an item is better decoded plain.
N and D are running means over the job's items. This is where vpsd departs from SmartSpec, whose goodput
counts decode steps only: with continuous batching the drafts' prefills are on the same cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vpsd.pipeline.theory import expected_accepted, tau_hat
from vpsd.pipeline.window import WeightedLine, running_mean


EXPLORE_SHARE = 0.03  # what exploring a losing draft may cost, as a share of the plain decoding's time


def batch_token_time(t_q: float, t_p: float, gamma: int, tau: float, drafting_share: float = 1.0) -> float:
    """Seconds per committed token of one item in a batch round, times B (see the module docstring), with
    `drafting_share` = k / B of the rows drafting (the rest commit one token each)."""
    return (gamma * t_q + t_p) / (1.0 + drafting_share * expected_accepted(tau, gamma))


@dataclass
class BatchWindow:
    initial: int
    gamma_min: int = 1
    gamma_max: int = 16
    fixed: bool = False
    decay: float = 0.9
    explore_every: int = 8  # items: one plain decision in this many drafts anyway (`speculation_pays`)
    explore_share: float = EXPLORE_SHARE  # rounds: what exploring may cost, as a share of the plain rounds' time
    accepted: float = 0.0
    rejections: float = 0.0
    verify: WeightedLine = field(default_factory=lambda: WeightedLine(0.9))  # T_p(rows), rows = B k
    draft: WeightedLine = field(default_factory=lambda: WeightedLine(0.9))  # T_q(B)
    _explore_budget: float = 0.0  # seconds of loss the next exploring round may cost (module docstring)
    draft_prefill_s: float | None = None  # D: running mean of what drafting adds to an item's prefill
    item_tokens: float | None = None  # N: running mean of an item's committed tokens
    _plain_items: int = 0  # consecutive items admitted without a draft

    def observe_draft_prefill(self, seconds: float) -> None:
        self.draft_prefill_s = running_mean(self.draft_prefill_s, seconds)

    def observe_item(self, tokens: int) -> None:
        self.item_tokens = running_mean(self.item_tokens, tokens)

    def drafting_saves(self, batch: int) -> float | None:
        """Seconds of decode work drafting saves one item at `batch` in flight (the module docstring): N cost(g*)
        E[X] / B while the rounds speculate, N (cost(0) - cost(g*)) / B <= 0 where they would not; None until the
        costs, N and D are measured."""
        costs = self.costs(batch)
        if costs is None or self.item_tokens is None or self.draft_prefill_s is None:
            return None
        g = min((g for g in costs if g > 0), key=costs.get)
        if costs[g] >= costs[0]:
            return self.item_tokens * (costs[0] - costs[g]) / batch
        tau = tau_hat(self.accepted, self.rejections)
        return self.item_tokens * costs[g] * expected_accepted(tau, g) / batch

    def speculation_pays(self, batch: int) -> bool:
        """Whether the next item should be drafted for (see the module docstring). A fixed window always
        drafts; an item in `explore_every` drafts anyway, so the costs and tau stay measured."""
        saves = None if self.fixed else self.drafting_saves(batch)
        if saves is None or saves > self.draft_prefill_s:
            self._plain_items = 0
            return True
        self._plain_items += 1
        return self._plain_items % self.explore_every == 0

    def observe_draft_step(self, batch: int, seconds: float) -> None:
        """One draft forward of `batch` rows of one token each."""
        if batch >= 1 and seconds > 0:
            self.draft.observe(batch, seconds)

    def observe_verify(self, batch: int, rows: int, seconds: float) -> None:
        """One target forward of `batch` rows, `rows` tokens each (the longest row's: the others are padded)."""
        if batch >= 1 and rows >= 1 and seconds > 0:
            self.verify.observe(batch * rows, seconds)

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        """One row's verified window (tau_hat's A and R, exponentially weighted)."""
        if num_drafted >= 1:
            self.accepted = self.decay * self.accepted + num_accepted
            self.rejections = self.decay * self.rejections + (num_accepted < num_drafted)

    def costs(self, batch: int, drafting: int | None = None) -> dict[int, float] | None:
        """{gamma: time per committed token x B} over 0 and [gamma_min, gamma_max], with `drafting` of the
        `batch` rows drafting (default: all); None until measured."""
        if not (self.verify.spread and self.draft.spread) or self.accepted + self.rejections <= 0:
            return None
        k = batch if drafting is None else max(0, min(drafting, batch))
        tau = tau_hat(self.accepted, self.rejections)
        t_q = self.draft.at(max(k, 1))
        return {g: batch_token_time(t_q, self.verify.at(batch * (g + 1)), g, tau, k / batch)
                for g in [0, *range(self.gamma_min, self.gamma_max + 1)]}

    def gamma(self, batch: int, drafting: int | None = None) -> int:
        """The window for the next round of a batch of `batch` items, `drafting` of them with a draft (default:
        all); 0: plain batched decoding."""
        if self.fixed:
            return self.initial
        costs = self.costs(batch, drafting)
        if costs is None:
            return self.initial
        best = min(costs, key=costs.get)
        if best > 0:
            self._explore_budget = 0.0
            return best
        self._explore_budget += self.explore_share * costs[0]  # costs[0] = T_p(B): this plain round's time
        k = batch if drafting is None else drafting
        if k <= 0:
            return 0  # no row has a draft: a speculative round would learn nothing
        g = min((g for g in costs if g > 0), key=costs.get)
        if self._explore_budget < self.exploring_loss(costs, g, batch, k):
            return 0
        self._explore_budget = 0.0
        return g

    def exploring_loss(self, costs: dict[int, float], gamma: int, batch: int, drafting: int) -> float:
        """Seconds a round at `gamma` loses against plain decoding of the tokens it commits (module docstring):
        its time, minus (1 + (k / B) E[X]) T_p(B)."""
        commits = 1.0 + drafting / batch * expected_accepted(tau_hat(self.accepted, self.rejections), gamma)
        return commits * (costs[gamma] - costs[0])

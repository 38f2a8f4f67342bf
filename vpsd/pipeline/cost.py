"""One cost model of the engine's rounds (ParallelVLM App. C over a batch), and the window each way of drafting
chooses from it.

`CostModel` is what the engine measures, live: T_p as a line in the token rows a target forward computes,
T_p(n) = a + b n with n = B k for B items of k rows (`WeightedLine`; on a CPU a forward's cost follows its
total rows, on a GPU b is close to 0 up to hundreds of rows), T_q(B) = a' + b' B for a draft forward of B
rows, and tau_hat = A / (A + R) over every verified window (pipeline/theory.py), all exponentially weighted
so that a moving context or a contended core is followed within a few rounds.

Two objectives read it, one per place the draft runs, both behind one protocol (`Window`), which is all the
engine sees of its pacing:

- `SerialWindow`: draft and target take turns (a local drafter). One round of B items costs gamma draft
  forwards and one verify of B (gamma + 1) rows and commits 1 + E[X] tokens per drafting item:

      time per committed token x B = (gamma T_q(k) + T_p(B (gamma + 1))) / (1 + (k / B) E[X](tau, gamma))

  with k of the B rows drafting (`theory.serial_round_token_time`); E[X] = tau (1 - tau^gamma) / (1 - tau) (Lemma 1).
  gamma = 0 is plain batched decoding, so the window falls back to it exactly where speculation does not
  pay at this B (SmartSpec's goodput rule, with Theorem 6's acceptance model).
- `ParallelWindow`: the draft runs beside the target (a remote drafter). The pipeline balances when
  gamma T_q = T_p(gamma) (ParallelVLM Eq. 6); once rounds are verified the window minimises Theorem 6's
  per-token time 2 max(gamma T_q, T_p(gamma)) / ((1 + tau^gamma) E[X]). Where this departs from the paper:
  T_p is measured as a function of the window, not once (a k-row verify costs more than a 1-row one on a
  CPU), so the balance is gamma = a / (T_q - b) and the optimum can be shorter than it; with b ~ 0 (a GPU)
  both are Eq. 6.

Exploring (`ExploreBudget`): where drafting does not pay, the engine still drafts now and then so tau and
the costs stay measured. Every plain round or item earns `share` (3%) of its time; a round or item that
drafts against the model's advice spends its predicted loss, and only once the budget covers it. So while
speculation loses, exploring costs at most 3% of the plain decoding's time, whatever the batch and the pair.
Pure: no clocks here; the engine passes in what it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from vpsd.pipeline.theory import expected_accepted, parallel_sd_rollback_token_time, serial_round_token_time, tau_hat

AUTO = "auto"
EXPLORE_SHARE = 0.03  # what exploring a losing draft may cost, as a share of the plain decoding's time


def running_mean(mean: float | None, x: float, weight: float = 0.2) -> float:
    """An exponentially weighted running mean: the first value as it is, then `weight` on each new one."""
    return x if mean is None else (1.0 - weight) * mean + weight * x


@dataclass
class WeightedLine:
    """T(n) = a + b n fitted by weighted least squares, each new point weighing 1 and the history `decay` times
    what it weighed before (about the last 1 / (1 - decay) points count). With one distinct n seen, the line is
    flat at the weighted mean. b is never negative: a forward never gets cheaper with more rows."""

    decay: float = 0.8
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # sum w, w n, w n^2, w t, w n t

    def observe(self, n: float, t: float) -> None:
        s = self._sums
        for i, v in enumerate((1.0, n, n * n, t, n * t)):
            s[i] = self.decay * s[i] + v

    def line(self) -> tuple[float | None, float]:
        """(a, b), or (None, 0) before any point."""
        w, wn, wnn, wt, wnt = self._sums
        if w <= 0:
            return None, 0.0
        var = wnn / w - (wn / w) ** 2
        if var < 1e-9:  # one size so far: a constant (Eq. 6 as printed)
            return wt / w, 0.0
        b = max((wnt / w - (wn / w) * (wt / w)) / var, 0.0)
        return wt / w - b * wn / w, b

    def at(self, n: float) -> float | None:
        a, b = self.line()
        return None if a is None else a + b * n

    @property
    def spread(self) -> bool:
        """Whether two distinct n have been seen (a slope is measured, not assumed 0)."""
        w, wn, wnn = self._sums[:3]
        return w > 0 and wnn / w - (wn / w) ** 2 >= 1e-9


@dataclass
class CostModel:
    """The measured costs and acceptance of a job's rounds (module docstring)."""

    decay: float = 0.9
    accepted: float = 0.0  # accepted draft tokens, exponentially weighted (tau_hat's A)
    rejections: float = 0.0  # windows that ended in a rejection, the same weights (tau_hat's R)

    def __post_init__(self) -> None:
        self.verify = WeightedLine(self.decay)  # T_p(n), n = token rows of the forward
        self.draft = WeightedLine(self.decay)  # T_q(B), B = rows of the draft forward

    def observe_verify(self, rows: int, seconds: float) -> None:
        if rows >= 1 and seconds > 0:
            self.verify.observe(rows, seconds)

    def observe_draft_step(self, rows: int, seconds: float) -> None:
        if rows >= 1 and seconds > 0:
            self.draft.observe(rows, seconds)

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        """One verified window: how many of its draft tokens the target accepted."""
        if num_drafted >= 1:
            self.accepted = self.decay * self.accepted + num_accepted
            self.rejections = self.decay * self.rejections + (num_accepted < num_drafted)

    @property
    def measured_acceptance(self) -> bool:
        return self.accepted + self.rejections > 0

    @property
    def tau(self) -> float:
        return tau_hat(self.accepted, self.rejections)

    def t_p(self, rows: float) -> float | None:
        return self.verify.at(rows)

    def t_q(self, rows: float) -> float | None:
        return self.draft.at(rows)


@dataclass
class ExploreBudget:
    """Seconds of loss the next exploring round or item may cost (module docstring)."""

    share: float = EXPLORE_SHARE
    seconds: float = 0.0

    def earn(self, plain_s: float) -> None:
        self.seconds += self.share * plain_s

    def afford(self, loss_s: float) -> bool:
        """Spends the budget on an exploration predicted to lose `loss_s`, if it covers it."""
        if self.seconds < loss_s:
            return False
        self.seconds = 0.0
        return True


class Window(Protocol):
    """How long the next round's window is, and what the window learns from the rounds: the engine's one view of
    its pacing, chosen with its drafter (`SerialWindow` for a drafter in turns, `ParallelWindow` for one beside
    the target)."""

    pipelined: bool  # the draft drafts beside the target (its windows arrive on their own)
    cost: CostModel

    def choose(self, batch: int, drafting: int | None = None) -> int:
        """The window of the next round of `batch` items, `drafting` of them with a draft; 0: a plain round."""

    def draft_ahead(self) -> int:
        """The window a draft beside the target drafts with, sent with each verdict; 0: it is asked each round."""

    def pre_verify(self) -> bool:
        """After a rejection, have the draft send its first token alone (conservative mode)?"""

    def observe_verify(self, batch: int, rows: int, seconds: float) -> None:
        """A verify forward of `batch` items, `rows` rows each (the longest; the others padded), took `seconds`."""

    def observe_draft_step(self, rows: int, seconds: float) -> None:
        """A draft forward of `rows` rows took `seconds`."""

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        """A window's verdict: `num_accepted` of `num_drafted` tokens."""


@dataclass
class SerialWindow:
    """gamma per round where draft and target take turns, by goodput (module docstring). `fixed`: a user's
    --gamma N, never moved."""

    pipelined = False  # class attribute: what kind of window, not a setting

    initial: int
    gamma_min: int = 1
    gamma_max: int = 16
    fixed: bool = False
    cost: CostModel = field(default_factory=lambda: CostModel(0.9))
    budget: ExploreBudget = field(default_factory=ExploreBudget)
    # A static draft tree's (depth, nodes) (engine/drafters/tree.py): a round drafts the whole tree or nothing, in
    # `depth` draft forwards, and verifies nodes + 1 rows a drafted item, not a chain's gamma + 1. None: a chain.
    tree: tuple[int, int] | None = None

    def costs(self, batch: int, drafting: int | None = None) -> dict[int, float] | None:
        """{gamma: time per committed token x B} over 0 and [gamma_min, gamma_max] (a tree: 0 and its depth),
        with `drafting` of the `batch` rows drafting (default: all); None until both lines have seen two sizes
        and tau a round. A tree's E[X] is Lemma 1's at its depth with tau measured on its own rounds."""
        c = self.cost
        if not (c.verify.spread and c.draft.spread) or not c.measured_acceptance:
            return None
        k = batch if drafting is None else max(0, min(drafting, batch))
        t_q = c.t_q(max(k, 1))
        if self.tree is None:
            windows = {g: g + 1 for g in [0, *range(self.gamma_min, self.gamma_max + 1)]}
        else:
            windows = {0: 1, self.tree[0]: self.tree[1] + 1}
        return {g: serial_round_token_time(t_q, c.t_p(batch * rows), g, c.tau, k / batch) for g, rows in windows.items()}

    def choose(self, batch: int, drafting: int | None = None) -> int:
        """The window of the next round of `batch` items, `drafting` of them with a draft (default: all);
        0: a plain batched step. While 0 wins, a round explores once the budget covers its loss."""
        if self.fixed:
            return self.initial
        costs = self.costs(batch, drafting)
        if costs is None:
            return self.initial
        best = min(costs, key=costs.get)
        if best > 0:
            self.budget.seconds = 0.0
            return best
        self.budget.earn(costs[0])  # costs[0] = T_p(B): this plain round's time
        k = batch if drafting is None else drafting
        if k <= 0:
            return 0  # no row has a draft: a speculative round would learn nothing
        g = min((g for g in costs if g > 0), key=costs.get)
        return g if self.budget.afford(self.exploring_loss(costs, g, batch, k)) else 0

    def draft_ahead(self) -> int:
        return 0  # the drafter in turns is told each round's window

    def pre_verify(self) -> bool:
        return True  # nothing is in flight after a verdict: the next round starts from the committed tokens

    def observe_verify(self, batch: int, rows: int, seconds: float) -> None:
        self.cost.observe_verify(batch * rows, seconds)

    def observe_draft_step(self, rows: int, seconds: float) -> None:
        self.cost.observe_draft_step(rows, seconds)

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        self.cost.observe_round(num_accepted, num_drafted)

    def exploring_loss(self, costs: dict[int, float], gamma: int, batch: int, drafting: int) -> float:
        """Seconds a round at `gamma` loses against plain decoding of the tokens it commits: its time, minus
        (1 + (k / B) E[X]) T_p(B)."""
        commits = 1.0 + drafting / batch * expected_accepted(self.cost.tau, gamma)
        return commits * (costs[gamma] - costs[0])

    def drafting_saves(self, batch: int, item_tokens: float) -> float | None:
        """Seconds of decode work drafting saves one item of `item_tokens` at `batch` in flight. While the
        rounds speculate (gamma* > 0) a plain row rides them padded to gamma* + 1 rows and commits one token
        where a drafted row commits 1 + E[X]: N cost(gamma*) E[X] / B; where they would not, N (cost(0) -
        cost(gamma*)) / B <= 0. None until measured."""
        costs = self.costs(batch)
        if costs is None:
            return None
        g = min((g for g in costs if g > 0), key=costs.get)
        if costs[g] >= costs[0]:
            return item_tokens * (costs[0] - costs[g]) / batch
        return item_tokens * costs[g] * expected_accepted(self.cost.tau, g) / batch

    def plain_item_s(self, batch: int, item_tokens: float) -> float | None:
        """An item's share of plain batched decoding: N T_p(B) / B."""
        t_p = self.cost.t_p(batch)
        return None if t_p is None else item_tokens * t_p / batch


@dataclass
class ParallelWindow:
    """gamma of pipelined drafting: Eq. 6, then Theorem 6's optimum (module docstring). The target measures
    T_p and decides; the draft reports T_q with its chunks. `batch`: the items the target verifies together
    now (T_p is read at batch x rows)."""

    initial: int
    gamma_min: int = 1
    gamma_max: int = 16
    fixed: bool = False
    cost: CostModel = field(default_factory=lambda: CostModel(0.8))
    batch: int = 1
    gamma: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_min <= self.gamma_max:
            raise ValueError(f"gamma bounds must satisfy 1 <= min <= max, got [{self.gamma_min}, {self.gamma_max}]")
        self.gamma = self._clamp(self.initial)

    def _clamp(self, g: float) -> int:
        return int(min(self.gamma_max, max(self.gamma_min, g)))

    @property
    def t_q(self) -> float | None:
        return self.cost.t_q(self.batch)

    def verify_time(self, rows: float) -> float | None:
        """T_p of a verify of `rows` rows per item at the current batch."""
        return self.cost.t_p(self.batch * rows)

    pipelined = True  # class attribute: what kind of window, not a setting

    def choose(self, batch: int, drafting: int | None = None) -> int:
        """The window now, T_p read at `batch` items from here on (the draft drafts it ahead; Eq. 6 moves it)."""
        self.batch = batch
        return self.gamma

    def draft_ahead(self) -> int:
        return self.gamma

    def observe_draft_step(self, rows: int, seconds: float) -> None:
        """The draft's step time (its running mean, sent with every chunk), read at the batch the target verifies:
        the draft's rows are those items'."""
        self.cost.observe_draft_step(self.batch, seconds)
        self._update()

    def observe_verify(self, batch: int, rows: int, seconds: float) -> None:
        """One verify of `rows` rows per item (the longest; the others are padded) at the current batch (the
        items in flight, as `choose` was told: T_p is planned at that batch)."""
        self.cost.observe_verify(self.batch * rows, seconds)
        self._update()

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        self.cost.observe_round(num_accepted, num_drafted)
        self._update()

    def pre_verify(self) -> bool:
        """After a rejection, verify the draft's first token alone (PEARL's pre-verify, ParallelVLM Alg. 1,
        HIPPO's conservative mode) while it drafts on, or wait for a whole window? Pre-verifying keeps the target
        busy with a two-row verify that commits one token; waiting leaves it idle for gamma draft steps, after
        which one forward verifies the window. Pre-verify pays while the draft's window takes longer than that
        forward; in a target-bound pipeline (gamma T_q < T_p(2)) waiting costs less and commits as much (the
        retry round Theorem 6 assumes). Before anything is measured, and under a fixed gamma: the papers' rule."""
        t_p2, t_q = self.verify_time(2), self.t_q
        if self.fixed or t_q is None or t_p2 is None:
            return True
        return self.gamma * t_q >= t_p2

    def _update(self) -> None:
        if self.fixed or self.t_q is None:
            return
        a, b = self.cost.verify.line()
        if a is None:
            return
        a, b, t_q = a, b * self.batch, self.t_q  # T_p(g) = a + b B g at the current batch
        if self.cost.measured_acceptance:
            tau = self.cost.tau
            self.gamma = min(range(self.gamma_min, self.gamma_max + 1),
                             key=lambda g: parallel_sd_rollback_token_time(t_q, a + b * g, g, tau))
        elif t_q <= b:  # each extra drafted token costs the target more than the draft: the longest window
            self.gamma = self.gamma_max
        else:
            self.gamma = self._clamp(math.floor(max(a, 0.0) / (t_q - b) + 0.5))

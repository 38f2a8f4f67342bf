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

What is measured, live and per batch size B (the costs change with B far more than with anything else):
T_q(B) the draft's forward of the batch (exponential average), T_p(B, k) the target's forward of B rows of k
tokens, a line a + b k per B (`WeightedLine`: on a CPU a k-row verify costs 2-4x a 1-row step, on a GPU about
one step up to k ~ 32), and tau_hat over every row's rounds (one acceptance model for the batch: the rows
share the draft and the target). Until a batch size has a T_q and a T_p line, and tau a round, the window is
`initial` (the config's serial gamma); then one plain round measures T_p(B, 1), which the windows of one
length could only extrapolate; when gamma 0 wins, one round in `explore_every` still speculates at
the best gamma > 0, so tau and the costs stay measured and the choice can come back. A fixed window (a
user's --gamma N) never moves. Pure: no clocks here; the decoder passes in what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vpsd.pipeline.theory import expected_accepted, tau_hat
from vpsd.pipeline.window import WeightedLine


def batch_token_time(t_q: float, t_p: float, gamma: int, tau: float) -> float:
    """Seconds per committed token of one item in a batch round, times B (see the module docstring)."""
    return (gamma * t_q + t_p) / (1.0 + expected_accepted(tau, gamma))


@dataclass
class BatchWindow:
    initial: int
    gamma_min: int = 1
    gamma_max: int = 16
    fixed: bool = False
    decay: float = 0.8
    explore_every: int = 8
    accepted: float = 0.0
    rejections: float = 0.0
    draft_step: dict[int, float] = field(default_factory=dict)  # B -> seconds of one draft forward of B rows
    verify: dict[int, WeightedLine] = field(default_factory=dict)  # B -> T_p(B, k)
    plain_measured: set[int] = field(default_factory=set)  # batch sizes with a 1-row forward measured
    _plain_rounds: int = 0  # consecutive rounds at gamma 0

    def observe_draft_step(self, batch: int, seconds: float) -> None:
        if seconds > 0:
            old = self.draft_step.get(batch)
            self.draft_step[batch] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def observe_verify(self, batch: int, rows: int, seconds: float) -> None:
        """One target forward of `batch` rows, `rows` tokens each (the longest row's), in `seconds`."""
        if rows >= 1 and seconds > 0:
            self.verify.setdefault(batch, WeightedLine(self.decay)).observe(rows, seconds)
            if rows == 1:
                self.plain_measured.add(batch)

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        """One row's verified window (tau_hat's A and R, exponentially weighted)."""
        if num_drafted >= 1:
            self.accepted = self.decay * self.accepted + num_accepted
            self.rejections = self.decay * self.rejections + (num_accepted < num_drafted)

    def costs(self, batch: int) -> dict[int, float] | None:
        """{gamma: time per committed token x B} over 0 and [gamma_min, gamma_max]; None until measured."""
        line = self.verify.get(batch)
        t_q = self.draft_step.get(batch)
        if line is None or t_q is None or self.accepted + self.rejections <= 0:
            return None
        tau = tau_hat(self.accepted, self.rejections)
        return {g: batch_token_time(t_q, line.at(g + 1), g, tau) for g in [0, *range(self.gamma_min, self.gamma_max + 1)]}

    def gamma(self, batch: int) -> int:
        """The window for the next round of a batch of `batch` items (0: plain batched decoding)."""
        if self.fixed:
            return self.initial
        costs = self.costs(batch)
        if costs is None:
            return self.initial
        if batch not in self.plain_measured:
            return 0  # one plain round: T_p(B, 1) measured, not extrapolated from windows of one length
        best = min(costs, key=costs.get)
        if best == 0:
            self._plain_rounds += 1
            if self._plain_rounds % self.explore_every:
                return 0
            return min((g for g in costs if g > 0), key=costs.get)
        self._plain_rounds = 0
        return best

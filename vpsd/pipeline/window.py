"""The draft window gamma, matched to the measured speed ratio (ParallelVLM Eq. 6: gamma = c* = T_p / T_q).

The parallel pipeline balances when the draft takes as long to draft a window as the target takes to
verify one: gamma T_q = T_p. Shorter, and the draft idles (the target's verification is the bottleneck
and a longer window would commit more per round for the same verify); longer, and the target idles while
the draft finishes its chunk (Theorem 6's max(gamma t, c t)).

Where this departs from the paper, and why:
- The paper measures T_p once, for a verification of a typical window. Here T_p depends on the window it
  verifies: on a CPU (and for long windows on a GPU) a k-token verify costs more than a 1-token one. The
  controller fits T_p(k) = a + b k to the verifications it has seen (a weighted least-squares line,
  recent rounds weighing more) and solves the balance gamma T_q = a + b gamma, i.e. gamma = a / (T_q - b);
  with one distinct window size seen so far it is Eq. 6 as printed, gamma = T_p / T_q. On a GPU, b ~ 0 and
  both agree.
- Once rounds have been verified, the window is the one that minimises Theorem 6's per-token time
  2 max(gamma T_q, T_p(gamma)) / ((1 + tau^gamma) E[X]) with the measured tau_hat (pipeline/theory.py). With
  T_p independent of gamma that minimum sits at the balance gamma = c (for gamma < c the numerator is flat
  while E[X] grows; past it the numerator grows linearly and E[X] saturates), so it is Eq. 6 again; with a
  verify that grows with the window, and an acceptance that makes long windows mostly wasted, it is shorter:
  the balance would push a CPU, where b is close to T_q, to the longest window allowed.
- Both times are measured live, not once: T_q by the draft (its step time, sent with every chunk), T_p by
  the target (which decides gamma, being the single source of truth, and sends it with every verdict).
  Longer contexts and contended cores move the ratio; the window follows within a few rounds.
- Rounding: to the nearest integer (ParallelVLM App. C discusses floor vs ceil: which wins depends on how
  the mean accepted length compares with gamma), clamped to [gamma_min, gamma_max].
Pure: no clocks here; the roles pass in what they measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vpsd.pipeline.theory import parallel_sd_rollback_token_time, tau_hat

AUTO = "auto"


def running_mean(mean: float | None, x: float, weight: float = 0.2) -> float:
    """An exponentially weighted running mean: the first value as it is, then `weight` on each new one (the
    timings, rates and item lengths the roles and the batch window follow live)."""
    return x if mean is None else (1.0 - weight) * mean + weight * x


@dataclass
class WeightedLine:
    """T(k) = a + b k fitted by weighted least squares, each new point weighing 1 and the history `decay` times
    what it weighed before (about the last 1 / (1 - decay) points count). With one distinct k seen, the line is
    flat at the weighted mean. b is never negative: a forward never gets cheaper with more rows, noise must not
    say otherwise."""

    decay: float = 0.8
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # sum w, w k, w k^2, w t, w k t

    def observe(self, k: float, t: float) -> None:
        s = self._sums
        for i, v in enumerate((1.0, k, k * k, t, k * t)):
            s[i] = self.decay * s[i] + v

    def line(self) -> tuple[float | None, float]:
        """(a, b), or (None, 0) before any point."""
        w, wk, wkk, wt, wkt = self._sums
        if w <= 0:
            return None, 0.0
        var = wkk / w - (wk / w) ** 2
        if var < 1e-9:  # one window size so far: T_p is a constant, Eq. 6 as printed
            return wt / w, 0.0
        b = max((wkt / w - (wk / w) * (wt / w)) / var, 0.0)
        return wt / w - b * wk / w, b

    def at(self, k: float) -> float | None:
        a, b = self.line()
        return None if a is None else a + b * k

    @property
    def spread(self) -> bool:
        """Whether two distinct k have been seen (a slope is measured, not assumed 0)."""
        w, wk, wkk = self._sums[:3]
        return w > 0 and wkk / w - (wk / w) ** 2 >= 1e-9


@dataclass
class WindowController:
    """Chooses gamma. `fixed` set: gamma never moves (a user's --gamma N)."""

    initial: int
    gamma_min: int = 1
    gamma_max: int = 16
    fixed: bool = False
    decay: float = 0.8  # weight of the history per new observation (about the last 5 rounds count)
    t_q: float | None = None  # draft step seconds, exponentially averaged
    accepted: float = 0.0  # accepted draft tokens, exponentially weighted (tau_hat's A)
    rejections: float = 0.0  # rounds that ended in a rejection, the same weights (tau_hat's R)
    gamma: int = 0

    def __post_init__(self) -> None:
        self._verify = WeightedLine(self.decay)
        if not 1 <= self.gamma_min <= self.gamma_max:
            raise ValueError(f"gamma bounds must satisfy 1 <= min <= max, got [{self.gamma_min}, {self.gamma_max}]")
        self.gamma = self._clamp(self.initial)

    def _clamp(self, g: float) -> int:
        return int(min(self.gamma_max, max(self.gamma_min, g)))

    def observe_draft_step(self, seconds: float) -> None:
        """One draft forward (T_q), or the draft's own running mean of it."""
        if seconds > 0:
            self.t_q = seconds if self.t_q is None else self.decay * self.t_q + (1 - self.decay) * seconds
            self._update()

    def observe_verify(self, rows: int, seconds: float) -> None:
        """One verification forward of `rows` new tokens that took `seconds` (T_p at that window)."""
        if rows < 1 or seconds <= 0:
            return
        self._verify.observe(rows, seconds)
        self._update()

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        """One verified chunk: how many of its draft tokens the target accepted."""
        if num_drafted < 1:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejections = self.decay * self.rejections + (num_accepted < num_drafted)
        self._update()

    def pre_verify(self) -> bool:
        """After a rejection, verify the draft's first token alone (PEARL's pre-verify, ParallelVLM Alg. 1,
        HIPPO's conservative mode) while it drafts on, or wait for a whole window?

        Pre-verifying keeps the target busy with a forward of two rows (the target's own token, which it still
        has to feed, and the draft's first) that commits one token; waiting leaves it idle for gamma draft
        steps, after which one forward verifies the window. Pre-verify pays while the draft's window takes
        longer than that forward (a draft-bound pipeline); in a target-bound one (gamma T_q < T_p(2)) waiting
        costs less and commits as much, and that is also the retry round Theorem 6 assumes. Before anything
        is measured, and always under a fixed gamma: pre-verify, the papers' rule."""
        t_p2 = self.verify_time(2)
        if self.fixed or self.t_q is None or t_p2 is None:
            return True
        return self.gamma * self.t_q >= t_p2

    def verify_time(self, rows: float) -> float | None:
        """T_p(rows) from the fitted line (the mean, when only one window size was seen)."""
        return self._verify.at(rows)

    def _update(self) -> None:
        if self.fixed or self.t_q is None:
            return
        a, b = self._verify.line()
        if a is None:
            return
        if self.accepted + self.rejections > 0:
            tau = tau_hat(self.accepted, self.rejections)
            self.gamma = min(range(self.gamma_min, self.gamma_max + 1),
                             key=lambda g: parallel_sd_rollback_token_time(self.t_q, a + b * g, g, tau))
        elif self.t_q <= b:  # each extra drafted token costs the target more than the draft: the longest window
            self.gamma = self.gamma_max
        else:
            self.gamma = self._clamp(math.floor(max(a, 0.0) / (self.t_q - b) + 0.5))

"""Speedup that theory predicts from measured forward times and acceptance (ParallelVLM, Appendix C).

With t = T_q (one draft forward), T_p = c * t (one target verification forward), window gamma and
per-token acceptance rate tau:
- serial SD, Theorem 4 (Eq. 10):        V = c * (tau * gamma + 1) / (gamma + c)
- parallel SD, Theorem 5 (Eq. 11):      V = T_p / (max(gamma t, c t) / (tau * gamma)) = c * tau * gamma / max(gamma, c)
- parallel SD with rollback, Theorem 6 (Eq. 13), accepted length X ~ TruncGeo(tau, gamma) (Lemma 1, Eq. 12):
      E[X] = tau (1 - tau^gamma) / (1 - tau),   V = c * (1 + tau^gamma) * E[X] / (2 * max(gamma, c))
  vpsd's pipeline rolls back (conservative mode after a rejection), so Theorem 6 is its ideal.
The paper states them as speedups over autoregressive decoding whose per-token time is T_p. Measured
accounting (`predicted_speedup`) departs from that in two ways, both because the paper's idealisations do
not hold on real hardware:
- the baseline is `ar`'s own measured per-token time T_ar, not T_p: a verification forward of gamma
  tokens costs more than one `ar` step (2-4x on a CPU, where small-batch GEMMs are not memory-bound), so
  dividing by T_p would credit the method with the target's extra verify cost;
- tau is the per-token acceptance probability that Lemma 1 / Theorem 6 assume (each draft token accepted
  i.i.d. with probability tau), estimated from the rounds as tau_hat = A / (A + R): A accepted draft tokens,
  R rounds that ended in a rejection (each accepted token is a success, each rejection a failure of the
  same Bernoulli trial; rounds that accepted everything end without a trial). accepted/drafted is not that
  probability: it counts the tokens after a rejection, which were never tried, as failures.
A serial round is predicted with that same tau: it commits 1 + E[X] tokens (Lemma 1's accepted length and the
target's own token), not Theorem 4's tau gamma + 1, which counts the drafted tokens after a rejection as tried
(`serial_round_token_time`). It is the one formula for serial rounds: the serial window chooses gamma with it
(pipeline/cost.py), and the reports predict serial rows with it, so a report's prediction is what the engine
optimised.
"""

from __future__ import annotations


def expected_accepted(tau: float, gamma: int) -> float:
    """Lemma 1: mean of a geometric accepted length truncated at gamma."""
    if tau >= 1.0:
        return float(gamma)
    return tau * (1.0 - tau**gamma) / (1.0 - tau)


def serial_sd_speedup(c: float, gamma: int, tau: float) -> float:
    return c * (tau * gamma + 1.0) / (gamma + c)


def parallel_sd_speedup(c: float, gamma: int, tau: float) -> float:
    return c * tau * gamma / max(gamma, c)


def parallel_sd_rollback_speedup(c: float, gamma: int, tau: float) -> float:
    return c * (1.0 + tau**gamma) * expected_accepted(tau, gamma) / (2.0 * max(gamma, c))


def tau_hat(accepted: int, rejections: int) -> float:
    """Per-token acceptance probability estimated from rounds: A / (A + R) (see the module docstring)."""
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def serial_sd_token_time(t_q: float, t_p: float, gamma: float, tau: float) -> float:
    """Theorem 4 (Eq. 10): per-token time of serial SD, (gamma T_q + T_p) / (tau gamma + 1)."""
    return (gamma * t_q + t_p) / (tau * gamma + 1.0)


def serial_round_token_time(t_q: float, t_p: float, gamma: float, tau: float, drafting_share: float = 1.0) -> float:
    """Seconds per committed token of a serial round (the module docstring): (gamma T_q + T_p) / (1 + E[X]).
    Over a batch (pipeline/cost.py) times B, with `drafting_share` = k / B of the rows drafting (the rest commit
    one token each); gamma 0 is a plain step, T_p a token."""
    return (gamma * t_q + t_p) / (1.0 + drafting_share * expected_accepted(tau, gamma))


def parallel_sd_rollback_token_time(t_q: float, t_p: float, gamma: float, tau: float) -> float:
    """Theorem 6 (Eq. 13): per-token time of parallel SD with rollback,
    2 max(gamma T_q, T_p) / ((1 + tau^gamma) E[X]), E[X] from Lemma 1 (gamma rounded to the chunk size)."""
    g = max(1, round(gamma))
    produced = (1.0 + tau**g) * expected_accepted(tau, g)
    return 2.0 * max(g * t_q, t_p) / produced if produced > 0 else float("inf")


def predicted_speedup(parallel: bool, t_ar: float, t_q: float, t_p: float, gamma: float, tau: float) -> float:
    """Decode-only speedup over `ar` that Appendix C predicts from measured times: T_ar over the method's
    per-token time (Theorem 6 for the parallel pipeline; a serial round as the serial window prices it, the
    module docstring). t_ar: ar's measured seconds per token; t_q: one draft step; t_p: one verification forward
    of the chunks actually sent."""
    if parallel:
        per_token = parallel_sd_rollback_token_time(t_q, t_p, gamma, tau)
    else:
        per_token = serial_round_token_time(t_q, t_p, gamma, tau)  # the mean window: E[X] holds for any gamma
    return t_ar / per_token if per_token > 0 else 0.0

"""Speedup that theory predicts from measured forward times and acceptance (ParallelVLM, Appendix C).

With t = T_q (one draft forward), T_p = c * t (one target verification forward), window gamma and
per-token acceptance rate tau:
- serial SD, Theorem 4 (Eq. 10):        V = c * (tau * gamma + 1) / (gamma + c)
- parallel SD, Theorem 5 (Eq. 11):      V = T_p / (max(gamma t, c t) / (tau * gamma)) = c * tau * gamma / max(gamma, c)
- parallel SD with rollback, Theorem 6 (Eq. 13), accepted length X ~ TruncGeo(tau, gamma) (Lemma 1, Eq. 12):
      E[X] = tau (1 - tau^gamma) / (1 - tau),   V = c * (1 + tau^gamma) * E[X] / (2 * max(gamma, c))
  vpsd's pipeline rolls back (conservative mode after a rejection), so Theorem 6 is its ideal.
All are speedups over autoregressive decoding of the target, whose per-token time is T_p.
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

"""ParallelVLM Appendix C formulas against values worked by hand and the paper's own limits."""

import math

import pytest

from vpsd.pipeline.theory import (
    parallel_sd_rollback_token_time,
    predicted_speedup,
    serial_sd_token_time,
    tau_hat,
    expected_accepted,
    parallel_sd_rollback_speedup,
    parallel_sd_speedup,
    serial_sd_speedup,
)


def test_expected_accepted_matches_the_series_definition():
    # E[X] = sum_{k<gamma} k (1-tau) tau^k + gamma tau^gamma   (proof of Lemma 1)
    for tau in (0.1, 0.5, 0.8, 0.95):
        for gamma in (1, 3, 5, 9):
            series = sum(k * (1 - tau) * tau**k for k in range(gamma)) + gamma * tau**gamma
            assert expected_accepted(tau, gamma) == pytest.approx(series)
    assert expected_accepted(1.0, 5) == 5.0
    assert expected_accepted(0.5, 2) == pytest.approx(0.75)  # 0.5 * 0.75 / 0.5


def test_serial_sd_by_hand_and_ideal_case():
    # c = 5, gamma = 5, tau = 0.6: 5 * (3 + 1) / 10 = 2.0
    assert serial_sd_speedup(5, 5, 0.6) == pytest.approx(2.0)
    # Theorem 2 (ideal, tau = 1): c (gamma + 1) / (gamma + c)
    assert serial_sd_speedup(4, 3, 1.0) == pytest.approx(4 * 4 / 7)


def test_parallel_sd_ideal_is_c_and_twice_serial_for_large_c():
    assert parallel_sd_speedup(7, 7, 1.0) == pytest.approx(7.0)
    assert parallel_sd_speedup(4, 2, 0.5) == pytest.approx(4 * 0.5 * 2 / 4)  # gamma < c waits on the target
    c = 1000.0
    ratio = parallel_sd_speedup(c, int(c), 1.0) / serial_sd_speedup(c, int(c), 1.0)
    assert ratio == pytest.approx(2 * c / (c + 1))


def test_parallel_with_rollback_limits_and_closed_form():
    # tau -> 1 reaches the ideal c (Theorem 3), from below.
    assert parallel_sd_rollback_speedup(5, 5, 1.0) == pytest.approx(5.0)
    assert parallel_sd_rollback_speedup(5, 5, 0.999) < 5.0
    # gamma = c: V = 1/2 sum_{k=1}^{2c} tau^k (the paper's remark after Theorem 6)
    for tau in (0.3, 0.7, 0.9):
        assert parallel_sd_rollback_speedup(4, 4, tau) == pytest.approx(0.5 * sum(tau**k for k in range(1, 9)))
    assert math.isclose(parallel_sd_rollback_speedup(3, 3, 0.0), 0.0)


def test_tau_hat_counts_rejections_not_untried_tokens():
    # 3 rounds of gamma 4: all accepted, 2 then a rejection, 0 then a rejection: A = 6, R = 2.
    assert tau_hat(6, 2) == pytest.approx(0.75)
    assert tau_hat(0, 0) == 0.0
    # The estimator is the maximum-likelihood tau of a truncated geometric: simulate and recover it.
    import random

    rng, tau, gamma = random.Random(0), 0.8, 4
    a = r = 0
    for _ in range(20000):
        k = 0
        while k < gamma and rng.random() < tau:
            k += 1
        a += k
        r += k < gamma
    assert tau_hat(a, r) == pytest.approx(tau, abs=0.01)


def test_token_times_are_the_theorems_and_baseline_is_ar():
    # Theorem 4 by hand: (5 * 1 + 5) / (0.6 * 5 + 1) = 2.5 ms per token.
    assert serial_sd_token_time(1.0, 5.0, 5, 0.6) == pytest.approx(2.5)
    # Theorem 6 by hand: gamma 4, T_q 1, T_p 3 (draft-bound): 2 * 4 / ((1 + 0.5^4) * E[X]), E[X] = 0.9375.
    ex = 0.5 * (1 - 0.5**4) / 0.5
    assert parallel_sd_rollback_token_time(1.0, 3.0, 4, 0.5) == pytest.approx(8.0 / ((1 + 0.0625) * ex))
    # With T_ar = T_p the prediction is the paper's speedup.
    assert predicted_speedup(True, 5.0, 1.0, 5.0, 5, 0.7) == pytest.approx(parallel_sd_rollback_speedup(5, 5, 0.7))
    # A serial round commits 1 + E[X], the accepted length of the same tau (not Theorem 4's tau gamma + 1): by
    # hand, E[X] = 0.6 (1 - 0.6^5) / 0.4 = 1.38336, (5 * 1 + 5) / 2.38336 = 4.19576 ms a token against ar's 5.
    assert predicted_speedup(False, 5.0, 1.0, 5.0, 5, 0.6) == pytest.approx(5.0 / 4.19576, rel=1e-5)
    assert predicted_speedup(False, 5.0, 1.0, 5.0, 5, 0.6) < serial_sd_speedup(5, 5, 0.6)  # 1.19x against 1.6x
    # A verify that costs twice an ar step halves the prediction against ar.
    assert predicted_speedup(True, 2.5, 1.0, 5.0, 5, 0.7) == pytest.approx(parallel_sd_rollback_speedup(5, 5, 0.7) / 2)

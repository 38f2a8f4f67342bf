"""The parallel window from the measured speed ratio (ParallelVLM Eq. 6, then Theorem 6), checked against the
equations worked by hand (pipeline/cost.py ParallelWindow)."""

import pytest

from vpsd.pipeline.cost import ParallelWindow


def test_eq6_with_one_window_size_is_tp_over_tq():
    # The paper's own example: T_q 47 ms at 90% pruning, T_p 420 ms: c* ~ 9, gamma = 9.
    w = ParallelWindow(initial=5)
    w.observe_draft_step(w.batch, 0.047)
    w.observe_verify(w.batch, 5, 0.420)
    assert w.gamma == 9
    # Without pruning: T_q 78 ms -> c ~ 5.4 -> 5.
    w = ParallelWindow(initial=9)
    w.observe_draft_step(w.batch, 0.078)
    w.observe_verify(w.batch, 9, 0.420)
    assert w.gamma == 5


def test_balance_with_a_verify_cost_that_grows_with_the_window():
    # T_p(k) = 20 ms + 2 ms k, T_q = 4 ms: gamma T_q = T_p(gamma) at gamma = 20 / (4 - 2) = 10.
    w = ParallelWindow(initial=4, gamma_max=32)
    for k in (1, 4, 1, 4, 6, 1, 4):
        w.observe_verify(w.batch, k, 0.020 + 0.002 * k)
        w.observe_draft_step(w.batch, 0.004)
    assert w.verify_time(10) == pytest.approx(0.040)
    assert w.gamma == 10
    # A draft no faster per token than the verify's per-row cost: the longest window allowed.
    w.observe_draft_step(w.batch, 0.001)
    for _ in range(40):
        w.observe_draft_step(w.batch, 0.0015)
    assert w.gamma == 32


def test_follows_a_moving_ratio_within_a_few_rounds_and_stays_in_bounds():
    w = ParallelWindow(initial=4, gamma_min=2, gamma_max=12)
    for _ in range(10):
        w.observe_draft_step(w.batch, 0.010)
        w.observe_verify(w.batch, w.gamma, 0.060)
    assert w.gamma == 6
    for _ in range(10):  # the target slows down (a longer context): the window grows with it
        w.observe_draft_step(w.batch, 0.010)
        w.observe_verify(w.batch, w.gamma, 0.090)
    assert w.gamma == 9
    for _ in range(20):
        w.observe_verify(w.batch, w.gamma, 1.0)
    assert w.gamma == 12
    for _ in range(20):
        w.observe_verify(w.batch, w.gamma, 0.001)
    assert w.gamma == 2


def test_fixed_gamma_never_moves_and_bounds_are_checked():
    w = ParallelWindow(initial=7, fixed=True)
    w.observe_draft_step(w.batch, 0.001)
    w.observe_verify(w.batch, 7, 1.0)
    assert w.gamma == 7
    with pytest.raises(ValueError):
        ParallelWindow(initial=4, gamma_min=5, gamma_max=3)


def theorem6_argmin(t_q, t_p_of, tau, lo, hi):
    """The window a brute-force search over Theorem 6 (Eq. 13), written out from the paper, picks."""
    def per_token(g):
        ex = tau * (1 - tau**g) / (1 - tau)
        return 2 * max(g * t_q, t_p_of(g)) / ((1 + tau**g) * ex)
    return min(range(lo, hi + 1), key=per_token)


def test_with_acceptance_measured_the_window_minimises_theorem6():
    # T_p independent of the window (a GPU): the optimum is the balance, Eq. 6, whatever tau.
    for tau_rounds in ([4, 4, 4, 2], [4, 1, 0, 3]):
        w = ParallelWindow(initial=4, gamma_max=16)
        for acc in tau_rounds * 3:
            w.observe_draft_step(w.batch, 0.010)
            w.observe_verify(w.batch, 4, 0.070)
            w.observe_round(acc, 4)
        assert w.gamma == 7
    # A CPU-like verify (b = 0.8 T_q): the balance says 16 (the cap), Theorem 6 a shorter window.
    w = ParallelWindow(initial=4, gamma_max=16)
    for k, acc in [(4, 4), (1, 1), (6, 3), (4, 4), (1, 0), (6, 6)] * 3:
        w.observe_draft_step(w.batch, 0.010)
        w.observe_verify(w.batch, k, 0.030 + 0.008 * k)
        w.observe_round(acc, k)
    tau = w.cost.tau
    expected = theorem6_argmin(0.010, lambda g: 0.030 + 0.008 * g, tau, 1, 16)
    assert w.gamma == expected < 16


def test_pre_verify_only_while_the_drafts_window_outlasts_a_two_row_verify():
    w = ParallelWindow(initial=4, gamma_max=16)
    assert w.pre_verify()  # nothing measured: the papers' rule
    for k in (1, 4, 8):  # T_p(k) = 30 ms + 5 ms k: T_p(2) = 40 ms
        w.observe_verify(w.batch, k, 0.030 + 0.005 * k)
    w.observe_draft_step(w.batch, 0.002)  # target-bound: gamma * 2 ms < 40 ms for any gamma <= 16
    assert not w.pre_verify()
    for _ in range(30):
        w.observe_draft_step(w.batch, 0.010)  # draft-bound: gamma * 10 ms >= 40 ms at the window it picks
    assert w.gamma * 0.010 >= 0.040 and w.pre_verify()
    fixed = ParallelWindow(initial=4, fixed=True)
    fixed.observe_verify(fixed.batch, 4, 1.0)
    fixed.observe_draft_step(fixed.batch, 0.001)
    assert fixed.pre_verify()

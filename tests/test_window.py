"""gamma from the measured speed ratio (ParallelVLM Eq. 6), checked against the equation worked by hand."""

import pytest

from vpsd.pipeline.window import WindowController


def test_eq6_with_one_window_size_is_tp_over_tq():
    # The paper's own example: T_q 47 ms at 90% pruning, T_p 420 ms: c* ~ 9, gamma = 9.
    w = WindowController(initial=5)
    w.observe_draft_step(0.047)
    w.observe_verify(5, 0.420)
    assert w.gamma == 9
    # Without pruning: T_q 78 ms -> c ~ 5.4 -> 5.
    w = WindowController(initial=9)
    w.observe_draft_step(0.078)
    w.observe_verify(9, 0.420)
    assert w.gamma == 5


def test_balance_with_a_verify_cost_that_grows_with_the_window():
    # T_p(k) = 20 ms + 2 ms k, T_q = 4 ms: gamma T_q = T_p(gamma) at gamma = 20 / (4 - 2) = 10.
    w = WindowController(initial=4, gamma_max=32)
    for k in (1, 4, 1, 4, 6, 1, 4):
        w.observe_verify(k, 0.020 + 0.002 * k)
        w.observe_draft_step(0.004)
    assert w.verify_time(10) == pytest.approx(0.040)
    assert w.gamma == 10
    # A draft no faster per token than the verify's per-row cost: the longest window allowed.
    w.observe_draft_step(0.001)
    for _ in range(40):
        w.observe_draft_step(0.0015)
    assert w.gamma == 32


def test_follows_a_moving_ratio_within_a_few_rounds_and_stays_in_bounds():
    w = WindowController(initial=4, gamma_min=2, gamma_max=12)
    for _ in range(10):
        w.observe_draft_step(0.010)
        w.observe_verify(w.gamma, 0.060)
    assert w.gamma == 6
    for _ in range(10):  # the target slows down (a longer context): the window grows with it
        w.observe_draft_step(0.010)
        w.observe_verify(w.gamma, 0.090)
    assert w.gamma == 9
    for _ in range(20):
        w.observe_verify(w.gamma, 1.0)
    assert w.gamma == 12
    for _ in range(20):
        w.observe_verify(w.gamma, 0.001)
    assert w.gamma == 2


def test_fixed_gamma_never_moves_and_bounds_are_checked():
    w = WindowController(initial=7, fixed=True)
    w.observe_draft_step(0.001)
    w.observe_verify(7, 1.0)
    assert w.gamma == 7
    with pytest.raises(ValueError):
        WindowController(initial=4, gamma_min=5, gamma_max=3)

"""TABED's ensemble math (Algorithm 1, Sec. 5.1, Appendix B) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vpsd.pipeline.ensemble import (
    AdaptiveWeights,
    TabedConfig,
    argmin_nearest_uniform,
    kl_divergence,
    total_variation,
    weight_grid,
    weighted_average,
)


def test_grid_for_two_views_is_the_papers_list():
    """Appendix B.2: w^j = [1 - j/n, j/n], j = 0..n (as a set)."""
    grid = weight_grid(2, 10)
    assert grid.shape == (11, 2)
    got = torch.tensor(sorted(map(tuple, grid.tolist())))
    assert torch.allclose(got, torch.tensor([(j / 10, 1 - j / 10) for j in range(11)]))


def test_grid_for_three_views_is_every_integer_composition():
    grid = weight_grid(3, 2)  # coefficients (a, b, c) >= 0 with a + b + c = 2
    expected = {(2, 0, 0), (0, 2, 0), (0, 0, 2), (1, 1, 0), (1, 0, 1), (0, 1, 1)}
    assert {tuple(int(round(v * 2)) for v in row) for row in grid.tolist()} == expected
    assert torch.allclose(grid.sum(1), torch.ones(6))


def test_weighted_average():
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.2, 0.8]])
    assert torch.allclose(weighted_average(q, torch.tensor([0.25, 0.75])), torch.tensor([0.125, 0.275, 0.6]))
    both = weighted_average(q, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert torch.equal(both, q)


def test_kl_and_tvd_by_hand():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5])
    # KL = 0.5 log(0.5/0.25) * 2 + 0 (0 log 0 = 0) = log 2
    assert kl_divergence(p, q).item() == pytest.approx(math.log(2))
    # TVD = 0.5 * (0.25 + 0.25 + 0.5) = 0.5
    assert total_variation(p, q).item() == pytest.approx(0.5)
    onehot = torch.tensor([0.0, 0.0, 1.0])
    assert kl_divergence(onehot, q).item() == pytest.approx(-math.log(0.5))  # -log q(y)
    assert total_variation(onehot, q).item() == pytest.approx(0.5)  # 1 - q(y)


def test_argmin_ties_go_to_the_candidate_nearest_uniform():
    cands = weight_grid(2, 2)  # [1,0], [0.5,0.5], [0,1] in some order
    errors = torch.zeros(3)
    assert cands[argmin_nearest_uniform(errors, cands)].tolist() == [0.5, 0.5]
    errors = torch.tensor([1.0 if c[0] == 0.5 else 0.0 for c in cands.tolist()])
    # [1,0] and [0,1] tie, equally far from uniform: the lower index wins
    i = argmin_nearest_uniform(errors, cands)
    assert i == min(j for j, c in enumerate(cands.tolist()) if c[0] != 0.5)


VIEWS = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])  # q^(1), q^(2) over a vocabulary of 3


def test_uniform_before_any_verified_position():
    w = AdaptiveWeights(TabedConfig(views=("multimodal", "text"), policy="grid"), 2)
    assert w.weights().tolist() == [0.5, 0.5]


def test_greedy_kl_picks_the_weight_that_maximises_q_of_the_committed_tokens():
    """One-hot p on y: e^j = sum -log q^j(y). Tokens 0 then 2 committed.

    w = [a, 1-a]: q(0) = 0.1 + 0.6a, q(2) = 0.6 - 0.5a; maximise (0.1+0.6a)(0.6-0.5a) over a in {0, 0.1, .., 1}:
    derivative 0.36 - 0.05 - 0.6a = 0 at a = 0.5167, so the grid's a = 0.5 wins.
    """
    w = AdaptiveWeights(TabedConfig(views=("multimodal", "text"), distance="kl", grid_steps=10), 2)
    w.observe(VIEWS, 0, None)
    w.observe(VIEWS, 2, None)
    assert w.weights().tolist() == pytest.approx([0.5, 0.5])
    # a third committed 0 shifts the optimum: (0.1+0.6a)^2 (0.6-0.5a) -> a = 0.6 + ... solve on the grid
    w.observe(VIEWS, 0, None)
    best = max((a / 10 for a in range(11)), key=lambda a: (0.1 + 0.6 * a) ** 2 * (0.6 - 0.5 * a))
    assert w.weights()[0].item() == pytest.approx(best)


def test_tvd_with_soft_labels():
    """p = q^(2) exactly: TVD is 0 at w = [0, 1] only."""
    w = AdaptiveWeights(TabedConfig(views=("multimodal", "text"), distance="tvd"), 2)
    w.observe(VIEWS, 2, VIEWS[1])
    assert w.weights().tolist() == [0.0, 1.0]


def test_match_counts_argmax_mismatches_over_the_window():
    """Committed 0: views with a >= 0.5 put argmax on 0... exactly: q(0)=0.1+0.6a, q(2)=0.6-0.5a, q(1)=0.3-0.1a.

    argmax is 0 iff 0.1+0.6a > 0.6-0.5a and > 0.3-0.1a, i.e. a > 0.4545. With window 1 only the last counts.
    """
    w = AdaptiveWeights(TabedConfig(views=("multimodal", "text"), distance="match", window=1), 2)
    w.observe(VIEWS, 2, None)
    w.observe(VIEWS, 0, None)  # window 1: only this position counts
    # a in {0.5, ..., 1.0} all match (error 0); the tie goes to the one nearest uniform: 0.5
    assert w.weights().tolist() == pytest.approx([0.5, 0.5])
    w2 = AdaptiveWeights(TabedConfig(views=("multimodal", "text"), distance="match", window=None), 2)
    w2.observe(VIEWS, 2, None)  # matches for a < 0.4545 (argmax 2)
    w2.observe(VIEWS, 0, None)  # matches for a > 0.4545
    # every a misses exactly one of the two: all tie at 1, the nearest to uniform is 0.5
    assert w2.weights().tolist() == pytest.approx([0.5, 0.5])
    w2.observe(VIEWS, 2, None)  # now a < 0.4545 miss once, a > 0.4545 twice: nearest uniform among a<=0.4 is 0.4
    assert w2.weights().tolist() == pytest.approx([0.4, 0.6])


def test_softmax_policy_is_softmax_of_inverse_view_errors():
    """e^(i) = sum of -log q^(i)(y) for y = 0: e1 = -log 0.7, e2 = -log 0.1; w = softmax([1/e1, 1/e2] / tau)."""
    cfg = TabedConfig(views=("multimodal", "text"), distance="kl", policy="softmax", tau=2.0)
    w = AdaptiveWeights(cfg, 2)
    w.observe(VIEWS, 0, None)
    inv = torch.tensor([1 / -math.log(0.7), 1 / -math.log(0.1)])
    assert torch.allclose(w.weights(), torch.softmax(inv / 2.0, 0))


def test_config_validation_and_target_probs_rule():
    with pytest.raises(ValueError):
        TabedConfig(distance="js")
    with pytest.raises(ValueError):
        TabedConfig.from_dict({"views": ["multimodal", "caption"]})
    assert TabedConfig.from_dict({"views": ["text", "pooled"]}).views == ("text", "pooled")
    assert not TabedConfig(distance="kl").needs_target_probs(0.0)  # one-hot p: rebuilt from the verdict
    assert TabedConfig(distance="kl").needs_target_probs(0.7)
    assert not TabedConfig(distance="match").needs_target_probs(0.7)

"""TABED's proposer: per-block weights are Algorithm 1's argmin over what it observed; q is the W-AVG."""

from __future__ import annotations

import math

import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.pipeline.ensemble import TabedConfig, weight_grid
from vpsd.engine.proposers import TabedProposer
from vpsd.pipeline.sampling import ItemSampler, SamplingRule


ITEM = "a"


def _drafter(temperature_views=("multimodal", "text", "pooled"), **cfg):
    """The proposer with one item admitted, and that item's views."""
    _, draft = tiny_pair("qwen2_5_vl")
    emb = draft.embed(draft.prepare(random_frames(6), "Describe the video."))
    keep = torch.arange(0, emb.layout.num_tokens, 2)
    proposer = TabedProposer(draft, TabedConfig(views=temperature_views, **cfg))
    proposer.admit(ITEM, emb, keep, gamma=2)
    return proposer, proposer.items[ITEM]


def test_block_weights_are_the_argmin_of_accumulated_kl():
    d, views = _drafter(("multimodal", "text"), distance="kl", grid_steps=10)
    gen = ItemSampler(SamplingRule(0.0), 0, 0)
    seen: list[tuple[torch.Tensor, int]] = []  # (view probs, committed token) at verified positions
    labels = [11, 3, 5, 8, 2, 9]  # committed tokens the "target" chose (any ids: greedy p is one-hot)
    for block in range(3):
        start = 2 * block
        for pos in (start, start + 1):
            token, q = d.propose(ITEM, pos, gen)
            assert q is None
            seen.append((views.probs[pos].clone(), labels[pos]))
            d.feed({ITEM: [labels[pos]]})
        d.observe(ITEM, start, labels[start : start + 2], None)
        assert not views.probs  # verified positions leave the pending store
        # Algorithm 1 line 3 written out: e_j = sum_t' -log(sum_i w_ji q_t'^(i)(y_t'))
        grid = weight_grid(2, 10)
        errors = [sum(-math.log(float(w @ views[:, y])) for views, y in seen) for w in grid]
        best = grid[min(range(len(errors)), key=errors.__getitem__)]
        assert torch.allclose(views.adaptive.weights(), best)
    d.propose(ITEM, 6, gen)  # a new block begins: it uses that w*
    assert torch.allclose(views.weights, best)


def test_sampling_q_is_the_weighted_average_of_the_views_at_the_run_temperature():
    d, views = _drafter()
    token, q = d.propose(ITEM, 0, ItemSampler(SamplingRule(0.7, rule="rejection"), 1, 1))
    probs = torch.softmax(views.logits / 0.7, dim=-1)
    assert torch.allclose(q, views.weights @ probs, atol=1e-6)
    assert torch.allclose(views.weights, torch.full((3,), 1 / 3))  # nothing verified yet: uniform
    assert math.isclose(float(q.sum()), 1.0, rel_tol=1e-5)


def test_rollback_forgets_rejected_positions_and_starts_a_block():
    d, views = _drafter(("multimodal", "text"))
    gen = ItemSampler(SamplingRule(0.0), 2, 2)
    length = views.batch.state.length
    for pos in range(3):
        token, _ = d.propose(ITEM, pos, gen)
        d.feed({ITEM: [token]})
    d.observe(ITEM, 0, [views.probs[0].argmax(-1)[0].item(), 7], None)  # position 1 rejected: target chose 7
    d.forget_from(ITEM, 2)
    assert not views.probs and len(views.adaptive.window) == 2
    d.rollback(ITEM, length + 1)
    assert views.block_start is None and views.batch.state.length == length + 1

"""Position-keyed sampling (pipeline/sampling.py): the noise against a hand-written reference, the law it draws
(chi-square, per position and through the filters), and the coupling that makes a seeded sample `ar`'s."""

from __future__ import annotations

import math

import pytest
import torch

from vpsd.pipeline.sampling import ItemSampler, SamplingRule, gumbel, row_keys, uniforms
from vpsd.pipeline.verification import verify_chunk

M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    """The hash written out on Python ints (no overflow to dodge): what the tensor version must equal."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_the_noise_is_the_reference_hash_of_seed_position_and_token():
    seed, positions, vocab = 123456789, [0, 1, 7, 10**9], 50
    got = uniforms(seed, positions, vocab)
    for row, key in enumerate(row_keys(seed, positions)):
        for v in (0, 1, 17, vocab - 1):
            h = _lowbias32(_lowbias32(v) ^ key)
            assert float(got[row, v]) == (h + 0.5) / 2.0**32
    assert torch.equal(got, uniforms(seed, positions, vocab))  # no state: the same call, the same noise
    assert not torch.equal(got[0], got[1]) and not torch.equal(got, uniforms(seed + 1, positions, vocab))
    assert 0 < float(got.min()) and float(got.max()) < 1


def test_a_row_noise_does_not_depend_on_which_rows_are_computed_with_it():
    """A window's rows and a plain step's row at the same position see the same noise (the verify's and `ar`'s)."""
    together = gumbel(5, [3, 4, 5], 40)
    for i, t in enumerate([3, 4, 5]):
        assert torch.equal(together[i], gumbel(5, t, 40)[0])


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "drew a token the filters removed"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


# 0.999 quantiles of chi-square with 1..7 degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("rule", [
    SamplingRule(0.7),
    SamplingRule(1.0),
    SamplingRule(1.3, top_k=3),
    SamplingRule(0.9, top_p=0.8),
    SamplingRule(1.0, min_p=0.15),
    SamplingRule(0.8, top_k=5, top_p=0.9, min_p=0.05),
])
def test_keyed_tokens_follow_the_filtered_target_distribution(rule):
    """Over positions (and, separately, over seeds at one position), the keyed token's frequencies match
    softmax(filtered(logits / T)): Gumbel-max draws exactly."""
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, 1.0, -2.0, 0.7])
    probs = rule.probs(logits)
    n = 4000
    over_positions = ItemSampler(rule, seed=11, stream_seed=0).scores(logits.expand(n, -1), list(range(n)))
    counts = torch.bincount(over_positions.argmax(-1), minlength=logits.numel()).double()
    chi2, dof = _chi2(counts, probs.double(), n)
    assert chi2 < CHI2_999[dof], (chi2, dof)
    over_seeds = torch.tensor([ItemSampler(rule, seed=s, stream_seed=0).token(logits, 42)[0] for s in range(n)])
    counts = torch.bincount(over_seeds, minlength=logits.numel()).double()
    chi2, dof = _chi2(counts, probs.double(), n)
    assert chi2 < CHI2_999[dof], (chi2, dof)


def test_the_chi_square_test_fails_for_a_biased_sampler():
    """The test above can fail: the argmax of the logits plus noise at the wrong scale is not the law."""
    rule = SamplingRule(0.7)
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, 1.0, -2.0, 0.7])
    n = 4000
    wrong = rule.tempered(logits).double() + 0.5 * gumbel(11, list(range(n)), logits.numel())
    counts = torch.bincount(wrong.argmax(-1), minlength=logits.numel()).double()
    chi2, dof = _chi2(counts, rule.probs(logits).double(), n)
    assert chi2 > CHI2_999[dof]


def test_filters_keep_what_transformers_warpers_keep():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    kept = lambda rule: (rule.probs(logits) > 0).tolist()  # noqa: E731
    assert kept(SamplingRule(1.0, top_k=2)) == [True, True, False, False, False]
    assert kept(SamplingRule(1.0, top_p=0.7)) == [True, True, False, False, False]  # 0.4 + 0.3 reaches 0.7
    assert kept(SamplingRule(1.0, top_p=0.71)) == [True, True, True, False, False]
    assert kept(SamplingRule(1.0, min_p=0.3)) == [True, True, True, False, False]  # >= 0.3 * 0.4
    assert kept(SamplingRule(1.0, top_p=0.88)) == [True, True, True, True, False]
    # top-p reads the distribution top-k left (0.4 / 0.95 + 0.3 / 0.95 + 0.15 / 0.95 > 0.88)
    assert kept(SamplingRule(1.0, top_k=4, top_p=0.88)) == [True, True, True, False, False]
    assert math.isclose(float(SamplingRule(1.0, top_k=2).probs(logits)[0]), 0.4 / 0.7, rel_tol=1e-6)
    with pytest.raises(ValueError, match="top_p"):
        SamplingRule(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="sampling rule"):
        SamplingRule(1.0, rule="nucleus")


def test_greedy_is_the_keyed_rule_without_noise():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    greedy = ItemSampler(SamplingRule(0.0, top_k=3), seed=9, stream_seed=0)
    assert torch.equal(greedy.scores(logits, list(range(5))), logits)
    assert [greedy.token(row, t)[0] for t, row in enumerate(logits)] == logits.argmax(-1).tolist()


def test_a_keyed_verify_commits_ar_own_sample_whatever_was_drafted():
    """The target accepts drafted tokens while they equal its keyed samples and emits its own at the first
    difference: the committed tokens are the ones `ar` samples at those positions, for any draft."""
    rule = SamplingRule(1.0, top_p=0.95)
    g = torch.Generator().manual_seed(1)
    for trial in range(50):
        rows = torch.randn(5, 12, generator=g)  # the target's rows at positions 10..14
        target = ItemSampler(rule, seed=trial, stream_seed=0)
        ar = [target.token(rows[i], 10 + i)[0] for i in range(5)]
        draft_logits = rows[:4] + torch.randn(4, 12, generator=g) * float(trial % 3)  # from exact to far off
        draft = ItemSampler(rule, seed=trial, stream_seed=1)
        drafted = [draft.token(draft_logits[i], 10 + i)[0] for i in range(4)]
        v = verify_chunk(drafted, None, rows, target, 10)
        assert v.emitted(drafted) == ar[: v.num_accepted + 1]
        if trial % 3 == 0:  # a draft equal to the target in distribution agrees in tokens
            assert v.num_accepted == 4


def test_tree_candidates_are_gumbel_top_k_led_by_the_keyed_token():
    rule = SamplingRule(0.8)
    logits = torch.randn(20, generator=torch.Generator().manual_seed(2))
    s = ItemSampler(rule, seed=4, stream_seed=0)
    kids, q = s.children(logits, 3, 6)
    assert q is None and kids[0] == s.token(logits, 6)[0] and len(set(kids)) == 3
    assert kids == s.scores(logits, 6).topk(3).indices.tolist()


def test_a_keyed_sampler_holds_no_generator_and_a_rejection_one_its_own():
    assert ItemSampler(SamplingRule(0.7), 1, 2).gen is None
    a, b = ItemSampler(SamplingRule(0.7, rule="rejection"), 1, 2), ItemSampler(SamplingRule(0.7, rule="rejection"), 1, 2)
    assert torch.equal(torch.rand(3, generator=a.gen), torch.rand(3, generator=b.gen))

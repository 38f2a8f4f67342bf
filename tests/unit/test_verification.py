"""The speculative sampling rule: greedy tables, temperature 0 == greedy, and the sampled distribution."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vpsd.pipeline.sampling import ItemSampler, SamplingRule, probs_from_logits
from vpsd.pipeline.verification import verify_chunk, verify_greedy, verify_sampling


def _logits_for(target_ids: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(target_ids), vocab)
    logits[torch.arange(len(target_ids)), torch.tensor(target_ids)] = 5.0
    return logits


def test_greedy_table():
    # (draft tokens, target argmax per row incl. bonus) -> (accepted, next token)
    cases = [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted: bonus from the last row
        ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # rejected at position 1: target's token
        ([1, 2, 3], [7, 2, 3, 4], 0, 7),  # rejected at once
        ([], [6], 0, 6),  # no draft: plain decoding step
    ]
    for drafts, target_ids, n, nxt in cases:
        v = verify_greedy(drafts, _logits_for(target_ids))
        assert (v.num_accepted, v.next_token) == (n, nxt)
        assert v.emitted(drafts) == drafts[:n] + [nxt]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.integers(0, 10_000))
def test_greedy_is_the_temperature_zero_case_of_sampling(k, seed):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, 6, generator=g)
    draft_logits = torch.randn(k, 6, generator=g)
    drafts = draft_logits.argmax(-1).tolist()
    # Make agreement likely so long accepted prefixes are exercised too.
    agree = torch.rand(k, generator=g) < 0.7
    for i in range(k):
        if agree[i]:
            drafts[i] = int(target_logits[i].argmax())
            draft_logits[i] = torch.nn.functional.one_hot(torch.tensor(drafts[i]), 6).float()
    q = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), 6).float().reshape(k, 6)
    p = probs_from_logits(target_logits, 0.0)
    sampled = verify_sampling(drafts, q, p, torch.Generator().manual_seed(seed))
    assert sampled == verify_greedy(drafts, target_logits)


def _speculative_sequence(P: torch.Tensor, Q: torch.Tensor, length: int, gamma: int, g: torch.Generator) -> tuple:
    """Runs whole rounds of speculative sampling where position i has target P[i] and draft Q[i]."""
    out: list[int] = []
    while len(out) < length:
        pos = len(out)
        k = min(gamma, P.shape[0] - pos - 1)
        drafts = [int(torch.multinomial(Q[pos + i], 1, generator=g)) for i in range(k)]
        v = verify_sampling(drafts, Q[pos : pos + k], P[pos : pos + k + 1], g)
        out += v.emitted(drafts)
    return tuple(out[:length])


def test_sampled_sequences_follow_the_target_distribution():
    """Joint law of the first two tokens must be P[0] x P[1] whatever Q is (chi-square, fixed seed)."""
    vocab, trials = 4, 20_000
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)
    counts: dict[tuple, int] = {}
    for _ in range(trials):
        key = _speculative_sequence(P, Q, 2, 2, g)
        counts[key] = counts.get(key, 0) + 1
    chi2 = 0.0
    for a, b in itertools.product(range(vocab), repeat=2):
        expected = trials * float(P[0, a] * P[1, b])
        chi2 += (counts.get((a, b), 0) - expected) ** 2 / expected
    # 15 degrees of freedom; the 0.999 quantile of chi-square(15) is 37.70.
    assert chi2 < 37.70, chi2
    # And the test can fail: the draft's own law is far from it.
    chi2_q = sum(
        (counts.get((a, b), 0) - trials * float(Q[0, a] * Q[1, b])) ** 2 / (trials * float(Q[0, a] * Q[1, b]))
        for a, b in itertools.product(range(vocab), repeat=2)
    )
    assert chi2_q > 37.70


def test_rejection_never_resamples_the_rejected_mass():
    # p puts all mass on token 0, q on token 1: the draft's token is always rejected and 0 emitted.
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    for seed in range(20):
        v = verify_sampling([1], q, p, torch.Generator().manual_seed(seed))
        assert (v.num_accepted, v.next_token) == (0, 0)


def test_a_round_that_drafts_nothing_draws_from_p():
    """Serial sd drafts k = 0 tokens when one token is left to max_new_tokens: sampling must still emit a token
    drawn from the target's row (it crashed on the missing q before)."""
    p = torch.tensor([[0.0, 1.0, 0.0]])
    v = verify_sampling([], None, p, torch.Generator().manual_seed(0))
    assert (v.num_accepted, v.next_token, v.num_drafted) == (0, 1, 0)
    rejection = ItemSampler(SamplingRule(1.0, rule="rejection"), 0, 0)
    assert verify_chunk([], None, torch.tensor([[0.0, 5.0, 0.0]]), rejection, 0).num_drafted == 0


def test_greedy_ids_reads_every_rows_argmax_of_a_batch_at_once():
    from vpsd.pipeline.verification import greedy_ids, verify_greedy

    g = torch.Generator().manual_seed(3)
    rows = {"a": torch.randn(4, 11, generator=g), "b": torch.randn(1, 11, generator=g), "c": torch.randn(6, 11, generator=g)}
    ids = greedy_ids(rows)
    assert ids == {k: v.argmax(-1).tolist() for k, v in rows.items()} and greedy_ids({}) == {}
    drafts = ids["c"][:2] + [(ids["c"][2] + 1) % 11, 0, 0]  # two accepted, then a mismatch
    assert verify_greedy(drafts, rows["c"], ids["c"]) == verify_greedy(drafts, rows["c"])
    assert verify_greedy(drafts, rows["c"]).num_accepted == 2

"""Many items in flight with the draft in the target's process: the batched cache computes what batch-1 decoding
computes, row by row, and the engine commits, for every item, what that item's batch-1 decoder commits (all three
families; B = 1, 2 and 8; `ar`, serial sd with a smaller draft, and the target drafting for itself on pruned video
under the uniform, HIPPO and UV-Prune strategies); sampling draws each item's tokens from its own streams; the
serial window chosen by goodput; whether an item drafts; admission under a KV budget."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from tests.conftest import random_frames, tiny_pair
from tests.engine_harness import PROMPTS, batch1_ar, batch1_sd, fresh, local_engine, requests, run
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.decoders.sd import decode_sd
from vpsd.engine.request import Request
from vpsd.engine.scheduler import kv_bytes_per_token
from vpsd.models.batch import BatchedCache
from vpsd.pipeline.cost import ExploreBudget, SerialWindow
from vpsd.pipeline.theory import serial_round_token_time
from vpsd.pipeline.drafting_policy import DraftingPolicy, ItemMeans, serial_loss
from vpsd.pipeline.sampling import probs_from_logits
from vpsd.pipeline.theory import expected_accepted

items = requests


# ---- the batched cache ------------------------------------------------------------------------------


def test_batched_rows_score_as_batch1_steps_through_joins_rollbacks_leaves_and_compaction(family):
    target, _ = tiny_pair(family)
    embs = [target.embed(target.prepare(random_frames(i, t=4 + 2 * (i % 2)), PROMPTS[i])) for i in range(3)]
    single = [target.prefill(e).state for e in embs]
    batch = BatchedCache(target)
    for i, e in enumerate(embs):
        batch.join(i, target.prefill(e).state)
    worst = 0.0

    def feed(tokens: dict[int, list[int]]) -> None:
        nonlocal worst
        got = batch.step(tokens)
        for key, ids in tokens.items():
            if ids:
                ref = target.step(single[key], torch.tensor(ids))
                worst = max(worst, float((ref - got[key]).abs().max()))

    feed({0: [5, 6], 1: [7], 2: []})  # ragged, and a row that feeds nothing
    feed({0: [8], 1: [9, 10, 11], 2: [12]})
    for key, drop in ((1, 3), (0, 1)):  # per-row rollback: the rows' entries become holes
        batch.rollback(key, batch.length(key) - drop)
        target.rollback(single[key], single[key].length - drop)
    feed({0: [1, 2, 3], 1: [4], 2: [4, 4]})
    batch.leave(0)
    for _ in range(12):  # enough holes to compact
        feed({1: [3, 4, 5], 2: [6]})
        batch.rollback(1, batch.length(1) - 2)
        target.rollback(single[1], single[1].length - 2)
    assert batch.width - max(batch.lengths) <= max(16, batch.width // 4) + 3  # compaction ran (before the last feed)
    feed({1: [7], 2: [8]})
    assert worst < 1e-5, worst
    for key in (1, 2):  # what a row holds is exactly its batch-1 cache, holes removed
        keys, values = batch.entries(key, 0)
        assert batch.length(key) == single[key].length
        torch.testing.assert_close(keys[None], single[key].cache.layers[0].keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(values[None], single[key].cache.layers[0].values, atol=1e-5, rtol=0)


def test_a_row_alone_is_stepped_by_the_batch1_forward_bit_for_bit(family):
    """One item in flight (the batch-1 pipeline) or a batch drained to one row: the row has no holes (a rollback
    crops it, a row left alone is compacted) and steps through `VideoLMAdapter.step` itself, so its logits and
    cache equal the batch-1 decode's exactly, not within float noise."""
    target, _ = tiny_pair(family)
    embs = [target.embed(target.prepare(random_frames(i, t=4), PROMPTS[i])) for i in range(2)]
    single = target.prefill(embs[0]).state
    batch = BatchedCache(target)
    batch.join("a", target.prefill(embs[0]).state)

    def same(tokens: list[int]) -> None:
        got = batch.step({"a": tokens})["a"]
        assert torch.equal(got, target.step(single, torch.tensor(tokens)))
        assert batch.width == batch.length("a") == single.length

    same([5, 6, 7])
    batch.rollback("a", batch.length("a") - 2)  # a crop, as at batch 1
    target.rollback(single, single.length - 2)
    same([8])
    batch.join("b", target.prefill(embs[1]).state)  # a second row: the batched path, holes and all
    batch.step({"a": [9], "b": [1, 2]})
    target.step(single, torch.tensor([9]))
    batch.rollback("a", batch.length("a") - 1)
    target.rollback(single, single.length - 1)
    batch.leave("b")  # alone again: compacted, back on the batch-1 forward (its cache now holds entries the
    assert batch.width == batch.length("a") == single.length  # batched forward wrote: equal within float noise)
    torch.testing.assert_close(batch.step({"a": [10, 11]})["a"], target.step(single, torch.tensor([10, 11])),
                               atol=1e-5, rtol=0)
    keys, values = batch.entries("a", 0)
    torch.testing.assert_close(keys[None], single.cache.layers[0].keys, atol=1e-5, rtol=0)


# ---- lossless -----------------------------------------------------------------------------------------

CASES = [  # (draft, strategy, ratio): None = ar
    (None, "none", 0.0),
    ("smaller", "uniform", 0.5),
    ("self", "hippo", 0.5),
    ("self", "uv", 0.5),
]


@pytest.mark.parametrize("size", [1, 2, 8])
@pytest.mark.parametrize("draft_kind,strategy,ratio", CASES, ids=[c[0] and f"{c[0]}-{c[1]}" or "ar" for c in CASES])
def test_every_item_equals_its_batch1_decode(family, size, draft_kind, strategy, ratio):
    target, smaller = tiny_pair(family)
    draft = {None: None, "smaller": smaller, "self": target}[draft_kind]
    pruning = PruningConfig(strategy, ratio, seed=3, layers=2) if draft is not None else None
    cfg = DecodingConfig(gamma=3, max_new_tokens=14, temperature=0.0)
    todo = items(9 if size == 8 else 5)
    got = run(local_engine(target, draft, cfg, pruning, size)[1], todo)
    assert set(got) == {it.id for it in todo}
    tolerance = TIE_TOLERANCE[target.model.dtype]
    for it in todo:
        one = dataclasses.replace(cfg, max_new_tokens=it.max_new_tokens)
        ref = batch1_ar(target, it, one)
        div = first_divergence(target, it.frames, it.prompt, ref.token_ids, got[it.id].token_ids)
        assert judge(div, tolerance), (it.id, div)  # identical, or a float tie at most (never seen here)
        if draft is not None:  # the same rounds as its batch-1 serial sd: same windows, same verdicts
            sd = batch1_sd(target, draft, it, one, pruning)
            assert got[it.id].token_ids == sd.token_ids
            assert got[it.id].stats.accepted_per_round == sd.stats.accepted_per_round
            assert got[it.id].num_kept == sd.num_kept


def test_self_speculation_really_accepts_in_a_batch(family):
    target, _ = tiny_pair(family)
    cfg = DecodingConfig(gamma=4, max_new_tokens=16, temperature=0.0)
    got = run(local_engine(target, target, cfg, PruningConfig("none", 0.0), 3)[1], items(4, max_new=16))
    assert all(r.stats.acceptance_rate == 1.0 for r in got.values())


SAMPLED = DecodingConfig(gamma=3, max_new_tokens=12, temperature=0.8, top_p=0.95, seed=7)


@pytest.mark.parametrize("size", [1, 4, 8])
@pytest.mark.parametrize("draft_kind,strategy,ratio", [(None, "none", 0.0), ("smaller", "uniform", 0.5),
                                                       ("self", "hippo", 0.5), ("self", "none", 0.0)])
def test_sampled_outputs_are_ar_own(size, draft_kind, strategy, ratio):
    """Position-keyed sampling (the default): at a seed every item's tokens are `ar`'s sample, token for token,
    whatever drafted them and whatever else is in the batch (the law: tests/unit/test_sampling.py). Items carry
    their own seeds: two of them the run's, the others their own. The target drafting for itself on the whole
    video draws the target's own samples (the same noise at the same positions): every token is accepted."""
    target, smaller = tiny_pair("qwen2_5_vl")
    draft = {None: None, "smaller": smaller, "self": target}[draft_kind]
    pruning = PruningConfig(strategy, ratio, seed=1, layers=2) if draft is not None else None
    todo = items(9 if size == 8 else 5, max_new=12)
    for i, it in enumerate(todo[2:]):
        it.seed = 100 + i
    got = run(local_engine(target, draft, SAMPLED, pruning, size)[1], todo)
    for it in todo:
        one = dataclasses.replace(SAMPLED, max_new_tokens=it.max_new_tokens, seed=it.seed or SAMPLED.seed)
        assert got[it.id].token_ids == batch1_ar(target, it, one).token_ids, it.id
    if draft is not None:
        assert sum(r.stats.accepted_tokens for r in got.values()) > 0  # the draft's tokens were accepted
    if draft is target and ratio == 0.0:
        assert all(r.stats.acceptance_rate == 1.0 for r in got.values())


@pytest.mark.parametrize("size", [2, 8])
def test_the_rejection_rule_draws_each_item_from_its_own_streams(size):
    """decoding.sampling: rejection: every item's tokens are exactly those of its batch-1 run (the same seeded
    streams, the same rows up to float noise): what else is in the batch changes nothing, so each row follows the
    law that the speculative-sampling rule gives batch-1 decoding (its chi-square test:
    tests/unit/test_verification.py)."""
    target, smaller = tiny_pair("qwen2_5_vl")
    pruning = PruningConfig("uniform", 0.5, seed=1)
    for draft in (None, smaller):
        cfg = DecodingConfig(gamma=3, max_new_tokens=12, temperature=1.0, seed=7, sampling="rejection")
        todo = items(9 if size == 8 else 4, max_new=12)
        got = run(local_engine(target, draft, cfg, pruning if draft else None, size)[1], todo)
        for it in todo:
            one = dataclasses.replace(cfg, max_new_tokens=it.max_new_tokens)
            ref = (batch1_ar(target, it, one) if draft is None else
                   decode_sd(target, draft, it.frames, it.prompt, one, keep_policy_for(pruning), pruning))
            assert got[it.id].token_ids == ref.token_ids, it.id


def test_exact_verify_in_a_batch_equals_ar(family):
    target, _ = tiny_pair(family)
    cfg = DecodingConfig(gamma=3, max_new_tokens=10, temperature=0.0, exact_verify=True)
    todo = items(3, max_new=10)
    got = run(local_engine(target, target, cfg, PruningConfig("uniform", 0.5), 3)[1], todo)
    for it in todo:
        ref = batch1_ar(target, it, dataclasses.replace(cfg, max_new_tokens=it.max_new_tokens))
        assert got[it.id].token_ids == ref.token_ids


# ---- admission ------------------------------------------------------------------------------------------


def test_items_join_only_while_their_kv_fits_the_budget():
    target, smaller = tiny_pair("qwen2_5_vl")
    cfg = DecodingConfig(gamma=3, max_new_tokens=10, temperature=0.0)
    todo = items(5, max_new=10)
    _, probe = local_engine(target, smaller, cfg, PruningConfig("uniform", 0.5), 8)
    needs = [probe.kv_need(it, target.prepare(it.frames, it.prompt).seq_len) for it in todo]
    budget = max(needs) + min(needs) + 1  # two items at most, whichever two
    engine, scheduler = local_engine(target, smaller, cfg, PruningConfig("uniform", 0.5), 8, kv_budget_bytes=budget)
    peak = 0
    rounds = engine.round

    def watched():
        nonlocal peak
        peak = max(peak, scheduler.reserved())
        assert len(engine.requests) <= 2
        return rounds()

    engine.round = watched
    got = run(scheduler, todo)
    assert 0 < peak <= budget and set(got) == {it.id for it in todo}
    assert all(not isinstance(r, Exception) for r in got.values())
    per_token = kv_bytes_per_token(target) + kv_bytes_per_token(smaller)
    assert needs[0] == (target.prepare(todo[0].frames, todo[0].prompt).seq_len + 10 + cfg.gamma_max + 1) * per_token
    _, alone = local_engine(target, smaller, cfg, PruningConfig("uniform", 0.5), 8, kv_budget_bytes=min(needs) - 1)
    with pytest.raises(ValueError, match="over the budget"):
        alone.check_kv(fresh(todo)[0])
    got = run(alone, todo[:2])  # in a job, that item fails alone with that error
    assert all(isinstance(r, ValueError) and "over the budget" in str(r) for r in got.values())


# ---- the window by goodput ------------------------------------------------------------------------------


def test_serial_round_token_time_is_the_round_over_what_it_commits():
    # gamma 4 drafts at 2 ms, a 5-row verify of 40 ms, tau 0.8: (4*2 + 40) / (1 + E[X]) with Lemma 1's E[X].
    assert serial_round_token_time(0.002, 0.040, 4, 0.8) == pytest.approx(0.048 / (1 + 0.8 * (1 - 0.8**4) / 0.2))
    assert serial_round_token_time(0.002, 0.030, 0, 0.8) == pytest.approx(0.030)  # gamma 0: one plain step per token
    # A quarter of the rows drafting: the round is the same, a quarter of the rows gain E[X].
    assert serial_round_token_time(0.002, 0.040, 4, 0.8, 0.25) == pytest.approx(0.048 / (1 + 0.25 * 2.3616))
    assert expected_accepted(0.8, 4) == pytest.approx(2.3616)


def _measured(window: SerialWindow, t_q: tuple[float, float], t_p: tuple[float, float], tau_rounds: tuple[int, int]):
    """Draft forwards T_q(B) = a + b B and target forwards T_p(rows) = a + b rows, at a few sizes; rounds."""
    cost = window.cost
    for b in (2, 8):
        cost.observe_draft_step(b, t_q[0] + t_q[1] * b)
        for k in (1, 5):
            cost.observe_verify(b * k, t_p[0] + t_p[1] * b * k)
    accepted, rejected = tau_rounds
    for _ in range(rejected):
        cost.observe_round(0, 4)
    for _ in range(accepted):
        cost.observe_round(4, 4)


def test_the_window_speculates_where_it_pays_and_falls_back_to_plain_batching_where_it_does_not():
    good = SerialWindow(5, 1, 12)
    assert good.choose(8) == 5  # nothing measured yet: the configured window
    _measured(good, (0.001, 0.0002), (0.045, 0.002), (40, 1))  # cheap draft, tau near 1
    costs = good.costs(8)
    assert costs[0] == pytest.approx(0.045 + 0.002 * 8)  # plain: one forward of 8 rows per token
    g = good.choose(8)
    assert g == min(costs, key=costs.get) > 0 and costs[g] < costs[0]
    t_q, t_p = 0.001 + 0.0002 * 8, 0.045 + 0.002 * 8 * (g + 1)
    assert costs[g] == pytest.approx(serial_round_token_time(t_q, t_p, g, good.cost.tau), rel=1e-9)
    bad = SerialWindow(5, 1, 12)
    _measured(bad, (0.02, 0.002), (0.045, 0.03), (1, 40))  # expensive draft and verify rows, tau near 0
    choices = [bad.choose(8) for _ in range(200)]
    assert choices.count(0) > 190 and any(choices)  # plain, with a round now and then exploring
    assert SerialWindow(3, 1, 12, fixed=True).choose(8) == 3


def test_exploring_costs_at_most_its_share_of_the_plain_rounds():
    """While plain wins, a round explores (the cheapest gamma > 0) once the budget, `explore_share` of each plain
    round's T_p(B), covers its loss against plain decoding of what it commits: its time minus (1 + E[X]) T_p(B).
    By hand from the lines; then the share of the rounds' time exploring loses, over a long run, is at most
    explore_share."""
    w = SerialWindow(5, 1, 12, budget=ExploreBudget(0.05))
    _measured(w, (0.02, 0.002), (0.045, 0.03), (1, 40))
    tau = w.cost.tau
    costs = w.costs(8)
    g = min((g for g in costs if g > 0), key=costs.get)
    t_q, t_p0, t_pg = 0.02 + 0.002 * 8, 0.045 + 0.03 * 8, 0.045 + 0.03 * 8 * (g + 1)
    loss = g * t_q + t_pg - (1 + expected_accepted(tau, g)) * t_p0
    assert w.exploring_loss(costs, g, 8, 8) == pytest.approx(loss, rel=1e-9)
    period = math.ceil(loss / (0.05 * t_p0))  # plain rounds the budget needs; the last of them explores
    choices = [w.choose(8) for _ in range(3 * period)]
    assert [i for i, c in enumerate(choices) if c] == [period - 1, 2 * period - 1, 3 * period - 1]
    assert all(c == g for c in choices if c)
    plain_s = choices.count(0) * t_p0
    assert choices.count(g) * loss <= 0.05 * (plain_s + choices.count(g) * t_p0) + 1e-12


@settings(max_examples=60, deadline=None)
@given(t_q=st.tuples(st.floats(1e-4, 0.05), st.floats(0.0, 0.01)),
       t_p=st.tuples(st.floats(1e-3, 0.1), st.floats(1e-4, 0.05)),
       tau_rounds=st.tuples(st.integers(0, 40), st.integers(1, 40)),
       share=st.floats(0.001, 0.5),
       rounds=st.lists(st.tuples(st.integers(1, 16), st.integers(0, 16)), min_size=1, max_size=300))
def test_whatever_the_batches_exploring_never_loses_more_than_its_share(t_q, t_p, tau_rounds, share, rounds):
    """Over any sequence of batches (B items, k of them drafting): the rounds that explore lose, in all, at most
    `explore_share` of the time of the rounds where plain decoding won; a round explores only with a drafting row;
    and a batch where every row drafts chooses what the all-drafting costs choose."""
    w = SerialWindow(5, 1, 12, budget=ExploreBudget(share))
    _measured(w, t_q, t_p, tau_rounds)
    lost = plain_s = 0.0
    for batch, k in rounds:
        k = min(k, batch)
        costs = w.costs(batch, k)
        g = w.choose(batch, k)
        if k == batch:
            assert costs == w.costs(batch)
        best = min(costs, key=costs.get)
        if best > 0:
            assert g == best
            continue
        plain_s += costs[0]
        if g:
            assert k > 0
            lost += w.exploring_loss(costs, g, batch, k)
    assert lost <= share * plain_s + 1e-12


def test_a_round_is_priced_by_the_rows_that_draft_in_it():
    """k of B rows drafting: the verify pads all B to gamma + 1 rows, the draft forwards carry k, and only the
    k rows gain E[X]: (gamma T_q(k) + T_p(B (gamma + 1))) / (1 + k / B E[X]) per committed token, times B."""
    w = SerialWindow(5, 1, 12)
    _measured(w, (0.001, 0.0002), (0.045, 0.002), (40, 1))  # speculation pays when every row drafts
    tau = w.cost.tau
    assert w.costs(8, 8) == w.costs(8)
    one = w.costs(8, 1)
    for g in (0, 3):
        by_hand = (g * (0.001 + 0.0002 * 1) + 0.045 + 0.002 * 8 * (g + 1)) / (1 + expected_accepted(tau, g) / 8)
        assert one[g] == pytest.approx(by_hand, rel=1e-9)
    assert w.choose(8) > 0  # every row drafts: speculate
    assert w.choose(8, 1) == 0  # one row drafts: its third of a token a round does not pay for padding all eight


def test_a_round_with_no_drafting_row_never_explores_and_the_budget_buys_one_round_at_most():
    w = SerialWindow(5, 1, 12)
    _measured(w, (0.02, 0.002), (0.045, 0.03), (1, 40))
    assert [w.choose(8, 0) for _ in range(500)] == [0] * 500  # plain rows only: nothing to learn
    after = [w.choose(8, 2) for _ in range(5)]  # a drafting row joins: the saved budget buys one round, not five
    assert after[0] > 0 and after[1:] == [0, 0, 0, 0]


def test_one_fit_serves_every_batch_size_once_two_sizes_were_seen():
    w = SerialWindow(5, 1, 12)
    w.cost.observe_draft_step(4, 0.001)
    w.cost.observe_verify(4 * 6, 0.05)
    w.cost.observe_round(3, 5)
    assert w.costs(4) is None and w.choose(4) == 5  # one size each: a slope would be a guess
    w.cost.observe_draft_step(2, 0.0008)
    w.cost.observe_verify(2 * 6, 0.04)
    assert w.costs(4) is not None and w.costs(3) is not None  # a batch size never seen is priced from the lines


def test_an_item_is_drafted_for_only_while_drafting_saves_more_than_its_draft_prefill_costs():
    """N cost(g*) E[X] / B against D, by hand (pipeline/cost.py SerialWindow.drafting_saves): a plain row beside
    drafted ones rides their rounds, padded to g* + 1 rows, for one token where a drafted row commits 1 + E[X].
    Where D is larger, items decode plain, and one explores once 3% of the plain items' time covers its loss
    (pipeline/drafting_policy.py)."""
    w = SerialWindow(5, 1, 12)
    means = ItemMeans(tokens=30)
    policy = DraftingPolicy(w.budget)
    assert policy.decide(serial_loss(w, 8, means))  # nothing measured: draft
    _measured(w, (0.001, 0.0002), (0.045, 0.002), (40, 1))
    costs = w.costs(8)
    g = min((g for g in costs if g > 0), key=costs.get)
    tau = w.cost.tau
    t_q, t_p = 0.001 + 0.0002 * 8, 0.045 + 0.002 * 8 * (g + 1)
    round_s = g * t_q + t_p  # the batch's round at g*: a plain row pays its share of it per token
    saves = 30 * (round_s / 8 - round_s / 8 / (1 + expected_accepted(tau, g)))
    assert saves == pytest.approx(30 * costs[g] * expected_accepted(tau, g) / 8, rel=1e-9)
    # Pricing the plain row at an all-plain round, cost(0), would see less than half the saving.
    assert 30 * (costs[0] - costs[g]) / 8 < 0.5 * saves
    assert serial_loss(w, 8, means) is None  # D not measured yet
    means.observe_draft_prefill(0.5 * saves)
    assert w.drafting_saves(8, 30) == pytest.approx(saves) and policy.decide(serial_loss(w, 8, means))
    means.observe_draft_prefill(10 * saves)  # running mean: 0.8 * 0.5 + 0.2 * 10 = 2.4 times the saving
    assert means.draft_prefill_s == pytest.approx(2.4 * saves)
    loss, plain_s = serial_loss(w, 8, means)
    assert loss == pytest.approx(1.4 * saves) and plain_s == pytest.approx(30 * (0.045 + 0.002 * 8) / 8)
    period = math.ceil(loss / (0.03 * plain_s))  # plain items the budget needs before one explores
    decisions = [policy.decide(serial_loss(w, 8, means)) for _ in range(2 * period + 2)]
    assert [i for i, d in enumerate(decisions) if d] == [period, 2 * period + 1]
    assert DraftingPolicy(w.budget, always=True).decide((1.0, 1.0))
    # Where the rounds would not speculate (an expensive draft, tau near 0), drafting saves nothing.
    bad = SerialWindow(5, 1, 12)
    _measured(bad, (0.02, 0.002), (0.045, 0.03), (1, 40))
    cheap = ItemMeans(tokens=30, draft_prefill_s=0.001)
    assert bad.drafting_saves(8, 30) <= 0 and not DraftingPolicy(bad.budget).decide(serial_loss(bad, 8, cheap))


def test_items_speculation_does_not_pay_for_decode_plain_in_the_same_batch_and_equal_ar(family):
    target, smaller = tiny_pair(family)
    cfg = DecodingConfig(gamma="auto", max_new_tokens=12, temperature=0.0)
    engine, scheduler = local_engine(target, smaller, cfg, PruningConfig("uniform", 0.5, seed=1), 4)
    _measured(engine.window, (0.001, 0.0002), (0.045, 0.002), (40, 1))
    engine.means.tokens = 12
    engine.means.draft_prefill_s = 1e6  # a draft whose prefill costs more than any item's decoding saves
    scheduler.policy.budget.seconds = 1.5e6  # enough to explore once
    todo = items(7, max_new=12)
    got = run(scheduler, todo)
    plain = [k for k, r in got.items() if r.num_kept is None]
    assert engine.report.plain_items == len(plain) and 4 <= len(plain) < len(todo)
    for it in todo:
        ref = batch1_ar(target, it, dataclasses.replace(cfg, max_new_tokens=it.max_new_tokens))
        assert got[it.id].token_ids == ref.token_ids, it.id


def _equal_mass_bins(p: torch.Tensor, k: int) -> list[list[int]]:
    """Tokens in k bins of about 1/k of p's mass each (most likely first)."""
    order = torch.argsort(p, descending=True).tolist()
    bins, mass, edge = [[]], 0.0, 1.0 / k
    for tok in order:
        bins[-1].append(tok)
        mass += float(p[tok])
        if mass >= edge * len(bins) and len(bins) < k:
            bins.append([])
    return [b for b in bins if b]


def _chi2(counts: Counter, law: torch.Tensor, bins: list[list[int]], n: int) -> float:
    stat = 0.0
    for b in bins:
        expected = n * float(law[b].sum())
        stat += (sum(counts[t] for t in b) - expected) ** 2 / expected
    return stat


def test_each_row_of_a_sampled_batch_follows_the_target_law():
    """Per row inside a batch, the speculative-sampling rule's token has the target's law (chi-square). (The
    position-keyed rule's rows are `ar`'s own samples, token for token: test_sampled_outputs_are_ar_own; its law:
    tests/unit/test_sampling.py.)

    Four items share every forward of a batch of 4; each row's first token is fixed (t1) so that its second,
    which a smaller draft proposes and the row's verification accepts or resamples, has the known law
    p(. | t1) of the target. 800 rounds with fresh seeds (each row its own streams, seeded as at batch 1); the
    counts in 8 bins of equal p-mass pass a chi-square test at 0.999 (7 degrees of freedom: 24.32) for every
    row, and fail it against the draft's own law q, so the test can tell the two apart. Temperature 0.1: at 1 the
    tiny random models' laws are both near uniform over 499 tokens, and no test of this size could tell them
    apart."""
    target, smaller = tiny_pair("qwen2_5_vl")
    temp, trials, k = 0.1, 800, 8
    pruning = PruningConfig("none", 0.0)
    base = DecodingConfig(gamma=1, max_new_tokens=3, temperature=temp, seed=0, sampling="rejection")
    todo = [Request(f"row-{i}", PROMPTS[i % 3], 3, random_frames(40 + i)) for i in range(4)]
    first = [30 + 7 * i for i in range(4)]
    engine, _ = local_engine(target, smaller, base, pruning, 4)
    prefilled = [engine.prefill(r, on_engine_thread=False) for r in todo]
    laws = []
    for it, t1 in zip(todo, first):
        p_pre = target.prefill(target.embed(target.prepare(it.frames, it.prompt)))
        q_pre = smaller.prefill(smaller.embed(smaller.prepare(it.frames, it.prompt)))
        laws.append((probs_from_logits(target.step(p_pre.state, torch.tensor([t1]))[-1], temp),
                     probs_from_logits(smaller.step(q_pre.state, torch.tensor([t1]))[-1], temp)))
    counts = [Counter() for _ in todo]
    for trial in range(trials):
        engine, _ = local_engine(target, smaller, dataclasses.replace(base, seed=trial), pruning, 4)
        for pf, t1 in zip(prefilled, first):
            request = copy.deepcopy(pf)
            request.seed = trial  # the item's seed was the run's when it was prefilled
            only = torch.full_like(request.prefill.logits, float("-inf"))
            only[t1] = 0.0
            request.prefill.logits = only  # its first token is t1, so its second has a known law
            assert engine.join(request) is None and request.committed == [t1]
        _, left = engine.round()
        finished = {r.id: r.result().token_ids for r in left}
        for i, it in enumerate(todo):
            tokens = finished.get(it.id) or engine.requests[it.id].committed
            counts[i][tokens[1]] += 1
    for i, (p, q) in enumerate(laws):
        bins = _equal_mass_bins(p, k)
        assert _chi2(counts[i], p, bins, trials) < 24.32, (i, _chi2(counts[i], p, bins, trials))
        assert _chi2(counts[i], q, bins, trials) > 24.32, i  # the draft's law is rejected: the test has power

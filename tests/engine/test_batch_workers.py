"""Parallel speculative decoding over a batch, in one process: the engine with its remote drafter (engine/drafters/
remote.py) and the draft and pruner workers (roles/draft.py, roles/pruner.py) speak their msgpack protocol over an
in-memory link, and a seeded scheduler interleaves them at random: messages delayed, verdicts arriving while
the draft is several chunks ahead, items joining mid-batch. Whatever the interleaving, every item's output is
its batch-1 `ar` output (greedy, fp32; the margin-aware checker judges any difference), for pearl, hippo and
parallelvlm on all three families at B = 2 and 8, and at B = 1 (the batch-1 pipeline is these workers with one
item in flight) for those and TABED. The real thing, over torchrun, is tests/faults/test_batch_torchrun.py and
tests/torchrun/test_pipeline_torchrun.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
from structlog.testing import capture_logs

from tests.conftest import tiny_pair
from tests.engine_harness import Pipeline, batch1_ar, fresh
from tests.engine_harness import requests as work_items
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.pipeline.drafting_policy import EXPLORE_AFTER, batch1_loss, parallel_loss
from vpsd.pipeline.messages import DraftChunk, Error, VerifyResult, decode


CASES = [("pearl", False), ("hippo", True), ("parallelvlm", False)]


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # an interleaving each
@pytest.mark.parametrize("size", [2, 8])
@pytest.mark.parametrize("method,draft_is_target", CASES, ids=[c[0] for c in CASES])
def test_every_item_equals_its_batch1_ar_under_any_interleaving(family, size, method, draft_is_target, seed):
    todo = work_items(9 if size == 8 else 4)
    pipe = Pipeline(family, method, size, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, draft_is_target)
    got = pipe.run(seed)
    assert set(got) == {it.id for it in todo}
    assert pipe.draft_idle()  # every row left the draft
    tolerance = TIE_TOLERANCE[pipe.target.model.dtype]
    for it in todo:
        ref = batch1_ar(pipe.target, it, dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens))
        div = first_divergence(pipe.target, it.frames, it.prompt, ref.token_ids, got[it.id].token_ids)
        assert judge(div, tolerance), (it.id, seed, div)
    if draft_is_target:  # the target drafting for itself on pruned video still agrees, mostly
        assert sum(r.stats.accepted_tokens for r in got.values()) > 0


ONE = [("pearl", False), ("hippo", True), ("parallelvlm", False), ("tabed", False)]


@pytest.mark.parametrize("size,seed", [(1, 0), (4, 1), (8, 2)])
@pytest.mark.parametrize("method,draft_is_target", ONE, ids=[c[0] for c in ONE])
def test_a_sampled_item_is_ar_own_sample_under_any_interleaving(method, draft_is_target, size, seed):
    """Position-keyed sampling at temperature 0.8, top-p 0.9: every item's tokens are its `ar` sample at the seed,
    for every parallel method at B = 1, 4 and 8 under random interleavings (a parallel draft's look-ahead thrown
    away by rejections, chunks arriving late: nothing of the timing reaches a sample)."""
    todo = work_items(9 if size == 8 else 4, max_new=10)
    settings = {"decoding.gamma": 3, "decoding.temperature": 0.8, "decoding.top_p": 0.9, "decoding.seed": 5}
    pipe = Pipeline("qwen2_5_vl", method, size, todo, settings, draft_is_target)
    got = pipe.run(seed)
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids, it.id


@pytest.mark.parametrize("method,draft_is_target", ONE, ids=[c[0] for c in ONE])
def test_one_item_in_flight_is_the_batch1_pipeline(family, method, draft_is_target):
    """`--batch 1` runs this same engine with one item in flight (the scheduler prefills it on the engine's
    thread): every item equals its `ar` output token for token, for every parallel method, TABED's views
    included, on all three families."""
    todo = work_items(3)
    pipe = Pipeline(family, method, 1, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, draft_is_target)
    got = pipe.run(seed=7)
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids, it.id
        assert got[it.id].num_kept is not None  # every item drafted: at batch 1 nothing falls back to plain
    assert pipe.draft_idle()


def test_tabed_items_draft_from_their_views_in_a_batch_and_sample_from_their_own_streams():
    """TABED in the draft worker: each item drafts from its own ensemble of views beside the others' rows.
    Greedy at B = 3: every item equals ar. Sampled with KL soft labels (the target ships p after every verdict):
    an item's tokens are the same alone and in a batch of 3 under another interleaving, and the weights of
    every block were logged as a distribution over the views."""
    todo = work_items(4, max_new=10)
    pipe = Pipeline("qwen2_5_vl", "tabed", 3, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, False)
    got = pipe.run(seed=8)
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids, it.id
    outs = []
    for size, seed in ((1, 0), (3, 1)):
        pipe = Pipeline("qwen2_5_vl", "tabed", size, todo, {"decoding.gamma": 3, "decoding.temperature": 0.8,
                                                            "decoding.sampling": "rejection"}, True)
        assert pipe.drafter.target_probs and pipe.dw.target_probs
        with capture_logs() as logs:
            got = pipe.run(seed)
        outs.append({k: r.token_ids for k, r in got.items()})
        weights = [e for e in logs if e["event"] == "tabed_weights"]
        assert len(weights) == len(todo)
        assert all(abs(sum(w) - 1.0) < 1e-3 for e in weights for w in e["blocks"])
    assert outs[0] == outs[1]


def test_verdicts_roll_the_draft_back_and_stale_chunks_are_dropped():
    """A draft that mostly agrees: rollbacks happen; after each, the draft sends its first token alone
    (conservative mode, pre-verify) while it drafts on; chunks drafted before a rollback arrive late and are
    dropped by epoch; a fully accepted chunk puts the item back in optimistic mode. The outputs are still ar's."""
    todo = work_items(4, max_new=24)
    # The target drafting for itself on HIPPO-pruned video: it agrees mostly, not always.
    pipe = Pipeline("qwen2_5_vl", "hippo", 4, todo, {"decoding.gamma": 4, "decoding.temperature": 0.0}, True)
    verdicts, chunks, dropped = [], [], []
    handle_draft, handle_target = pipe.dw.handle, pipe.drafter.handle

    def draft_sees(src, msg):
        if isinstance(msg, VerifyResult):
            verdicts.append(msg)
        handle_draft(src, msg)

    def target_sees(src, msg):
        if isinstance(msg, DraftChunk):
            chunks.append(msg)
        handle_target(src, msg)

    pipe.dw.handle, pipe.drafter.handle = draft_sees, target_sees
    has_proposal = pipe.drafter.has_proposal

    def counting(request):
        queue = pipe.drafter.chunks.get(request.id, ())
        before = len(queue)
        left = has_proposal(request)
        dropped.extend([request.id] * (before - len(queue)))
        return left

    pipe.drafter.has_proposal = counting
    got = pipe.run(seed=5)
    assert sum(r.stats.rollbacks for r in got.values()) > 0
    rollbacks = [v for v in verdicts if v.rollback]
    assert rollbacks and all(v.mode == "conservative" for v in rollbacks)  # a fixed window: the papers' pre-verify
    assert any(v.mode == "optimistic" and not v.rollback for v in verdicts)
    # After a rollback to committed length n at epoch e, the draft's first chunk of that epoch is one token.
    for v in rollbacks:
        first = next((c for c in chunks if c.item_id == v.item_id and c.epoch == v.epoch), None)
        if first is not None:
            assert (first.start, len(first.token_ids)) == (v.committed_len, 1)
    assert dropped  # chunks of an old epoch reached the target after its rollback
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids


def test_a_draft_error_fails_its_item_alone():
    """The draft reports it cannot draft one item (an Error naming it): that item fails with the draft's message,
    its ItemDone frees the draft's row, and every other item finishes as ar decodes it."""
    todo = work_items(3, max_new=10)
    pipe = Pipeline("qwen2_5_vl", "pearl", 3, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, False)
    for r in list(pipe.queue):
        assert pipe.admit(r, on_engine_thread=True)
    pipe.queue.clear()
    pipe.drafter.handle("draft", Error("draft", 1, "item-1", "its grid differs"))
    got = pipe.run(seed=2)
    assert isinstance(got["item-1"], ValueError) and "its grid differs" in str(got["item-1"])
    assert "item-1" not in pipe.dw.rows and pipe.draft_idle()
    for it in (todo[0], todo[2]):
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids


def test_the_workers_speak_the_wire_protocol():
    """What crosses the in-memory link is the msgpack the rank transport carries: every queued message decodes
    to its registered type, chunks name their items, and each verdict answers a chunk of the same item."""
    todo = work_items(2, max_new=8)
    pipe = Pipeline("qwen2_5_vl", "pearl", 2, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, False)
    for r in list(pipe.queue):
        assert pipe.admit(r, on_engine_thread=True)
    pipe.queue.clear()
    while pipe._deliver("pruner", pipe.pw.handle) or pipe._deliver("draft", pipe.dw.handle):
        pass
    while pipe.dw.step():
        pass
    chunks = [m for m in (decode(data) for _, data in pipe.hub.inbox["target"]) if isinstance(m, DraftChunk)]
    assert {c.item_id for c in chunks} == {"item-0", "item-1"}
    while pipe._deliver("target", pipe.drafter.handle):
        pass
    ran, _ = pipe.engine.round()
    assert ran
    verdicts = [m for m in (decode(data) for _, data in pipe.hub.inbox["draft"]) if isinstance(m, VerifyResult)]
    assert {v.item_id for v in verdicts} == {"item-0", "item-1"}
    assert all(v.start == 0 for v in verdicts)  # both first chunks, verified in one forward


def test_a_round_waits_for_stragglers_only_while_that_costs_less_than_a_round():
    """patience = T_p min(1/2, waiting / ready): leaving a straggler behind costs it a round, waiting costs each
    ready item the wait."""
    todo = work_items(1)
    pipe = Pipeline("qwen2_5_vl", "pearl", 2, todo, {"decoding.gamma": 3}, False)
    s = pipe.scheduler
    assert s.patience_s(3, 1) == 0.0  # nothing measured yet: no waiting
    pipe.engine.report.verify_s = [0.1, 0.1]
    assert s.patience_s(4, 1) == pytest.approx(0.025)
    assert s.patience_s(2, 2) == pytest.approx(0.05)  # capped at half a round
    assert s.patience_s(0, 3) == 0.0


@pytest.mark.parametrize("rule", ["keyed", "rejection"])
def test_a_sampled_item_draws_from_its_own_streams_whatever_the_batch_and_timing(rule):
    """Temperature 1, the target drafting for itself on the whole video: every proposal is accepted (p = q, up to
    float noise; keyed: the draft's noise is the target's), so an item's tokens are its draft's draws, seeded per
    item. They are the same at B = 2 and B = 8 and under different interleavings: nothing another row or the
    timing does reaches an item's sample (keyed: they are `ar`'s)."""
    todo = work_items(5, max_new=10)
    outs = []
    for size, seed in ((2, 0), (8, 1), (8, 2)):
        pipe = Pipeline("qwen2_5_vl", "pearl", size, todo, {"decoding.gamma": 3, "decoding.temperature": 1.0,
                                                           "decoding.sampling": rule}, True)
        got = pipe.run(seed)
        assert all(r.stats.acceptance_rate == 1.0 for r in got.values())
        outs.append({k: r.token_ids for k, r in got.items()})
    assert outs[0] == outs[1] == outs[2]
    assert len({tuple(t) for t in outs[0].values()}) > 1  # the items differ: not one stream shared by all
    if rule == "keyed":
        for it in todo:
            one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
            assert outs[0][it.id] == batch1_ar(pipe.target, it, one).token_ids, it.id


def test_where_drafting_does_not_pay_items_are_decoded_plain_beside_drafted_ones():
    """With tau measured near 0, a round with drafted rows costs T_p(gamma + 1) for barely more than the one token
    a plain round commits for T_p(1): the next items join as plain rows of the target's batch (one explores once
    3% of the plain items' time covers its loss), the draft and the pruner never hear of them, and every item
    still equals its batch-1 ar output."""
    todo = work_items(9, max_new=12)
    pipe = Pipeline("qwen2_5_vl", "pearl", 4, todo, {"decoding.gamma": "auto", "decoding.temperature": 0.0}, False)
    e, s = pipe.engine, pipe.scheduler
    w = e.window
    w.observe_verify(w.batch, 1, 0.010)
    w.observe_verify(w.batch, 4, 0.016)  # T_p(k) = 8 ms + 2 ms k
    w.cost.accepted, w.cost.rejections = 0.0, 10.0  # tau_hat 0: what an OOD video does to a pair
    e.means.tokens = 12

    def decide(budget: int | None = None) -> bool:
        r = fresh(todo)[0]
        r.max_new_tokens = budget or r.max_new_tokens
        s.decide(r)
        return r.drafted

    g = w.gamma
    loss, plain_s = parallel_loss(w, 1, e.means)  # a drafted row commits one token a round, as a plain one
    assert loss == pytest.approx(12 * (0.008 + 0.002 * (g + 1) - 0.010)) and plain_s == pytest.approx(12 * 0.010)
    period = math.ceil(loss / (0.03 * plain_s))
    decisions = [decide() for _ in range(2 * period + 2)]
    assert [i for i, d in enumerate(decisions) if d] == [period, 2 * period + 1]
    w.cost.accepted = 1000.0  # tau_hat ~ 1: drafting pays again
    assert decide()
    e.means.drafted_rate = 1.1  # but finished items measured 1.1 tokens a round: the measurement wins
    assert not decide()
    w.cost.accepted, e.means.drafted_rate = 0.0, None
    got = pipe.run(seed=3)
    plain = [k for k, r in got.items() if r.num_kept is None]
    assert e.report.plain_items == len(plain) >= 1
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids, it.id
    assert pipe.draft_idle()


def test_at_batch_1_an_item_the_draft_would_slow_down_is_decoded_as_ar():
    """At batch 1 the measure is the wall: seconds per decoded token of the drafted items that finished, against
    the plain ones' (one plain item measures it, unless drafting beats half the line's T_p(1)). Where drafting is
    slower (a video the draft reads badly), the next items are decoded plain; one still drafts once 3% of the
    plain items' time covers what it is expected to lose. The draft and the pruner never hear of the plain ones,
    and every item equals its `ar` output."""
    todo = work_items(5, max_new=10)
    pipe = Pipeline("qwen2_5_vl", "pearl", 1, todo, {"decoding.gamma": "auto", "decoding.temperature": 0.0}, False)
    e, s = pipe.engine, pipe.scheduler
    w, means = e.window, e.means

    def decide(budget: int | None = None) -> bool:
        r = fresh(todo)[0]
        r.max_new_tokens = budget or r.max_new_tokens
        s.decide(r)
        return r.drafted

    assert decide()  # nothing measured: the papers' pipeline
    w.observe_verify(w.batch, 2, 0.010)
    w.observe_verify(w.batch, 4, 0.012)  # T_p(1) = 0.009 s on the line
    w.cost.accepted, w.cost.rejections = 1.0, 10.0
    means.tokens = 30
    assert decide()  # no drafted item has finished yet
    means.token_s[True] = 0.004  # 4 ms a token drafted: under half the line's T_p(1), drafting pays unmeasured
    assert decide()
    means.token_s[True] = 0.006  # over half of it: one plain item measures what plain costs ...
    assert not decide(budget=15)  # ... a cheap one: a budget of at most half the 30 tokens an item commits
    assert [decide(budget=16) for _ in range(EXPLORE_AFTER)] == [True] * EXPLORE_AFTER  # longer ones draft ...
    assert not decide(budget=16)  # ... until that many have waited for a cheap one
    means.token_s = {True: 0.020, False: 0.009}  # drafted: 20 ms a token, against 9 ms plain
    s.policy.budget.seconds = 0.0
    loss, plain_s = batch1_loss(w, means)
    assert loss == pytest.approx(0.011 * 30) and plain_s == pytest.approx(0.009 * 30)
    period = math.ceil(loss / (0.03 * plain_s))  # 41 plain items between two that explore
    decisions = [decide() for _ in range(3 * period + 3)]
    assert [i for i, d in enumerate(decisions) if d] == [period, 2 * period + 1, 3 * period + 2]
    means.token_s[False] = 0.025  # plain items measured slower still: drafting pays
    assert decide()
    w.cost.accepted = 1000.0  # a high tau does not overrule the measured wall
    means.token_s[False] = 0.015
    assert not decide()
    means.token_s = {True: 1.0}  # drafting measured very slow: the run decodes plain
    got = pipe.run(seed=5)
    plain = [k for k, r in got.items() if r.num_kept is None]
    assert e.report.plain_items == len(plain) >= 3 and set(means.token_s) == {True, False}
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids, it.id
    assert pipe.draft_idle()


def test_items_join_a_pipelined_batch_only_while_their_kv_fits_the_budget():
    """`batching.kv_budget_mib`: with room for two items at most, never more than two are in flight (prefilled
    items wait for a round to free room), all finish as ar decodes them, and an item over the budget alone fails
    with that error before anything is announced."""
    todo = work_items(5, max_new=10)
    target, _ = tiny_pair("qwen2_5_vl")
    probe = Pipeline("qwen2_5_vl", "pearl", 8, todo, {"decoding.gamma": 3}, False).scheduler
    needs = [probe.kv_need(it, target.prepare(it.frames, it.prompt).seq_len) for it in todo]
    budget = max(needs) + min(needs) + 1
    pipe = Pipeline("qwen2_5_vl", "pearl", 8, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0,
                                                    "batching.kv_budget_mib": budget / 2**20}, False)
    got = pipe.run(seed=4)
    assert 0 < pipe.peak_kv <= budget and set(got) == {it.id for it in todo}
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == batch1_ar(target, it, one).token_ids
    tight = Pipeline("qwen2_5_vl", "pearl", 8, todo, {"decoding.gamma": 3,
                                                      "batching.kv_budget_mib": (min(needs) - 1) / 2**20}, False)
    with pytest.raises(ValueError, match="over the budget"):
        tight.scheduler.check_kv(fresh(todo)[0])
    assert not tight.hub.inbox["draft"] and not tight.hub.inbox["pruner"]


@pytest.mark.parametrize("size", [1, 2])
def test_without_synchronous_prefill_the_draft_hears_of_an_item_after_the_targets_prefill(size):
    """`decoding.sync_prefill: false` (PEARL-video, HIPPO Table 3's first row): the draft and the pruner are told
    of an item only when it joins, after the target's whole prefill, where HIPPO's synchronous prefill tells them
    before its vision tower runs. Outputs are the same either way."""
    todo = work_items(3, max_new=10)
    for sync in (True, False):
        pipe = Pipeline("qwen2_5_vl", "pearl", size, todo,
                        {"decoding.gamma": 3, "decoding.temperature": 0.0, "decoding.sync_prefill": sync}, False)
        first = pipe.queue[0]
        pipe.scheduler.check_kv(first)
        pipe.scheduler.decide(first)
        pipe.engine.prefill(first, on_engine_thread=True)
        told = [type(decode(data)).__name__ for _, data in pipe.hub.inbox["draft"]]
        assert told == (["JobStart"] if sync else []), sync
        assert pipe.engine.join(first) is None
        pipe.queue.pop(0)
        assert [type(decode(data)).__name__ for _, data in pipe.hub.inbox["draft"]] == ["JobStart"]
        got = pipe.run(seed=3)
        for it in todo:
            one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
            assert got[it.id].token_ids == batch1_ar(pipe.target, it, one).token_ids, (sync, it.id)
        assert pipe.draft_idle()


def test_seconds_per_token_weigh_each_item_by_its_tokens():
    """A drafted job's rate is its decode seconds over its tokens: two 85-token captions at 12 and 14 ms a token
    and a 5-token answer whose 0.35 s is mostly the draft's start rate about 14.7 ms a token as a ratio of the
    means (a mean of per-item rates put it at 27 ms, over a plain item's 30 ms / 2 guess, and turned drafting off
    for the rest of the job in a run that drafted at 2x)."""
    from vpsd.pipeline.drafting_policy import ItemMeans
    from vpsd.pipeline.cost import running_mean

    means = ItemMeans()
    items = [(85, 84 * 0.0118), (85, 84 * 0.0143), (5, 0.35)]
    for tokens, decode_s in items:
        means.observe_item(True, tokens, decode_s, rounds=10)
    spent = decoded = None
    for tokens, decode_s in items:  # the same running means, by hand
        spent, decoded = running_mean(spent, decode_s), running_mean(decoded, tokens - 1)
    assert means.token_s[True] == pytest.approx(spent / decoded)
    assert means.token_s[True] < 0.016
    means.observe_item(False, 85, 84 * 0.030, rounds=84)
    assert means.token_s[False] == pytest.approx(0.030)
    assert means.token_s[True] < means.token_s[False]  # drafting pays

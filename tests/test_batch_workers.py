"""Parallel speculative decoding over a batch, worker by worker, in one process: the target, draft and pruner
workers (roles/target.py, roles/draft.py, roles/pruner.py) speak their msgpack protocol over an
in-memory link, and a seeded scheduler interleaves them at random: messages delayed, verdicts arriving while
the draft is several chunks ahead, items joining mid-batch. Whatever the interleaving, every item's output is
its batch-1 `ar` output (greedy, fp32; the margin-aware checker judges any difference), for pearl, hippo and
parallelvlm on all three families at B = 2 and 8, and at B = 1 (the batch-1 pipeline is these workers with one
item in flight) for those and TABED. The real thing, over torchrun, is tests/test_batch_torchrun.py and
tests/test_pipeline_torchrun.py."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from structlog.testing import capture_logs

from tests.conftest import config_path, random_frames, tiny_pair
from vpsd.config import load_config
from vpsd.decoders.ar import decode_ar
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.pipeline.messages import DraftChunk, Error, VerifyResult, decode
from vpsd.pipeline.methods import get_method
from vpsd.roles.draft import DraftWorker
from vpsd.roles.target import TargetWorker
from vpsd.roles.link import Idle, MemoryHub
from vpsd.roles.pruner import PrunerWorker
from vpsd.roles.starting import WorkItem

PROMPTS = ["Describe the video.", "What happens in this video? Answer in detail.", "Which colours?"]


def work_items(n: int, max_new: int = 14) -> list[WorkItem]:
    return [WorkItem(f"item-{i}", PROMPTS[i % 3], max_new - 2 * (i % 3), random_frames(10 + i, t=4 + 2 * (i % 2)),
                     video={"item": f"item-{i}"}) for i in range(n)]


class FramesInMemory:
    """The draft's frame source for items that never were files: the same frames the target got."""

    def __init__(self, items: list[WorkItem]) -> None:
        self.frames = {it.id: it.frames for it in items}

    def take(self, wire):
        return self.frames[wire["item"]], None, {}

    def ahead(self, wire) -> None:
        pass


class Pipeline:
    """Target, draft and pruner workers on one in-memory hub, and a scheduler that interleaves them."""

    def __init__(self, family: str, method: str, size: int, todo: list[WorkItem], overrides: dict,
                 draft_is_target: bool) -> None:
        m = get_method(method)
        strategy = m.default_strategy
        self.cfg = load_config(config_path(family), {"pruning.strategy": strategy, "pruning.ratio":
                                                      0.0 if strategy == "none" else 0.5, **overrides})
        target, smaller = tiny_pair(family)
        self.target = target
        self.rng = random.Random(0)
        self.hub = MemoryHub(["target", "draft", "pruner"], shuffle=self.rng)
        probs = verdicts_carry_target_probs(m.draft, self.cfg.tabed_settings, self.cfg.decoding.temperature)
        self.tw = TargetWorker(self.hub.link("target"), target, self.cfg, size, target_probs=probs)
        self.dw = DraftWorker(self.hub.link("draft"), target if draft_is_target else smaller, self.cfg,
                              FramesInMemory(todo), drafts_from=m.draft)
        self.pw = PrunerWorker(self.hub.link("pruner"), self.cfg)
        self.queue = list(todo)
        self.deferred: dict = {}  # prefilled items waiting for KV room
        self.peak_kv = 0
        self.results: dict[str, object] = {}

    def _deliver(self, role: str, worker) -> bool:
        link = self.hub.link(role)
        if not link.poll():
            return False
        worker.handle(*link.recv())
        return True

    def _admit(self, rng: random.Random) -> bool:
        """On the role's thread (signals streamed from inside the prefill), or prefilled as on the launcher's
        prefill thread and joined (signals held, then sent): both ways at random. An item whose KV does not fit
        waits (prefilled, if it was) for a round to free some."""
        item = self.queue[0]
        if item.id in self.deferred:
            joined = self.tw.join(self.deferred[item.id])
        elif rng.random() < 0.5:
            joined = self.tw.admit(item)
        else:
            p = self.tw.prefill(item)
            joined = self.tw.join(p)
            if not joined:
                self.deferred[item.id] = p
        if joined:
            self.queue.pop(0)
            self.deferred.pop(item.id, None)
            self.peak_kv = max(self.peak_kv, self.tw.reserved_bytes())
        return joined

    def _target_step(self) -> bool:
        ran, finished = self.tw.step()
        for item, res in finished:
            self.results[item.id] = res
        return ran or bool(finished)

    def run(self, seed: int, max_turns: int = 50_000) -> dict:
        rng = self.rng
        rng.seed(seed)
        actions = {
            "admit": lambda: bool(self.queue) and not self.tw.full and self._admit(rng),
            "target_msg": lambda: self._deliver("target", self.tw),
            "target_step": self._target_step,
            "draft_msg": lambda: self._deliver("draft", self.dw),
            "draft_step": self.dw.step,
            "pruner_msg": lambda: self._deliver("pruner", self.pw),
        }
        names = list(actions)
        idle = 0
        for _ in range(max_turns):
            if not self.queue and not self.tw.rows:
                while self._deliver("draft", self.dw) or self._deliver("pruner", self.pw):
                    pass  # the ItemDone tails
                return self.results
            name = rng.choice(names)
            try:
                moved = actions[name]()
            except Idle:
                moved = False
            idle = 0 if moved else idle + 1
            assert idle < 200, f"no worker can move: a deadlock ({name})"
        raise AssertionError("the pipeline did not finish")


CASES = [("pearl", False), ("hippo", True), ("parallelvlm", False)]


@pytest.mark.parametrize("size", [2, 8])
@pytest.mark.parametrize("method,draft_is_target", CASES, ids=[c[0] for c in CASES])
def test_every_item_equals_its_batch1_ar_under_any_interleaving(family, size, method, draft_is_target):
    todo = work_items(9 if size == 8 else 4)
    refs = {}
    for seed in (0, 1):
        pipe = Pipeline(family, method, size, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0},
                        draft_is_target)
        got = pipe.run(seed)
        assert set(got) == {it.id for it in todo}
        assert not pipe.dw.rows and pipe.dw.batch.size == 0 and not pipe.dw.waiting  # every row left the draft
        tolerance = TIE_TOLERANCE[pipe.target.model.dtype]
        for it in todo:
            if it.id not in refs:
                one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
                refs[it.id] = decode_ar(pipe.target, it.frames, it.prompt, one).token_ids
            div = first_divergence(pipe.target, it.frames, it.prompt, refs[it.id], got[it.id].token_ids)
            assert judge(div, tolerance), (it.id, seed, div)
        if draft_is_target:  # the target drafting for itself on pruned video still agrees, mostly
            assert sum(r.stats.accepted_tokens for r in got.values()) > 0


ONE = [("pearl", False), ("hippo", True), ("parallelvlm", False), ("tabed", False)]


@pytest.mark.parametrize("method,draft_is_target", ONE, ids=[c[0] for c in ONE])
def test_one_item_in_flight_is_the_batch1_pipeline(family, method, draft_is_target):
    """`--batch 1` runs these same workers with one item in flight (launch/batch.py admits it on the role's
    thread): every item equals its `ar` output token for token, for every parallel method, TABED's views
    included, on all three families."""
    todo = work_items(3)
    pipe = Pipeline(family, method, 1, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, draft_is_target)
    got = pipe.run(seed=7)
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == decode_ar(pipe.target, it.frames, it.prompt, one).token_ids, it.id
        assert got[it.id].num_kept is not None  # every item drafted: at batch 1 nothing falls back to plain
    assert not pipe.dw.rows and not pipe.dw.waiting


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
        assert got[it.id].token_ids == decode_ar(pipe.target, it.frames, it.prompt, one).token_ids, it.id
    outs = []
    for size, seed in ((1, 0), (3, 1)):
        pipe = Pipeline("qwen2_5_vl", "tabed", size, todo, {"decoding.gamma": 3, "decoding.temperature": 0.8}, True)
        assert pipe.tw.target_probs and pipe.dw.target_probs
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
    handle_draft, handle_target = pipe.dw.handle, pipe.tw.handle

    def draft_sees(src, msg):
        if isinstance(msg, VerifyResult):
            verdicts.append(msg)
        handle_draft(src, msg)

    def target_sees(src, msg):
        if isinstance(msg, DraftChunk):
            chunks.append(msg)
        handle_target(src, msg)

    pipe.dw.handle, pipe.tw.handle = draft_sees, target_sees
    drop_stale = pipe.tw._drop_stale

    def counting(item_id, row):
        before = len(row.chunks)
        left = drop_stale(item_id, row)
        dropped.extend([item_id] * (before - len(row.chunks)))
        return left

    pipe.tw._drop_stale = counting
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
        assert got[it.id].token_ids == decode_ar(pipe.target, it.frames, it.prompt, one).token_ids


def test_a_draft_error_fails_its_item_alone():
    """The draft reports it cannot draft one item (an Error naming it): that item fails with the draft's message,
    its ItemDone frees the draft's row, and every other item finishes as ar decodes it."""
    todo = work_items(3, max_new=10)
    pipe = Pipeline("qwen2_5_vl", "pearl", 3, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, False)
    for it in todo:
        pipe.tw.admit(it)
    pipe.queue.clear()
    pipe.tw.handle("draft", Error("draft", 1, "item-1", "its grid differs"))
    got = pipe.run(seed=2)
    assert isinstance(got["item-1"], ValueError) and "its grid differs" in str(got["item-1"])
    assert "item-1" not in pipe.dw.rows and pipe.dw.batch.size == 0
    for it in (todo[0], todo[2]):
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == decode_ar(pipe.target, it.frames, it.prompt, one).token_ids


def test_the_workers_speak_the_wire_protocol():
    """What crosses the in-memory link is the msgpack the rank transport carries: every queued message decodes
    to its registered type, chunks name their items, and each verdict answers a chunk of the same item."""
    todo = work_items(2, max_new=8)
    pipe = Pipeline("qwen2_5_vl", "pearl", 2, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, False)
    for it in todo:
        pipe.tw.admit(it)
    pipe.queue.clear()
    while pipe._deliver("pruner", pipe.pw) or pipe._deliver("draft", pipe.dw):
        pass
    while pipe.dw.step():
        pass
    chunks = [m for m in (decode(data) for _, data in pipe.hub.inbox["target"]) if isinstance(m, DraftChunk)]
    assert {c.item_id for c in chunks} == {"item-0", "item-1"}
    while pipe._deliver("target", pipe.tw):
        pass
    ran, _ = pipe.tw.step()
    assert ran
    verdicts = [m for m in (decode(data) for _, data in pipe.hub.inbox["draft"]) if isinstance(m, VerifyResult)]
    assert {v.item_id for v in verdicts} == {"item-0", "item-1"}
    assert all(v.start == 0 for v in verdicts)  # both first chunks, verified in one forward


def test_a_round_waits_for_stragglers_only_while_that_costs_less_than_a_round():
    """patience = T_p min(1/2, waiting / ready): leaving a straggler behind costs it a round, waiting costs each
    ready item the wait."""
    todo = work_items(1)
    tw = Pipeline("qwen2_5_vl", "pearl", 2, todo, {"decoding.gamma": 3}, False).tw
    assert tw.patience_s(3, 1) == 0.0  # nothing measured yet: no waiting
    tw.verify_s = [0.1, 0.1]
    assert tw.patience_s(4, 1) == pytest.approx(0.025)
    assert tw.patience_s(2, 2) == pytest.approx(0.05)  # capped at half a round
    assert tw.patience_s(0, 3) == 0.0


def test_a_sampled_item_draws_from_its_own_streams_whatever_the_batch_and_timing():
    """Temperature 1, the target drafting for itself on the whole video: every proposal is accepted (p = q, up to
    float noise), so an item's tokens are its draft stream's draws, seeded per item. They are the same at B = 2
    and B = 8 and under different interleavings: nothing another row or the timing does reaches an item's
    sample."""
    todo = work_items(5, max_new=10)
    outs = []
    for size, seed in ((2, 0), (8, 1), (8, 2)):
        pipe = Pipeline("qwen2_5_vl", "pearl", size, todo, {"decoding.gamma": 3, "decoding.temperature": 1.0}, True)
        got = pipe.run(seed)
        assert all(r.stats.acceptance_rate == 1.0 for r in got.values())
        outs.append({k: r.token_ids for k, r in got.items()})
    assert outs[0] == outs[1] == outs[2]
    assert len({tuple(t) for t in outs[0].values()}) > 1  # the items differ: not one stream shared by all


def test_where_drafting_does_not_pay_items_are_decoded_plain_beside_drafted_ones():
    """With tau measured near 0, a round with drafted rows costs T_p(gamma + 1) for barely more than the one token
    a plain round commits for T_p(1): the next items join as plain rows of the target's batch (one in `explore_every` still drafts), the draft and the pruner
    never hear of them, and every item still equals its batch-1 ar output."""
    todo = work_items(9, max_new=12)
    pipe = Pipeline("qwen2_5_vl", "pearl", 4, todo, {"decoding.gamma": "auto", "decoding.temperature": 0.0}, False)
    w = pipe.tw.window
    w.observe_verify(1, 0.010)
    w.observe_verify(4, 0.016)
    w.accepted, w.rejections = 0.0, 10.0  # tau_hat 0: what an OOD video does to a pair (README, 4x the video)
    decisions = [pipe.tw.drafting_pays() for _ in range(16)]
    assert decisions.count(True) == 2 and decisions[7] and decisions[15]  # explores one in 8
    w.accepted = 1000.0  # tau_hat ~ 1: drafting pays again
    assert pipe.tw.drafting_pays()
    pipe.tw.drafted_rate = 1.1  # but finished items measured 1.1 tokens a round: the measurement wins
    assert not pipe.tw.drafting_pays()
    w.accepted, pipe.tw.drafted_rate = 0.0, None
    got = pipe.run(seed=3)
    assert pipe.tw.plain_items >= 1
    plain = [k for k, r in got.items() if r.num_kept is None]
    assert plain and len(plain) < len(todo) or pipe.tw.plain_items == len(todo)
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == decode_ar(pipe.target, it.frames, it.prompt, one).token_ids, it.id
    assert not pipe.dw.rows and not pipe.dw.waiting


def test_at_batch_1_an_item_the_draft_would_slow_down_is_decoded_as_ar():
    """At batch 1 the measure is the wall: seconds per decoded token of the drafted items that finished, against
    the plain ones' (one plain item measures it, unless drafting beats half the line's T_p(1)). Where drafting is
    slower (a video the draft reads badly), the next items are decoded plain; one still drafts once 3% of the
    plain items' time covers what it is expected to lose. The draft and the pruner never hear of the plain ones,
    and every item equals its `ar` output."""
    todo = work_items(5, max_new=10)
    pipe = Pipeline("qwen2_5_vl", "pearl", 1, todo, {"decoding.gamma": "auto", "decoding.temperature": 0.0}, False)
    tw, w = pipe.tw, pipe.tw.window
    assert tw.drafting_pays()  # nothing measured: the papers' pipeline
    w.observe_verify(2, 0.010)
    w.observe_verify(4, 0.012)  # T_p(1) = 0.009 s on the line
    w.accepted, w.rejections = 1.0, 10.0
    assert tw.drafting_pays()  # no drafted item has finished yet
    tw.token_s[True] = 0.004  # 4 ms a token drafted: under half the line's T_p(1), drafting pays unmeasured
    assert tw.drafting_pays()
    tw.token_s[True] = 0.006  # over half of it: one plain item measures what plain costs
    assert not tw.drafting_pays() and not tw.drafting_pays()  # (until it finishes)
    tw.token_s = {}
    tw.observe_item_at_batch_1(False, 0.020 * 30, 30)  # a drafted item: 20 ms a token, against 9 ms plain
    tw.observe_item_at_batch_1(True, 0.009 * 30, 30)  # the measuring plain item (into the budget too)
    assert tw.token_s == {True: 0.020, False: 0.009} and tw.item_tokens == 30
    # Exploring loses 11 ms x 30 tokens; each plain item adds 3% of its 0.27 s.
    period = math.ceil(0.011 * 30 / (0.03 * 0.009 * 30))  # 41 plain items, the measuring one included
    decisions = []
    for _ in range(3 * period + 2):
        decisions.append(tw.drafting_pays())
        if not decisions[-1]:
            tw.observe_item_at_batch_1(True, 0.009 * 30, 30)
    # `period` plain items between two that explore (the first time the measuring item was one of them).
    assert [i for i, d in enumerate(decisions) if d] == [period - 1, 2 * period, 3 * period + 1]
    tw.token_s[False] = 0.025  # plain items measured slower still: drafting pays
    assert tw.drafting_pays()
    w.accepted = 1000.0  # a high tau does not overrule the measured wall
    tw.token_s[False] = 0.015
    assert not tw.drafting_pays()
    tw.token_s = {True: 1.0}  # drafting measured very slow: the run decodes plain
    got = pipe.run(seed=5)
    plain = [k for k, r in got.items() if r.num_kept is None]
    assert tw.plain_items == len(plain) >= 3 and set(tw.token_s) == {True, False}
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == decode_ar(pipe.target, it.frames, it.prompt, one).token_ids, it.id
    assert not pipe.dw.rows and not pipe.dw.waiting


def test_items_join_a_pipelined_batch_only_while_their_kv_fits_the_budget():
    """`batching.kv_budget_mib`: with room for two items at most, never more than two are in flight (prefilled
    items wait for a round to free room), all finish as ar decodes them, and an item over the budget alone fails
    with that error before anything is announced."""
    todo = work_items(5, max_new=10)
    target, _ = tiny_pair("qwen2_5_vl")
    probe = Pipeline("qwen2_5_vl", "pearl", 8, todo, {"decoding.gamma": 3}, False).tw
    needs = [probe.kv_bytes(it, target.prepare(it.frames, it.prompt).seq_len) for it in todo]
    budget = max(needs) + min(needs) + 1
    pipe = Pipeline("qwen2_5_vl", "pearl", 8, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0,
                                                    "batching.kv_budget_mib": budget / 2**20}, False)
    got = pipe.run(seed=4)
    assert 0 < pipe.peak_kv <= budget and set(got) == {it.id for it in todo}
    for it in todo:
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert got[it.id].token_ids == decode_ar(target, it.frames, it.prompt, one).token_ids
    tight = Pipeline("qwen2_5_vl", "pearl", 8, todo, {"decoding.gamma": 3,
                                                      "batching.kv_budget_mib": (min(needs) - 1) / 2**20}, False)
    with pytest.raises(ValueError, match="over the budget"):
        tight.tw.prefill(todo[0])
    assert not tight.hub.inbox["draft"] and not tight.hub.inbox["pruner"]

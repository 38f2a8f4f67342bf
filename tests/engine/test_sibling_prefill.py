"""One video's questions prefilled together (engine/sibling_prefill.py): the first one's prefix computed and kept, and
every question's suffix packed in one forward under a mask that shows each its prefix and its own tokens.

Held: each question's first-token logits, cache and positions are its own prefill's within float noise (all three
families), and its pruning signals too (attention and UV-Prune's rows, streamed once where its prefill asks); the
suffixes run as ONE forward of exactly their rows; every method's output with a job's runs grouped equals `ar`'s
with reuse, token for token, in this process and through the draft and pruner workers; the prefill thread groups
a run of consecutive items on one video (at most a batch), a steal runs the whole run, and it prefills further
ahead only while the KV budget has room."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import random_frames, tiny_pair
from tests.engine.test_prefix_reuse import QUESTIONS, engine, questions, tokens
from tests.engine_harness import Pipeline, run
from vpsd.engine import sibling_prefill
from vpsd.engine.prefix_cache import PrefixReuse
from vpsd.engine.prefill_ahead import ListSource, PrefillAhead
from vpsd.engine.request import Request
from vpsd.engine.sibling_prefill import Siblings
from vpsd.models.signals import hooked_layers, prefill_with_signals


def _planned(target, reuse: PrefixReuse, frames, tag: str, need_features: bool = False):
    out = []
    for i, q in enumerate(QUESTIONS):
        inputs = target.prepare(frames, q)
        plan = reuse.plan(f"{tag}{i}", inputs)
        out.append(plan.embed(target, inputs, need_features))
    return out


def _rows_fed(target) -> tuple[list[int], list]:
    fed: list[int] = []
    layer = target.language_model.layers[0]
    return fed, [layer.register_forward_hook(lambda m, a, o: fed.append(
        (o[0] if isinstance(o, tuple) else o).shape[1]))]


def test_packed_suffixes_are_each_questions_own_prefill(family):
    target, _ = tiny_pair(family)
    frames = random_frames(21, t=4)
    alone = PrefixReuse(64 * 2**20)
    want = [emb.reuse.prefill(target, emb) for emb in _planned(target, alone, frames, "a")]
    reuse = PrefixReuse(64 * 2**20)
    group, embs = Siblings(target), []
    for i, q in enumerate(QUESTIONS):  # planned one after another, as the engine does: the 2nd and 3rd hit
        inputs = target.prepare(frames, q)
        emb = reuse.plan(f"q{i}", inputs).embed(target, inputs, False)
        assert emb.reuse.hit == (i > 0) and group.join(emb, (0, 0))
        embs.append(emb)
    start = embs[0].reuse.ends[-1]
    assert group.rows == sum(e.seq_len - start for e in embs)
    fed, hooks = _rows_fed(target)
    try:
        group.prefill()
    finally:
        for h in hooks:
            h.remove()
    assert fed == [group.rows]  # one forward, of exactly the suffixes' rows
    for emb, ref in zip(embs, want):
        got = emb.reuse.prefill(target, emb)  # takes the packed result: no forward
        assert emb.reuse.ready is None
        assert (got.state.length, got.state.prefill_len, got.state.position_offset) == (
            ref.state.length, ref.state.prefill_len, ref.state.position_offset)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(got.state.cache.layers, ref.state.cache.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    assert len(fed) == 1
    stats = reuse.stats()
    assert (stats["requests"], stats["hits"], stats["misses"]) == (3, 2, 1), stats


@pytest.mark.parametrize("layers", [2, None])
def test_packed_signals_measure_what_each_questions_own_prefill_measures(family, layers):
    target, _ = tiny_pair(family)
    frames = random_frames(22, t=4)
    wanted = hooked_layers(target, layers, attention=True, hidden=True)
    alone = PrefixReuse(64 * 2**20)
    want = [prefill_with_signals(target, emb, layers, attention=True, hidden=True)
            for emb in _planned(target, alone, frames, "a", need_features=True)]
    reuse = PrefixReuse(64 * 2**20)
    group, embs = Siblings(target), []
    for i, q in enumerate(QUESTIONS):
        inputs = target.prepare(frames, q)
        emb = reuse.plan(f"q{i}", inputs).embed(target, inputs, True)
        assert group.join(emb, wanted)
        embs.append(emb)
    group.prefill()
    for emb, ref in zip(embs, want):
        seen = []
        got = prefill_with_signals(target, emb, layers, attention=True, hidden=True, on_ready=seen.append)
        assert seen == [got.signals]  # streamed once, as its own prefill streams them
        for name in ("video_attention", "video_hidden", "text_hidden"):
            torch.testing.assert_close(getattr(got.signals, name), getattr(ref.signals, name), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_a_question_that_cannot_join_prefills_on_its_own():
    """Another video's question, or one wanting UV rows of another layer, stays out of the group; a lone member
    is left to prefill as a single request would (its prefix already on its plan, computed once)."""
    target, _ = tiny_pair("qwen2_5_vl")
    reuse = PrefixReuse(64 * 2**20)
    first, second, third = _planned(target, reuse, random_frames(23, t=4), "a")
    other = _planned(target, reuse, random_frames(24, t=4), "b")[0]
    group = Siblings(target)
    assert group.join(first, (0, 0)) and not group.join(other, (0, 0)) and not group.join(second, (0, 2))
    fed, hooks = _rows_fed(target)
    try:
        group.prefill()  # alone: nothing packed
        assert fed == [] and first.reuse.ready is None
        first.reuse.prefill(target, first)  # its suffix alone: the prefix was computed when it joined
        start = first.reuse.ends[-1]
        assert fed == [first.seq_len - start]
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("method, size", [("ar", 2), ("sd", 2), ("hippo", 2), ("parallelvlm", 2), ("specvlm", 2),
                                          ("std", 2), ("sd-tree", 2), ("pearl", 4)])
def test_a_jobs_runs_of_one_videos_questions_decode_as_ar_does(method, size, monkeypatch):
    """A job's scheduler groups the runs (JobEvents.group_key): every method's output equals `ar`'s with reuse,
    token for token, the 2nd and 3rd questions hit, and the runs were packed, at most a batch at a time (std's
    prefill reads every layer's
    attention per head, never a packed result: its questions prefill one by one)."""
    packed = []
    real = sibling_prefill.prefill_siblings_with_signals
    monkeypatch.setattr(sibling_prefill, "prefill_siblings_with_signals",
                        lambda target, embs, *a: packed.append(len(embs)) or real(target, embs, *a))
    todo = questions(random_frames(25, t=4), max_new=10) + questions(random_frames(26, t=6), tag="w", max_new=10)
    _, s_ar = engine("qwen2_5_vl")
    want = tokens(run(s_ar, todo))
    e, s = engine("qwen2_5_vl", method, size=size)
    assert tokens(run(s, todo, grouped=True)) == want
    stats = e.reuse_stats()
    assert (stats["hits"], stats["misses"]) == (4, 2), stats
    assert packed == ([] if method == "std" else [min(3, size)] * 2)  # a run is at most a batch


@pytest.mark.parametrize("method", ["hippo", "parallelvlm"])
def test_through_the_draft_and_pruner_workers_grouped_questions_equal_ar(method):
    """The remote drafter: signals measured in the packed forward are held and sent at each question's join."""
    family = "qwen2_5_vl"
    todo = questions(random_frames(27, t=4), max_new=10) + questions(random_frames(28, t=6), tag="w", max_new=10)
    _, s_ar = engine(family)
    want = tokens(run(s_ar, todo))
    for seed in (3, 4):
        p = Pipeline(family, method, 2, todo, {"reuse.budget_mib": 64}, draft_is_target=False, grouped=True)
        p.engine.reuse.cache.reset()
        assert tokens(p.run(seed=seed)) == want, seed
        stats = p.engine.reuse_stats()
        assert (stats["hits"], stats["misses"]) == (4, 2), stats


def test_the_prefill_thread_prepares_a_run_of_one_videos_items_as_one_task():
    """Consecutive items with one key are one `prepare` call (at most `group_max`), taken from the source as the
    run is submitted; a steal runs a whole run on the stealing thread, once."""
    calls: list[tuple[list[str], str | None, int]] = []
    gate = threading.Event()

    def prepare(items, hint):
        calls.append((list(items), hint, threading.get_ident()))
        if items[0] == "a1":
            gate.wait(10)
        return [it.upper() for it in items]

    items = ["a1", "a2", "a3", "a4", "b1", "c1", "c2"]
    ahead = PrefillAhead(ListSource(items), size=4, prepare=prepare, cpus=None, group_key=lambda it: it[0],
                         group_max=3, room=lambda count: False)
    try:
        ahead.top_up(in_flight=2)  # two free slots and the reserve of two: the first run, then the next
        assert [c[0] for c in calls[:1]] == [["a1", "a2", "a3"]]
        assert [entry[0] for entry in ahead.ahead] == ["a1", "a2", "a3", "a4"]
        assert ahead.steal_if_thin(in_flight=1)  # "a4" (its own run, capped at 3) on this thread
        assert calls[-1][0] == ["a4"] and calls[-1][2] == threading.get_ident()
        assert not ahead.steal_if_thin(in_flight=1)  # the first run has started: nothing left to steal
        gate.set()
        got = []
        for _ in items:
            ahead.top_up(in_flight=0)
            got.append(ahead.next_ready(block=True))
            ahead.pop()
        assert got == [(it, it.upper()) for it in items]
        assert sorted(c[0] for c in calls) == [["a1", "a2", "a3"], ["a4"], ["b1"], ["c1", "c2"]]
    finally:
        gate.set()
        ahead.close()


def test_items_are_prefilled_up_to_a_batch_further_ahead_only_while_their_kv_fits():
    asked: list[int] = []
    room = {"ok": True}

    def fits(count: int) -> bool:
        asked.append(count)
        return room["ok"]

    for ok, want in ((True, 4 + 4), (False, 4 + 2)):
        room["ok"], asked[:] = ok, []
        ahead = PrefillAhead(ListSource([f"i{k}" for k in range(20)]), size=4,
                             prepare=lambda items, hint: [it.upper() for it in items], cpus=None, room=fits)
        try:
            ahead.top_up(in_flight=0)  # four free slots, the reserve of two, then up to a batch while it fits
            assert len(ahead.ahead) == want and asked[0] == 7, ok
        finally:
            ahead.close()


def test_the_schedulers_room_counts_each_item_ahead_at_the_largest_need_seen():
    e, s = engine("qwen2_5_vl", size=4)
    s.kv_budget = 1000
    assert not s.room_ahead(1)  # no need seen yet: no deeper than the reserve
    s.largest_need = 300
    assert s.room_ahead(3) and not s.room_ahead(4)


def test_a_requests_prefill_seconds_count_each_part_once():
    """prefill_s (results' stats, `vpsd summary`): the embeddings, the prefix and the request's share of a packed
    forward, each once; never more than the wall time the prefills took."""
    e, _ = engine("qwen2_5_vl", size=2)
    one, run_of_three = questions(random_frames(29, t=4))[0], questions(random_frames(30, t=4), tag="w")
    for r in (one, *run_of_three):
        r.drafted = False
    t0 = time.perf_counter()
    e.prefill(one, on_engine_thread=False)
    assert 0 < one.prefill_s <= time.perf_counter() - t0
    t0 = time.perf_counter()
    assert all(isinstance(r, Request) for r in e.prefill_group(run_of_three))
    assert 0 < sum(r.prefill_s for r in run_of_three) <= time.perf_counter() - t0

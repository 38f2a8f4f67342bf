"""One video, many questions (engine/prefix_cache.py): the target's prefix (system + video block) is prefilled once
and reused by every later question about the same video; its vision features too.

Held: three questions on one video with reuse equal `ar` without it (all three families; judged as every lossless
test judges, here exactly equal on the float32 tiny models); a hit computes exactly what a miss computes (the
prefill's logits bit for bit), so every method with reuse equals `ar` with reuse token for token, the methods whose
target prefill feeds the pruner included (their signals come from the same two forwards: equal to the one-forward
signals within float noise, a hit's equal to a miss's bit for bit), and every one of them hits; a changed video
never hits; an evicted prefix is recomputed; the budget is never exceeded; the counters and the trace say what
happened; positions need no vision tower; the config's keys are checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import config_path, random_frames, tiny_pair
from tests.engine_harness import PROMPTS, Pipeline, batch1_ar, fresh, run
from vpsd.checked import ConfigError
from vpsd.config import ReuseConfig, load_config
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.engine.engine import Engine
from vpsd.engine.prefix_cache import PrefixCache, PrefixReuse, segment_ends, video_key
from vpsd.models.signals import prefill_with_signals
from vpsd.engine.request import Request
from vpsd.engine.scheduler import Scheduler
from vpsd.launch.wiring import local_drafter
from vpsd.pipeline.methods import DraftPlace, get_method

QUESTIONS = PROMPTS  # three questions of different lengths


def questions(frames, tag: str = "v", max_new: int = 12) -> list[Request]:
    return [Request(f"{tag}-q{i}", q, max_new, frames, video={"item": f"{tag}-q{i}"}) for i, q in enumerate(QUESTIONS)]


def config(family: str, method: str = "ar", budget_mib: float = 64.0, enabled: bool = True, **overrides):
    m = get_method(method)
    strategy = overrides.pop("pruning.strategy", m.default_strategy)
    return load_config(config_path(family), {"pruning.strategy": strategy,
                                             "pruning.ratio": 0.0 if strategy == "none" else 0.5,
                                             "reuse.budget_mib": budget_mib, "reuse.enabled": enabled, **overrides})


def engine(family: str, method: str = "ar", size: int = 1, self_draft: bool = False, **kw) -> tuple[Engine, Scheduler]:
    """The engine as the launcher wires `method` in this process (a parallel method over a batch drafts here)."""
    cfg = config(family, method, **kw)
    cfg = dataclasses.replace(cfg, batching=dataclasses.replace(cfg.batching, size=size))
    target, draft = tiny_pair(family)
    m = get_method(method)
    drafter = None
    if m.draft_place(size, False, "rank") is DraftPlace.LOCAL:
        drafter = local_drafter(cfg, m, target, None if self_draft else draft)
    e = Engine(target, cfg, size, drafter)
    if e.reuse is not None:  # the target's one cache, shared by every engine over it: cold, counters at 0
        e.reuse.cache.reset()
    return e, Scheduler(e, None, None if drafter is None or self_draft else draft)


def tokens(out: dict) -> dict[str, list[int]]:
    return {k: v.token_ids for k, v in out.items()}


def test_three_questions_on_one_video_reuse_the_prefix_and_equal_ar_without_it(family):
    target, _ = tiny_pair(family)
    todo = questions(random_frames(7, t=4))
    e, s = engine(family)
    out = run(s, todo)
    stats = e.reuse_stats()
    assert (stats["requests"], stats["hits"], stats["misses"]) == (3, 2, 1)
    assert stats["vision_skipped"] == 2 and stats["vision_misses"] == 1  # `ar` on a hit never runs the tower
    prefix = segment_ends(target.prepare(todo[0].frames, todo[0].prompt))[0]
    assert stats["reused_tokens"] == 2 * prefix
    cfg = config(family)
    for item in todo:
        ref = batch1_ar(target, item, dataclasses.replace(cfg.decoding, max_new_tokens=item.max_new_tokens))
        div = first_divergence(target, item.frames, item.prompt, ref.token_ids, out[item.id].token_ids)
        assert judge(div, TIE_TOLERANCE[torch.float32]), (item.id, div)
        assert out[item.id].token_ids == ref.token_ids  # float32 tiny models: no near-tie here


def test_a_hit_computes_exactly_what_a_miss_computes_and_positions_need_no_tower(family):
    """Lossless by construction: the prefill is cut where the request's own tokens say, never where the cache does,
    so the logits and every cache entry of a hit are a miss's, bit for bit; and they match a full prefill's within
    float noise."""
    target, _ = tiny_pair(family)
    frames = random_frames(8, t=4)
    inputs = target.prepare(frames, QUESTIONS[1])
    full = target.embed(inputs)
    bare = target.embed_with(inputs, None)  # no vision tower
    assert torch.equal(bare.positions, full.positions) and bare.next_position == full.next_position
    results = []
    for warm in (False, True):
        reuse = PrefixReuse(64 * 2**20)
        if warm:  # another question about the same video first
            other = target.prepare(frames, QUESTIONS[2])
            plan = reuse.plan("other", other)
            plan.prefill(target, plan.embed(target, other, False))
        plan = reuse.plan("q", inputs)
        assert plan.hit == warm
        pre = plan.prefill(target, plan.embed(target, inputs, False))
        assert plan.vision == ("skipped" if warm else "computed")
        results.append(pre)
    miss, hit = results
    assert torch.equal(miss.logits, hit.logits)
    assert (hit.state.length, hit.state.prefill_len, hit.state.position_offset) == (
        miss.state.length, miss.state.prefill_len, miss.state.position_offset)
    for a, b in zip(miss.state.cache.layers, hit.state.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    plain = target.prefill(full)
    assert (plain.state.length, plain.state.position_offset) == (hit.state.length, hit.state.position_offset)
    assert float((plain.logits - hit.logits).abs().max()) < 1e-4


SIGNALS = ("hippo", "parallelvlm", "specvlm", "std")  # their target prefill feeds the pruner (or std's sparse KV)


@pytest.mark.parametrize("layers", [2, None])
def test_signals_come_from_the_two_forwards_and_a_hit_measures_what_a_miss_measures(family, layers):
    """With reuse, a prefill with signals is the reuse's two forwards: the text rows are exactly the suffix, so the
    text-to-video attention and the text rows are measured there (the video keys read from the cache), and
    UV-Prune's video rows at layer L come from the prefix forward, kept with its KV. The signals equal the
    one-forward prefill's within float noise; a hit's equal a miss's bit for bit, logits and cache too; a prefix
    kept without the rows (an `ar` request's) is computed again with them, then hit; on_ready fires once, in the
    suffix forward, right after layer L-1."""
    target, _ = tiny_pair(family)
    frames = random_frames(8, t=4)
    inputs = target.prepare(frames, QUESTIONS[1])
    one = prefill_with_signals(target, target.embed(inputs), layers, attention=True, hidden=True)
    depth = len(target.language_model.layers)
    expect = depth if layers is None else min(layers, depth)
    prefix = segment_ends(inputs)[0]

    def with_signals(reuse, item, inputs, seen=None):
        plan = reuse.plan(item, inputs)
        emb = plan.embed(target, inputs, True)
        return plan, prefill_with_signals(target, emb, layers, attention=True, hidden=True, on_ready=seen)

    results = {}
    for warm in ("cold", "signals", "ar"):
        reuse = PrefixReuse(64 * 2**20)
        other = target.prepare(frames, QUESTIONS[2])  # another question about the same video first
        if warm == "signals":
            with_signals(reuse, "other", other)
        elif warm == "ar":  # a prefix kept without UV-Prune's rows
            plan = reuse.plan("other", other)
            plan.prefill(target, plan.embed(target, other, False))
        before = reuse.stats()["bytes"]
        fed, seen = [], []  # (layer, rows fed) of every decoder layer's forward; the layers run at on_ready
        counters = [layer.register_forward_hook(lambda m, a, o, i=i: fed.append((i, o[0].shape[1] if isinstance(
            o, tuple) else o.shape[1]))) for i, layer in enumerate(target.language_model.layers)]
        try:
            plan, pre = with_signals(reuse, "q", inputs, lambda signals: seen.append((list(fed), signals)))
        finally:
            for h in counters:
                h.remove()
        assert plan.hit == (warm == "signals"), warm
        suffix = [(i, n) for i, n in fed if n == inputs.seq_len - prefix]
        assert [i for i, _ in suffix] == list(range(depth))  # the suffix's forward, all layers
        assert len(seen) == 1 and seen[0][1] is pre.signals
        assert seen[0][0][-expect:] == suffix[:expect] and len(seen[0][0]) == len(fed) - depth + expect
        if warm == "ar":  # computed again with the rows, kept with both: the next question hits
            assert reuse.stats()["bytes"] > before
            assert with_signals(reuse, "again", target.prepare(frames, QUESTIONS[0]))[0].hit
        results[warm] = pre
    miss = results["cold"]
    for warm in ("signals", "ar"):
        got = results[warm]
        assert torch.equal(got.logits, miss.logits)
        for name in ("video_attention", "video_hidden", "text_hidden"):
            assert torch.equal(getattr(got.signals, name), getattr(miss.signals, name)), (warm, name)
        for a, b in zip(got.state.cache.layers, miss.state.cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    s, ref = miss.signals, one.signals
    assert s.video_attention.shape == ref.video_attention.shape == (expect, *ref.video_attention.shape[1:])
    assert s.video_hidden.shape == ref.video_hidden.shape and s.text_hidden.shape == ref.text_hidden.shape
    for name in ("video_attention", "video_hidden", "text_hidden"):
        torch.testing.assert_close(getattr(s, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    assert torch.equal(s.video_hidden[0], ref.video_hidden[0])  # layer 0: the embeddings, as they are
    assert float((miss.logits - one.logits).abs().max()) < 1e-4


@pytest.mark.parametrize("method, self_draft, size", [
    ("sd", False, 1), ("sd", True, 1), ("sd-tree", False, 1), ("pearl", False, 2), ("hippo", False, 2),
    ("parallelvlm", False, 2), ("specvlm", False, 1), ("std", False, 1), ("ar", False, 2)])
def test_every_method_with_reuse_equals_ar_with_reuse_token_for_token(method, self_draft, size):
    """Every method's target prefill reuses as `ar`'s does, those that feed the pruner its signals from the target's
    prefill included (hippo's and specvlm's attention, parallelvlm's hidden rows, std's every-layer attention: taken
    from the same two forwards), so every output is `ar`'s with reuse, token for token (here exactly: no near-tie
    on the float32 tiny model), and the 2nd and 3rd question about each video hit."""
    family = "qwen2_5_vl"
    frames = random_frames(9, t=4)
    todo = questions(frames, max_new=10) + questions(random_frames(10, t=6), tag="w", max_new=10)
    e_ar, s_ar = engine(family)
    want = tokens(run(s_ar, todo))
    e, s = engine(family, method, size=size, self_draft=self_draft)
    out = run(s, todo)
    assert tokens(out) == want
    stats = e.reuse_stats()
    assert (stats["requests"], stats["hits"], stats["misses"], stats["skipped"]) == (6, 4, 2, 0), stats
    if method in SIGNALS and method != "std":  # drafted from a pruned video: the signals were read
        assert all(r.num_kept is not None and r.num_kept < r.num_video_tokens for r in out.values())


@pytest.mark.parametrize("method", ["pearl", "hippo", "parallelvlm"])
def test_through_the_draft_and_pruner_workers_every_method_reuses_and_equals_ar(method):
    """The draft and the pruner on their own (in-memory) ranks: hippo's and parallelvlm's signals stream from the
    suffix forward (or are held and sent at the join), and every question after the first hits."""
    family = "qwen2_5_vl"
    todo = questions(random_frames(11, t=4), max_new=10)
    _, s_ar = engine(family)
    want = tokens(run(s_ar, todo))
    p = Pipeline(family, method, 1, todo, {"reuse.budget_mib": 64}, draft_is_target=False)
    p.engine.reuse.cache.reset()
    got = tokens(p.run(seed=3))
    assert got == want
    stats = p.engine.reuse_stats()
    assert (stats["hits"], stats["misses"], stats["skipped"]) == (2, 1, 0), stats


def test_a_changed_video_never_hits():
    family = "qwen2_5_vl"
    target, _ = tiny_pair(family)
    frames = random_frames(12, t=4)
    changed = frames.copy()
    changed[2, 10, 10, 0] ^= 1  # one value of one pixel of one frame: as a file rewritten between two questions
    first = target.prepare(frames, QUESTIONS[0])
    second = target.prepare(changed, QUESTIONS[0])
    assert video_key(first) != video_key(second)
    e, s = engine(family)
    todo = [Request("a", QUESTIONS[0], 8, frames), Request("b", QUESTIONS[1], 8, changed),
            Request("c", QUESTIONS[2], 8, changed)]
    out = run(s, todo)
    stats = e.reuse_stats()
    assert (stats["hits"], stats["misses"]) == (1, 2)  # c hits b's prefix, never a's
    cfg = config(family)
    for item in todo:
        assert out[item.id].token_ids == batch1_ar(target, item, dataclasses.replace(
            cfg.decoding, max_new_tokens=item.max_new_tokens)).token_ids


def test_an_evicted_prefix_is_recomputed_and_the_budget_is_never_exceeded():
    family = "qwen2_5_vl"
    target, _ = tiny_pair(family)
    a, b = random_frames(13, t=4), random_frames(14, t=4)
    one = PrefixReuse(1 << 30)
    plan = one.plan("x", target.prepare(a, QUESTIONS[0]))
    plan.prefill(target, plan.embed(target, target.prepare(a, QUESTIONS[0]), False))
    entry = one.stats()["bytes"]  # one video's prefix and features
    budget_mib = 1.5 * entry / 2**20  # room for one video's, not two
    todo = [Request("a0", QUESTIONS[0], 8, a), Request("b0", QUESTIONS[0], 8, b), Request("a1", QUESTIONS[1], 8, a),
            Request("a2", QUESTIONS[2], 8, a)]
    e, s = engine(family, budget_mib=budget_mib)
    out = run(s, todo)
    stats = e.reuse_stats()
    assert stats["evicted"] >= 1 and stats["peak_bytes"] <= stats["budget_bytes"] == int(budget_mib * 2**20)
    assert (stats["hits"], stats["misses"]) == (1, 3)  # a1: a's prefix went for b's; a2 hits a1's
    e_ar, s_ar = engine(family, enabled=False)
    assert e_ar.reuse is None
    assert tokens(out) == tokens(run(s_ar, todo))  # here exactly equal, as without reuse
    # A budget too small for any prefix keeps nothing and fails nothing.
    e, s = engine(family, budget_mib=entry / 2**20 / 8)  # the same target's cache, resized
    assert tokens(run(s, todo)) == tokens(out)
    stats = e.reuse_stats()
    assert stats["hits"] == 0 and stats["too_large"] >= 4 and stats["peak_bytes"] <= stats["budget_bytes"]


def test_the_cache_evicts_least_recently_used_first_and_a_segment_goes_with_what_follows_it():
    from vpsd.engine.prefix_cache import Segment

    def seg(key: bytes, parent: bytes | None, n: int) -> Segment:
        t = torch.zeros(1, 1, n, 4)  # 16 n bytes, keys and values: 32 n
        return Segment(key, parent, 0, n, [(t, t.clone())])

    c = PrefixCache(100 * 32)
    assert c.put_segment(seg(b"a", None, 40)) and c.put_segment(seg(b"a2", b"a", 10))
    assert c.put_segment(seg(b"b", None, 40))
    assert [s.key for s in c.segments([b"a", b"a2"])] == [b"a", b"a2"]  # touched: b is now the oldest
    assert c.put_segment(seg(b"c", None, 40))  # b goes
    assert c.segments([b"b"]) == [] and len(c.segments([b"a", b"a2"])) == 2
    assert c.put_segment(seg(b"d", None, 60))  # c goes, then a with a2 (unreachable without it)
    assert c.segments([b"a"]) == [] and not c.has_segment(b"a2")
    assert c.stats()["bytes"] == 60 * 32 <= c.budget
    assert not c.put_segment(seg(b"e", None, 101)) and c.stats()["too_large"] == 1
    assert not c.put_segment(seg(b"f", b"gone", 1))  # a parent evicted meanwhile: not kept
    # UV-Prune's rows count with the KV; the same segment kept again with rows is one entry with both
    c = PrefixCache(100 * 32)
    assert c.put_segment(seg(b"a", None, 20)) and c.put_segment(seg(b"a2", b"a", 10))
    with_rows = seg(b"a", None, 20)
    with_rows.rows[3] = torch.zeros(5, 4)  # 80 bytes
    assert with_rows.nbytes == 20 * 32 + 80
    assert c.put_segment(with_rows)
    held = c.segments([b"a", b"a2"])
    assert len(held) == 2 and set(held[0].rows) == {3} and c.stats()["bytes"] == 30 * 32 + 80
    assert c.put_segment(seg(b"a", None, 20)) and set(c.segments([b"a"])[0].rows) == {3}  # rows stay
    big = seg(b"a", None, 20)
    big.rows[5] = torch.zeros(200, 4)  # past the budget with the rows held: not kept, the entry stays as it was
    assert not c.put_segment(big) and c.stats()["too_large"] == 1
    assert len(c.segments([b"a", b"a2"])) == 2 and set(c.segments([b"a"])[0].rows) == {3}
    assert c.stats()["bytes"] == 30 * 32 + 80


def test_the_reuse_settings_are_checked():
    with pytest.raises(ConfigError, match="reuse.budget_mib"):
        load_config(config_path("qwen2_5_vl"), {"reuse.budget_mib": -1})
    with pytest.raises(ConfigError, match="did you mean 'budget_mib'"):
        load_config(config_path("qwen2_5_vl"), {"reuse.budget": 1})
    assert ReuseConfig().enabled and ReuseConfig(enabled=False).budget_bytes == 0
    assert ReuseConfig(enabled=False).frames_bytes == ReuseConfig(enabled=False).draft_budget_bytes == 0
    assert ReuseConfig(budget_mib=8).draft_budget_bytes == 2 * 2**20  # a draft keeps features only: a quarter
    assert load_config(config_path("qwen2_5_vl")).to_dict()["reuse"] == {"enabled": True, "budget_mib": 512.0,
                                                                         "frames_mib": 128.0}


def test_every_engine_over_one_target_shares_its_cache():
    """The Python API builds an engine per generate call, a server one for its life: both reuse across requests."""
    family = "qwen2_5_vl"
    target, _ = tiny_pair(family)
    todo = questions(random_frames(15, t=4))
    first, s1 = engine(family)
    run(s1, todo[:1])
    second = Engine(target, config(family, budget_mib=32), 1)  # as the next API call builds it
    run(Scheduler(second), todo[1:])
    assert second.reuse is first.reuse and second.reuse.cache.budget == 32 * 2**20
    assert (second.reuse_stats()["hits"], second.reuse_stats()["misses"]) == (2, 1)

"""Draft trees (sd-tree, specvlm) and Sparse-to-Dense's sparse KV (std) in the one engine, at any batch size.

Each is a drafter of the engine (engine/drafters/tree.py, engine/drafters/sparse_kv.py): one commit rule, one round,
every request in flight drafting in one forward per depth or token and verified in the round's one target
forward (a tree mask per row). Checked against the reference decoders (decoders/tree_sd.py, decoders/std.py: the
oracle, one item at a time) at batch 1 and 3: the same tokens, the same accepted tokens in every round, the same
kept video; greedy, identical to `ar`; sampled, the same draws as the item's batch-1 run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import FAMILIES, random_frames, tiny_pair
from tests.engine_harness import requests, run, run_config
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.ar import decode_ar
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.decoders.serial import decode_serial
from vpsd.engine.engine import Engine
from vpsd.engine.scheduler import Scheduler
from vpsd.launch.wiring import local_drafter
from vpsd.models.batch import BatchedCache, TreeFeed
from vpsd.pipeline.methods import DraftPlace, get_method
from vpsd.pipeline.cost import SerialWindow
from vpsd.pipeline.tree import NAMED_TREES, DraftTree

TREE = [2, 2, 1]  # 2 + 4 + 4 nodes, depth 3: siblings to reject, a leaf level, room in 14 tokens for several rounds


def _setup(family: str, name: str, temperature: float):
    target, smaller = tiny_pair(family)
    draft = None if name == "std" else smaller
    strategy, ratio = {"sd-tree": ("none", 0.0), "specvlm": ("specvlm", 0.5), "std": ("none", 0.5)}[name]
    pruning = PruningConfig(strategy, ratio, seed=3, layers=2)
    dec = DecodingConfig(gamma=3, max_new_tokens=14, temperature=temperature, seed=5,
                         tree=None if name == "std" else TREE)
    return target, draft, pruning, dec


def _engine_run(target, draft, pruning, dec, name: str, size: int, todo) -> dict:
    cfg = run_config(target, dec, pruning, size)
    engine = Engine(target, cfg, size, local_drafter(cfg, get_method(name), target, draft))
    return run(Scheduler(engine, None, draft), todo)


# Batch 3 on every family; batch 1 (each forward the batch-1 forward itself, models/batch.py) on one.
@pytest.mark.parametrize("family,size", [(f, 3) for f in FAMILIES] + [("qwen2_5_vl", 1)])
@pytest.mark.parametrize("name", ["sd-tree", "specvlm", "std"])
def test_every_item_equals_its_reference_decoder_and_ar_at_any_batch(family, name, size):
    target, draft, pruning, dec = _setup(family, name, 0.0)
    todo = requests(5)
    got = _engine_run(target, draft, pruning, dec, name, size, todo)
    for it in todo:
        one = dataclasses.replace(dec, max_new_tokens=it.max_new_tokens)
        ref = decode_serial(get_method(name), target, draft, it.frames, it.prompt, one, pruning)
        row = got[it.id]
        assert row.token_ids == ref.token_ids, (it.id, size)
        # the same rounds as the oracle's: the batch never changes what a round drafts or accepts
        assert row.stats.accepted_per_round == ref.stats.accepted_per_round, (it.id, size)
        assert row.num_kept == ref.num_kept and sum(row.stats.drafted_per_round) > 0
        assert row.stats.rollbacks == ref.stats.rollbacks
        ar = decode_ar(target, it.frames, it.prompt, one)
        div = first_divergence(target, it.frames, it.prompt, ar.token_ids, row.token_ids)
        assert judge(div, TIE_TOLERANCE[target.model.dtype]), (it.id, div)


@pytest.mark.parametrize("rule", ["keyed", "rejection"])
@pytest.mark.parametrize("name,size", [("sd-tree", 3), ("specvlm", 1), ("specvlm", 8), ("std", 3)])
def test_sampled_items_draw_their_batch1_tokens_in_a_batch(name, size, rule):
    """Temperature 1, seed 5: each item's candidates and verdicts are its batch-1 run's, in its order, whatever
    else is in flight: keyed, a node's candidates are the draft's best keyed scores and the output is `ar`'s
    sample; under the rejection rule they come from its own streams (recursive rejection over a tree's
    siblings, pipeline/tree.py)."""
    target, draft, pruning, dec = _setup("qwen2_5_vl", name, 1.0)
    dec = dataclasses.replace(dec, sampling=rule)
    todo = requests(9 if size == 8 else 5)
    got = _engine_run(target, draft, pruning, dec, name, size, todo)
    for it in todo:
        one = dataclasses.replace(dec, max_new_tokens=it.max_new_tokens)
        ref = decode_serial(get_method(name), target, draft, it.frames, it.prompt, one, pruning)
        assert got[it.id].token_ids == ref.token_ids, it.id
        assert got[it.id].stats.accepted_per_round == ref.stats.accepted_per_round, it.id
        if rule == "keyed":
            assert ref.token_ids == decode_ar(target, it.frames, it.prompt, one).token_ids, it.id
        assert got[it.id].stats.accepted_per_round == ref.stats.accepted_per_round, it.id


def test_a_batched_tree_step_scores_each_row_as_its_batch1_tree_step_and_keep_leaves_a_chain():
    """Two rows feeding trees of different shapes beside a row feeding a chain, in one forward: each row's logits
    are its batch-1 `step_tree`'s (float noise of the wider batch aside); keeping the accepted path leaves each
    row's entries equal to its batch-1 compacted cache, and the next chain step scores as there."""
    target, _ = tiny_pair("qwen3_vl")  # M-RoPE: a node's three position rows advance together
    embs = [target.embed(target.prepare(random_frames(s, t=4), "Describe the video.")) for s in (1, 2, 3)]
    batch, singles = BatchedCache(target), {}
    for key, emb in zip("abc", embs):
        batch.join(key, target.prefill(emb).state)
        singles[key] = target.prefill(emb).state
    trees = {"a": DraftTree.from_branching([2, 1]), "b": DraftTree.from_branching([3])}
    pending = {"a": [5, 6], "b": [7], "c": [8, 9]}
    nodes = {"a": [11, 12, 13, 14], "b": [15, 16, 17]}
    feeds, shapes = {}, {}
    for key, tree in trees.items():
        offsets, visible = tree.verify_inputs(len(pending[key]))
        feeds[key] = pending[key] + nodes[key]
        shapes[key] = TreeFeed(offsets + singles[key].length, visible)
    feeds["c"] = pending["c"]
    got = batch.step(feeds, shapes)
    for key in "ab":
        ref = target.step_tree(singles[key], torch.tensor(feeds[key]), shapes[key].seq_index, shapes[key].visible)
        torch.testing.assert_close(got[key], ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["c"], target.step(singles["c"], torch.tensor(feeds["c"])), atol=1e-5, rtol=0)
    paths = {"a": [1, 3], "b": [2]}  # node indices after the root: a's first candidate and its child, b's third
    for key, path in paths.items():
        start = singles[key].length - len(nodes[key])
        batch.keep(key, start, [n - 1 for n in path])
        target.compact(singles[key], start, [n - 1 for n in path])
        assert batch.length(key) == singles[key].length
        keys, values = batch.entries(key, 0)
        torch.testing.assert_close(keys[None], singles[key].cache.layers[0].keys, atol=1e-5, rtol=0)
    after = batch.step({"a": [20], "b": [21], "c": [22]})
    for key, token in zip("abc", (20, 21, 22)):
        torch.testing.assert_close(after[key], target.step(singles[key], torch.tensor([token])), atol=1e-5, rtol=0)


def test_trees_and_sparse_kv_run_at_any_batch_and_tabed_batches_only_pipelined():
    for name in ("sd-tree", "specvlm", "std"):
        assert get_method(name).draft_place(8) is DraftPlace.LOCAL
    assert get_method("tabed").draft_place(8, pipelined=True) is DraftPlace.REMOTE
    with pytest.raises(ValueError, match="needs batching.pipelined=true"):
        get_method("tabed").draft_place(8)


def test_a_tree_is_priced_by_the_rows_it_verifies_and_drafted_only_where_that_pays():
    """The serial window's goodput rule (pipeline/cost.py) with a tree prices a drafted row's verify at the tree's
    nodes + 1 rows, not a chain's gamma + 1: on a compute-bound verify (T_p(n) = 10 ms + 1 ms n, as on a CPU past a
    few rows; tau 0.9) at B = 4 a chain pays (a window of 5: 39 ms for 4.7 tokens a row, against 14 ms a plain
    token) and EAGLE's 25-node tree of the same depth does not (119 ms for 4.7); with verify rows nearly free (a
    GPU) the tree pays too."""
    def measured(tree, per_row_s):
        w = SerialWindow(5, 1, 8, tree=tree)
        for rows in (4, 24, 104):
            w.cost.observe_verify(rows, 0.010 + per_row_s * rows)
        for b in (1, 4):
            w.cost.observe_draft_step(b, 0.001)
        for _ in range(5):
            w.cost.observe_round(4, 5)  # tau_hat 0.8
            w.cost.observe_round(5, 5)
        return w

    eagle = DraftTree.from_paths(NAMED_TREES["eagle"])
    assert (eagle.depth, eagle.num_nodes) == (5, 25)
    assert measured(None, 0.001).choose(4) > 0
    assert measured((5, 25), 0.001).choose(4) == 0
    assert measured((5, 25), 0.00001).choose(4) == 5

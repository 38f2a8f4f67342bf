"""One seed rule for every random stream of an item (vpsd/pipeline/seeds.py), checked where it shows: a random
pruning (the `random` strategy, seeded pruning.seed + the item's seed) keeps the same video tokens with the draft
in the target's process (batched), on a worker of its own (the ranks' protocol, batched and alone) and on threads,
at a seed other than the default 0 (at which the old rules happened to agree). Sampled tokens through the ranks'
protocol and on threads: tests/engine/test_draft_on_threads.py; at every batch size: tests/engine/test_batch_workers.py."""

from __future__ import annotations

import pytest

from tests.conftest import config_path, tiny_pair
from tests.engine_harness import FramesInMemory, Jobs, Pipeline, fresh, local_engine, run
from tests.engine_harness import requests as work_items
from vpsd.config import DecodingConfig, PruningConfig, load_config
from vpsd.engine.engine import Engine
from vpsd.engine.scheduler import Scheduler
from vpsd.launch.in_process import RoleThreads
from vpsd.pipeline.methods import get_method
from vpsd.pipeline.seeds import draft_seed, pruning_seed, verify_seed
from vpsd.reports.kept_log import read_kept

SEEDS = {"decoding.seed": 5, "pruning.seed": 3, "pruning.strategy": "random", "pruning.ratio": 0.5,
         "decoding.gamma": 3}


def test_the_streams_of_an_item_derive_from_its_seed():
    assert (verify_seed(5), draft_seed(5), pruning_seed(3, 5)) == (5, 6, 8)


@pytest.fixture(scope="module")
def todo():
    return work_items(3)


def _kept_in_process(todo, size: int) -> dict[str, list[int]]:
    target, draft = tiny_pair("qwen2_5_vl")
    pruning = PruningConfig("random", 0.5, seed=3)
    engine, scheduler = local_engine(target, draft, DecodingConfig(gamma=3, seed=5), pruning, size,
                                     parallel_signals=True)
    return {k: r.kept.tolist() for k, r in run(scheduler, todo).items()}


def _kept_through_workers(todo, size: int, out) -> dict[str, list[int]]:
    pipe = Pipeline("qwen2_5_vl", "hippo", size, todo, SEEDS, draft_is_target=False)
    pipe.pw.out = out  # the pruner worker logs what it kept, as on its rank
    pipe.run(seed=1)
    return {r.item_id: r.kept.tolist() for r in read_kept(out)}


def _kept_on_threads(todo, out) -> dict[str, list[int]]:
    cfg = load_config(config_path("qwen2_5_vl"), SEEDS)
    target, draft = tiny_pair("qwen2_5_vl")
    threads = RoleThreads(target, draft, cfg, get_method("hippo"), out, "seeds", 30.0, videos=FramesInMemory(todo))
    engine = Engine(target, cfg, 1, threads.drafter)
    threads.drafter.await_peers(30.0)
    Scheduler(engine, None).run(fresh(todo), Jobs())
    threads.stop()
    return {r.item_id: r.kept.tolist() for r in read_kept(out)}


def test_a_random_pruning_keeps_the_same_tokens_wherever_the_draft_runs(todo, tmp_path):
    local = _kept_in_process(todo, 2)
    assert set(local) == {it.id for it in todo}
    assert _kept_through_workers(todo, 2, tmp_path / "batched") == local
    assert _kept_through_workers(todo, 1, tmp_path / "alone") == local
    assert _kept_on_threads(todo, tmp_path / "threads") == local
    # and the seed reaches the selection: another item seed keeps other tokens
    target, draft = tiny_pair("qwen2_5_vl")
    engine, scheduler = local_engine(target, draft, DecodingConfig(gamma=3, seed=6), PruningConfig("random", 0.5, seed=3),
                                     2, parallel_signals=True)
    assert {k: r.kept.tolist() for k, r in run(scheduler, todo).items()} != local

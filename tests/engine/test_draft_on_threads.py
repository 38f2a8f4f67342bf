"""A parallel method's draft and pruner on threads of the target's process (`draft_on: thread`,
launch/in_process.py): the same roles as on their ranks, over an in-process carrier (roles/thread_link.py).
Every item equals its batch-1 `ar` output; a sampled item draws what it draws through the ranks' protocol (its
seeds do not depend on where the draft runs); a role thread that dies is named by the target's next wait. The
real job with the setting, through torchrun: tests/torchrun/test_pipeline_torchrun.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.conftest import config_path, tiny_pair
from tests.engine_harness import FramesInMemory, Jobs, Pipeline, fresh
from tests.engine_harness import requests as work_items
from vpsd.config import load_config
from vpsd.decoders.ar import decode_ar
from vpsd.engine.engine import Engine
from vpsd.engine.scheduler import Scheduler
from vpsd.launch.in_process import RoleThreads
from vpsd.pipeline.messages import Shutdown, VerifyResult
from vpsd.pipeline.methods import get_method
from vpsd.roles.context import RoleFailure
from vpsd.roles.thread_link import ThreadHub


def _run_on_threads(family: str, method: str, size: int, todo, overrides: dict, draft_is_target: bool) -> dict:
    m = get_method(method)
    cfg = load_config(config_path(family), {"pruning.strategy": m.default_strategy, "pruning.ratio":
                                            0.0 if m.default_strategy == "none" else 0.5, **overrides})
    target, smaller = tiny_pair(family)
    threads = RoleThreads(target, target if draft_is_target else smaller, cfg, m, None, "test", timeout_s=30.0,
                          videos=FramesInMemory(todo))
    engine = Engine(target, cfg, size, threads.drafter)
    threads.drafter.await_peers(30.0)
    jobs = Jobs()
    Scheduler(engine, cfg.batching.kv_budget_bytes).run(fresh(todo), jobs)
    threads.stop()
    assert not any(t.is_alive() for t in threads.threads)
    return jobs.out


@pytest.mark.parametrize("family,method,size,draft_is_target", [
    ("qwen2_5_vl", "hippo", 1, True), ("qwen2_5_vl", "pearl", 2, False), ("qwen3_vl", "parallelvlm", 2, False),
    ("llava_onevision", "hippo", 1, True)])
def test_every_item_equals_its_batch1_ar_with_the_draft_on_a_thread(family, method, size, draft_is_target):
    todo = work_items(3)
    got = _run_on_threads(family, method, size, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0},
                          draft_is_target)
    target, _ = tiny_pair(family)
    cfg = load_config(config_path(family), {"decoding.gamma": 3})
    for it in todo:
        one = dataclasses.replace(cfg.decoding, max_new_tokens=it.max_new_tokens, temperature=0.0)
        assert got[it.id].token_ids == decode_ar(target, it.frames, it.prompt, one).token_ids, it.id
    if draft_is_target:
        assert sum(r.stats.accepted_tokens for r in got.values()) > 0  # it did draft, and the target agreed


def test_a_sampled_item_draws_the_same_tokens_on_a_thread_as_through_the_ranks_protocol():
    todo = work_items(3, max_new=10)
    settings = {"decoding.gamma": 3, "decoding.temperature": 1.0, "decoding.seed": 5}
    threads = _run_on_threads("qwen2_5_vl", "pearl", 2, todo, settings, True)
    pipe = Pipeline("qwen2_5_vl", "pearl", 2, todo, settings, True)
    ranks = pipe.run(seed=3)
    assert {k: r.token_ids for k, r in threads.items()} == {k: r.token_ids for k, r in ranks.items()}
    for it in todo:  # and position-keyed (the default), they are `ar`'s own sample at the seed
        one = dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens)
        assert threads[it.id].token_ids == decode_ar(pipe.target, it.frames, it.prompt, one).token_ids, it.id


def test_a_role_thread_that_dies_ends_the_targets_wait_naming_it():
    hub = ThreadHub(("target", "draft", "pruner"), idle_timeout_s=60.0)
    target, draft = hub.link("target"), hub.link("draft")
    draft.send("target", VerifyResult("x", 0, 0, 0, 0, 0, "full", False))
    assert target.recv("draft")[1].item_id == "x"  # a message: decoded from its wire form
    t0 = time.monotonic()
    hub.fail("draft", ValueError("out of memory"))
    with pytest.raises(RoleFailure, match="the draft thread failed: ValueError: out of memory"):
        target.recv("draft")
    assert time.monotonic() - t0 < 5.0


def test_tensors_are_handed_over_as_copies_in_announce_order():
    hub = ThreadHub(("target", "draft", "pruner"))
    pruner, draft = hub.link("pruner"), hub.link("draft")
    keep = torch.arange(5)
    pruner.send_tensors("draft", [keep, torch.ones(2, 3)], tag="keep", item_id="a")
    keep += 100  # the sender reuses its buffer: the receiver's copy is what was sent
    pruner.send("draft", Shutdown("done"))
    _, announce = draft.recv("pruner")
    got = draft.recv_tensors(announce)
    assert announce.tag == "keep" and announce.item_id == "a" and torch.equal(got[0], torch.arange(5))
    assert isinstance(draft.recv("pruner")[1], Shutdown)

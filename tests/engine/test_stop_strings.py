"""Stop strings end decoding in the engine, at the round that completes one, for every drafter place and batch
size: the output is what `ar` returns with the same stop strings (its text before the stop string, the tokens
that cover it), and decoding spent no round past that one (pipeline/stopping.py, Request.look_for_stop)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import tiny_pair
from tests.engine_harness import Pipeline, batch1_ar, local_engine, requests, run
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.engine.request import Request
from vpsd.launch.results import output_of
from vpsd.pipeline.stopping import stop_length

DECODING = DecodingConfig(gamma=3, max_new_tokens=14, temperature=0.0)


def with_stops(target, todo: list[Request]) -> tuple[list[Request], dict]:
    """Each item with a stop string its `ar` output completes after a few tokens (two characters of its text there,
    no half-decoded byte among them), and `ar`'s full output to hold the engine to."""
    out, full = [], {}
    for it in todo:
        ref = batch1_ar(target, it, dataclasses.replace(DECODING, max_new_tokens=it.max_new_tokens))
        stop = next(t[-2:] for k in range(4, len(ref.token_ids)) if len(t := target.text(ref.token_ids[:k])) >= 2
                    and "\ufffd" not in t[-2:])
        out.append(dataclasses.replace(it, stop=(stop,)))
        full[it.id] = ref.token_ids
    return out, full


def assert_stopped_as_ar(target, todo: list[Request], full: dict, got: dict, rounds_past: int) -> None:
    """Each output is `ar`'s cut at its stop string, and at most `rounds_past` tokens were committed past the
    token that completed it (0 for `ar`: it stops on that token; a window's round for a drafter)."""
    for it in todo:
        expected, reason = output_of(target.text, full[it.id], it.stop, target.eos_token_ids)
        assert expected.stopped and reason == "stop" and expected.generated < len(full[it.id])
        committed = got[it.id].token_ids
        assert output_of(target.text, committed, it.stop, target.eos_token_ids) == (expected, reason), it.id
        assert stop_length(target.text, committed, it.stop) == expected.generated
        assert expected.generated <= len(committed) <= expected.generated + rounds_past, (it.id, len(committed))


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("draft", ["ar", "sd"])
def test_a_stop_string_ends_decoding_in_the_engine(size, draft):
    target, smaller = tiny_pair("qwen2_5_vl")
    todo, full = with_stops(target, requests(4))
    drafter = smaller if draft == "sd" else None
    got = run(local_engine(target, drafter, DECODING, PruningConfig("uniform", 0.5) if drafter else None, size)[1],
              todo)
    assert_stopped_as_ar(target, todo, full, got, rounds_past=0 if drafter is None else DECODING.gamma)


def test_a_stop_string_ends_a_pipelined_batch_and_the_draft_lets_the_item_go():
    """The draft on its own rank (the real protocol over an in-memory link, interleaved at random): the item
    leaves at the round that completed its stop string and the draft drops its row."""
    target, _ = tiny_pair("qwen2_5_vl")
    todo, full = with_stops(target, requests(4))
    pipe = Pipeline("qwen2_5_vl", "hippo", 3, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, True)
    got = pipe.run(seed=0)
    assert pipe.draft_idle()
    assert_stopped_as_ar(target, todo, full, got, rounds_past=pipe.cfg.decoding.gamma)  # a fixed window here

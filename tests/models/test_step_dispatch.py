"""What a decode step dispatches, counted on CPU so that CI catches what would make a GPU step slow
(vpsd/models/dispatch.py): no host read inside a step, a verify or a batched step of any family; one read of the
chosen token ids a round (the draft: one a drafted token), greedy or sampled; and no more aten ops a step than transformers' own
generate() step on the same model and inputs (+10%).

On a GPU a host read drains the device's queue (a captured step's one launch waits on it), and every aten op is a
kernel launch's CPU cost; a change that adds either shows up here, not only on the GPU a month later."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FAMILIES, random_frames, tiny_pair
from tests.engine_harness import local_engine, requests
from vpsd.config import DecodingConfig
from vpsd.models.batch import BatchedCache
from vpsd.models.dispatch import audit

OPS_ALLOWANCE = 1.10  # a vpsd round may dispatch at most this much of transformers' generate() step


def _prefilled(adapter, seed: int):
    return adapter.prefill(adapter.embed(adapter.prepare(random_frames(seed), "Describe the video."))).state


@pytest.mark.parametrize("fam", FAMILIES)
def test_a_step_a_verify_and_a_batched_step_read_nothing_on_the_host(fam):
    target, _ = tiny_pair(fam)
    state = _prefilled(target, 1)
    batch = BatchedCache(target)
    batch.join("a", _prefilled(target, 2))
    batch.join("b", _prefilled(target, 3))
    forwards = {
        "step": lambda: target.step(state, torch.tensor([5])),
        "verify": lambda: target.step(state, torch.tensor([5, 6, 7, 8, 9])),
        "batched step": lambda: batch.step({"a": [5], "b": [6]}),
        "batched verify": lambda: batch.step({"a": [5, 6, 7], "b": [8]}),
    }
    for name, forward in forwards.items():
        forward()  # first calls may set things up
        with audit() as seen:
            forward()
        assert seen.num_ops > 0 and seen.host_reads == [], f"{fam} {name} reads the host: {seen.host_reads}"


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40}], ids=["greedy", "sampled"])
def test_a_round_reads_the_chosen_ids_once(fam, size, sampling):
    """Greedy or sampled (position-keyed: the noise is hashed on the logits' device, pipeline/sampling.py), a
    round reads the host once for every row's token, and the draft once a drafted token."""
    target, draft = tiny_pair(fam)
    for drafter in (None, draft):  # ar; serial sd with the draft in this process
        engine, _ = local_engine(target, drafter, DecodingConfig(gamma=4, max_new_tokens=40, **sampling), None, size)
        for r in requests(size, max_new=40):
            engine.prefill(r, True)
            engine.join(r)
        engine.round()
        with audit() as seen:
            engine.round()
        drafted = sum(r.stats.drafted_per_round[-1] for r in engine.requests.values())  # this round's windows
        assert drafter is None or drafted > 0
        expected = ["tolist"] if drafter is None else ["__int__"] * drafted + ["tolist"]
        assert sorted(seen.host_reads) == sorted(expected), f"{fam} B={size} {'sd' if drafter else 'ar'}"


def _generate_step_ops(model, inputs, n: int = 6) -> float:
    """aten ops of one transformers generate() decode step (greedy): the difference of two runs, n steps apart."""
    kwargs = dict(input_ids=inputs.input_ids, **inputs.pixel_inputs, do_sample=False)
    counts = []
    with torch.inference_mode():
        model.generate(**kwargs, max_new_tokens=2, min_new_tokens=2)  # warm
        for new in (2, 2 + n):
            with audit() as seen:
                model.generate(**kwargs, max_new_tokens=new, min_new_tokens=new)
            counts.append(seen.num_ops)
    return (counts[1] - counts[0]) / n


@pytest.mark.parametrize("fam", FAMILIES)
def test_an_ar_round_dispatches_no_more_than_transformers_generate_step(fam):
    target, _ = tiny_pair(fam)
    engine, _ = local_engine(target, None, DecodingConfig(max_new_tokens=40), None, 1)
    request = requests(1, max_new=40)[0]
    engine.prefill(request, True)
    engine.join(request)
    engine.round()
    with audit() as seen:
        engine.round()
    theirs = _generate_step_ops(target.model, target.prepare(request.frames, request.prompt))
    assert seen.num_ops <= OPS_ALLOWANCE * theirs, f"{fam}: vpsd {seen.num_ops} aten ops a step, transformers {theirs}"

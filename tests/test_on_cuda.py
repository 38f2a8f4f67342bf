"""The decoders on a CUDA device: skipped where there is none (CI never has one), run on a lent GPU machine.

Each item's random streams are CPU generators (seeded as at batch 1), and torch refuses a CPU generator for a
draw from a CUDA tensor, so every draw reads its rows on the host (`pipeline/sampling.py on_generator`). These
check that sampled and greedy decoding run with the models on a GPU, and that a batch still draws each item's
tokens from its own streams there.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.conftest import config_path, random_frames
from tests.engine_harness import local_engine, run
from vpsd.config import DecodingConfig, PruningConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.engine.request import Request
from vpsd.decoders.keep import keep_policy_for
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.decoders.sd import decode_sd
from vpsd.models.registry import load_adapter, tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@functools.lru_cache(maxsize=None)
def cuda_pair(family: str):
    cfg = load_config(config_path(family))
    tok = tiny_tokenizer()
    target = load_adapter(family, dataclasses.replace(cfg.target, device="cuda"), tok)
    draft = load_adapter(family, dataclasses.replace(cfg.draft, device="cuda"), tok)
    return target, draft


def cuda_items(n: int, max_new: int) -> list[Request]:
    return [Request(f"item-{i}", "Describe the video.", max_new - i % 3, random_frames(30 + i, t=4 + 2 * (i % 2)))
            for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sd_on_cuda_runs_and_greedy_equals_ar(temperature):
    target, draft = cuda_pair("qwen2_5_vl")
    assert target.device.type == "cuda"
    pruning = PruningConfig("uniform", 0.5, seed=1)
    cfg = DecodingConfig(gamma=3, max_new_tokens=12, temperature=temperature, seed=5)
    frames = random_frames(3)
    ar = decode_ar(target, frames, "Describe the video.", cfg)
    sd = decode_sd(target, draft, frames, "Describe the video.", cfg, keep_policy_for(pruning), pruning)
    assert 1 <= len(sd.token_ids) <= 12 and 1 <= len(ar.token_ids) <= 12
    if temperature == 0.0:
        div = first_divergence(target, frames, "Describe the video.", ar.token_ids, sd.token_ids)
        assert judge(div, TIE_TOLERANCE[target.model.dtype]), div


def test_a_sampled_batch_on_cuda_draws_each_item_from_its_own_streams():
    target, draft = cuda_pair("qwen2_5_vl")
    pruning = PruningConfig("uniform", 0.5, seed=1)
    cfg = DecodingConfig(gamma=3, max_new_tokens=10, temperature=1.0, seed=7)
    todo = cuda_items(4, max_new=10)
    got = run(local_engine(target, draft, cfg, pruning, 4)[1], todo)
    for it in todo:
        one = dataclasses.replace(cfg, max_new_tokens=it.max_new_tokens)
        ref = decode_sd(target, draft, it.frames, it.prompt, one, keep_policy_for(pruning), pruning)
        assert got[it.id].token_ids == ref.token_ids, it.id

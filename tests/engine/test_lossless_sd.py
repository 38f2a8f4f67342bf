"""Greedy serial speculative decoding reproduces the target's autoregressive output token for token.

Every family, several seeds and prompts, pruning ratios 0 / 0.5 / 0.9, a smaller draft of the same
family and self-speculation (the target fed pruned video tokens).
"""

from __future__ import annotations

import pytest

from tests.conftest import random_frames, tiny_pair
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.sd import decode_sd

PROMPTS = ["Describe the video.", "What happens in this video? Answer in detail."]


@pytest.mark.parametrize("draft_kind", ["smaller", "self"])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.9])
def test_greedy_sd_equals_ar(family, draft_kind, ratio):
    target, smaller = tiny_pair(family)
    draft = target if draft_kind == "self" else smaller
    accepted = 0
    for seed, prompt in [(0, PROMPTS[0]), (1, PROMPTS[1]), (2, PROMPTS[0])]:
        frames = random_frames(seed)
        cfg = DecodingConfig(gamma=3 + seed, max_new_tokens=20, temperature=0.0)
        ref = decode_ar(target, frames, prompt, cfg)
        got = decode_sd(target, draft, frames, prompt, cfg, keep_policy_for(PruningConfig("uniform", ratio, seed)))
        assert got.token_ids == ref.token_ids
        assert got.num_kept <= got.num_video_tokens
        accepted += sum(got.stats.accepted_per_round)
    if draft_kind == "self" and ratio == 0.0:
        # The unpruned target drafting for itself must agree on every token: proves drafts are really used.
        assert accepted > 0


def test_self_speculation_without_pruning_accepts_everything(family):
    target, _ = tiny_pair(family)
    # 16 tokens = the prefill's token + 3 rounds of (4 drafts + 1 bonus).
    cfg = DecodingConfig(gamma=4, max_new_tokens=16, temperature=0.0)
    got = decode_sd(target, target, random_frames(5), PROMPTS[0], cfg, keep_policy_for(PruningConfig("none", 0.0)))
    assert got.stats.acceptance_rate == 1.0
    assert got.stats.mean_accepted_tokens == 5.0

"""Issue 13, point 6: lossless comparisons that fail on real divergence, not on ties; and `exact_verify`,
which makes greedy speculation reproduce `ar` bit for bit (one-token verify forwards)."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.ar import decode_ar
from vpsd.decoders.keep import keep_policy_for
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.decoders.sd import decode_sd

PROMPT = "What happens in this video?"
GREEDY = DecodingConfig(gamma=3, max_new_tokens=10, temperature=0.0)


def test_a_tie_passes_and_a_real_divergence_fails():
    target = copy.deepcopy(tiny_pair("qwen2_5_vl")[0])
    frames = random_frames(2)
    first = decode_ar(target, frames, PROMPT, GREEDY).token_ids
    # Give a second token the lm_head row of the token ar picks at position 2: an exact top-2 tie there.
    chosen, twin = first[2], (first[2] + 1) % target.model.lm_head.weight.shape[0]
    with torch.no_grad():
        target.model.lm_head.weight[twin] = target.model.lm_head.weight[chosen]
    ar = decode_ar(target, frames, PROMPT, GREEDY).token_ids
    pos = next(i for i, t in enumerate(ar) if t in (chosen, twin))
    tied = ar[:pos] + [twin if ar[pos] == chosen else chosen]
    d = first_divergence(target, frames, PROMPT, ar, tied)
    assert d.position == pos and d.margin == 0.0
    assert judge(d, TIE_TOLERANCE[torch.float32])  # a flip at a tie is float noise's to decide
    # A wrong token where the target is sure fails: that is a real divergence.
    wrong = ar[:1] + [ar[1] + 1] + ar[2:]
    d = first_divergence(target, frames, PROMPT, ar, wrong)
    assert d.position == 1 and d.margin > TIE_TOLERANCE[torch.float32]
    assert not judge(d, TIE_TOLERANCE[torch.float32])
    assert first_divergence(target, frames, PROMPT, ar, list(ar)) is None and judge(None, 0.0)
    shorter = first_divergence(target, frames, PROMPT, ar, ar[:4])
    assert shorter.position == 4 and shorter.other_token is None


def test_exact_verify_reproduces_ar_rows_bit_for_bit_in_bf16():
    target, draft = (copy.deepcopy(a) for a in tiny_pair("qwen2_5_vl"))
    target.model.to(torch.bfloat16)
    draft.model.to(torch.bfloat16)
    frames = random_frames(3)
    ar = decode_ar(target, frames, PROMPT, GREEDY)
    pre = target.prefill(target.embed(target.prepare(frames, PROMPT)))
    state = pre.state
    tokens = torch.tensor(ar.token_ids[:5])
    rows = target.step(state, tokens, rowwise=True)
    target.rollback(state, state.prefill_len)
    singles = torch.cat([target.step(state, tokens[i : i + 1]) for i in range(5)])
    assert torch.equal(rows, singles)  # the verify rows are ar's rows
    none = PruningConfig("none", 0.0)
    sd = decode_sd(target, draft, frames, PROMPT, replace(GREEDY, exact_verify=True), keep_policy_for(none), none)
    assert sd.token_ids == ar.token_ids

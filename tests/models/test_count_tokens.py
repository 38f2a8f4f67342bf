"""models/*: `count_tokens` (the sequence's length from the frames' count and size alone, what a long video's fit to
the context is decided by before it is decoded) equals the length `prepare` makes from the pixels, in every family,
for odd sizes, odd frame counts, real frame times and a conversation."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import FAMILIES, tiny_pair
from vpsd.models.prompt import Turn, chat_prompt

SHAPES = [(1, 56, 56), (3, 90, 160), (8, 112, 112), (7, 65, 49), (5, 300, 40)]


@pytest.mark.parametrize("family", FAMILIES)
def test_count_tokens_is_the_length_prepare_makes(family):
    target, _ = tiny_pair(family)
    chat = chat_prompt([Turn("system", "Be brief."), Turn("user", "What is it?", True), Turn("assistant", "A ball."),
                        Turn("user", "Which colour?")])
    for t, h, w in SHAPES:
        frames = np.zeros((t, h, w, 3), np.uint8)
        times = np.cumsum(np.linspace(0.3, 1.7, t)) if t > 1 else None
        for prompt in ("Describe the video.", chat):
            want = target.prepare(frames, prompt, times).seq_len
            assert target.count_tokens(t, h, w, prompt, times) == want, (t, h, w, prompt[:20])

"""Where an output ends: the one stop rule of every decoder, serial, batched and parallel.

Plain decoding stops after `max_new_tokens` tokens or at the first EOS, which it keeps. A speculative round
commits several tokens at once and may accept an EOS mid-window, or run past the budget: such a sequence is
done as soon as it holds an EOS anywhere or has reached the budget, and `cut` trims it exactly where plain
decoding would have stopped. Pure.
"""

from __future__ import annotations

from typing import Collection, Sequence


def done(tokens: Sequence[int], max_new_tokens: int, eos_token_ids: Collection[int]) -> bool:
    """Whether a sequence needs no more tokens: its budget is spent, or it holds an EOS."""
    return len(tokens) >= max_new_tokens or any(t in eos_token_ids for t in tokens)


def cut(tokens: Sequence[int], max_new_tokens: int, eos_token_ids: Collection[int]) -> list[int]:
    """The sequence as plain decoding would have returned it: at most max_new_tokens, up to the first EOS."""
    out = list(tokens[:max_new_tokens])
    for i, t in enumerate(out):
        if t in eos_token_ids:
            return out[: i + 1]
    return out

"""Where an output ends: the one stop rule of every decoder, serial, batched and parallel.

Plain decoding stops after `max_new_tokens` tokens or at the first EOS, which it keeps. A speculative round
commits several tokens at once and may accept an EOS mid-window, or run past the budget: such a sequence is
done as soon as it holds an EOS anywhere or has reached the budget, and `cut` trims it exactly where plain
decoding would have stopped. Pure.

Stop strings (a request's `stop`, lmms-eval's `until`) end an output in its text, not its tokens: plain decoding
with them stops after the first token whose text, read with the tokens before it, holds one (`stop_length`), and
the output is the text before the stop string, with the shortest prefix of the tokens that covers it
(`cut_at_stop`). A prefix is read as an incremental detokenizer reads it (vLLM's): replacement characters at its
end are the bytes of a character the next token may complete, held back, not text. A round may commit tokens past
the stop, as past an EOS; the cut makes the output plain decoding's all the same.
"""

from __future__ import annotations

from typing import Callable, Collection, NamedTuple, Sequence


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


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the first of the stop strings begins in `text`; None when none occurs."""
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


def stop_length(decode: Callable[[Sequence[int]], str], tokens: Sequence[int], stop: Sequence[str],
                start: int = 1) -> int | None:
    """The number of tokens after which plain decoding with stop strings stops: the shortest prefix, of at least
    `start` tokens (those before were looked at already), whose text holds a stop string; None: none does."""
    if not stop:
        return None
    return next((n for n in range(max(1, start), len(tokens) + 1)
                 if first_stop(settled(decode(tokens[:n])), stop) is not None), None)


def settled(text: str) -> str:
    """A prefix's text without the replacement characters at its end (module docstring)."""
    return text.rstrip("\ufffd")


class StopCut(NamedTuple):
    tokens: list[int]  # the shortest prefix of the output's tokens that covers `text`
    text: str  # the output's text, up to its first stop string
    generated: int  # how many tokens plain decoding generated: up to the one that completed the stop string
    stopped: bool  # a stop string ended it


def cut_at_stop(decode: Callable[[Sequence[int]], str], tokens: Sequence[int], stop: Sequence[str]) -> StopCut:
    """The output as plain decoding with stop strings returns it (module docstring); the whole output when no
    stop string ends it. `decode`: the tokenizer's."""
    tokens = list(tokens)
    n = stop_length(decode, tokens, stop)
    if n is None:
        return StopCut(tokens, decode(tokens), len(tokens), False)
    text = settled(decode(tokens[:n]))
    at = first_stop(text, stop)
    covered = next(m for m in range(n + 1) if len(decode(tokens[:m])) >= at)
    return StopCut(tokens[:covered], text[:at], n, True)

"""A streamed request's text, sent as its tokens commit, never past where its output will end. Pure.

After each round the request's committed tokens (cut at its budget and first EOS) are read as the final output
will be read (the tokenizer's decode), and the part that can no longer change is released:
- replacement characters at the end are the bytes of a character the next token may complete: held back
  (pipeline/stopping.py `settled`, as an incremental detokenizer does);
- once a stop string occurs, only the text before it is ever released, and nothing after;
- a tail that could still become a stop string (a prefix of one) is held back until the next tokens tell.
A parallel round commits several tokens at once: they go out together. At the end, `finish(text)` releases the
rest of the final output's text; every released piece is a prefix of it, so the chunks join to it exactly.
"""

from __future__ import annotations

from typing import Callable, Sequence

from vpsd.pipeline.stopping import first_stop, settled


def _held_tail(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self.decode, self.stop = decode, tuple(stop)
        self.sent = ""  # what was released so far
        self.ended = False  # a stop string was seen: nothing more until finish

    def update(self, tokens: Sequence[int]) -> str:
        """The text that the committed `tokens` release now (may be empty)."""
        if self.ended or not tokens:
            return ""
        text = settled(self.decode(list(tokens)))
        at = first_stop(text, self.stop) if self.stop else None
        if at is not None:
            text, self.ended = text[:at], True
        else:
            text = text[:len(text) - _held_tail(text, self.stop)]
        return self._release(text)

    def finish(self, final_text: str) -> str:
        """The rest of the output's text (its whole text as the API returns it)."""
        return self._release(final_text)

    def _release(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (a re-read that does not extend what was sent is held until it does)
        delta, self.sent = text[len(self.sent):], text
        return delta

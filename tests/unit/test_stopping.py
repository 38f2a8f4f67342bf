"""The one stop rule: what plain decoding returns, whatever chunks a speculative decoder committed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vpsd.pipeline.stopping import StopCut, cut, cut_at_stop, done, first_stop, stop_length

EOS = {0, 9}


def plain(stream: list[int], max_new: int) -> list[int]:
    """Token by token, as `ar` appends them: stop at the budget or after the first EOS."""
    out: list[int] = []
    for t in stream:
        if len(out) >= max_new or (out and out[-1] in EOS):
            break
        out.append(t)
    return out


@given(st.lists(st.integers(0, 9), max_size=30), st.integers(1, 20), st.lists(st.integers(1, 6), min_size=1, max_size=30))
def test_chunked_commits_cut_to_what_plain_decoding_returns(stream, max_new, chunks):
    committed: list[int] = []
    i = r = 0
    while not done(committed, max_new, EOS) and i < len(stream):  # rounds of any size until the rule says stop
        size = chunks[r % len(chunks)]
        committed += stream[i : i + size]
        i, r = i + size, r + 1
    if done(committed, max_new, EOS):
        assert cut(committed, max_new, EOS) == plain(stream, max_new)
    else:  # the stream ran out first: nothing to cut
        assert cut(committed, max_new, EOS) == committed == plain(stream, max_new)


def test_done_and_cut_by_hand():
    assert not done([1, 2], 3, EOS) and done([1, 2, 3], 3, EOS) and done([1, 9, 2], 10, EOS)
    assert cut([1, 9, 2, 3], 10, EOS) == [1, 9] and cut([1, 2, 3, 4], 3, EOS) == [1, 2, 3]


# ---- stop strings ---------------------------------------------------------------------------------------

WORDS = {0: "He", 1: "llo", 2: " wor", 3: "ld", 4: "!", 5: "\n", 6: "o"}
LEAD = 7  # a byte-level token: alone it reads as U+FFFD; with the next token it completes one character


def decode(tokens) -> str:
    """A tokenizer's decode in miniature, byte-level pieces included: a prefix's text is not always a prefix of
    the whole text (the last character changes once the next token completes it)."""
    out, i = [], 0
    while i < len(tokens):
        if tokens[i] == LEAD:
            out.append("\ufffd" if i + 1 == len(tokens) else chr(ord("A") + tokens[i + 1]))
            i += 2
        else:
            out.append(WORDS[tokens[i]])
            i += 1
    return "".join(out)


def test_the_output_is_the_text_before_the_stop_string_and_the_tokens_that_cover_it():
    # "He" "llo" " wor" "ld": the stop string "o w" is complete after the third token, begins in the second
    assert cut_at_stop(decode, [0, 1, 2, 3], ["o w"]) == StopCut([0, 1], "Hell", 3, True)
    assert cut_at_stop(decode, [0, 1, 2, 3], ["xyz"]) == StopCut([0, 1, 2, 3], "Hello world", 4, False)
    assert cut_at_stop(decode, [0, 1, 2, 3], ["ld", "llo"]) == StopCut([0], "He", 2, True)  # the earliest one
    assert first_stop("Hello", ["", "l"]) == 2 and stop_length(decode, [0, 1], []) is None
    # a byte-level piece is no text until its character is complete: "A" is (7, 0)'s, never the half of it
    assert stop_length(decode, [0, 7], ["\ufffd"]) is None and stop_length(decode, [0, 7, 0], ["A"]) == 3


def plain_with_stops(stream: list[int], stop: list[str]) -> list[int]:
    """Token by token, as `ar` appends them, looking at the text after each one."""
    out: list[int] = []
    for t in stream:
        out.append(t)
        if first_stop(decode(out).rstrip("\ufffd"), stop) is not None:  # a character not yet complete: no text yet
            break
    return out


@given(st.lists(st.integers(0, 7), max_size=25), st.lists(st.text("Heloldwr!\n\ufffdABCDEFGH", min_size=1, max_size=3),
                                                           min_size=1, max_size=2),
       st.lists(st.integers(1, 6), min_size=1, max_size=20))
def test_rounds_that_commit_past_a_stop_string_cut_to_what_plain_decoding_returns(stream, stop, chunks):
    """A round commits several tokens and the engine looks at each new prefix once (Request.look_for_stop):
    whatever the chunks, decoding ends in the round that committed plain decoding's last token, and the output is
    plain decoding's, byte-level characters that change included."""
    committed: list[int] = []
    checked, r, stopped = 0, 0, False
    while not stopped and len(committed) < len(stream):
        checked = len(committed)
        committed += stream[checked : checked + chunks[r % len(chunks)]]
        r += 1
        stopped = stop_length(decode, committed, stop, checked + 1) is not None
    plain = plain_with_stops(stream, stop)
    assert cut_at_stop(decode, committed, stop) == cut_at_stop(decode, plain, stop)
    assert not stream or checked < len(plain) <= len(committed)  # not a round later, not a round sooner

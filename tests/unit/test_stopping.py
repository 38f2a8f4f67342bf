"""The one stop rule: what plain decoding returns, whatever chunks a speculative decoder committed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vpsd.pipeline.stopping import cut, done

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

"""Cache bookkeeping (pure) and the papers' statistics definitions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.stats import AcceptanceStats


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12), st.integers(0, 50))
def test_sync_keeps_the_agreeing_prefix_and_returns_the_rest(fed, committed, prefill):
    cur = CacheCursor(prefill, list(fed))
    length, pending = cur.sync(committed)
    kept = length - prefill
    assert fed[:kept] == committed[:kept]
    assert kept == len(fed) or kept == len(committed) or fed[kept] != committed[kept]
    assert committed[:kept] + pending == committed
    cur.feed(pending)
    assert cur.fed == committed and cur.length == prefill + len(committed)


def test_stats_match_hand_computed_values():
    s = AcceptanceStats()
    for accepted, drafted in [(4, 4), (0, 4), (2, 4), (1, 2)]:
        s.record(accepted, drafted)
    assert s.rounds == 4
    assert s.mean_accepted_tokens == (7 + 4) / 4  # bonus / recovered token counted once per round
    assert s.acceptance_rate == 7 / 14
    assert s.per_position_acceptance() == [3 / 4, 2 / 4, 1 / 3, 1 / 3]
    assert s.histogram() == {0: 1, 1: 1, 2: 1, 4: 1}


def test_parallel_rounds_count_what_they_committed():
    # The parallel target keeps an all-accepted chunk's bonus row instead of emitting it: (4, 4) commits 4;
    # a rejecting round commits the accepted prefix plus the target's own token.
    s = AcceptanceStats()
    for accepted, drafted, committed in [(4, 4, 4), (0, 4, 1), (2, 4, 3), (4, 4, 4)]:
        s.record(accepted, drafted, committed)
    assert s.mean_accepted_tokens == 12 / 4
    assert s.acceptance_rate == 10 / 16


def test_a_round_commits_its_accepted_tokens_and_at_most_one_more():
    s = AcceptanceStats()
    for bad in (1, 4):
        try:
            s.record(2, 4, bad)
        except ValueError:
            continue
        raise AssertionError(f"committing {bad} after accepting 2 was allowed")


def test_extend_pools_rounds_with_their_commit_counts():
    a, b = AcceptanceStats(), AcceptanceStats()
    a.record(4, 4, 4)
    b.record(1, 4)  # serial rule: commits 2
    a.extend(b)
    assert a.rounds == 2 and a.mean_accepted_tokens == 6 / 2 and a.acceptance_rate == 5 / 8


def test_verify_feed_rolls_back_feeds_what_is_missing_and_points_at_the_windows_rows():
    """The one verify step of the serial, batched and parallel decoders (CacheCursor.verify_feed + window_rows)."""
    import torch

    from vpsd.pipeline.verification import window_rows

    cur = CacheCursor(10)
    cur.feed([1, 2, 3])
    # Token 3 was rejected and 7 committed in its place: roll back to 12, feed 7 then the window.
    assert cur.verify_feed([1, 2, 7], [8, 9]) == (12, [7, 8, 9], 0)
    assert cur.fed == [1, 2, 7, 8, 9]
    logits = torch.arange(3.0)[:, None]
    assert window_rows(logits, 0).flatten().tolist() == [0.0, 1.0, 2.0]  # rows for 8, 9 and the bonus
    # Everything committed is in the cache: the window's first row is the kept row of the last forward.
    assert cur.verify_feed([1, 2, 7, 8, 9], [4]) == (15, [4], -1)
    kept = torch.tensor([5.0])
    assert window_rows(torch.tensor([[6.0]]), -1, kept).flatten().tolist() == [5.0, 6.0]
    import pytest

    with pytest.raises(ValueError, match="none was kept"):
        window_rows(torch.tensor([[6.0]]), -1)
    # Two committed tokens the cache lacks: the window's first row is the second fed token's.
    cur = CacheCursor(4)
    assert cur.verify_feed([5, 6], [7]) == (4, [5, 6, 7], 1)

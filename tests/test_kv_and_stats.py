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

"""`vpsd bench reuse-soak`'s pure parts (vpsd/bench/reuse_soak.py): the requests' order (every video asked its
share, its questions in turn, shuffled at a seed), RSS at a share of the requests, the second half's fitted slope
and the flat verdict against max(2% of the RSS at 50%, 20 MiB), hand-computed."""

from __future__ import annotations

from collections import Counter

import pytest

from vpsd.bench.reuse_soak import Sample, rss_at, schedule, slope_per_request, summarize, verdict


def test_every_video_is_asked_its_share_with_its_questions_in_turn_shuffled_at_a_seed():
    asks = schedule(10, 3, ("a", "b"), seed=0)
    assert Counter(v for v, _ in asks) == {0: 4, 1: 3, 2: 3}  # the first ones once more: 10 / 3
    assert sorted(q for v, q in asks if v == 0) == ["a", "a", "b", "b"]
    assert sorted(q for v, q in asks if v == 1) == ["a", "a", "b"]
    assert asks == schedule(10, 3, ("a", "b"), seed=0)
    assert asks != schedule(10, 3, ("a", "b"), seed=1)
    assert asks != sorted(asks)  # shuffled, not a video's questions in a row


def _samples(rss_of_done) -> list[Sample]:
    return [Sample(t=float(d), done=d, rss_mib=rss_of_done(d)) for d in range(0, 1001, 50)]


def test_rss_at_takes_the_first_sample_once_that_many_were_done():
    samples = [Sample(0.0, 0, 100.0), Sample(1.0, 40, 110.0), Sample(2.0, 120, 130.0)]
    assert rss_at(samples, 10) == 110.0 and rss_at(samples, 100) == 130.0
    assert rss_at(samples, 500) == 130.0  # none reached it: the last
    assert rss_at([], 1) is None


def test_slope_is_least_squares_and_needs_two_points():
    assert slope_per_request([(0, 1.0), (10, 3.0), (20, 5.0)]) == pytest.approx(0.2)
    assert slope_per_request([(0, 1.0), (10, 5.0), (20, 3.0)]) == pytest.approx(0.1)
    assert slope_per_request([(5, 1.0), (5, 2.0)]) is None


def test_a_server_that_grows_only_while_its_cache_fills_is_flat():
    # +100 MiB over the first 300 requests (the cache filling, the allocator warming), then +-3 MiB of noise
    s = summarize(_samples(lambda d: 500 + min(d, 300) // 3 + (3 if d % 100 else -3)), 1000)
    assert (s["rss_at_10"], s["rss_at_50"], s["rss_at_100"], s["rss_max"]) == (530, 597, 597, 603)
    assert abs(s["slope_mib_per_100"]) < 0.5 and s["threshold_mib"] == 20.0  # 2% of 597 MiB is 11.9: the floor
    assert s["flat"] is True
    assert verdict(s).startswith("verdict: flat: the second half grew")


def test_a_leak_of_60_kib_a_request_is_growing_and_a_big_server_s_threshold_is_2_percent():
    s = summarize(_samples(lambda d: 500 + d * 60 / 1024), 1000)
    assert s["slope_mib_per_100"] == pytest.approx(100 * 60 / 1024)
    assert s["second_half_growth_mib"] == pytest.approx(500 * 60 / 1024)  # 29.3 MiB over 500 requests
    assert s["flat"] is False and "GROWING" in verdict(s)
    big = summarize(_samples(lambda d: 4000 + d * 60 / 1024), 1000)  # the same leak on a 4 GiB server
    assert big["threshold_mib"] == pytest.approx(0.02 * (4000 + 500 * 60 / 1024))
    assert big["flat"] is True  # 29 MiB is under its 81 MiB: within what its allocator moves by


def test_too_few_samples_in_the_second_half_are_not_judged():
    s = summarize([Sample(0.0, 0, 100.0), Sample(1.0, 10, 120.0)], 10)
    assert s["flat"] is None and "not judged" in verdict(s)

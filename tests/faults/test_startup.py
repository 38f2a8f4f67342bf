"""The ranks' arrival under the start-up bound (vpsd/transport/startup.py), in one process: each rank a thread on
one store, as torchrun's ranks share the agent's. Through real ranks: tests/faults/test_startup_torchrun.py."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from vpsd.transport.startup import RanksMissing, await_connected, await_ranks, missing_line


def _arrive(store, ranks, world, bound_s, local_world=None):
    """Run await_ranks for `ranks` on threads; returns {rank: seconds or the RanksMissing}, and what was said."""
    said, got = [], {}

    def one(rank):
        try:
            got[rank] = await_ranks(store, rank, world, local_world or world, bound_s, said.append, progress=False)
        except RanksMissing as e:
            got[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got, said


def test_every_rank_passes_once_the_last_arrives():
    store = dist.HashStore()
    late = threading.Thread(target=lambda: (time.sleep(0.5), _arrive(store, [2], 3, 10.0)))
    late.start()
    got, said = _arrive(store, [0, 1], 3, 10.0)
    late.join()
    assert all(isinstance(got[r], float) and 0.3 < got[r] < 5.0 for r in (0, 1)) and not said


def test_a_rank_that_never_comes_is_named_once_within_the_bound():
    store = dist.HashStore()
    t0 = time.monotonic()
    got, said = _arrive(store, [0, 1, 3], 4, 0.5, local_world=2)
    assert time.monotonic() - t0 < 0.5 + 5.0 + 1.0  # the bound, and at most the reporter's moment
    assert all(isinstance(got[r], RanksMissing) and got[r].missing == [2] for r in (0, 1, 3))
    assert len(said) == 1, said  # by one rank, not each
    assert said[0].startswith("rank 2 (node 1, host ") and "ranks 0, 1, 3 waited for it" in said[0]
    assert "start-up bound (0 s, --startup-timeout)" in said[0] or "start-up bound (1 s" in said[0]


def test_the_line_names_each_missing_rank_and_its_node():
    line = missing_line([1, 4, 5], {}, local_world=3, startup_timeout_s=600)
    assert line.startswith("rank 1 (node 0), rank 4 (node 1), rank 5 (node 1) did not start within the start-up bound "
                           "(600 s, --startup-timeout)")
    assert "waited for them" in line



def test_no_rank_leaves_the_connect_before_every_rank_has_made_its_group():
    """A rank a method leaves idle exits right after the process group is made; gloo's connect returns in a rank
    when its own pairs are up, so it waits for every rank's (await_connected), or a slower peer still reading its
    handshake dies with "Connection closed by peer" (CI, tests/faults/test_stuck_torchrun.py's idle ranks)."""
    store, said, done = dist.HashStore(), [], {}

    def one(rank, delay_s):
        time.sleep(delay_s)
        await_connected(store, rank, 3, 10.0, said.append)
        done[rank] = time.monotonic()

    threads = [threading.Thread(target=one, args=(r, d)) for r, d in ((0, 0.0), (1, 0.0), (2, 0.6))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(done) == [0, 1, 2] and min(done.values()) - t0 >= 0.5 and not said


def test_a_rank_whose_connect_never_finishes_is_named_once():
    store, said, got = dist.HashStore(), [], {}

    def one(rank):
        try:
            await_connected(store, rank, 3, 0.5, said.append)
        except RanksMissing as e:
            got[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [got[r].missing for r in (0, 2)] == [[1], [1]]
    assert said == ["rank 1 did not finish the process group's connect within the start-up bound (0 s, --startup-timeout)"]

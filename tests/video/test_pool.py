"""The reader pool (vpsd/video/pool.py) and the frames read through it (vpsd/video/prefetch.py): several items
read at once in the order asked, a memory budget for what is read and not yet taken that holds (but for one item
bigger than all of it, read alone), a per-item error, readers on the cores no role is pinned to, a video decoded
by several readers (`map_parts`), and a frame request's size known before it is read."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import media
from vpsd.config import ConfigError, load_config
from vpsd.video.errors import VideoError
from vpsd.video.item import FrameRequest, load_frames
from vpsd.video.pool import ReaderPool, readers_for, spare_cores
from vpsd.video.prefetch import FramePool, frame_pool, frames_bytes
from tests.conftest import config_path

MB = 1 << 20


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_several_items_are_read_at_once_in_the_order_asked():
    started: list[str] = []
    release = threading.Event()
    lock = threading.Lock()

    def load(key: str) -> str:
        with lock:
            started.append(key)
        assert release.wait(10)
        return key.upper()

    pool: ReaderPool[str, str] = ReaderPool(load, readers=3)
    try:
        for key in "abcde":
            pool.ahead(key)
        wait_until(lambda: len(started) == 3)  # three readers, three reads at once...
        time.sleep(0.1)
        assert sorted(started) == ["a", "b", "c"]  # ...the first three asked; d and e wait for a reader
        release.set()
        timings: dict[str, float] = {}
        assert [pool.take(k, timings) for k in "abcde"] == list("ABCDE")
        assert "video_wait_s" in timings
        assert started[3:] == ["d", "e"]
    finally:
        pool.close()


def test_one_reader_reads_in_the_order_asked_and_a_take_goes_first():
    started: list[str] = []
    gate = threading.Event()

    def load(key: str) -> str:
        started.append(key)
        if key == "a":
            assert gate.wait(10)
        return key

    pool: ReaderPool[str, str] = ReaderPool(load, readers=1)
    try:
        for key in "abc":
            pool.ahead(key)
        wait_until(lambda: started == ["a"])
        taker = threading.Thread(target=lambda: pool.take("c"))
        taker.start()  # c is needed now: it is read before b, asked earlier
        time.sleep(0.1)
        gate.set()
        taker.join(10)
        assert started[:2] == ["a", "c"]
        assert pool.take("b") == "b" and pool.take("a") == "a"
    finally:
        pool.close()


@pytest.mark.parametrize("readers", [1, 4])
def test_the_budget_holds_and_an_item_bigger_than_it_is_read_alone(readers):
    """Items of 1 MB and one of 3 MB under a 2.5 MB budget, taken slowly: what is counted (reads in progress and
    values not taken) never exceeds the budget, except while the 3 MB item is the only thing counted."""
    sizes = {"a": 1, "b": 1, "c": 1, "big": 3, "d": 1, "e": 1, "f": 1}
    budget = int(2.5 * MB)
    samples: list[tuple[int, int]] = []
    lock = threading.Lock()
    pool: ReaderPool[str, np.ndarray]

    def sample() -> None:
        with pool._cond:
            samples.append((pool.held, pool._granted))

    def load(key: str) -> np.ndarray:
        sample()
        time.sleep(0.01)
        sample()
        return np.zeros(sizes[key] * MB, dtype=np.uint8)

    pool = ReaderPool(load, readers=readers, budget_bytes=budget, estimate=lambda k: sizes[k] * MB)
    try:
        for key in sizes:
            pool.ahead(key)
        for key in sizes:
            time.sleep(0.05)  # the consumer is slower than the readers: the budget is what stops them
            sample()
            assert len(pool.take(key)) == sizes[key] * MB
            sample()
        assert samples
        for held, granted in samples:
            assert held <= budget or (held == 3 * MB and granted == 1), (held, granted)
        assert pool.peak_bytes == 3 * MB  # the big one, alone
        assert max(h for h, g in samples if g > 1) <= budget
        if readers > 1:  # the readers did read ahead, up to the budget
            assert max(g for _, g in samples) >= 2
        assert pool.held == 0
    finally:
        pool.close()


def test_an_unknown_size_is_read_alone_and_nothing_deadlocks_out_of_order():
    """No estimate: each read waits until nothing else is counted. A take of an item behind a held one is needed
    now and read at once, budget or not."""
    pool: ReaderPool[str, np.ndarray] = ReaderPool(lambda k: np.zeros(MB, np.uint8), readers=2, budget_bytes=MB // 2,
                                                   estimate=lambda k: None)
    try:
        pool.ahead("a")
        pool.ahead("b")
        wait_until(lambda: pool.held == MB)
        time.sleep(0.05)
        assert pool.held == MB and pool._granted == 1  # b waits for a to be taken
        assert len(pool.take("b")) == MB  # ...unless it is needed first
        assert len(pool.take("a")) == MB
        assert pool.held == 0
    finally:
        pool.close()


def test_a_failed_read_is_its_item_error_and_the_others_go_on():
    def load(key: str) -> str:
        if key == "bad":
            raise VideoError("corrupt", key, "broken")
        return key

    pool: ReaderPool[str, str] = ReaderPool(load, readers=2, budget_bytes=MB, size_of=lambda v: 10)
    try:
        for key in ("a", "bad", "b"):
            pool.ahead(key)
        assert pool.take("a") == "a"
        with pytest.raises(VideoError, match="broken") as err:
            pool.take("bad")
        assert err.value.kind == "corrupt"
        assert pool.take("b") == "b"
        assert pool.take("never asked") == "never asked"
        assert pool.held == 0
    finally:
        pool.close()


def test_keep_only_forgets_what_will_never_be_taken():
    pool: ReaderPool[str, np.ndarray] = ReaderPool(lambda k: np.zeros(100, np.uint8), readers=2, budget_bytes=1000,
                                                   estimate=lambda k: 100)
    try:
        pool.ahead("a")
        pool.ahead("b")
        wait_until(lambda: pool.held == 200)
        pool.keep_only(["b"])
        assert pool.held == 100 and list(pool._reads) == ["b"]
        assert len(pool.take("b")) == 100 and pool.held == 0
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.ahead("c")


def test_readers_run_on_the_spare_cores():
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two cores")
    pinned = {"target": [mine[0]]}
    spare = spare_cores(pinned, allowed=mine)
    assert spare == mine[1:] and mine[0] not in spare
    seen: list[set[int]] = []
    pool: ReaderPool[int, int] = ReaderPool(lambda k: seen.append(os.sched_getaffinity(0)) or k, readers=2,
                                            cores=spare)
    try:
        assert [pool.take(k) for k in range(4)] == list(range(4))
        assert seen and all(s == set(spare) for s in seen)  # each reader thread's own mask
        assert os.sched_getaffinity(0) == set(mine)  # the caller's is its own
    finally:
        pool.close()


def test_how_many_readers():
    assert spare_cores({"target": [0], "draft": [1], "pruner": [2]}, allowed=range(8)) == [3, 4, 5, 6, 7]
    assert spare_cores(None, allowed=[0, 1]) == [0, 1]
    assert spare_cores({"target": [0, 1]}, allowed=[0, 1]) == []
    assert readers_for(None, [3, 4, 5], read_ahead=4) == 3  # one a spare core
    assert readers_for(None, list(range(16)), read_ahead=4) == 5  # no more than can be busy
    assert readers_for(None, [], read_ahead=4) == 1  # at least one
    assert readers_for(2, [], read_ahead=4) == 2  # video.readers wins
    cfg = load_config(config_path("qwen2_5_vl"), {"video.readers": 2, "video.frames_budget_mib": 8})
    pool = frame_pool(cfg.video, {"target": [0]})
    assert pool.pool.readers == 2 and pool.pool.budget == 8 * MB
    pool.close()
    defaults = load_config(config_path("qwen2_5_vl")).video
    assert (defaults.readers, defaults.read_ahead, defaults.frames_budget_mib, defaults.share_frames) == (
        None, 4, 1024.0, True)
    for bad in ({"video.readers": 0}, {"video.read_ahead": -1}, {"video.frames_budget_mib": 0},
                {"video.share_frames": "yes"}):
        with pytest.raises(ConfigError):
            load_config(config_path("qwen2_5_vl"), bad)


def test_one_read_split_between_readers():
    """map_parts (the hook for one video's stretches between keyframes decoded at once): the parts of one load
    run on the idle readers and the reader that asked, together (a barrier of three would time out otherwise)."""
    barrier = threading.Barrier(3, timeout=10)
    pool: ReaderPool[str, list]

    def part(i: int) -> int:
        barrier.wait()
        return i * i

    def load(key: str) -> list:
        return pool.map_parts(part, [1, 2, 3])

    pool = ReaderPool(load, readers=3)
    try:
        assert pool.take("long video") == [1, 4, 9]
    finally:
        pool.close()


def test_frames_read_through_the_pool_and_their_size_known_before(tmp_path):
    videos = [media.write_gray_video(tmp_path / f"v{i}.mp4", num_frames=16, size=(32, 48), fps=8) for i in range(3)]
    requests = [FrameRequest(str(v), 4, None, 24) for v in videos] + [FrameRequest(str(videos[0]), None, 2.0, None)]
    pool = FramePool(readers=2, budget_bytes=MB)
    try:
        for i, request in enumerate(requests):
            pool.ahead(f"item{i}", request)
        for i, request in enumerate(requests):
            frames, times, timings = pool.take(f"item{i}", request)
            direct, direct_times = load_frames(request, "x", {})
            np.testing.assert_array_equal(frames, direct)
            np.testing.assert_array_equal(times, direct_times)
            assert {"video_read_s", "preprocess_s", "video_wait_s"} <= set(timings)
            if (size := frames_bytes(request)) is not None:  # known before the read: exactly what it holds
                assert size == frames.nbytes + times.nbytes
        missing = FrameRequest(str(tmp_path / "nope.mp4"), 4)
        assert frames_bytes(missing) in (0, None)
        with pytest.raises(VideoError) as err:
            pool.take("gone", missing)
        assert err.value.kind == "missing"
    finally:
        pool.close()

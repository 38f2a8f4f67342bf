"""The pieces of a batch job, in one process: frame requests, fitting the context, read-ahead,
resumable results, the progress bar's quiet mode."""

from __future__ import annotations

import io
import json
import threading

import numpy as np
import pytest

import media
from tests.conftest import tiny_pair
from vpsd.launch.progress import Progress, wants_bar
from vpsd.launch.results import ResultRow, ResultsFile
from vpsd.video import VideoError, read_video
from vpsd.video.fit import fit_to_context
from vpsd.video.item import FrameRequest, cap_frames, load_frames
from vpsd.video.prefetch import FramePrefetcher, Prefetcher


@pytest.fixture
def gray_mp4(tmp_path):
    return media.write_gray_video(tmp_path / "gray.mp4", num_frames=16, size=(32, 48), fps=8)


def test_request_resolution_item_first_then_config():
    assert FrameRequest.resolve("v", 4, None, 8, None, 112) == FrameRequest("v", 4, None, 112)
    assert FrameRequest.resolve("v", None, 2.0, 8, None, None) == FrameRequest("v", None, 2.0, None)
    assert FrameRequest.resolve("v", None, None, 8, None, None) == FrameRequest("v", 8, None, None)
    # An fps set in the config wins over the config's (defaulted) frame count.
    assert FrameRequest.resolve("v", None, None, 8, 1.0, None) == FrameRequest("v", None, 1.0, None)
    wire = FrameRequest("v", 4, None, 112).to_wire("id-1", max_frames=3)
    assert wire["item"] == "id-1" and wire["max_frames"] == 3
    # The cap travels as part of the request: a draft reading the file itself reads only the capped frames.
    assert FrameRequest.from_wire(wire) == FrameRequest("v", 4, None, 112, max_frames=3)


@pytest.mark.parametrize("request_,cap", [(dict(num_frames=9), 4), (dict(fps=3), 2), (dict(), 5)])
def test_cap_after_reading_equals_reading_with_max_frames(gray_mp4, request_, cap):
    """The draft reads ahead before the target knows the cap; capping later must give the same frames."""
    frames, times = load_frames(FrameRequest(str(gray_mp4), **request_), "x", {})
    direct = read_video(gray_mp4, max_frames=cap, **request_)
    np.testing.assert_array_equal(cap_frames(frames, cap), direct.frames)
    np.testing.assert_array_equal(cap_frames(times, cap), direct.timestamps)  # the times travel with the frames


def test_load_frames_times_read_and_preprocess(gray_mp4):
    timings: dict[str, float] = {}
    frames, times = load_frames(FrameRequest(str(gray_mp4), 4, None, 24), "x", timings)
    assert frames.shape == (4, 16, 24, 3)
    np.testing.assert_allclose(times, [0, 5 / 8, 10 / 8, 15 / 8])  # linspace(0, 15, 4) of an 8 fps video
    assert set(timings) == {"video_read_s", "preprocess_s"} and all(v >= 0 for v in timings.values())


def _counter(target, prompt: str, reserve: int):
    return lambda f: target.prepare(f, prompt).seq_len + reserve


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_fit_to_context_with_a_real_adapter(family):
    target, _ = tiny_pair(family)
    frames = np.random.default_rng(0).integers(0, 256, (8, 56, 56, 3), dtype=np.uint8)
    count = _counter(target, "describe", 16)
    needed = count(frames)
    same, cap = fit_to_context(frames, count, needed, subsample=False, path="v.mp4")
    assert cap is None and same is frames
    with pytest.raises(VideoError) as err:
        fit_to_context(frames, count, needed - 1, subsample=False, path="v.mp4")
    assert err.value.kind == "too_long" and str(needed) in str(err.value)
    limit = (needed + count(frames[:1])) // 2
    fitted, cap = fit_to_context(frames, count, limit, subsample=True, path="v.mp4")
    assert 1 <= cap < 8 and count(fitted) <= limit
    np.testing.assert_array_equal(fitted, cap_frames(frames, cap))
    if cap + 1 < 8:  # the largest cap that fits, not just any
        assert count(cap_frames(frames, cap + 1)) > limit
    with pytest.raises(VideoError, match="even one frame"):
        fit_to_context(frames, count, count(frames[:1]) - 1, subsample=True, path="v.mp4")


def test_prefetcher_reads_ahead_in_order_and_reraises_per_key():
    started: list[str] = []
    second_started = threading.Event()
    release = threading.Event()

    def load(key: str) -> str:
        started.append(key)
        if key == "b":
            second_started.set()
        if key == "bad":
            raise VideoError("corrupt", key, "broken")
        release.wait(10)
        return key.upper()

    p: Prefetcher[str, str] = Prefetcher(load)
    try:
        p.ahead("a")
        p.ahead("b")
        p.ahead("a")  # once per key
        release.set()
        timings: dict[str, float] = {}
        assert p.take("a", timings) == "A" and "video_wait_s" in timings
        # "b" is read without anybody waiting for it.
        assert second_started.wait(10)
        assert p.take("b") == "B"
        with pytest.raises(VideoError, match="broken"):
            p.take("bad")  # never asked ahead: read on the spot
        assert started == ["a", "b", "bad"]
    finally:
        p.close()


def test_frame_prefetcher_reuses_a_read_ahead_clip_and_applies_the_cap(gray_mp4, tmp_path):
    req = FrameRequest(str(gray_mp4), 8, None, None)
    videos = FramePrefetcher()
    try:
        videos.ahead(req.to_wire("a"))
        frames, times, timings = videos.take(req.to_wire("a", max_frames=3))
        direct = read_video(gray_mp4, num_frames=8, max_frames=3)
        np.testing.assert_array_equal(frames, direct.frames)
        np.testing.assert_array_equal(times, direct.timestamps)
        assert {"video_read_s", "preprocess_s", "video_wait_s"} <= set(timings)
        missing = FrameRequest(str(tmp_path / "nope.mp4"), 8).to_wire("b")
        videos.ahead(missing)
        with pytest.raises(VideoError) as err:
            videos.take(missing)
        assert err.value.kind == "missing"
        videos.ahead(req.to_wire("c"))
        videos.ahead(None)  # the next item was skipped: nothing is held for it
        assert not videos._pool.pool._reads  # nothing is held for it
    finally:
        videos.close()


def test_resume_cuts_a_torn_last_line_so_the_next_append_stands_alone(tmp_path):
    f = ResultsFile(tmp_path)
    f.append(ResultRow.from_json({"id": "a", "method": "m", "error": None}))
    with f.path.open("a") as h:
        h.write('{"id": "b", "method": "m", "tok')  # the crash came mid-write
    assert f.resume("m") == {"a"}
    f.append(ResultRow.from_json({"id": "b", "method": "m", "error": None}))
    rows = [json.loads(line) for line in f.path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]


def test_retry_failed_leaves_one_line_per_id(tmp_path):
    f = ResultsFile(tmp_path)
    f.append(ResultRow.from_json({"id": "a", "method": "m", "error": None}))
    f.append(ResultRow.from_json({"id": "b", "method": "m", "error": {"type": "VideoError", "message": "x"}}))
    f.append(ResultRow.from_json({"id": "b", "method": "other", "error": {"type": "VideoError", "message": "x"}}))
    assert f.resume("m") == {"a", "b"}
    assert f.resume("m", retry_failed=True) == {"a"}
    rows = [json.loads(line) for line in f.path.read_text().splitlines()]
    assert [(r["id"], r["method"]) for r in rows] == [("a", "m"), ("b", "other")]
    assert not (tmp_path / "results.jsonl.tmp").exists()


def test_progress_is_quiet_off_a_terminal_or_when_asked():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wants_bar(False, Tty()) and not wants_bar(True, Tty()) and not wants_bar(False, io.StringIO())
    shown = Tty()
    bar = Progress(total=4, initial=1, enabled=True, stream=shown)
    bar.item_done(10, failed=False)
    bar.item_done(0, failed=True)
    bar.close()
    text = shown.getvalue()
    assert "3/4" in text and "failed=1" in text and "tok_s=" in text
    hidden = io.StringIO()
    bar = Progress(total=2, initial=0, enabled=False, stream=hidden)
    bar.item_done(5, failed=False)
    bar.close()
    assert hidden.getvalue() == ""


class GatedPrefills:
    """A `prepare` for PrefillAhead that records each item's thread; "first" (the pool's) runs until `release`,
    and `releaser` (if any) sets it when its own prefill runs."""

    def __init__(self, releaser: str | None = None) -> None:
        self.release, self.started, self.threads, self.releaser = threading.Event(), threading.Event(), {}, releaser

    def __call__(self, items, nxt):  # PrefillAhead prepares runs of items: here always one
        (it,) = items
        return [self.one(it)]

    def one(self, it):
        self.threads[it] = threading.get_ident()
        if it == "first":
            self.started.set()
            self.release.wait(10)
        elif it == self.releaser:
            self.release.set()
        return it.upper()


def test_the_decode_thread_steals_only_a_prefill_that_has_not_started():
    """PrefillAhead (engine/prefill_ahead.py): under a half-full batch the decode thread runs the last queued prefill
    itself. When every prefill left has started or finished (the manifest's tail) there is nothing to steal:
    it must say so, so the caller decodes meanwhile; saying True made the loop spin without a round."""
    from vpsd.engine.prefill_ahead import ListSource, PrefillAhead

    prepare = GatedPrefills()
    ahead = PrefillAhead(ListSource(["first", "second"]), size=4, prepare=prepare, cpus=None)
    try:
        ahead.top_up(in_flight=1)
        assert prepare.started.wait(10)  # "first" runs on the pool; "second" is queued behind it
        assert not ahead.steal_if_thin(in_flight=2)  # a half-full batch decodes instead
        assert ahead.steal_if_thin(in_flight=1)  # "second", on this thread
        assert prepare.threads["second"] == threading.get_ident() != prepare.threads["first"]
        assert not ahead.steal_if_thin(in_flight=1)  # only the running one is left: nothing to steal
        assert ahead.next_ready(block=False) is None  # still in order: "first" is not done
        prepare.release.set()
        assert ahead.next_ready(block=True) == ("first", "FIRST")
        ahead.pop()
        assert ahead.next_ready(block=False) == ("second", "SECOND")
    finally:
        prepare.release.set()
        ahead.close()


def test_a_blocking_wait_prefills_a_later_item_meanwhile():
    """PrefillAhead.next_ready(block=True) (nothing is decoding: a job's start): instead of idling until the first
    item's prefill ends, the waiting thread prefills the last queued item, and the items still come in order."""
    from vpsd.engine.prefill_ahead import ListSource, PrefillAhead

    prepare = GatedPrefills(releaser="third")  # the head finishes while this thread works
    ahead = PrefillAhead(ListSource(["first", "second", "third"]), size=4, prepare=prepare, cpus=None)
    try:
        ahead.top_up(in_flight=0)
        assert prepare.started.wait(10)
        assert ahead.next_ready(block=True) == ("first", "FIRST")
        assert prepare.threads["third"] == threading.get_ident() != prepare.threads["first"]  # the last queued one
        ahead.pop()
        assert ahead.next_ready(block=True) == ("second", "SECOND")
        ahead.pop()
        assert ahead.next_ready(block=False) == ("third", "THIRD")
    finally:
        prepare.release.set()
        ahead.close()


@pytest.mark.parametrize("bitwise", [True, False])
def test_a_drained_prefill_thread_lends_its_cores_to_the_decode_thread_until_close(bitwise, monkeypatch):
    """PrefillAhead.lend_cores_when_drained (engine/prefill_ahead.py): once every prefill of the job has run, the calling
    thread takes the prefill thread's cores and one intra-op thread each, once; `close` gives them back. Only where
    this machine's forwards keep their bits on more threads (models/thread_invariance.py): elsewhere nothing moves."""
    import os

    import torch

    from vpsd.engine import prefill_ahead as module
    from vpsd.engine.prefill_ahead import ListSource, PrefillAhead

    monkeypatch.setattr(module, "bitwise_across_threads", lambda threads: bitwise)

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores to pin two threads apart")
    mine, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {cpus[0]})
    prepare = GatedPrefills()
    ahead = PrefillAhead(ListSource(["first", "second"]), size=4, prepare=prepare, cpus=[cpus[1]])
    try:
        ahead.top_up(in_flight=0)
        assert prepare.started.wait(10)
        assert not ahead.drained and ahead.lend_cores_when_drained() is None  # "first" still prefills
        prepare.release.set()
        assert ahead.next_ready(block=True) == ("first", "FIRST")
        ahead.pop()
        assert ahead.next_ready(block=True) == ("second", "SECOND")  # done, not yet joined: nothing left to run
        assert ahead.drained
        if not bitwise:
            assert ahead.lend_cores_when_drained() is None
            assert os.sched_getaffinity(0) == {cpus[0]} and torch.get_num_threads() == threads
            return
        assert ahead.lend_cores_when_drained() == threads + 1
        assert os.sched_getaffinity(0) == {cpus[0], cpus[1]} and torch.get_num_threads() == threads + 1
        assert ahead.lend_cores_when_drained() is None  # once
        ahead.close()
        assert os.sched_getaffinity(0) == {cpus[0]} and torch.get_num_threads() == threads
    finally:
        prepare.release.set()
        ahead.close()
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(threads)


def test_an_unpinned_prefill_thread_lends_nothing():
    """Without cpu_affinity the prefill thread's core is not the job's to lend: a second intra-op thread would
    compete with whatever else runs on the machine."""
    import torch

    from vpsd.engine.prefill_ahead import ListSource, PrefillAhead

    threads = torch.get_num_threads()
    ahead = PrefillAhead(ListSource(["only"]), size=4, prepare=lambda items, hint: [item.upper() for item in items], cpus=None)
    try:
        ahead.top_up(in_flight=0)
        assert ahead.next_ready(block=True) == ("only", "ONLY")
        assert ahead.drained and ahead.lend_cores_when_drained() is None and torch.get_num_threads() == threads
    finally:
        ahead.close()


def test_the_probe_says_whether_two_threads_compute_the_bits_of_one():
    """What lending the prefill cores at the tail relies on to leave every output as it was, measured where it runs:
    the probe (models/thread_invariance.py) answers what a prefill and a batched verify of a real language model,
    wide enough that its kernels split over threads, compute here on two intra-op threads against one. (Bitwise on
    the AMD EPYC vpsd was built on; not on an Intel Xeon: the cached attention moved by 5e-7.)"""
    import torch

    from vpsd.models.thread_invariance import _forwards, bitwise_across_threads, probe_model

    model = probe_model()
    one, two = _forwards(model, 1), _forwards(model, 2)
    assert torch.equal(one[0], _forwards(model, 1)[0])  # one thread is repeatable
    assert bitwise_across_threads(2) == all(torch.equal(a, b) for a, b in zip(one, two))


def test_a_shared_source_is_asked_for_read_ahead_once_and_then_only_when_an_item_is_needed():
    """Where pipelines share the items (launch/coordinator.py), a read-ahead the source refuses ("not now") is not
    asked again every round: only once the pipeline has room for an item."""
    from vpsd.engine.prefill_ahead import PrefillAhead

    class Tail:
        def __init__(self):
            self.items, self.asked = ["a", "b"], []

        def take(self, needed):
            self.asked.append(needed)
            if not self.items:
                return None, False
            if not needed:
                return None, True  # at the tail: read-ahead refused
            return self.items.pop(0), bool(self.items)

    source = Tail()
    ahead = PrefillAhead(source, size=1, prepare=lambda items, nxt: [(it, nxt) for it in items], cpus=None, shared=True)
    try:
        assert ahead.pending and source.asked == [True]  # nothing in flight: needed
        ahead.top_up(in_flight=0)
        assert ahead.next_ready(block=True) == ("a", ("a", None))  # no hint taken for the draft
        ahead.pop()
        for _ in range(3):  # "a" decoding: a read-ahead, refused once, then not asked again
            ahead.top_up(in_flight=1)
        assert source.asked == [True, False]
        ahead.top_up(in_flight=0)  # room again: asked, and granted
        assert source.asked == [True, False, True] and ahead.next_ready(block=True)[0] == "b"
        ahead.pop()
        assert not ahead.pending and ahead.drained
    finally:
        ahead.close()


class _NotNowSource:
    """A served pipeline's source: "not now" to a read-ahead until a request arrives (`arrive`)."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.asks = 0

    def take(self, needed: bool):
        self.asks += 1
        return (self.waiting.pop(0) if self.waiting else None), True


def test_after_a_not_now_a_read_ahead_is_asked_again_a_little_later():
    """A request that arrives while the batch decodes is read ahead (engine/prefill_ahead.py ASK_AGAIN_S), not only
    once a slot frees: asked again at once, the source would be asked every round; never, a served pipeline at
    batch 1 read each video only after the request before it ended."""
    import time

    from vpsd.engine.prefill_ahead import ASK_AGAIN_S, PrefillAhead

    source = _NotNowSource()
    ahead = PrefillAhead(source, size=1, prepare=lambda items, nxt: [item.upper() for item in items], cpus=None)
    try:
        ahead.top_up(in_flight=1)  # the batch is full: a read-ahead, answered "not now"
        assert source.asks == 1 and not ahead.ahead
        source.waiting.append("next")
        ahead.top_up(in_flight=1)
        assert source.asks == 1 and not ahead.ahead  # not asked again within the interval
        time.sleep(ASK_AGAIN_S * 1.5)
        ahead.top_up(in_flight=1)
        assert [entry[0] for entry in ahead.ahead] == ["next"]  # read while "the batch" decodes
        assert ahead.next_ready(block=True) == ("next", "NEXT")
    finally:
        ahead.close()

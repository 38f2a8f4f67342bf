"""One video's stretches between keyframes read at once (vpsd/video/decode.py `split_wanted`, `read_part`,
`read_video(parts=, map_parts=)`; vpsd/video/prefetch.py FramePool): a split read gives the whole read's frames,
timestamps and work bit for bit, whatever order its parts run in; a file that cannot seek, or a part that finds the
index untrusted, is read whole; a pool of two readers runs the parts on two threads at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.video.corpus import ENTRIES, X264, encode
from vpsd.video import decode
from vpsd.video.errors import VideoError
from vpsd.video.frames import geometry, to_rgb
from vpsd.video.info import inspect_video
from vpsd.video.item import FrameRequest, load_frames
from vpsd.video.prefetch import FramePool
from vpsd.video.seek import Untrusted

BY_NAME = {e.name: e for e in ENTRIES}
SPLIT = ["h264-open-gop.mp4", "h264-open-gop.mkv", "h264-bframes.mov", "h264.ts", "h264-rot90.mp4",
         "hevc-open-gop.mp4", "vp9.webm"]
DENSE = [dict(), dict(fps=7.0), dict(num_frames=20, max_side=32)]  # every frame; fps 7 of 12; 20 frames, scaled


class Mapper:
    """map_parts run on this thread, last part first (the parts must not depend on their order); records them."""

    def __init__(self) -> None:
        self.calls: list[list[np.ndarray]] = []

    def __call__(self, fn, parts):
        self.calls.append([np.asarray(p) for p in parts])
        done = {i: fn(p) for i, p in reversed(list(enumerate(parts)))}
        return [done[i] for i in range(len(parts))]


@pytest.fixture
def always_split(monkeypatch):
    """Split however few frames a read keeps (the corpus's files are 4 s)."""
    monkeypatch.setattr(decode, "SPLIT_MIN_INTERVALS", 0)


def same_clip(a, b) -> None:
    assert a.frames.dtype == b.frames.dtype and a.frames.shape == b.frames.shape
    assert np.array_equal(a.frames, b.frames)
    assert np.array_equal(a.timestamps, b.timestamps)
    assert np.array_equal(a.indices, b.indices)
    assert (a.read_mode, a.fallback_reason, a.frames_decoded, a.source_num_frames) == \
        (b.read_mode, b.fallback_reason, b.frames_decoded, b.source_num_frames)


@pytest.mark.parametrize("request_", DENSE, ids=["all", "fps7", "n20-side32"])
@pytest.mark.parametrize("name", SPLIT)
def test_split_read_equals_the_whole_read(corpus, always_split, name, request_):
    path = corpus(BY_NAME[name])
    whole = decode.read_video(path, **request_)
    assert whole.read_mode == "exact" and whole.parts == 1
    _, index = inspect_video(path)
    for k in (2, 3, 4):
        mapper = Mapper()
        split = decode.read_video(path, parts=k, map_parts=mapper, **request_)
        same_clip(split, whole)
        assert len(mapper.calls) == 1
        pieces = mapper.calls[0]
        assert split.parts == len(pieces) == min(k, len(set(index.seek_point(i) for i in whole.indices.tolist())))
        assert np.array_equal(np.concatenate(pieces), np.unique(whole.indices))


def test_each_part_read_alone_gives_the_whole_reads_rows(corpus):
    path = corpus(BY_NAME["h264-open-gop.mkv"])
    whole = decode.read_video(path, fps=7.0, max_side=40)
    info, index = inspect_video(path)
    g = geometry(info.coded_height, info.coded_width, info.sample_aspect_ratio, info.rotation, max_side=40)
    rows = {i: r for r, i in enumerate(whole.indices.tolist())}
    decoded = 0
    for piece in decode.split_wanted(index, np.unique(whole.indices), 3, min_intervals=0):
        frames, n = decode.read_part(path, index, piece, g.coded, lambda f: to_rgb(f, g))
        decoded += n
        assert sorted(frames) == piece.tolist()
        for i, frame in frames.items():
            assert np.array_equal(frame, whole.frames[rows[i]])
    assert decoded == whole.frames_decoded


def test_split_points_are_keyframe_stretches(corpus):
    path = corpus(BY_NAME["h264.ts"])
    _, index = inspect_video(path)
    wanted = np.arange(len(index))
    # 5 keyframes in 48 frames: more than 4 intervals' worth (38.4 frames) is dense enough to split by default
    assert len(decode.split_wanted(index, wanted[::2], 4)) == 1
    assert len(decode.split_wanted(index, wanted, 4)) == 4
    assert len(decode.split_wanted(index, wanted[::4], 4, min_intervals=0)) == 4
    assert len(decode.split_wanted(index, wanted[:9], 4, min_intervals=0)) == 1  # one stretch
    assert len(decode.split_wanted(index, wanted, 1, min_intervals=0)) == 1
    for k in (2, 3, 4, 9):
        pieces = decode.split_wanted(index, wanted, k, min_intervals=0)
        assert 1 < len(pieces) <= min(k, len(index.seek_points))
        assert np.array_equal(np.concatenate(pieces), wanted)
        for before, piece in zip(pieces, pieces[1:]):
            assert index.seek_point(int(piece[0])) == int(piece[0]) > before[-1]  # starts a stretch


@pytest.mark.parametrize("name", ["edit-list.mp4", "duplicate-pts.mkv", "wrong-count.avi"])
def test_a_file_that_cannot_seek_is_read_whole(corpus, always_split, name):
    path = corpus(BY_NAME[name])
    mapper = Mapper()
    whole = decode.read_video(path, fps=7.0)
    split = decode.read_video(path, fps=7.0, parts=3, map_parts=mapper)
    assert split.read_mode == "sequential" and split.parts == 1
    assert mapper.calls == []
    same_clip(split, whole)


def test_keyframe_reads_are_not_split(corpus, always_split):
    path = corpus(BY_NAME["h264-open-gop.mp4"])
    mapper = Mapper()
    split = decode.read_video(path, fps=7.0, seek="keyframe", parts=3, map_parts=mapper)
    assert mapper.calls == [] and split.parts == 1
    same_clip(split, decode.read_video(path, fps=7.0, seek="keyframe"))


def test_a_part_that_finds_the_index_untrusted_reads_the_video_front_to_back(corpus, always_split, monkeypatch):
    path = corpus(BY_NAME["h264-bframes.mov"])
    whole = decode.read_video(path)
    real = decode.read_part

    def read_part(path, index, wanted, coded, convert):
        if wanted[0] > 0:
            raise Untrusted("a seek went astray")
        return real(path, index, wanted, coded, convert)

    monkeypatch.setattr(decode, "read_part", read_part)
    clip = decode.read_video(path, parts=3, map_parts=Mapper())
    assert clip.read_mode == "sequential" and clip.fallback_reason == "a seek went astray" and clip.parts == 1
    assert np.array_equal(clip.frames, whole.frames) and np.array_equal(clip.timestamps, whole.timestamps)


def test_parts_must_be_positive(corpus):
    path = corpus(BY_NAME["vp9.webm"])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(VideoError) as err:
            decode.read_video(path, parts=bad, map_parts=Mapper())
        assert err.value.kind == "bad_request"


def test_a_pool_of_two_readers_reads_the_parts_on_two_threads(tmp_path, monkeypatch):
    # 96 frames, a keyframe every 10: every frame is more than 4 intervals' worth, so the pool splits by default.
    path = encode(tmp_path / "dense.mp4", "libx264", options=X264, frames=96)
    request = FrameRequest(str(path), None, None, 40)
    direct, direct_times = load_frames(request, "x", {})
    threads: list[int] = []
    both = threading.Barrier(2, timeout=10)  # times out unless two parts run at once
    real = decode.read_part

    def read_part(*args, **kwargs):
        threads.append(threading.get_ident())
        both.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "read_part", read_part)
    pool = FramePool(readers=2)
    try:
        frames, times, timings = pool.take("dense", request)
    finally:
        pool.close()
    assert len(threads) == 2 and len(set(threads)) == 2 and threading.get_ident() not in threads
    assert np.array_equal(frames, direct) and np.array_equal(times, direct_times)
    assert "video_read_s" in timings


def test_a_pool_of_one_reader_reads_whole(tmp_path, monkeypatch):
    path = encode(tmp_path / "dense.mp4", "libx264", options=X264, frames=96)
    calls: list[int] = []
    real = decode.read_part

    def read_part(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "read_part", read_part)
    pool = FramePool(readers=1)
    try:
        frames, _, _ = pool.take("dense", FrameRequest(str(path), None, None, 40))
    finally:
        pool.close()
    assert calls == [1] and len(frames) == 96

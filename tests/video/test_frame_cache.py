"""video/frame_cache.py: a video's decoded frames kept for its next question, on real files read by PyAV (nothing
mocked; decodes are counted by the reads' own `video_read` spans and the cache's counters). A second read of the
same file and request decodes nothing and gives the same frames and times, read-only; a file rewritten on disk, a
folder's image edited, another request, an evicted entry: read again; two threads asking at once decode once; a
failed read is not kept; budget 0 or reuse off keeps nothing; a data: URL is keyed by its bytes; and the one
cache serves every reader over the target (ItemReader alone, as the API and the server read; and its pool, as a
job reads)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.conftest import config_path, tiny_pair
from tests.video.corpus import encode, picture
from vpsd.config import load_config
from vpsd.launch.items import ItemReader
from vpsd.launch.manifest import ManifestItem
from vpsd.video.errors import VideoError
from vpsd.video.frame_cache import FrameCache, cache_for
from vpsd.video.identity import forget_content, note_content
from vpsd.video.item import FrameRequest, load_frames
from vpsd.video.prefetch import FramePool

CLIP_BYTES = 8 * (48 * 64 * 3 + 8)  # 8 frames of 64x48 and their times


def video(path: Path, frames: int = 48, size: tuple[int, int] = (48, 64)) -> Path:
    return encode(path, "libx264", frames=frames, size=size, rate=24)


def request(path: Path, **fields) -> FrameRequest:
    return FrameRequest(str(path), **{"num_frames": 8, **fields})


def decodes(logs: list[dict]) -> int:
    """Reads that decoded: their `video_read` spans."""
    return sum(e.get("event") == "span" and e.get("name") == "video_read" for e in logs)


def read(cache: FrameCache | None, req: FrameRequest, item: str = "it") -> tuple[np.ndarray, np.ndarray]:
    return load_frames(req, item, {}, cache=cache)


def test_a_second_read_of_the_same_file_and_request_decodes_nothing(tmp_path):
    path, cache = video(tmp_path / "v.mp4"), FrameCache(2**30)
    with capture_logs() as logs:
        frames, times = read(cache, request(path), "a")
        again, again_times = read(cache, request(path), "b")
    assert decodes(logs) == 1
    assert again is frames and again_times is times  # the very arrays: nothing copied
    reference = load_frames(request(path), "ref", {})
    assert np.array_equal(frames, reference[0]) and np.array_equal(times, reference[1])
    assert not frames.flags.writeable and not times.flags.writeable  # shared: no consumer may change them
    with pytest.raises(ValueError):
        frames[0, 0, 0, 0] = 1
    stats = cache.stats()
    assert (stats["reads"], stats["hits"], stats["misses"], stats["stored"]) == (2, 1, 1, 1)
    assert stats["bytes"] == frames.nbytes + times.nbytes == CLIP_BYTES
    traced = [e for e in logs if e.get("event") == "frames_cache"]
    assert [(e["item"], e["hit"]) for e in traced] == [("a", False), ("b", True)]
    assert traced[1]["bytes"] == CLIP_BYTES and traced[0]["kept"] is True


def test_a_file_rewritten_on_disk_is_read_again(tmp_path):
    path, cache = video(tmp_path / "v.mp4"), FrameCache(2**30)
    old, _ = read(cache, request(path))
    video(path, frames=24, size=(32, 48))  # other pictures at the same path
    with capture_logs() as logs:
        new, new_times = read(cache, request(path))
    assert decodes(logs) == 1 and cache.stats()["misses"] == 2
    reference = load_frames(request(path), "ref", {})
    assert np.array_equal(new, reference[0]) and np.array_equal(new_times, reference[1])
    assert new.shape != old.shape


def test_a_file_replaced_by_another_of_the_same_size_and_time_is_read_again(tmp_path):
    # Only the inode tells them apart: a copy renamed over the file, its modification time set to the old one's.
    path, cache = video(tmp_path / "v.mp4"), FrameCache(2**30)
    read(cache, request(path))
    st = path.stat()
    copy = tmp_path / "copy.mp4"
    copy.write_bytes(path.read_bytes())
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(copy, path)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert path.stat().st_ino != st.st_ino
    read(cache, request(path))
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (0, 2)


def test_another_frame_request_misses(tmp_path):
    path, cache = video(tmp_path / "v.mp4"), FrameCache(2**30)
    read(cache, request(path))
    for other in (request(path, num_frames=4), request(path, num_frames=None, fps=2.0), request(path, max_side=32),
                  request(path, seek="keyframe"), request(path, max_frames=3)):
        frames, _ = read(cache, other)
        assert np.array_equal(frames, load_frames(other, "ref", {})[0])
    assert cache.stats()["misses"] == 6 and cache.stats()["hits"] == 0
    read(cache, request(path, max_side=32))
    assert cache.stats()["hits"] == 1


def test_least_recently_used_is_evicted_and_frames_over_the_budget_are_not_kept(tmp_path):
    a, b = video(tmp_path / "a.mp4"), video(tmp_path / "b.mp4", frames=30)
    cache = FrameCache(CLIP_BYTES * 3 // 2)  # room for one clip
    read(cache, request(a))
    read(cache, request(b))
    stats = cache.stats()
    assert (stats["evicted"], stats["evicted_bytes"], stats["bytes"]) == (1, CLIP_BYTES, CLIP_BYTES)
    read(cache, request(b))
    read(cache, request(a))  # evicted: decoded again
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (1, 3)
    with capture_logs() as logs:
        read(cache, request(a, num_frames=16))  # 2 clips' bytes: over the whole budget
    assert cache.stats()["too_large"] == 1 and cache.stats()["bytes"] == CLIP_BYTES
    assert [e["kept"] for e in logs if e.get("event") == "frames_cache"] == [False]
    cache.resize(CLIP_BYTES // 2)  # a smaller budget evicts down to it
    assert cache.stats()["bytes"] == 0 and cache.stats()["budget_bytes"] == CLIP_BYTES // 2


def second_waits_on_first(cache: FrameCache, first, second, started: threading.Event,
                          release: threading.Event) -> None:
    """`first` on a thread until its read has started (`started`), then `second` on another until it waits on that
    read (the cache counts it joined), then the first read released; both threads joined."""
    one = threading.Thread(target=first)
    one.start()
    started.wait(30)
    two = threading.Thread(target=second)
    two.start()
    deadline = time.monotonic() + 30
    while cache.stats()["joined"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    one.join(30), two.join(30)


def test_two_threads_reading_the_same_frames_decode_once(tmp_path):
    path, cache = video(tmp_path / "v.mp4"), FrameCache(2**30)
    started, release = threading.Event(), threading.Event()

    def first_read():  # the real read, held until the second reader waits on it
        started.set()
        release.wait(30)
        return load_frames(request(path), "a", {})

    got: dict[str, tuple] = {}
    with capture_logs() as logs:
        second_waits_on_first(cache, lambda: got.__setitem__("a", cache.read(request(path), "a", first_read)),
                              lambda: got.__setitem__("b", read(cache, request(path), "b")), started, release)
    assert decodes(logs) == 1  # the second never read
    assert got["a"][0] is got["b"][0] and got["a"][1] is got["b"][1]
    stats = cache.stats()
    assert (stats["misses"], stats["joined"], stats["hits"]) == (1, 1, 0)
    assert [e["joined"] for e in logs if e.get("event") == "frames_cache" and e["hit"]] == [True]


def test_a_pool_reading_two_items_of_one_video_at_once_decodes_it_once(tmp_path):
    path, cache = video(tmp_path / "v.mp4"), FrameCache(2**30)
    pool = FramePool(readers=2, cache=cache)
    try:
        with capture_logs() as logs:
            pool.ahead("q1", request(path))
            pool.ahead("q2", request(path))
            f1, t1, _ = pool.take("q1", request(path))
            f2, t2, _ = pool.take("q2", request(path))
    finally:
        pool.close()
    assert decodes(logs) == 1 and f1 is f2 and t1 is t2
    stats = cache.stats()
    assert stats["misses"] == 1 and stats["hits"] + stats["joined"] == 1


def test_a_failed_read_is_not_kept_and_every_waiter_gets_its_error(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all" * 100)
    cache = FrameCache(2**30)
    for _ in range(2):
        with pytest.raises(VideoError) as e:
            read(cache, request(bad))
        assert e.value.kind == "corrupt"
    assert cache.stats()["misses"] == 2 and cache.stats()["stored"] == 0
    # a read in flight that fails: the one waiting on it gets the same error
    started, release = threading.Event(), threading.Event()

    def failing():
        started.set()
        release.wait(30)
        raise VideoError("corrupt", bad, "broken")

    errors: list[BaseException] = []

    def reader(load):
        try:
            cache.read(request(bad), "x", load)
        except VideoError as err:
            errors.append(err)

    second_waits_on_first(cache, lambda: reader(failing), lambda: reader(lambda: pytest.fail("the waiter read")),
                          started, release)
    assert len(errors) == 2 and all(str(err).endswith("broken") for err in errors)
    # a missing file cannot be keyed: read (and failed) as before, nothing kept
    with pytest.raises(VideoError) as e:
        read(cache, request(tmp_path / "missing.mp4"))
    assert e.value.kind == "missing" and cache.stats()["uncached"] == 1


def test_a_folder_is_read_again_when_one_of_its_images_changes(tmp_path):
    import av

    folder = tmp_path / "frames"
    folder.mkdir()

    def write(i: int, shade: int = 0) -> None:
        with av.open(str(folder / f"{i}.png"), "w") as container:
            stream = container.add_stream("png")
            stream.width, stream.height, stream.pix_fmt = 64, 48, "rgb24"
            pixels = np.clip(picture(i, 48, 64).astype(int) + shade, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)

    for i in range(4):
        write(i)
    cache = FrameCache(2**30)
    req = FrameRequest(str(folder), num_frames=4)
    read(cache, req)
    read(cache, req)
    assert cache.stats()["hits"] == 1
    write(2, shade=60)
    frames, _ = read(cache, req)
    assert cache.stats()["misses"] == 2 and np.array_equal(frames, load_frames(req, "ref", {})[0])


def test_a_data_url_is_keyed_by_its_bytes(tmp_path):
    payload = video(tmp_path / "v.mp4").read_bytes()
    first, second = tmp_path / "upload-1.mp4", tmp_path / "upload-2.mp4"
    cache = FrameCache(2**30)
    try:
        for path in (first, second):  # two requests' temporary files, as serve/media.py writes them
            path.write_bytes(payload)
            note_content(path, payload)
        read(cache, request(first))
        forget_content(first)
        first.unlink()  # the first request is done
        read(cache, request(second))
        assert cache.stats()["hits"] == 1
        # a file noted, then changed under it, is keyed by what it is now
        second.write_bytes(video(tmp_path / "w.mp4", frames=24).read_bytes())
        read(cache, request(second))
        assert cache.stats()["misses"] == 2
    finally:
        forget_content(first), forget_content(second)


def test_a_data_url_through_the_server_s_parser(tmp_path):
    import base64

    from vpsd.serve.media import MediaLimits, parse_messages
    from vpsd.serve.schema import ChatCompletionRequest

    url = "data:video/mp4;base64," + base64.b64encode(video(tmp_path / "v.mp4").read_bytes()).decode()
    ask = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What happens?"}, {"type": "video_url", "video_url": {"url": url}}]}]})
    cache = FrameCache(2**30)
    for _ in range(2):  # two requests sending the same video
        parsed = parse_messages(ask, MediaLimits(), tmp_path / "scratch")
        try:
            read(cache, request(Path(parsed.video)))
        finally:
            parsed.cleanup()
    assert (cache.stats()["misses"], cache.stats()["hits"]) == (1, 1)


def reader(**reuse) -> ItemReader:
    cfg = load_config(config_path("qwen2_5_vl"))
    cfg = dataclasses.replace(cfg, reuse=dataclasses.replace(cfg.reuse, **reuse))
    return ItemReader(tiny_pair("qwen2_5_vl")[0], cfg)


def item(item_id: str, path: Path) -> ManifestItem:
    return ManifestItem(item_id, path, "Describe the video.", 8, 8, None, {}, 1)


def test_the_item_reader_s_questions_about_one_video_read_it_once(tmp_path):
    path = video(tmp_path / "v.mp4")
    first = reader()
    assert first.cache is reader().cache is cache_for(first.target, first.cfg.reuse.frames_bytes)  # the target's
    before = first.cache.stats()
    with capture_logs() as logs:
        a = first.load(item("q1", path))
        b = reader().load(item("q2", path))  # another reader over the same target: an API call's, an engine's
    assert decodes(logs) == 1 and b.timings["video_read_s"] == 0.0 < a.timings["video_read_s"]
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.times, b.times)
    assert first.cache.stats()["hits"] - before["hits"] == 1
    pool = FramePool(cache=first.cache)  # a job's readers (launch/job.py frame_pool(cache=...))
    try:
        with capture_logs() as logs:
            c = ItemReader(first.target, first.cfg, pool).load(item("q3", path))
    finally:
        pool.close()
    assert decodes(logs) == 0 and np.array_equal(c.frames, a.frames)


@pytest.mark.parametrize("reuse", [{"frames_mib": 0}, {"enabled": False}])
def test_budget_zero_or_reuse_off_keeps_nothing(tmp_path, reuse):
    path = video(tmp_path / "v.mp4")
    r = reader(**reuse)
    assert r.cache is None
    with capture_logs() as logs:
        r.load(item("q1", path))
        loaded = r.load(item("q2", path))
    assert decodes(logs) == 2 and loaded.frames.flags.writeable  # nothing shared

"""The video reader on a corpus of real codecs and containers (tests/video/corpus.py).

Every file is read as a full front to back decode reads it (tests/video/reference.py), frame for frame bit for
bit, timestamp for timestamp, by count (1, 4, 16 frames), by rate, and scaled, or refused with the same error
kind; and by the path the corpus says (seeking, or front to back with the reason). Then what seeking is for
(decoding grows with the frames kept), the approximate keyframe mode, the probe, rotation and non-square pixels,
and the request's way from the config to the reader.
"""

from __future__ import annotations

import av
import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.video.corpus import ENTRIES, X264, encode
from tests.video.reference import front_to_back, stored_count_and_rate
from vpsd.checked import ConfigError
from vpsd.config import load_config
from vpsd.video.decode import probe_video, read_video
from vpsd.video.errors import VideoError
from vpsd.video.frames import max_side_size
from vpsd.video.item import FrameRequest, load_frames, load_item_frames
from vpsd.video.resize import resize_frames

REQUESTS = [dict(num_frames=1), dict(num_frames=4), dict(num_frames=16), dict(fps=2.5),
            dict(num_frames=4, max_side=40), dict(fps=5, size=(30, 50))]
EXACT = [e for e in ENTRIES if e.mode == "exact"]


def outcome(read, *args, **kwargs):
    try:
        return read(*args, **kwargs)
    except VideoError as err:
        return err


@pytest.mark.parametrize("entry", ENTRIES, ids=str)
def test_reads_what_a_full_decode_reads(entry, corpus):
    path = corpus(entry)
    for request in REQUESTS:
        want, got = outcome(front_to_back, path, **request), outcome(read_video, path, **request)
        if isinstance(want, VideoError):
            assert isinstance(got, VideoError) and got.kind == want.kind, (request, got)
            continue
        assert not isinstance(got, VideoError), (request, got)
        assert got.indices.tolist() == want.indices.tolist(), request
        assert got.frames.dtype == np.uint8 and np.array_equal(got.frames, want.frames), request
        assert got.timestamps.tolist() == want.timestamps.tolist(), request  # the same floats
        assert got.source_num_frames == want.source_num_frames
        assert got.read_mode == entry.mode, (request, got.fallback_reason)
        assert (got.fallback_reason is None) == (entry.mode == "exact")
        assert entry.reason in (got.fallback_reason or ""), got.fallback_reason
    if entry.error is not None:
        with pytest.raises(VideoError) as err:
            read_video(path, num_frames=16)  # reaches the last frame
        assert err.value.kind == entry.error


def test_reading_grows_with_the_frames_kept(tmp_path):
    """240 frames, a keyframe every 10: 4 frames cost a GOP each at most, not the video."""
    path = encode(tmp_path / "long.mkv", "libx264", frames=240, options=X264)
    few, all_ = read_video(path, num_frames=4), read_video(path, num_frames=240)
    assert few.read_mode == "exact" and few.frames_decoded <= 4 * (10 + 4)
    assert all_.frames_decoded == 240
    np.testing.assert_array_equal(few.frames, all_.frames[few.indices])


@pytest.mark.parametrize("entry", EXACT, ids=str)
def test_keyframe_mode_reads_the_nearest_keyframes(entry, corpus):
    path = corpus(entry)
    every = front_to_back(path)
    wanted = read_video(path, num_frames=6).indices
    clip = read_video(path, num_frames=6, seek="keyframe")
    assert clip.read_mode == "keyframe" and clip.frames_decoded <= len(set(clip.indices.tolist())) * 2
    with av.open(str(path)) as container:  # the frames flagged keyframes
        stream = container.streams.video[0]
        keys = {p.pts for p in container.demux(stream) if p.size and p.is_keyframe}
    with av.open(str(path)) as container:
        key_frames = [i for i, f in enumerate(container.decode(video=0)) if f.pts in keys]
    for i, w, frame, t in zip(clip.indices.tolist(), wanted.tolist(), clip.frames, clip.timestamps.tolist()):
        assert i in key_frames
        gap = abs(every.timestamps[i] - every.timestamps[w])
        assert all(gap <= abs(every.timestamps[k] - every.timestamps[w]) for k in key_frames)
        np.testing.assert_array_equal(frame, every.frames[i])
        assert t == every.timestamps[i]


@pytest.mark.parametrize("entry", ENTRIES, ids=str)
def test_probe_says_what_a_read_selects_from(entry, corpus):
    path = corpus(entry)
    info = probe_video(path)
    count, rate = stored_count_and_rate(path)
    assert (info.num_frames, info.fps, info.duration_s) == (count, rate, count / rate)
    assert (info.height, info.width) == entry.size and info.rotation == entry.rotation
    assert info.seekable == (entry.mode == "exact") and entry.reason in (info.fallback_reason or "")
    if entry.mode == "exact":  # the frames a read will select, known before it decodes any
        assert info.indices(fps=2.5).tolist() == read_video(path, fps=2.5).indices.tolist()
    if entry.error is None:
        assert read_video(path, num_frames=1).frames.shape[1:3] == (info.height, info.width)


def test_rotation_stands_frames_upright(corpus):
    by_name = {e.name: e for e in ENTRIES}
    # The display matrix turns the frame counterclockwise by frame.rotation degrees: np.rot90's direction.
    for name, turns in (("h264-rot90.mp4", 1), ("h264-rot-90.mov", 3), ("h264-rot180.mp4", 2)):
        path = corpus(by_name[name])
        clip = read_video(path, num_frames=4)
        with av.open(str(path)) as container:  # the frames as coded
            coded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        np.testing.assert_array_equal(clip.frames, np.rot90(np.stack(coded)[clip.indices], turns, axes=(1, 2)))
    small = read_video(corpus(by_name["h264-rot90.mp4"]), num_frames=4, max_side=32)
    assert small.frames.shape[1:3] == (32, 24)  # upright 64x48, longest side 32


def test_non_square_pixels_are_stretched_to_the_display_aspect(corpus):
    path = corpus(next(e for e in ENTRIES if e.name == "h264-sar4x3.mp4"))
    clip = read_video(path, num_frames=4)
    assert clip.frames.shape[1:3] == (48, 85)  # 64 pixels of 4:3 show 85.3 wide
    with av.open(str(path)) as container:  # the frames as coded, stretched by one swscale call each
        frames = list(container.decode(video=0))
    stretched = [frames[i].to_ndarray(format="rgb24", width=85, height=48, interpolation="BICUBIC")
                 for i in clip.indices.tolist()]
    np.testing.assert_array_equal(clip.frames, np.stack(stretched))


def test_max_side_scales_as_it_converts_like_torch_within_a_few_levels(tmp_path):
    path = encode(tmp_path / "big.mp4", "libx264", size=(120, 160), frames=24, options=X264)
    full = read_video(path, num_frames=4)
    small = read_video(path, num_frames=4, max_side=56)
    assert small.frames.shape[1:3] == max_side_size(120, 160, 56) == (42, 56)
    torch_small = resize_frames(full.frames, 42, 56)
    diff = np.abs(small.frames.astype(int) - torch_small.astype(int))
    assert diff.mean() < 4 and np.percentile(diff, 99) < 40  # swscale's bicubic, not torch's: close, not equal
    assert read_video(path, num_frames=4, max_side=500).frames.shape == full.frames.shape  # never enlarged


@pytest.mark.parametrize("request_, word", [
    (dict(seek="nearest"), "seek"),
    (dict(size=(10, 10), max_side=5), "not both"),
    (dict(size=(0, 10)), "size"),
    (dict(size=10), "size"),
    (dict(max_side=0), "max_side"),
])
def test_bad_reader_requests(tmp_path, request_, word):
    path = encode(tmp_path / "v.mkv", "libx264", frames=4)
    with pytest.raises(VideoError, match=word) as err:
        read_video(path, **request_)
    assert err.value.kind == "bad_request"


def test_the_request_carries_seek_and_max_side_to_the_reader(tmp_path):
    path = encode(tmp_path / "v.mkv", "libx264", frames=48, options=X264)
    request = FrameRequest(str(path), 4, None, 40, seek="keyframe")
    assert FrameRequest.from_wire(request.to_wire("a")) == request
    assert FrameRequest.from_wire({"video": str(path)}).seek == "exact"  # a wire from before the field
    assert FrameRequest.resolve(path, None, None, 4, None, 40, None, "keyframe") == request
    with capture_logs() as logs:
        frames, times = load_frames(request, "a", {})
    direct = read_video(path, num_frames=4, max_side=40, seek="keyframe")
    np.testing.assert_array_equal(frames, direct.frames)
    np.testing.assert_array_equal(times, direct.timestamps)
    read = [e for e in logs if e.get("name") == "video_read"]
    assert read and read[0]["read_mode"] == "keyframe" and read[0]["frames_decoded"] > 0
    # The untraced reference read gives what a job reads.
    np.testing.assert_array_equal(load_item_frames(path, 4, None, 40, seek="keyframe")[0], frames)


def test_video_seek_is_checked_at_launch():
    config = "configs/tiny_qwen2_5_vl.yaml"
    assert load_config(config).video.seek == "exact"
    assert load_config(config, {"video.seek": "keyframe"}).video.seek == "keyframe"
    with pytest.raises(ConfigError, match="video.seek"):
        load_config(config, {"video.seek": "fast"})

"""vpsd.video: frame sampling, decoding of real files and frame folders, errors, resizing.

Videos are tiny (16 frames, 32x48, 8 fps) and frame i is a solid gray 8*i, so each decoded frame
says which source frame it is (see tests/media.py).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import media
from vpsd.video import VideoClip, VideoError, read_video, resize_frames, smart_resize
from vpsd.video import decode as decode_module
from vpsd.video.sampling import cap_indices, rate_indices, uniform_indices

NUM_FRAMES, FPS, SIZE = 16, 8, (32, 48)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module", params=[".mp4", ".mkv", ".webm"])
def gray_video(request, media_dir):
    # webm/mkv store no frame count, so they also exercise counting packets.
    return media.write_gray_video(media_dir / f"gray{request.param}", NUM_FRAMES, SIZE, FPS)


@pytest.fixture(scope="module")
def gray_mp4(media_dir):
    return media.write_gray_video(media_dir / "gray_only.mp4", NUM_FRAMES, SIZE, FPS)


def decoded_indices(clip: VideoClip) -> list[int]:
    return [media.decoded_index(frame) for frame in clip.frames]


def assert_clip(clip: VideoClip, expected: list[int]) -> None:
    assert clip.indices.tolist() == expected
    assert decoded_indices(clip) == expected, "pixels do not come from the frames the indices name"
    assert clip.frames.shape == (len(expected), *SIZE, 3) and clip.frames.dtype == np.uint8
    np.testing.assert_allclose(clip.timestamps, np.array(expected) / FPS, atol=1e-6)
    assert clip.fps == FPS and clip.source_num_frames == NUM_FRAMES and clip.duration_s == NUM_FRAMES / FPS


# --- sampling on real files ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "num_frames, expected",
    [
        (1, [0]),
        (4, [0, 5, 10, 15]),
        (5, [0, 4, 8, 11, 15]),  # linspace 0, 3.75, 7.5, 11.25, 15; 7.5 rounds to even
        (16, list(range(16))),
    ],
)
def test_sampling_by_count(gray_video, num_frames, expected):
    assert_clip(read_video(gray_video, num_frames=num_frames), expected)


def test_more_frames_than_the_video_repeats_frames(gray_mp4):
    clip = read_video(gray_mp4, num_frames=20)
    expected = np.round(np.linspace(0, 15, 20)).astype(int).tolist()
    assert len(set(expected)) == 16 and len(expected) == 20
    assert_clip(clip, expected)


@pytest.mark.parametrize(
    "fps, expected",
    [
        (2, [0, 4, 8, 12]),  # t = 0, .5, 1, 1.5 s
        (3, [0, 2, 5, 8, 10, 13]),  # frame on screen at t*8 = 0, 2.67, 5.33, 8, 10.67, 13.33
        (2.5, [0, 3, 6, 9, 12]),  # t*8 = 0, 3.2, 6.4, 9.6, 12.8
        (0.5, [0]),  # t = 2 s is the end of a 2 s video
        (8, list(range(16))),
        (30, list(range(16))),  # faster than the source: every frame once, no repeats
    ],
)
def test_sampling_by_fps(gray_video, fps, expected):
    assert_clip(read_video(gray_video, fps=fps), expected)


@pytest.mark.parametrize(
    "request_, expected",
    [
        (dict(max_frames=4), [0, 5, 10, 15]),
        (dict(fps=3, max_frames=4), [0, 5, 8, 13]),  # 4 of [0, 2, 5, 8, 10, 13]: positions 0, 2, 3, 5
        (dict(num_frames=5, max_frames=3), [0, 8, 15]),
        (dict(fps=2, max_frames=10), [0, 4, 8, 12]),  # cap above the count changes nothing
    ],
)
def test_max_frames_caps_uniformly(gray_mp4, request_, expected):
    assert_clip(read_video(gray_mp4, **request_), expected)


def test_all_frames(gray_video):
    assert_clip(read_video(gray_video), list(range(16)))


def test_overstated_frame_count_is_resampled_from_real_frames(gray_mp4, monkeypatch):
    # Stored counts can exceed what decodes (edit lists); sampling must stay uniform over real frames.
    monkeypatch.setattr(decode_module, "_probe", lambda path: (24, float(FPS)))
    assert_clip(read_video(gray_mp4, num_frames=4), [0, 5, 10, 15])


# --- frame folders ------------------------------------------------------------------------------

def test_folder_in_natural_order(media_dir):
    folder = media.write_frame_folder(media_dir / "unpadded", num_frames=12, padded=False)
    (folder / "notes.txt").write_text("not a frame")
    (folder / ".hidden.png").write_bytes(b"")
    clip = read_video(folder)
    assert decoded_indices(clip) == list(range(12))  # frame_10 after frame_9, extras ignored
    assert clip.frames.shape == (12, 24, 40, 3) and clip.source_num_frames == 12 and clip.fps == 1.0


def test_folder_sampling_and_clock(media_dir):
    folder = media.write_frame_folder(media_dir / "padded", num_frames=12, padded=True)
    clip = read_video(folder, fps=1, folder_fps=2)
    assert clip.indices.tolist() == decoded_indices(clip) == [0, 2, 4, 6, 8, 10]
    np.testing.assert_allclose(clip.timestamps, [0, 1, 2, 3, 4, 5])
    assert clip.duration_s == 6.0
    assert decoded_indices(read_video(folder, num_frames=4)) == [0, 4, 7, 11]


def test_folder_of_jpegs_with_a_stray_size(media_dir):
    folder = media.write_frame_folder(media_dir / "jpegs", num_frames=6, suffix=".jpg", padded=True)
    media.write_frame_folder(media_dir / "other_size", num_frames=4, size=(16, 16), suffix=".jpg", padded=True)
    (media_dir / "other_size" / "frame_00003.jpg").replace(folder / "frame_00003.jpg")
    clip = read_video(folder)
    assert clip.frames.shape == (6, 24, 40, 3)
    assert decoded_indices(clip) == list(range(6))


# --- errors -------------------------------------------------------------------------------------

def expect_error(path, kind: str, *words: str, **request) -> VideoError:
    with pytest.raises(VideoError) as info:
        read_video(path, **request)
    err = info.value
    assert err.kind == kind, str(err)
    assert str(path) in str(err)
    for word in words:
        assert word in str(err)
    return err


def test_missing(media_dir):
    expect_error(media_dir / "nope.mp4", "missing", "missing video", "no such file")


def test_zero_bytes(media_dir):
    expect_error(media.write_zero_bytes(media_dir / "zero.mp4"), "empty", "zero bytes")


def test_random_bytes(media_dir):
    path = media.write_random_bytes(media_dir / "noise.mp4")
    err = expect_error(path, "corrupt")
    assert str(err) == f"corrupt video {path}: invalid data found when processing input"


def test_truncated_without_index(media_dir):
    expect_error(media.write_truncated(media_dir / "cut.mp4", 0.5, faststart=False), "corrupt")


@pytest.mark.parametrize("request_", [{}, {"num_frames": 2}])
def test_truncated_tail_is_corrupt_not_shorter(media_dir, request_):
    path = media.write_truncated(media_dir / "cut_tail.mp4", 0.9, faststart=True)
    expect_error(path, "corrupt", "at frame", **request_)


def test_audio_only(media_dir):
    expect_error(media.write_audio_only(media_dir / "voice.wav"), "no_video_stream", "streams found: audio")


def test_empty_folder(media_dir):
    folder = media_dir / "no_frames"
    folder.mkdir()
    (folder / "readme.txt").write_text("x")
    expect_error(folder, "empty", "no frame images")


def test_folder_with_a_broken_image_names_it(media_dir):
    folder = media.write_frame_folder(media_dir / "broken_frames", num_frames=4, padded=True)
    bad = media.write_random_bytes(folder / "frame_00002.png", 256)
    err = expect_error(bad, "corrupt")  # the image itself, read as a one-frame video
    err = expect_error(folder, "corrupt", str(bad))
    assert err.path == str(bad)


@pytest.mark.parametrize(
    "request_, word",
    [
        (dict(num_frames=4, fps=2), "not both"),
        (dict(num_frames=0), "num_frames"),
        (dict(num_frames=2.5), "num_frames"),
        (dict(num_frames=True), "num_frames"),
        (dict(fps=-1), "fps"),
        (dict(fps=float("nan")), "fps"),
        (dict(max_frames=0), "max_frames"),
        (dict(folder_fps=0), "folder_fps"),
    ],
)
def test_bad_requests(gray_mp4, request_, word):
    expect_error(gray_mp4, "bad_request", word, **request_)


def test_error_survives_pickling(media_dir):
    err = VideoError("too_long", media_dir / "long.mp4", "3600 s is over the 600 s limit")
    back = pickle.loads(pickle.dumps(err))
    assert (back.kind, back.path, str(back)) == (err.kind, err.path, str(err))
    with pytest.raises(ValueError):
        VideoError("exploded", "x", "y")


# --- pure sampling properties -------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), k=st.integers(1, 300))
def test_uniform_indices_properties(n, k):
    idx = uniform_indices(n, k)
    assert len(idx) == k and idx[0] == 0 and np.all(np.diff(idx) >= 0) and idx[-1] <= n - 1
    if k > 1:
        assert idx[-1] == n - 1
    if k <= n:
        assert len(np.unique(idx)) == k


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), source_fps=st.floats(1, 120), fps=st.floats(0.05, 120), cap=st.integers(1, 64))
def test_rate_and_cap_properties(n, source_fps, fps, cap):
    idx = rate_indices(n, source_fps, fps)
    assert idx[0] == 0 and idx[-1] <= n - 1 and np.all(np.diff(idx) > 0)
    if fps < source_fps:
        # One frame per 1/fps seconds of an n/source_fps second video.
        assert abs(len(idx) - n * fps / source_fps) < 1 + 1e-6
        # Frame idx is on screen at t = k/fps: idx <= t * source_fps < idx + 1.
        position = np.arange(len(idx)) * source_fps / fps
        assert np.all(idx <= position + 1e-6) and np.all(position < idx + 1 + 1e-6)
    capped = cap_indices(idx, cap)
    assert len(capped) == min(cap, len(idx)) and set(capped.tolist()) <= set(idx.tolist())
    assert np.all(np.diff(capped) > 0)


# --- resizing -----------------------------------------------------------------------------------

def test_resize_keeps_flat_colour_and_dtype():
    frames = np.zeros((3, 30, 50, 3), np.uint8)
    frames[..., 0], frames[..., 1], frames[..., 2] = 10, 128, 250
    out = resize_frames(frames, 28, 56)
    assert out.shape == (3, 28, 56, 3) and out.dtype == np.uint8
    assert np.all(out == frames[:, :1, :1])


def test_resize_clamps_bicubic_overshoot():
    frames = np.zeros((1, 8, 8, 3), np.uint8)
    frames[:, :, 4:] = 255
    out = resize_frames(frames, 32, 32)
    # Ringing above 255 must clamp, not wrap around to dark values inside the bright half.
    assert out[0, :, 20:].min() >= 250 and out[0, :, :12].max() <= 5


def test_resize_many_frames_in_chunks():
    frames = np.random.default_rng(0).integers(0, 256, (70, 12, 12, 3), dtype=np.uint8)
    out = resize_frames(frames, 6, 6)
    one_by_one = np.concatenate([resize_frames(frames[i : i + 1], 6, 6) for i in (0, 33, 69)])
    assert out.shape == (70, 6, 6, 3) and np.array_equal(out[[0, 33, 69]], one_by_one)


def test_resize_same_size_is_a_copy_and_bad_input_raises():
    frames = np.zeros((2, 4, 4, 3), np.uint8)
    out = resize_frames(frames, 4, 4)
    assert np.array_equal(out, frames) and out is not frames
    with pytest.raises(ValueError):
        resize_frames(np.zeros((4, 4, 3), np.uint8), 2, 2)
    with pytest.raises(ValueError):
        resize_frames(frames.astype(np.float32), 2, 2)


@pytest.mark.parametrize(
    "height, width, expected",
    [
        (480, 640, (476, 644)),  # 17.14 -> 17 and 22.86 -> 23 patches of 28
        (1080, 1920, (728, 1316)),  # 2.1 Mpx > 1003520: scale by sqrt(2073600/1003520), round down
        (10, 10, (56, 56)),  # under 3136 px: scale by sqrt(3136/100) = 5.6, round up
        (384, 384, (392, 392)),
    ],
)
def test_smart_resize_examples(height, width, expected):
    assert smart_resize(height, width) == expected


@settings(max_examples=300, deadline=None)
@given(height=st.integers(16, 4000), width=st.integers(16, 4000))
def test_smart_resize_properties(height, width):
    assume(max(height, width) <= 200 * min(height, width))
    h, w = smart_resize(height, width)
    assert h % 28 == 0 and w % 28 == 0 and h >= 28 and w >= 28
    assert 4 * 28 * 28 <= h * w <= 1280 * 28 * 28
    # Aspect kept up to one patch of rounding on each side.
    assert abs(h / w - height / width) <= (height / width) * (28 / min(h, w) + 28 / min(h, w)) + 1e-9


def test_smart_resize_rejects_extreme_aspect_and_small_budget():
    with pytest.raises(ValueError):
        smart_resize(10, 2500)
    with pytest.raises(ValueError):
        smart_resize(100, 100, min_pixels=100)


def test_a_frames_file_reads_back_as_its_frames_under_every_rule(tmp_path):
    """The Python API hands a rank frames it holds in memory as a frames file (.npz): read whole, it is exactly
    those frames and times; by count, rate and cap it follows the rules a video's frames do."""
    frames = np.random.default_rng(0).integers(0, 256, (10, 8, 12, 3), dtype=np.uint8)
    times = np.arange(10) * 0.5  # 2 frames a second
    path = tmp_path / "clip.npz"
    decode_module.write_frames_file(path, frames, times)
    whole = read_video(path, num_frames=10)
    assert np.array_equal(whole.frames, frames) and np.array_equal(whole.timestamps, times)
    by_count = read_video(path, num_frames=4)
    assert by_count.indices.tolist() == uniform_indices(10, 4).tolist()
    assert np.array_equal(by_count.frames, frames[by_count.indices])
    assert read_video(path, fps=1.0).indices.tolist() == rate_indices(10, 2.0, 1.0).tolist()
    assert read_video(path, max_frames=3).indices.tolist() == cap_indices(np.arange(10), 3).tolist()
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(VideoError) as e:
        read_video(tmp_path / "bad.npz")
    assert e.value.kind == "corrupt"
    np.savez(tmp_path / "gray.npz", frames=frames[..., 0], times=times)
    with pytest.raises(VideoError, match=r"need \(T, H, W, 3\) uint8"):
        read_video(tmp_path / "gray.npz")

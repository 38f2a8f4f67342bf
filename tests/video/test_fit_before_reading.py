"""launch/items.py `planned_request`: whether a video fits the context is decided from its metadata, before a frame
is decoded (a 60-minute video at fps 4 was once decoded whole, at full size, and took the rank down): `too_long`
without reading, `video.subsample_to_fit` reading only the frames that fit (the frames a read of everything then
capped gives), and `too_large` for frames that would not fit video.frames_budget_mib."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import config_path, tiny_pair
from tests.video.corpus import encode
from vpsd.config import load_config
from vpsd.launch import items as items_module
from vpsd.launch.items import ItemReader
from vpsd.launch.manifest import ManifestItem
from vpsd.video.errors import VideoError
from vpsd.video.item import cap_frames, load_frames


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    # 10 s at 24 fps, 64x48: fps 4 selects 40 frames (20 temporal groups of the tiny Qwen's 4 tokens each)
    return encode(tmp_path_factory.mktemp("fit") / "v.mp4", "libx264", frames=240, size=(48, 64), rate=24)


def reader(**video) -> ItemReader:
    cfg = load_config(config_path("qwen2_5_vl"))
    cfg = dataclasses.replace(cfg, video=dataclasses.replace(cfg.video, **video))
    return ItemReader(tiny_pair("qwen2_5_vl")[0], cfg)


def item(path: Path) -> ManifestItem:
    return ManifestItem("it", path, "Describe the video.", 8, None, 4.0, {}, 1)


def never_read(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the video was read")

    monkeypatch.setattr(items_module, "load_frames", refuse)


def test_a_video_too_long_for_the_context_is_refused_before_a_frame_is_read(video, monkeypatch):
    r = reader(context_limit=60, max_side=None)
    never_read(monkeypatch)
    with pytest.raises(VideoError) as e:
        r.load(item(video))
    assert e.value.kind == "too_long" and "40 frames need" in str(e.value)


def test_subsampled_to_fit_reads_only_the_frames_that_fit(video):
    whole = reader(max_side=None)
    full, full_times = load_frames(whole.frame_request(item(video)), "it", {})
    assert len(full) == 40
    r = reader(context_limit=60, subsample_to_fit=True, max_side=None)
    request = r.planned_request(item(video), {})
    loaded = r.load(item(video))
    k = request.max_frames
    assert k is not None and 1 < k < 40 and len(loaded.frames) == k
    assert np.array_equal(loaded.frames, cap_frames(full, k)) and np.array_equal(loaded.times, cap_frames(full_times, k))
    assert loaded.video["max_frames"] == k  # the draft reads the same cap
    need = r.target.prepare(loaded.frames, "Describe the video.", loaded.times).seq_len + 8
    assert need <= 60 < r.target.prepare(cap_frames(full, k + 1), "Describe the video.",
                                         cap_frames(full_times, k + 1)).seq_len + 8


def test_frames_over_the_memory_budget_are_refused_before_they_are_read(video, monkeypatch):
    r = reader(frames_budget_mib=40 * 48 * 64 * 3 / 2**20 * 0.9, max_side=None)
    never_read(monkeypatch)
    with pytest.raises(VideoError) as e:
        r.load(item(video))
    assert e.value.kind == "too_large" and "video.frames_budget_mib" in str(e.value)

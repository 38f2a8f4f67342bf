"""Under `video.sampling: checkpoint` the target checkpoint's own video processor
decides which frames a video gives, with the settings in its files.

The rules are checked index for index against transformers' own `sample_frames` over many video lengths and
frame rates: Qwen3-VL's and the base processor's (LLaVA-OneVision's) run as they are; Qwen2-VL's module imports
torchvision, so its method is compiled from the installed source (tests/transformers_source.py). Then a job's
reader, fed a real video file, takes exactly those frames, and the draft reads the same ones from the wire.
"""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import VideoMetadata

from tests import media
from tests.conftest import tiny_pair
from tests.official_layout import QWEN_TEMPLATE, _qwen_processor, official_checkpoint, save_official
from tests.transformers_source import method
from vpsd.config import config_from_dict
from vpsd.launch.preflight import sampling_problems
from vpsd.models.checkpoint import read_frame_sampling
from vpsd.video.decode import read_video
from vpsd.video.item import FrameRequest
from vpsd.video.sampling import QWEN2_VL, QWEN3_VL, UNIFORM_FLOOR, ProcessorSampling

qwen2_sample_frames = method("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor",
                             "sample_frames", {"torch": torch, "math": math, "np": np})
qwen3_sample_frames = Qwen3VLVideoProcessor.__dict__["sample_frames"]
base_sample_frames = BaseVideoProcessor.__dict__["sample_frames"]

LENGTHS = [1, 2, 3, 5, 8, 17, 30, 34, 61, 100, 257, 1000, 4801]
SOURCE_FPS = [1.0, 7.5, 24.0, 29.97, 60.0]


def _official(fn, settings: ProcessorSampling, total: int, source_fps: float) -> np.ndarray:
    # The processor's attributes as the checkpoint's files would set them.
    self = types.SimpleNamespace(fps=settings.fps, num_frames=settings.num_frames, min_frames=settings.min_frames,
                                 max_frames=settings.max_frames, temporal_patch_size=settings.temporal_factor)
    meta = VideoMetadata(total_num_frames=total, fps=source_fps)
    out = fn(self, meta, num_frames=settings.num_frames, fps=None if settings.num_frames else settings.fps)
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("settings", [
    ProcessorSampling(QWEN2_VL, fps=2.0),
    ProcessorSampling(QWEN2_VL, fps=0.5, min_frames=6, max_frames=40, temporal_factor=2),
    ProcessorSampling(QWEN2_VL, fps=3.0, temporal_factor=3),
    ProcessorSampling(QWEN2_VL, num_frames=9),
], ids=str)
def test_qwen2_vl_rule_is_the_processors(settings):
    checked = 0
    for total in LENGTHS:
        for source_fps in SOURCE_FPS:
            try:
                want = _official(qwen2_sample_frames, settings, total, source_fps)
            except (ValueError, ZeroDivisionError):
                # transformers refuses this clip (too short for the rule); vpsd reads it, clamped (docstring).
                got = settings.indices(total, source_fps)
                assert 1 <= len(got) and got.max() < total
                continue
            np.testing.assert_array_equal(settings.indices(total, source_fps), want, err_msg=f"{total=} {source_fps=}")
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("settings", [
    ProcessorSampling(QWEN3_VL, fps=2.0),
    ProcessorSampling(QWEN3_VL, fps=0.25, min_frames=2, max_frames=16),
    ProcessorSampling(QWEN3_VL, num_frames=12),
], ids=str)
def test_qwen3_vl_rule_is_the_processors(settings):
    for total in LENGTHS:
        for source_fps in SOURCE_FPS:
            if settings.num_frames is not None and settings.num_frames > total:
                continue  # transformers repeats frames past the end; vpsd clamps the count to the video
            want = _official(qwen3_sample_frames, settings, total, source_fps)
            np.testing.assert_array_equal(settings.indices(total, source_fps), want, err_msg=f"{total=} {source_fps=}")


@pytest.mark.parametrize("settings", [ProcessorSampling(UNIFORM_FLOOR, num_frames=8),
                                      ProcessorSampling(UNIFORM_FLOOR, fps=1.0)], ids=str)
def test_llava_onevision_rule_is_the_base_processors(settings):
    for total in LENGTHS:
        for source_fps in SOURCE_FPS:
            if settings.num_frames is not None and settings.num_frames > total:
                continue  # transformers raises; vpsd clamps the count to the video
            want = _official(base_sample_frames, settings, total, source_fps)
            np.testing.assert_array_equal(settings.indices(total, source_fps), want, err_msg=f"{total=} {source_fps=}")


def test_settings_come_from_the_checkpoints_files(tmp_path):
    target, _ = tiny_pair("qwen2_5_vl")
    proc = _qwen_processor(target, fps=0.5, min_frames=2, max_frames=6)
    path = save_official(target, tmp_path / "q25", proc, QWEN_TEMPLATE)
    assert read_frame_sampling(path, "qwen2_5_vl") == ProcessorSampling(QWEN2_VL, fps=0.5, min_frames=2, max_frames=6)
    proc.pop("fps"), proc.pop("min_frames"), proc.pop("max_frames")  # published Qwen2.5-VL: the defaults
    (path / "video_preprocessor_config.json").write_text(json.dumps(proc))
    assert read_frame_sampling(path, "qwen2_5_vl") == ProcessorSampling(QWEN2_VL, fps=2.0)

    llava, _ = tiny_pair("llava_onevision")
    path = official_checkpoint(llava, "llava_onevision", tmp_path / "llava")
    assert read_frame_sampling(path, "llava_onevision") is None  # the published layout names no count
    proc = json.loads((path / "video_preprocessor_config.json").read_text())
    (path / "video_preprocessor_config.json").write_text(json.dumps({**proc, "num_frames": 4}))
    assert read_frame_sampling(path, "llava_onevision") == ProcessorSampling(UNIFORM_FLOOR, num_frames=4)


def _item(item_id: str, video, num_frames=None):
    from vpsd.launch.manifest import ManifestItem

    return ManifestItem(id=item_id, video=str(video), prompt="What happens?", max_new_tokens=None,
                        num_frames=num_frames, fps=None, extra={}, line=1)


def _config(path, family: str, sampling: str = "checkpoint"):
    return config_from_dict({"family": family, "target": {"path": str(path)}, "video": {"sampling": sampling}})


def test_a_job_reads_the_frames_the_checkpoint_asks_for_and_the_draft_the_same(tmp_path):
    from vpsd.launch.items import ItemReader
    from vpsd.models.registry import load_adapter
    from vpsd.models.spec import ModelSpec
    from vpsd.video.prefetch import FramePrefetcher

    target, _ = tiny_pair("qwen3_vl")
    proc = _qwen_processor(target, fps=1.0, min_frames=2, max_frames=5)
    path = save_official(target, tmp_path / "q3", proc, QWEN_TEMPLATE)
    video = media.write_gray_video(tmp_path / "clip.mp4", num_frames=24, fps=8)  # 3 s at 8 fps
    cfg = _config(path, "qwen3_vl")
    assert sampling_problems(cfg) == []
    reader = ItemReader(load_adapter("qwen3_vl", ModelSpec(path=str(path))), cfg)
    item = _item("a", video)
    loaded = reader.load(item)
    want = ProcessorSampling(QWEN3_VL, fps=1.0, min_frames=2, max_frames=5).indices(24, 8.0)
    assert want.tolist() == [0, 12, 23]  # int(3 s x 1 fps) = 3 frames, linspace over the video
    assert [media.decoded_index(f) for f in loaded.frames] == want.tolist()
    np.testing.assert_allclose(loaded.times, want / 8.0, atol=1e-6)
    frames, times, _ = FramePrefetcher().take(loaded.video)  # the draft's read, from the wire form
    np.testing.assert_array_equal(frames, loaded.frames)
    np.testing.assert_array_equal(times, loaded.times)
    # A manifest line's own request still wins.
    own = ItemReader(reader.target, cfg).frame_request(_item("b", video, num_frames=4))
    assert (own.num_frames, own.processor) == (4, None)
    # video.sampling: config (the default) keeps the config's count.
    assert ItemReader(reader.target, _config(path, "qwen3_vl", "config")).frame_request(item).num_frames == 8


def test_read_video_by_the_rule_matches_the_rule(tmp_path):
    video = media.write_gray_video(tmp_path / "clip.mp4", num_frames=30, fps=10)
    rule = ProcessorSampling(QWEN2_VL, fps=2.0)
    clip = read_video(video, processor=rule)
    assert clip.indices.tolist() == rule.indices(30, 10.0).tolist() == [0, 5, 10, 15, 20, 25]
    assert FrameRequest.from_wire(FrameRequest(str(video), processor=rule).to_wire("x")).processor == rule


def test_unusable_checkpoint_sampling_is_a_clear_error_at_launch(tmp_path):
    tiny = config_from_dict({"family": "qwen2_5_vl", "target": {"tiny": {"seed": 0}},
                             "video": {"sampling": "checkpoint"}})
    assert "needs a target checkpoint `path`" in sampling_problems(tiny)[0]
    llava, _ = tiny_pair("llava_onevision")
    path = official_checkpoint(llava, "llava_onevision", tmp_path / "llava")
    assert "names no num_frames or fps" in sampling_problems(_config(path, "llava_onevision"))[0]
    with pytest.raises(Exception, match="video.sampling must be 'config' or 'checkpoint'"):
        _config(path, "llava_onevision", "processor")

"""The clip's real sampling times reach the model: Qwen2.5-VL's temporal rotary spacing
(`second_per_grid_ts`) and Qwen3-VL's timestamps follow from where the frames were taken, for frames read by
count and by rate, evenly spaced or not; the positions are pinned by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import media
from tests.conftest import random_frames, tiny_pair
from vpsd.models.qwen2_5_vl import Qwen2_5_VLAdapter, sampled_fps
from vpsd.video.item import FrameRequest, load_frames

PROMPT = "Describe the video."


def _temporal_rows(adapter, frames, times) -> list[int]:
    """Temporal rotary position of each temporal group's first video token."""
    inputs = adapter.prepare(frames, PROMPT, times)
    layout = inputs.layout
    pos = adapter.embed(inputs).positions[0, 0, layout.seq_positions]
    return [int(pos[layout.frame == g][0]) for g in range(layout.grid[0])]


def test_qwen2_5_vl_positions_follow_unevenly_spaced_frames():
    target, _ = tiny_pair("qwen2_5_vl")
    tps = target.model.config.vision_config.tokens_per_second
    frames = random_frames(0, t=8)
    # 8 of 16 frames of an 8 fps video by count: linspace(0, 15, 8).round() = 0 2 4 6 9 11 13 15 (uneven).
    times = np.array([0, 2, 4, 6, 9, 11, 13, 15]) / 8.0
    assert sampled_fps(times) == pytest.approx(7 / (15 / 8))
    spacing = 2 / (7 / (15 / 8))  # seconds per temporal patch of 2 frames: mean spacing 15/56 s
    inputs = target.prepare(frames, PROMPT, times)
    assert float(inputs.pixel_inputs["second_per_grid_ts"]) == pytest.approx(spacing)
    rows = _temporal_rows(target, frames, times)
    assert [r - rows[0] for r in rows] == [int(g * spacing * tps) for g in range(4)]
    # Slower sampling spreads the groups further apart in rotary time; no times: 2 fps from 0.
    slow = _temporal_rows(target, frames, np.arange(8) * 4.0)  # one frame every 4 s
    assert [r - slow[0] for r in slow] == [int(g * 8.0 * tps) for g in range(4)]
    default = _temporal_rows(target, frames, None)
    assert [r - default[0] for r in default] == [int(g * 1.0 * tps) for g in range(4)]


def test_qwen3_vl_timestamps_follow_unevenly_spaced_frames():
    target, _ = tiny_pair("qwen3_vl")
    times = np.array([0.0, 0.5, 3.0, 3.2, 10.0, 10.1])  # groups (0, 0.5) (3, 3.2) (10, 10.1)
    text = target.tokenizer.decode(target.prepare(random_frames(0, t=6), PROMPT, times).input_ids[0])
    stamps = [s.split(" seconds>")[0] for s in text.split("<")[1:] if " seconds>" in s]
    assert stamps == ["0.2", "3.1", "10.1"]  # (0 + 0.5) / 2 = 0.25 shows as 0.2 (round half to even, as the reference)


@pytest.mark.parametrize("request_,indices", [
    (dict(num_frames=6), [0, 3, 6, 9, 12, 15]),  # linspace(0, 15, 6).round()
    (dict(fps=3.0), [0, 2, 5, 8, 10, 13]),  # the frame on screen every 1/3 s of an 8 fps video
])
def test_read_times_reach_the_prompt(tmp_path, request_, indices):
    """From a file: the times load_frames returns are the decoded frames' own, for count and rate sampling,
    and Qwen3-VL's prompt shows them."""
    video = media.write_gray_video(tmp_path / "v.mp4", num_frames=16, size=(32, 32), fps=8)
    frames, times = load_frames(FrameRequest(str(video), **request_), "x", {})
    assert [media.decoded_index(f) for f in frames] == indices
    np.testing.assert_allclose(times, np.array(indices) / 8.0)
    target, _ = tiny_pair("qwen3_vl")
    text = target.tokenizer.decode(target.prepare(frames, PROMPT, times).input_ids[0])
    pairs = np.array(indices).reshape(-1, 2) / 8.0
    for a, b in pairs:
        assert f"<{(a + b) / 2:.1f} seconds>" in text


def test_a_checkpoint_trained_on_fixed_times_can_ignore_them_and_bad_times_are_refused():
    target, _ = tiny_pair("qwen2_5_vl")
    fixed = Qwen2_5_VLAdapter(target.model, target.tokenizer, use_frame_times=False)
    frames = random_frames(0, t=4)
    far = np.array([0.0, 10.0, 20.0, 30.0])
    assert torch.equal(fixed.prepare(frames, PROMPT, far).pixel_inputs["second_per_grid_ts"],
                       target.prepare(frames, PROMPT).pixel_inputs["second_per_grid_ts"])
    for bad in (np.array([0.0, 1.0]), np.array([0.0, 2.0, 1.0, 3.0]), np.array([0.0, np.nan, 1.0, 2.0])):
        with pytest.raises(ValueError, match="frame_times"):
            target.prepare(frames, PROMPT, bad)

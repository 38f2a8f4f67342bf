"""The target sends the draft its frames (`video.share_frames`, roles/frames_wire.py) instead of the draft reading
the video again, in one process over the in-memory link and the harness's random interleaving: the frames follow
each JobStart on the tensor channel, the draft takes exactly the target's, never touches its own reader, and every
item still equals its batch-1 `ar` output. The real thing over torchrun: tests/torchrun/test_frames_once.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.engine_harness import Pipeline, batch1_ar
from tests.engine_harness import requests as work_items
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge


class NoFiles:
    """A draft's reader that must not be used: the frames come from the target."""

    def take(self, wire):
        raise AssertionError(f"the draft read the video of {wire.get('item')} the target sent")

    def ahead(self, wire) -> None:
        raise AssertionError("the draft read ahead a video the target will send")


@pytest.mark.parametrize("size", [1, 3])
def test_the_draft_takes_the_targets_frames_and_outputs_stay_ar(size):
    todo = work_items(4, max_new=10)
    pipe = Pipeline("qwen2_5_vl", "hippo", size, todo, {"decoding.gamma": 3, "decoding.temperature": 0.0}, False)
    pipe.drafter.send_frames = True  # as build_engine wires a draft rank under video.share_frames
    pipe.dw.videos = NoFiles()
    got_frames = {}
    received = pipe.dw._received

    def spy(job):
        frames, times, timings = received(job)
        got_frames[job.item_id] = frames
        assert timings["video_read_s"] == 0.0 and timings["video_wait_s"] >= 0.0
        return frames, times, timings

    pipe.dw._received = spy
    got = pipe.run(seed=3)
    assert set(got_frames) == {it.id for it in todo}
    for it in todo:
        np.testing.assert_array_equal(got_frames[it.id], it.frames)  # exactly the target's
        ref = batch1_ar(pipe.target, it, dataclasses.replace(pipe.cfg.decoding, max_new_tokens=it.max_new_tokens))
        if size == 1:
            assert got[it.id].token_ids == ref.token_ids, it.id
        else:
            div = first_divergence(pipe.target, it.frames, it.prompt, ref.token_ids, got[it.id].token_ids)
            assert judge(div, TIE_TOLERANCE[pipe.target.model.dtype]), (it.id, div)
    assert pipe.draft_idle()

"""The target's EOS ids travel with each job, and a draft on another video grid is refused
with one check shared by the serial and parallel paths (tests/torchrun/test_pipeline_torchrun.py runs the parallel one)."""

from __future__ import annotations

import msgpack
import pytest

from tests.conftest import random_frames, tiny_pair
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.sd import decode_sd
from vpsd.models.qwen2_5_vl import Qwen2_5_VLAdapter
from vpsd.models.qwen_video import QwenVisionSpec
from vpsd.pipeline.messages import JobStart, MessageError, decode, encode


def test_job_start_carries_the_targets_eos_ids_and_refuses_the_old_version():
    job = JobStart("j", "i", 0, 8, 4, [7, 9], {}, None, "p", False)
    assert decode(encode(job)).eos_token_ids == [7, 9]
    old = msgpack.unpackb(encode(job))
    old["type"] = "JobStart/1"
    del old["eos_token_ids"]
    with pytest.raises(MessageError, match="version 1"):
        decode(msgpack.packb(old))


def test_serial_speculation_refuses_a_draft_on_another_grid():
    target, _ = tiny_pair("qwen2_5_vl")
    # The same weights with a smaller pixel budget per frame: a 2x2 token grid where the target has 4x4.
    other = Qwen2_5_VLAdapter(target.model, target.tokenizer, vision_spec=QwenVisionSpec(max_pixels=56 * 56))
    none = PruningConfig(strategy="none", ratio=0.0)
    with pytest.raises(ValueError, match=r"draft video grid \(2, 2, 2\) differs from the target's \(2, 4, 4\)"):
        decode_sd(target, other, random_frames(0, t=4, h=112, w=112), "x", DecodingConfig(max_new_tokens=2),
                  keep_policy_for(none), none)

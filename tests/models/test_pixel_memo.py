"""A video's prepared pixel tensors and their digests, kept for its next question (models/pixel_memo.py): taken as
they are for the same read-only frames (the frame cache's), never for a writable array, a budget they exceed or
frames that are gone; the prefix cache's key is the same either way."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from tests.conftest import config_path, random_frames, tiny_tokenizer
from vpsd.config import load_config
from vpsd.engine.prefix_cache import video_key
from vpsd.models.registry import load_adapter

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")


def adapter(family: str, budget: int = 64 << 20):
    cfg = load_config(config_path(family))
    model = load_adapter(family, cfg.target, tiny_tokenizer())  # its own: the memo is the adapter's
    model.pixel_memo.budget = budget
    return model


def read_only(frames):
    frames.flags.writeable = False
    return frames


def hashed_again(inputs) -> bytes:
    """The key computed from the tensors' bytes alone, no digest carried."""
    return video_key(dataclasses.replace(inputs, digests={}))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_question_about_the_same_read_only_frames_takes_the_kept_tensors_and_the_same_key(family):
    model = adapter(family)
    frames = read_only(random_frames(1, t=4))
    first = model.prepare(frames, "What happens?")
    assert not first.digests  # nothing hashed until a prefix cache asks: a video asked once never is
    second = model.prepare(frames, "Which object moves first?")
    assert model.pixel_memo.hits == 1 and second.pixels_kept and not first.pixels_kept
    assert second.pixel_inputs["pixel_values_videos"] is first.pixel_inputs["pixel_values_videos"]
    key = video_key(first)
    assert second.digests and second.digests is first.digests  # hashed once, for every question of the video
    assert video_key(second) == key == hashed_again(second)
    fresh = model.prepare(random_frames(1, t=4), "What happens?")  # the same pixels in a writable array: made
    assert model.pixel_memo.hits == 1 and not fresh.pixels_kept and not fresh.digests  # hashed only if asked
    torch.testing.assert_close(fresh.pixel_inputs["pixel_values_videos"], first.pixel_inputs["pixel_values_videos"],
                               rtol=0, atol=0)
    assert video_key(fresh) == video_key(first)


def test_writable_frames_an_exceeded_budget_and_frames_that_are_gone_keep_nothing():
    model = adapter("qwen2_5_vl")
    writable = random_frames(2, t=4)
    model.prepare(writable, "a")
    model.prepare(writable, "b")
    assert model.pixel_memo.hits == 0  # a caller's own array could change between the questions
    small = adapter("qwen2_5_vl", budget=1024)
    frames = read_only(random_frames(2, t=4))
    small.prepare(frames, "a")
    small.prepare(frames, "b")
    assert small.pixel_memo.hits == 0  # larger than its budget
    frames = read_only(random_frames(3, t=4))
    model.prepare(frames, "a")
    assert model.pixel_memo._entry is not None
    del frames
    gc.collect()
    assert model.pixel_memo._entry is None  # dropped with the frames


def test_a_new_video_replaces_the_kept_one_and_a_copied_model_keeps_nothing():
    import copy

    model = adapter("qwen2_5_vl")
    a, b = read_only(random_frames(4, t=4)), read_only(random_frames(5, t=4))
    model.prepare(a, "q")
    model.prepare(b, "q")
    model.prepare(a, "q")  # one video an adapter: `a` was replaced by `b`
    assert model.pixel_memo.hits == 0
    model.prepare(a, "r")
    assert model.pixel_memo.hits == 1
    twin = copy.deepcopy(model)
    assert twin.pixel_memo._entry is None and twin.pixel_memo.budget == model.pixel_memo.budget


def test_a_question_prepared_while_the_same_video_is_being_prepared_waits_and_takes_its_tensors():
    """The prefill-ahead thread prepares the next question while the engine's thread still prepares the same
    video's previous one (seen in a job: one hit of two): the second waits, and nothing is made twice."""
    import threading

    from vpsd.models.pixel_memo import PixelMemo

    memo, frames = PixelMemo(budget=1 << 20), read_only(random_frames(6, t=2))
    inside, release, made, got = threading.Event(), threading.Event(), [], {}

    def make():
        made.append(1)
        inside.set()
        release.wait(30)
        return {"pixel_values_videos": torch.ones(4, 4)}

    first = threading.Thread(target=lambda: got.setdefault("first", memo.tensors(frames, "k", make)))
    first.start()
    inside.wait(30)
    second = threading.Thread(target=lambda: got.setdefault("second", memo.tensors(frames, "k", make)))
    second.start()
    second.join(1.0)  # were it not waiting, it would have made its own by now
    release.set()
    first.join(30)
    second.join(30)
    assert len(made) == 1 and memo.hits == 1
    assert got["second"][0]["pixel_values_videos"] is got["first"][0]["pixel_values_videos"] and got["second"][2]

"""The long-video world: deterministic per seed, its events where its captions and answers say, in the pixels."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from vpsd.world.caption import words
from vpsd.world.dataset import LONG_HELD_OUT_FROM, main, make_long_example
from vpsd.world.long_caption import LONG_VOCABULARY, dense_caption, event_clause, long_example_text, question
from vpsd.world.long_sampler import sample_long_scene
from vpsd.world.long_scene import DURATION_S, FPS, MIN_GAP_S, SIZE, frame_of
from vpsd.world.render import render
from vpsd.world.scene import COLOURS

SEEDS = range(120)
TOKENS_PER_GROUP = (SIZE[0] // 28) * (SIZE[1] // 28)  # 7-pixel patches merged 4x4, two frames a group


def test_same_seed_same_example_and_seeds_differ() -> None:
    a, b = make_long_example(11), make_long_example(11)
    assert np.array_equal(a.frames, b.frames) and (a.answer, a.prompt, a.scene) == (b.answer, b.prompt, b.scene)
    assert a.scene != make_long_example(12).scene


@pytest.mark.parametrize("seed", SEEDS)
def test_scene_shape_events_and_token_count(seed: int) -> None:
    scene = sample_long_scene(seed)
    assert DURATION_S[0] <= scene.duration_s <= DURATION_S[1] and scene.num_frames == FPS * scene.duration_s
    assert 4 <= len(scene.events) <= 12
    seconds = [e.second for e in scene.events]
    assert seconds == sorted(seconds) and all(b - a >= MIN_GAP_S for a, b in zip(seconds, seconds[1:]))
    assert all(0 < s < scene.duration_s for s in seconds)
    video_tokens = math.ceil(scene.num_frames / 2) * TOKENS_PER_GROUP
    assert 1000 <= video_tokens <= 4100  # "1k-4k video tokens an item" at the config's sampling (every frame)


@pytest.mark.parametrize("seed", SEEDS)
def test_each_event_happens_in_the_first_frame_of_its_second(seed: int) -> None:
    """The scene's own account of each object, before and at the event's frame."""
    scene = sample_long_scene(seed)
    for e in scene.events:
        obj, t = scene.objects[e.obj], frame_of(e.second)
        before = t - 1
        if e.kind == "appears":
            assert obj.visible(t) and not obj.visible(before)
        elif e.kind in ("disappears", "leaves"):
            assert obj.visible(before) and not obj.visible(t)
        elif e.kind == "turns":
            assert obj.colour_at(before) != obj.colour_at(t) == e.detail
        elif e.kind == "becomes":
            assert obj.shape_at(before) != obj.shape_at(t) == e.detail
        elif e.kind == "starts":
            assert obj.centre(before) == obj.centre(t) != obj.centre(t + 1)
        else:  # stops, meets: moving up to its frame, still from it on
            assert obj.centre(t - 2) != obj.centre(before) and obj.centre(t) == obj.centre(min(t + 4, scene.num_frames - 1))
        if e.kind == "meets":
            other = scene.objects[e.other]
            assert other.visible(t) and not other.moving(t)


def test_every_event_kind_occurs() -> None:
    kinds = {e.kind for seed in range(400) for e in sample_long_scene(seed).events}
    assert kinds == {"appears", "disappears", "starts", "stops", "meets", "leaves", "turns", "becomes"}


@pytest.mark.parametrize("seed", range(12))
def test_the_pixels_show_the_event_at_its_second(seed: int) -> None:
    """Rendered frames: a colour change shows at the object's centre exactly at the event's frame, an appearing
    object's colour appears there, and nothing but the distractor changes in a stretch without events."""
    scene = sample_long_scene(seed)
    frames = render(scene)
    for e in scene.events:
        obj, t = scene.objects[e.obj], frame_of(e.second)
        x, y = obj.centre(t)
        pixel = lambda f: frames[f, int(y * scene.height), int(x * scene.width)].astype(int)  # noqa: E731
        if e.kind == "turns":
            assert np.abs(pixel(t) - COLOURS[e.detail]).sum() < 30 and np.abs(pixel(t - 1) - COLOURS[e.detail]).sum() > 60
        if e.kind == "appears":
            assert np.abs(pixel(t) - COLOURS[obj.colour_at(t)]).sum() < 30
    changes = {frame_of(e.second) for e in scene.events}
    moving = {t for t in range(scene.num_frames) for o in scene.objects if o.visible(t) and o.moving(t)}
    box = scene.distractor_box()
    for t in range(1, scene.num_frames):
        if t in changes or t in moving or (t - 1) in moving:
            continue
        diff = frames[t] != frames[t - 1]
        if box is not None:
            y0, y1, x0, x1 = box
            diff[y0:y1, x0:x1] = False
        assert not diff.any(), f"frame {t} changed without an event"


def test_captions_and_answers_use_the_vocabulary_and_name_every_event() -> None:
    vocabulary = set(LONG_VOCABULARY)
    lengths = []
    for seed in SEEDS:
        scene = sample_long_scene(seed)
        text = dense_caption(scene)
        tokens = words(text)
        assert set(tokens) <= vocabulary, set(tokens) - vocabulary
        for e in scene.events:
            assert event_clause(scene, e) in text
        lengths.append(len(tokens))
        q, a = question(scene, random.Random(seed))
        assert set(words(q.replace("?", " ?"))) <= vocabulary and set(words(a)) <= vocabulary
    assert min(lengths) >= 60 and max(lengths) <= 260


def test_prompts_mix_captions_and_questions_in_every_run_of_seeds() -> None:
    for start in (0, 4, 100_000):
        kinds = [long_example_text(sample_long_scene(s), s)[2] for s in range(start, start + 8)]
        assert kinds.count("question") == 2 and kinds.count("caption") == 6


def test_questions_are_answered_by_the_scene() -> None:
    for seed in range(60):
        scene = sample_long_scene(seed)
        q, a = question(scene, random.Random(seed))
        if q.startswith("when did"):
            second = int(a.split()[1])
            assert any(e.second == second for e in scene.events)
        elif q.startswith("what happened at"):
            second = int(q.split()[3])
            (event,) = [e for e in scene.events if e.second == second]
            assert a == event_clause(scene, event) + "."
        else:
            assert q.startswith("what colour was the") and a.split()[-1].rstrip(".") in COLOURS


def test_vpsd_world_long_writes_videos_and_a_mixed_manifest(tmp_path) -> None:
    assert main(["--kind", "long", "--out", str(tmp_path), "--count", "4", "--seed", str(LONG_HELD_OUT_FROM)]) == 0
    lines = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"long-{LONG_HELD_OUT_FROM + i:06d}" for i in range(4)]
    assert {line["kind"] for line in lines} == {"caption", "question"}
    from vpsd.video.item import load_item_frames

    frames, times = load_item_frames(tmp_path / lines[0]["video"], None, FPS, None)
    example = make_long_example(LONG_HELD_OUT_FROM)
    assert frames.shape == example.frames.shape
    assert np.allclose(np.diff(times), 1 / FPS)
    assert np.abs(frames.astype(int) - example.frames.astype(int)).mean() < 3  # near-lossless round trip

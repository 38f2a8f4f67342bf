"""The procedural video world: deterministic, captions that match the pixels, mp4s that decode back."""

from __future__ import annotations

import dataclasses
import json

import av
import numpy as np
import pytest

from vpsd.world.caption import LOCATIONS, PROMPTS, VOCABULARY, caption, location, words
from vpsd.world.dataset import main, make_example, write_manifest, write_video
from vpsd.world.render import render
from vpsd.world.scene import (
    CELL_MARGIN,
    COLOURS,
    EVENT_KINDS,
    INTERIOR,
    LATTICE,
    SIZES,
    Scene,
    SceneObject,
    event_window,
    sample_scene,
)

SEEDS = range(200)


def first_scene_with(kind: str) -> tuple[Scene, SceneObject]:
    for seed in SEEDS:
        scene = sample_scene(seed)
        for obj in scene.objects:
            if obj.event and obj.event.kind == kind:
                return scene, obj
    raise AssertionError(f"no {kind} event in {len(SEEDS)} seeds")


def read_video(path) -> np.ndarray:
    """All frames of an mp4 as (T, H, W, 3) uint8 RGB: the plain PyAV decode, no sampling."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def centre_pixel(frames: np.ndarray, obj: SceneObject, t: int) -> np.ndarray:
    x, y = obj.centre(t)
    height, width = frames.shape[1:3]
    return frames[t, int(y * height), int(x * width)].astype(int)


def test_same_seed_same_example() -> None:
    a, b = make_example(7), make_example(7)
    assert np.array_equal(a.frames, b.frames)
    assert (a.caption, a.prompt, a.scene) == (b.caption, b.prompt, b.scene)
    assert a.caption != make_example(8).caption


def test_frames_shape_and_dtype_at_qwen_sizes() -> None:
    for num_frames, size in ((16, (112, 112)), (32, (224, 168)), (20, (168, 224))):
        frames = make_example(3, num_frames, size).frames
        assert frames.shape == (num_frames, *size, 3) and frames.dtype == np.uint8


def test_captions_short_and_inside_vocabulary() -> None:
    vocabulary = set(VOCABULARY)
    for seed in SEEDS:
        text = caption(sample_scene(seed))
        assert 15 <= len(text.split()) <= 40, text
        assert set(words(text)) <= vocabulary, set(words(text)) - vocabulary


def test_every_scene_has_an_event_in_the_middle() -> None:
    kinds = set()
    for seed in SEEDS:
        scene = sample_scene(seed)
        events = [o.event for o in scene.objects if o.event]
        assert events
        lo, hi = event_window(scene.num_frames)
        assert all(lo <= e.frame <= hi and 0 < e.frame < scene.num_frames for e in events)
        kinds |= {e.kind for e in events}
    assert kinds == set(EVENT_KINDS)


def test_objects_start_anywhere_including_the_centre() -> None:
    starts = [o.start for seed in SEEDS for o in sample_scene(seed).objects]
    assert any(all(0.4 < v < 0.6 for v in start) for start in starts)
    assert {location(x, y) for x, y in starts} == {loc for row in LOCATIONS for loc in row}


def test_centres_sit_on_the_pixel_lattice_and_moving_objects_move() -> None:
    moved = 0
    for seed in SEEDS:
        scene = sample_scene(seed)
        for obj in scene.objects:
            for t in range(scene.num_frames):
                x, y = obj.centre(t)
                for v, side in ((x, scene.width), (y, scene.height)):
                    offset = v * side - LATTICE / 2  # a lattice cell's centre is half a step past its corner
                    assert offset / LATTICE == pytest.approx(round(offset / LATTICE), abs=1e-9)
            if obj.motion != "still":
                moved += obj.centre(0) != obj.centre(scene.num_frames - 1)
            else:
                assert obj.centre(0) == obj.centre(scene.num_frames - 1)
    assert moved > 50


def test_a_moving_object_shifts_a_lattice_step_within_every_two_frames() -> None:
    """So each temporal pair of vision patches (frames 2 apart when 8 of 16 are sampled) shows the motion."""
    for seed in SEEDS:
        scene = sample_scene(seed)
        for obj in scene.objects:
            if obj.motion == "still":
                continue
            for t in range(scene.num_frames - 2):
                if obj.visible(t) and obj.visible(t + 2):
                    (x0, y0), (x1, y1) = obj.centre(t), obj.centre(t + 2)
                    shift = max(abs(x1 - x0) * scene.width, abs(y1 - y0) * scene.height)
                    assert shift >= LATTICE - 1e-6


def test_an_appearing_object_is_far_from_the_lines_between_quadrants() -> None:
    """Its location word must hold where the sampled frames first show it, a lattice step or two later."""
    seen = 0
    for seed in SEEDS:
        for obj in sample_scene(seed).objects:
            if obj.event and obj.event.kind == "appears":
                seen += 1
                for v in obj.centre(obj.first_frame):
                    assert abs(v - 0.5) >= CELL_MARGIN
    assert seen > 20


def test_a_disappearing_object_vanishes_away_from_the_borders() -> None:
    """So it never looks like an object leaving the frame, which is last seen cut by a border."""
    seen = 0
    for seed in SEEDS:
        scene = sample_scene(seed)
        for obj in scene.objects:
            if obj.event and obj.event.kind == "disappears":
                seen += 1
                last = obj.event.frame - 1
                assert obj.visible(last) and not obj.visible(obj.event.frame)
                x, y = obj.centre(last)
                assert INTERIOR <= x <= 1 - INTERIOR and INTERIOR <= y <= 1 - INTERIOR
                # the whole object, not just its centre, stays clear of the borders
                assert min(x, y, 1 - x, 1 - y) - obj.radius >= INTERIOR - max(SIZES.values()) - 1e-9
    assert seen > 20


def test_quadrant_lines_are_video_token_boundaries() -> None:
    """A location word is then a fact about whole tokens (train.py: one token per 28-pixel cell)."""
    from training.world_short import MERGED_CELL, SIZE

    for side in SIZE:
        assert (side / 2) % MERGED_CELL == 0


def test_colours_unique_so_definite_references_are_unambiguous() -> None:
    for seed in SEEDS:
        objects = sample_scene(seed).objects
        used = [o.colour for o in objects]
        used += [o.event.new_colour for o in objects if o.event and o.event.new_colour]
        assert len(used) == len(set(used))


def test_colour_change_in_caption_and_pixels() -> None:
    scene, obj = first_scene_with("turns")
    text, k = caption(scene), obj.event.frame
    assert f"the {obj.colour} {obj.shape} turns {obj.event.new_colour}." in text
    frames = render(scene)
    assert np.abs(centre_pixel(frames, obj, k - 1) - COLOURS[obj.colour]).max() <= 1
    assert np.abs(centre_pixel(frames, obj, k) - COLOURS[obj.event.new_colour]).max() <= 1


def test_appearing_object_absent_early_present_later() -> None:
    scene, obj = first_scene_with("appears")
    k = obj.event.frame
    assert f"then a {obj.size} {obj.colour} {obj.shape} appears {location(*obj.start)}" in caption(scene)
    frames = render(scene)
    without = render(dataclasses.replace(scene, objects=tuple(o for o in scene.objects if o is not obj)))
    # Before frame k the object has no pixel at all; from k on it is drawn at its place.
    assert np.array_equal(frames[:k], without[:k])
    assert not np.array_equal(frames[k], without[k])
    assert np.abs(centre_pixel(frames, obj, k) - COLOURS[obj.colour]).max() <= 1


@pytest.mark.parametrize("kind", ["disappears", "leaves"])
def test_object_gone_after_it_leaves(kind: str) -> None:
    scene, obj = first_scene_with(kind)
    k = obj.event.frame
    phrase = "disappears" if kind == "disappears" else "leaves the frame"
    assert f"then the {obj.colour} {obj.shape} {phrase}." in caption(scene)
    frames = render(scene)
    without = render(dataclasses.replace(scene, objects=tuple(o for o in scene.objects if o is not obj)))
    assert not np.array_equal(frames[k - 1], without[k - 1])
    assert np.array_equal(frames[k:], without[k:])


def test_mp4_round_trip_keeps_pixels_and_colours(tmp_path) -> None:
    example = make_example(5)
    path = tmp_path / "v.mp4"
    write_video(path, example.frames)
    decoded = read_video(path)
    assert decoded.shape == example.frames.shape
    assert np.abs(decoded.astype(int) - example.frames).mean() < 3.0
    for obj in example.scene.objects:
        for t in range(example.scene.num_frames):
            if obj.visible(t):
                x, y = obj.centre(t)
                if 0.05 < x < 0.95 and 0.05 < y < 0.95:  # a shape half out of frame has no clean centre
                    assert np.abs(centre_pixel(decoded, obj, t) - COLOURS[obj.colour_at(t)]).max() < 12


def test_manifest_and_cli(tmp_path) -> None:
    manifest = write_manifest(tmp_path / "a", [3, 4], max_new_tokens=48)
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["world-000003", "world-000004"]
    for line, seed in zip(lines, (3, 4)):
        assert set(line) == {"id", "video", "prompt", "max_new_tokens", "reference"}
        assert line["reference"] == make_example(seed).caption
        assert line["prompt"] in PROMPTS and line["max_new_tokens"] == 48
        assert read_video(manifest.parent / line["video"]).shape == (16, 112, 112, 3)
    main(["--out", str(tmp_path / "b"), "--count", "2", "--seed", "3", "--max-new-tokens", "48"])
    assert (tmp_path / "b" / "manifest.jsonl").read_text() == manifest.read_text()


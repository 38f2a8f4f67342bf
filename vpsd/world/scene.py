"""A seeded sampler of what happens in one procedural video; no pixels, no words.

Contract:
- `sample_scene(seed, num_frames, size)` is a pure function of its arguments: the same seed always gives
  the same `Scene`. It uses `random.Random`, whose float stream is stable across Python versions.
- A `Scene` holds everything the renderer and the captioner need; both are pure functions of it.
- Coordinates are fractions of the frame: x of the width, y of the height, (0, 0) the top-left corner.
  An object's `radius` is a fraction of the shorter side, so shapes stay round on non-square frames.
- Every scene has at least one event (appears, disappears, leaves, turns), and every event happens in
  the middle of the video (`event_window`), so the first frame alone never tells the whole story.
- Object centres sit on a lattice of `LATTICE` pixels (cell centres), so a moving object jumps one lattice
  step at a time. With the lattice equal to the vision patch side every shape is the same pixel pattern
  wherever it is, which a tiny vision tower learns in minutes; off-lattice shapes shift against the
  patch grid and took it longer than the whole CPU training budget (a probe read shape at chance).
- Colours are unique across the scene, new colours included, so "the red circle" names one object.
- Objects never overlap while both are visible, so every object stays fully visible and checkable.
- Where an object appears is named by the quadrant of its centre (`half` of each axis): the halves of a 112-pixel frame
  fall on the boundaries of the 28-pixel video tokens, so the location is a whole-token fact. (With thirds,
  the lines cut through tokens and the trained target missed the location in a fifth of all captions.)
- A disappearing object vanishes away from the borders (`INTERIOR`), so it never looks like one that leaves
  the frame; the trained target used to confuse the two in about one caption in six.
- One or two objects and exactly one event: at most 28 caption words. (Three objects and two events made
  captions a tiny language model could not bind within the CPU training hour.)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

# RGB values far apart in hue, so they survive 4:2:0 chroma subsampling and stay nameable.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (40, 80, 235),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "purple": (150, 60, 200),
    "orange": (250, 140, 20),
    "cyan": (40, 215, 225),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"black": (28, 28, 32), "grey": (112, 112, 112)}
SHAPES = ("circle", "square", "triangle", "cross")
# Radius as a fraction of the shorter side: 9 and 17 pixels on a 112-pixel frame.
SIZES: dict[str, float] = {"small": 0.08, "large": 0.15}
MOTIONS = ("left", "right", "up", "down", "still")
DIRECTIONS: dict[str, tuple[float, float]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

EventKind = Literal["appears", "disappears", "leaves", "turns"]
EVENT_KINDS: tuple[EventKind, ...] = ("appears", "disappears", "leaves", "turns")

# Centres snap to this many pixels (the world model's vision patch side, training.world_short.VISION).
LATTICE = 7
# Keeps objects off the frame border, and labelled positions off the lines between quadrants, so a location
# word is never a coin flip between two cells: an appearing object is first sampled up to 2 frames after
# it appears (8 of 16 frames), by when it may have moved a lattice step or two.
BORDER_MARGIN = 0.02
CELL_MARGIN = 0.1
# A disappearing object's centre, in its last visible frame, lies in [INTERIOR, 1 - INTERIOR] on both axes:
# even a large one keeps 0.15 of the frame between its edge and the border as it vanishes.
INTERIOR = 0.3
# Speed of a moving object in pixels per frame: over half a lattice step, so in any two frames it moves at
# least one step. With 8 of 16 frames sampled, the tower's temporal pairs are frames 2 apart, so every pair
# shows the motion, and "stays still" is the only motion with no shift anywhere.
SPEED_PX = (3.7, 4.6)
# A square's corners reach 1.13 radii from its centre; keep bounding circles apart with some air.
BOUNDING_FACTOR = 1.2
MAX_TRIES = 200


@dataclass(frozen=True)
class Event:
    kind: EventKind
    frame: int  # first frame where the change is visible (appears: first visible; others: first gone/new)
    new_colour: str | None = None  # only for "turns"


@dataclass(frozen=True)
class SceneObject:
    shape: str
    size: str
    colour: str  # colour when first seen
    motion: str  # one of MOTIONS
    start: tuple[float, float]  # (x, y) centre at `first_frame`
    velocity: tuple[float, float]  # (dx, dy) per frame, fractions of width / height
    event: Event | None = None
    lattice: tuple[float, float] = (0.0, 0.0)  # snap step in fractions of (width, height); 0: no snapping

    @property
    def radius(self) -> float:
        return SIZES[self.size]

    @property
    def first_frame(self) -> int:
        return self.event.frame if self.event and self.event.kind == "appears" else 0

    def visible(self, t: int) -> bool:
        if t < self.first_frame:
            return False
        if self.event and self.event.kind in ("disappears", "leaves"):
            return t < self.event.frame
        return True

    def centre(self, t: int) -> tuple[float, float]:
        dt = t - self.first_frame
        x, y = self.start[0] + self.velocity[0] * dt, self.start[1] + self.velocity[1] * dt
        return _snap(x, self.lattice[0]), _snap(y, self.lattice[1])

    def colour_at(self, t: int) -> str:
        if self.event and self.event.kind == "turns" and t >= self.event.frame:
            return self.event.new_colour
        return self.colour

    def shape_at(self, t: int) -> str:
        return self.shape


@dataclass(frozen=True)
class Background:
    colour: str  # key of BACKGROUNDS
    textured: bool
    texture_seed: int  # the renderer draws the texture from this, so a Scene stays pure data


@dataclass(frozen=True)
class Scene:
    num_frames: int
    height: int
    width: int
    background: Background
    objects: tuple[SceneObject, ...]


def _snap(v: float, step: float) -> float:
    """The centre of the lattice cell holding `v` (cells of `step`, starting at 0)."""
    return (math.floor(v / step) + 0.5) * step if step else v


def event_window(num_frames: int) -> tuple[int, int]:
    """Inclusive range of frames where events may happen: the middle 40% of the video."""
    return max(1, round(num_frames * 0.3)), min(num_frames - 1, round(num_frames * 0.7))


def half(v: float) -> int:
    """Which half (0, 1) of an axis a fraction falls in; shared with the captioner."""
    return min(1, int(v * 2))


def sample_scene(seed: int, num_frames: int = 16, size: tuple[int, int] = (112, 112), lattice: int = LATTICE) -> Scene:
    rng = random.Random(seed)
    height, width = size
    grid = (lattice / width, lattice / height)
    num_objects = rng.choice((1, 2))
    event_kinds = [rng.choice(EVENT_KINDS)] + [None] * (num_objects - 1)
    rng.shuffle(event_kinds)

    background = Background(rng.choice(tuple(BACKGROUNDS)), rng.random() < 0.5, rng.randrange(2**31))
    colours = list(COLOURS)
    rng.shuffle(colours)  # pop from a shuffled list: colours unique across the scene
    objects: list[SceneObject] = []
    for kind in event_kinds:
        for _ in range(MAX_TRIES):
            obj = _sample_object(rng, kind, colours[-2:], num_frames, height, width, grid)
            if not any(_overlap(obj, other, num_frames, height, width) for other in objects):
                objects.append(obj)
                colours.pop()
                if obj.event and obj.event.kind == "turns":
                    colours.pop()
                break
        # An object that finds no free room is dropped: rare, and the scene stays valid without it,
        # unless it carried the only event.
    if not any(o.event for o in objects):
        return sample_scene(rng.randrange(2**31), num_frames, size, lattice)
    return Scene(num_frames, height, width, background, tuple(objects))


def _sample_object(
    rng: random.Random, kind: EventKind | None, colours: list[str], num_frames: int, height: int, width: int,
    grid: tuple[float, float],
) -> SceneObject:
    """Rejection-sample one object with event `kind`; `colours[-1]` is its colour, `colours[-2]` a new one."""
    shape, size = rng.choice(SHAPES), rng.choice(tuple(SIZES))
    short = min(height, width)
    # Half-extents as fractions of each axis.
    rx, ry = SIZES[size] * short / width, SIZES[size] * short / height
    lo, hi = event_window(num_frames)
    frame = rng.randint(lo, hi)
    motion = rng.choice(MOTIONS[:4] if kind == "leaves" else MOTIONS)
    event = None if kind is None else Event(kind, frame, colours[-2] if kind == "turns" else None)
    first = frame if kind == "appears" else 0
    last = frame - 1 if kind in ("disappears", "leaves") else num_frames - 1

    for _ in range(MAX_TRIES):
        x = rng.uniform(rx + BORDER_MARGIN, 1 - rx - BORDER_MARGIN)
        y = rng.uniform(ry + BORDER_MARGIN, 1 - ry - BORDER_MARGIN)
        if motion == "still":
            velocity = (0.0, 0.0)
        elif kind == "leaves":
            # Fully outside (plus a margin) exactly at `frame`: speed follows from the start position.
            dx, dy = DIRECTIONS[motion]
            if dx:
                gap = (x + rx if dx < 0 else 1 + rx - x) + BORDER_MARGIN
            else:
                gap = (y + ry if dy < 0 else 1 + ry - y) + BORDER_MARGIN
            velocity = (dx * gap / frame, dy * gap / frame)
            if gap / frame * (width if dx else height) < SPEED_PX[0]:
                continue  # too close to its edge to move visibly every two frames
        else:
            dx, dy = DIRECTIONS[motion]
            speed = rng.uniform(*SPEED_PX)
            velocity = (dx * speed / width, dy * speed / height)
        obj = SceneObject(shape, size, colours[-1], motion, (x, y), velocity, event, grid)
        if kind != "leaves" and not _inside(obj, first, last, rx, ry):
            continue
        if kind == "appears" and not _clear_of_cell_lines(*obj.centre(first)):
            continue
        if kind == "disappears" and not all(INTERIOR <= v <= 1 - INTERIOR for v in obj.centre(last)):
            continue
        return obj
    # The ranges above always leave room (0.3 + 0.45 + margins < 1), so this is a bug, not bad luck.
    raise RuntimeError(f"could not place a {size} {motion} object")


def _inside(obj: SceneObject, first: int, last: int, rx: float, ry: float) -> bool:
    # Motion is linear, so the end points bound the whole path.
    for t in (first, last):
        x, y = obj.centre(t)
        inside_x = rx + BORDER_MARGIN <= x <= 1 - rx - BORDER_MARGIN
        inside_y = ry + BORDER_MARGIN <= y <= 1 - ry - BORDER_MARGIN
        if not (inside_x and inside_y):
            return False
    return True


def _clear_of_cell_lines(x: float, y: float) -> bool:
    return all(abs(v - 0.5) >= CELL_MARGIN for v in (x, y))


def _overlap(a: SceneObject, b: SceneObject, num_frames: int, height: int, width: int) -> bool:
    reach = BOUNDING_FACTOR * (a.radius + b.radius) * min(height, width)
    for t in range(num_frames):
        if a.visible(t) and b.visible(t):
            (ax, ay), (bx, by) = a.centre(t), b.centre(t)
            if math.hypot((ax - bx) * width, (ay - by) * height) < reach:
                return True
    return False

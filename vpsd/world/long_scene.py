"""A seeded sampler of a long procedural video: objects with timelines, 4-12 events at whole seconds.

The long world is where the papers' premise holds: 16-64 s of video (64-256 frames at 4 fps, 112x224), so
at one temporal group per two frames and 32 video tokens per group an item holds 1k-4k video tokens, most
of them showing nothing new (long still stretches: the temporal redundancy HIPPO's temporal score and
UV-Prune exploit), and the answer hangs on the few groups where something happens.

Contract:
- `sample_long_scene(seed)` (vpsd.world.long_sampler) is a pure function of the seed.
- Objects start still. What happens to them is a list of `TimedEvent`s, each at a whole second `s`, first
  visible in frame `s * FPS` (the first frame of a temporal group): appears, disappears, starts moving,
  stops, meets (stops beside another object), leaves the frame, turns (colour), becomes (shape). Events sit
  on second boundaries so "at 12 seconds" is a whole-group fact, as the short world's quadrant lines are
  whole-token facts (vpsd.world.scene). At most one event per second, at least `MIN_GAP_S` apart.
- A move is two events: it starts at one event second and ends at a later one (stops, meets or leaves), at a
  speed in `SPEED_PX` per frame: over one lattice step per frame, so every temporal pair (two consecutive
  frames) shows the motion, as in the short world where the sampled frames were two source frames apart.
- (colour, shape) names one object for the whole video, and no two visible objects share a colour, so
  "the red circle" is always one object.
- Visible objects never overlap and stay inside the frame, but for one leaving it.
- A `Distractor` (in half the videos): a small checker patch in a corner that blinks; no object ever comes
  near it and no caption or answer mentions it. Its tokens change all the time, so a pruner that ranks by
  change alone spends budget on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from vpsd.world.scene import LATTICE, SIZES, Background, _snap

FPS = 4
SIZE = (112, 224)  # (H, W): 4 x 8 video tokens of 28 pixels per temporal group
DURATION_S = (16, 64)  # 64-256 frames
MIN_GAP_S = 2  # seconds between events: stretches where nothing happens
MAX_VISIBLE = 4
# Pixels per frame: over one 7-pixel lattice step, so each pair of consecutive frames shows the motion.
SPEED_PX = (7.4, 9.2)
# A leave is timed to end exactly on a second boundary, so its speed is solved for; allow a wider band.
LEAVE_SPEED_PX = (6.5, 11.0)
MOVE_SECONDS = (1, 4)
# Two objects "meet" when a mover stops with a gap of MEET_MIN_GAP_PX to MEET_GAP_PX pixels between their
# bounding circles; anything else keeps at least 3 * MEET_GAP_PX from every object it stops or appears beside,
# so a meet is never confused with a stop.
MEET_MIN_GAP_PX = 0.5
MEET_GAP_PX = LATTICE + MEET_MIN_GAP_PX
MEET_DISTANCE_PX = 85  # an object placed on another's row starts at least this far from it
DISTRACTOR_PX = 12  # side of the blinking checker patch
DISTRACTOR_CLEARANCE_PX = 34  # objects keep this far (centre to the patch's box) from it
MAX_TRIES = 60

EventKind = Literal["appears", "disappears", "starts", "stops", "meets", "leaves", "turns", "becomes"]
INSTANT_KINDS: tuple[EventKind, ...] = ("appears", "disappears", "turns", "becomes")


@dataclass(frozen=True)
class Segment:
    """What an object does from frame `start` until its next segment starts."""

    start: int
    position: tuple[float, float]  # centre at `start`, fractions of (width, height), before snapping
    velocity: tuple[float, float]  # per frame, fractions of (width, height)
    colour: str
    shape: str
    visible: bool


@dataclass(frozen=True)
class TrackedObject:
    size: str
    segments: tuple[Segment, ...]
    lattice: tuple[float, float]

    @property
    def radius(self) -> float:
        return SIZES[self.size]

    def segment(self, t: int) -> Segment:
        current = self.segments[0]
        for seg in self.segments[1:]:
            if seg.start > t:
                break
            current = seg
        return current

    def visible(self, t: int) -> bool:
        return t >= self.segments[0].start and self.segment(t).visible

    def centre(self, t: int) -> tuple[float, float]:
        seg = self.segment(t)
        dt = t - seg.start
        x, y = seg.position[0] + seg.velocity[0] * dt, seg.position[1] + seg.velocity[1] * dt
        return _snap(x, self.lattice[0]), _snap(y, self.lattice[1])

    def colour_at(self, t: int) -> str:
        return self.segment(t).colour

    def shape_at(self, t: int) -> str:
        return self.segment(t).shape

    def moving(self, t: int) -> bool:
        return self.segment(t).velocity != (0.0, 0.0)

    def with_segment(self, seg: Segment) -> "TrackedObject":
        """This object with `seg` appended (its start after every existing segment's)."""
        return replace(self, segments=(*[s for s in self.segments if s.start < seg.start], seg))


@dataclass(frozen=True)
class TimedEvent:
    second: int
    kind: EventKind
    obj: int  # index into LongScene.objects
    detail: str | None = None  # starts: direction; turns: new colour; becomes: new shape
    other: int | None = None  # meets: the object met


@dataclass(frozen=True)
class Distractor:
    corner: tuple[int, int]  # (row, col) of the corner: 0 top / left, 1 bottom / right
    period: int  # frames on, then frames off


@dataclass(frozen=True)
class LongScene:
    num_frames: int
    height: int
    width: int
    fps: int
    background: Background
    objects: tuple[TrackedObject, ...]
    events: tuple[TimedEvent, ...]
    distractor: Distractor | None = None

    @property
    def duration_s(self) -> int:
        return self.num_frames // self.fps

    def distractor_box(self) -> tuple[int, int, int, int] | None:
        """(y0, y1, x0, x1) pixels of the blinking patch, or None."""
        return None if self.distractor is None else distractor_box(self.distractor, self.height, self.width)

    def distractor_on(self, t: int) -> bool:
        return self.distractor is not None and (t // self.distractor.period) % 2 == 0


def distractor_box(distractor: Distractor, height: int, width: int) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1) pixels of the blinking patch: 4 pixels in from its corner."""
    row, col = distractor.corner
    margin = 4
    y0 = margin if row == 0 else height - margin - DISTRACTOR_PX
    x0 = margin if col == 0 else width - margin - DISTRACTOR_PX
    return y0, y0 + DISTRACTOR_PX, x0, x0 + DISTRACTOR_PX


def frame_of(second: int) -> int:
    return second * FPS



"""How a long scene is sampled: a seeded simulation, second by second, of objects and their events.

`sample_long_scene(seed)` is a pure function of the seed (`random.Random`, stable across Python versions). The
scene's rules (what an event is, when it shows, what names an object) are vpsd.world.long_scene's; this module
draws scenes that keep them: event seconds at least MIN_GAP_S apart, then at each an event of a kind drawn by
`KIND_WEIGHTS` that fits (every candidate object tried before the kind is dropped), a move planned whole (its
start and its ending: a stop, a meet or a leave at a later event second), every object checked against every
other's planned path in every frame. A scene with fewer than four events is drawn again.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from vpsd.world.long_scene import (
    DISTRACTOR_CLEARANCE_PX,
    DURATION_S,
    FPS,
    LEAVE_SPEED_PX,
    MAX_TRIES,
    MAX_VISIBLE,
    MEET_DISTANCE_PX,
    MEET_GAP_PX,
    MEET_MIN_GAP_PX,
    MIN_GAP_S,
    MOVE_SECONDS,
    SIZE,
    SPEED_PX,
    Distractor,
    EventKind,
    LongScene,
    Segment,
    TimedEvent,
    TrackedObject,
    distractor_box,
    frame_of,
)
from vpsd.world.scene import (
    BACKGROUNDS,
    BORDER_MARGIN,
    BOUNDING_FACTOR,
    CELL_MARGIN,
    COLOURS,
    DIRECTIONS,
    LATTICE,
    SHAPES,
    SIZES,
    Background,
)

# Where a still object may vanish (fraction of each axis kept from the border), so it never looks like one
# leaving; looser than the short world's: here a leave is always announced by a move towards the edge.
LONG_INTERIOR = 0.2
# How often each event is drawn at a free second ("starts" opens a move, whose end takes a later second).
KIND_WEIGHTS: dict[str, float] = {"appears": 1.0, "disappears": 0.8, "turns": 1.0, "becomes": 0.8, "starts": 2.2}


def sample_long_scene(seed: int) -> LongScene:
    rng = random.Random(seed)
    while True:
        scene = _try_scene(rng)
        if scene is not None:
            return scene


# ---- sampling ---------------------------------------------------------------------------------------


@dataclass
class _Draft:
    """A scene under construction: objects with their planned timelines, the events so far."""

    num_frames: int
    height: int
    width: int
    background: Background
    distractor: Distractor | None
    objects: list[TrackedObject] = field(default_factory=list)
    events: list[TimedEvent] = field(default_factory=list)
    # A started move's planned end: object -> (second, kind, other), emitted when its second comes.
    pending: dict[int, tuple[int, EventKind, int | None]] = field(default_factory=dict)

    @property
    def grid(self) -> tuple[float, float]:
        return LATTICE / self.width, LATTICE / self.height

    def half_extents(self, size: str) -> tuple[float, float]:
        short = min(self.height, self.width)
        return SIZES[size] * short / self.width, SIZES[size] * short / self.height

    def reserved(self) -> set[int]:
        """Objects a planned move involves (the mover, the object it will meet): no other event touches them."""
        return {i for i in self.pending} | {o for _, _, o in self.pending.values() if o is not None}

    def visible_at(self, t: int) -> list[int]:
        return [i for i, o in enumerate(self.objects) if o.visible(t)]

    def names_used(self) -> set[tuple[str, str]]:
        return {(s.colour, s.shape) for o in self.objects for s in o.segments}

    def colours_visible(self, t: int, but: int | None = None) -> set[str]:
        return {self.objects[i].colour_at(t) for i in self.visible_at(t) if i != but}

    def fits(self, index: int, obj: TrackedObject, leaving: bool = False) -> bool:
        """`obj` (as object `index`, new or replacing) overlaps no other visible object in any frame, stays
        inside the frame (but when `leaving`), and keeps clear of the distractor."""
        others = [o for i, o in enumerate(self.objects) if i != index]
        rx, ry = self.half_extents(obj.size)
        box = None if self.distractor is None else distractor_box(self.distractor, self.height, self.width)
        for t in range(obj.segments[0].start, self.num_frames):
            if not obj.visible(t):
                continue
            x, y = obj.centre(t)
            inside = rx + BORDER_MARGIN <= x <= 1 - rx - BORDER_MARGIN and ry + BORDER_MARGIN <= y <= 1 - ry - BORDER_MARGIN
            if not inside and not leaving:
                return False
            if box is not None and _near_box(x * self.width, y * self.height, box):
                return False
            for other in others:
                if other.visible(t) and _gap_px(obj, other, t, self.height, self.width) < 0:
                    return False
        return True


def _near_box(px: float, py: float, box: tuple[int, int, int, int]) -> bool:
    y0, y1, x0, x1 = box
    dx = max(x0 - px, 0.0, px - x1)
    dy = max(y0 - py, 0.0, py - y1)
    return math.hypot(dx, dy) < DISTRACTOR_CLEARANCE_PX


def _gap_px(a: TrackedObject, b: TrackedObject, t: int, height: int, width: int) -> float:
    """Pixels between the two objects' bounding circles at frame t (negative: they overlap)."""
    (ax, ay), (bx, by) = a.centre(t), b.centre(t)
    reach = BOUNDING_FACTOR * (a.radius + b.radius) * min(height, width)
    return math.hypot((ax - bx) * width, (ay - by) * height) - reach


def _try_scene(rng: random.Random) -> LongScene | None:
    duration = rng.randint(*DURATION_S)
    num_frames = duration * FPS
    height, width = SIZE
    background = Background(rng.choice(tuple(BACKGROUNDS)), rng.random() < 0.5, rng.randrange(2**31))
    distractor = None
    if rng.random() < 0.5:
        distractor = Distractor((rng.randrange(2), rng.randrange(2)), rng.choice((2, 3, 4, 6)))
    draft = _Draft(num_frames, height, width, background, distractor)

    for _ in range(rng.choice((1, 2, 2, 3))):
        _add_object(draft, rng, 0)
    if not draft.objects:
        return None

    wanted = max(4, min(12, round(duration / 4) + rng.randint(-1, 1)))
    seconds = _event_seconds(rng, duration, wanted)
    for s in seconds:
        due = [i for i, (sec, _, _) in draft.pending.items() if sec == s]
        if due:
            _end_move(draft, due[0], s)
            continue
        _sample_event(draft, rng, s, seconds)
    if draft.pending or len(draft.events) < 4:
        return None
    events = tuple(sorted(draft.events, key=lambda e: e.second))
    return LongScene(num_frames, height, width, FPS, background, tuple(draft.objects), events, distractor)


def _event_seconds(rng: random.Random, duration: int, wanted: int) -> list[int]:
    """`wanted` (or as many as fit) sorted seconds in [1, duration - 1], at least MIN_GAP_S apart."""
    for _ in range(MAX_TRIES):
        seconds = sorted(rng.sample(range(1, duration), min(wanted, duration - 1)))
        if all(b - a >= MIN_GAP_S for a, b in zip(seconds, seconds[1:])):
            return seconds
        wanted = max(4, wanted - 1) if rng.random() < 0.3 else wanted
    # Evenly spread seconds always satisfy the gap (duration >= 16 > 4 * MIN_GAP_S).
    step = (duration - 1) / (wanted + 1)
    return [max(1, round(step * (i + 1))) for i in range(wanted)]


def _free_name(draft: _Draft, rng: random.Random, t: int, shape: str | None = None) -> tuple[str, str] | None:
    used, visible = draft.names_used(), draft.colours_visible(t)
    options = [(c, s) for c in COLOURS for s in (SHAPES if shape is None else (shape,))
               if (c, s) not in used and c not in visible]
    return rng.choice(options) if options else None


def _placement(draft: _Draft, rng: random.Random, size: str, t: int) -> tuple[float, float]:
    """A centre for a new object: clear of the quadrant lines (its location is named); half the time on the
    row or column of a visible object, so that moves which meet it are possible."""
    rx, ry = draft.half_extents(size)
    x = rng.uniform(rx + BORDER_MARGIN, 1 - rx - BORDER_MARGIN)
    y = rng.uniform(ry + BORDER_MARGIN, 1 - ry - BORDER_MARGIN)
    visible = draft.visible_at(t)
    if visible and rng.random() < 0.7:
        # On a visible object's row, far enough along it that a move at SPEED_PX can meet it in 2-4 s.
        ax, ay = draft.objects[rng.choice(visible)].centre(t)
        far = MEET_DISTANCE_PX / draft.width
        sides = [(rx + BORDER_MARGIN, ax - far), (ax + far, 1 - rx - BORDER_MARGIN)]
        sides = [(lo, hi) for lo, hi in sides if hi > lo]
        if sides:
            lo, hi = rng.choice(sides)
            x, y = rng.uniform(lo, hi), ay
    return x, y


def _clear_of_lines(x: float, y: float) -> bool:
    return all(abs(v - 0.5) >= CELL_MARGIN for v in (x, y))


def _add_object(draft: _Draft, rng: random.Random, second: int) -> bool:
    t = frame_of(second)
    if len(draft.visible_at(t)) >= MAX_VISIBLE:
        return False
    name = _free_name(draft, rng, t)
    if name is None:
        return False
    size = rng.choice(tuple(SIZES))
    for _ in range(MAX_TRIES):
        x, y = _placement(draft, rng, size, t)
        obj = TrackedObject(size, (Segment(t, (x, y), (0.0, 0.0), name[0], name[1], True),), draft.grid)
        if _clear_of_lines(*obj.centre(t)) and _far_from_all(draft, obj, t) and draft.fits(len(draft.objects), obj):
            draft.objects.append(obj)
            if second > 0:
                draft.events.append(TimedEvent(second, "appears", len(draft.objects) - 1))
            return True
    return False


def _far_from_all(draft: _Draft, obj: TrackedObject, t: int) -> bool:
    """Never within three meet distances of another visible object, from frame t on: a new object must not
    read as a meet, nor be where a planned stop will end."""
    return all(_gap_px(obj, other, u, draft.height, draft.width) > 3 * MEET_GAP_PX
               for u in range(t, draft.num_frames) if obj.visible(u)
               for other in draft.objects if other.visible(u))


def _sample_event(draft: _Draft, rng: random.Random, second: int, seconds: list[int]) -> bool:
    """One event at `second`: a kind drawn by `KIND_WEIGHTS`, tried on every idle object in random order;
    a kind that fits nothing is dropped and another drawn. False when nothing fits."""
    t = frame_of(second)
    kinds = dict(KIND_WEIGHTS)
    while kinds:
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        del kinds[kind]
        if kind == "appears":
            if _add_object(draft, rng, second):
                return True
            continue
        idle = [i for i in draft.visible_at(t) if i not in draft.reserved()]
        rng.shuffle(idle)
        for i in idle:
            if kind == "starts" and _start_move(draft, rng, i, second, seconds):
                return True
            if kind != "starts" and _instant(draft, rng, i, second, kind):
                return True
    return False


def _instant(draft: _Draft, rng: random.Random, i: int, second: int, kind: EventKind) -> bool:
    """Object i disappears, turns or becomes at `second`, if that fits."""
    t = frame_of(second)
    obj = draft.objects[i]
    colour, shape = obj.colour_at(t), obj.shape_at(t)
    if kind == "disappears":
        x, y = obj.centre(t)
        if not (LONG_INTERIOR <= x <= 1 - LONG_INTERIOR and LONG_INTERIOR <= y <= 1 - LONG_INTERIOR):
            return False
        _set(draft, i, Segment(t, obj.centre(t), (0.0, 0.0), colour, shape, False))
        draft.events.append(TimedEvent(second, "disappears", i))
        return True
    if kind == "turns":
        name = _free_name(draft, rng, t, shape)
        if name is None:
            return False
        colour, detail = name[0], name[0]
    else:
        shapes = [s for s in SHAPES if s != shape and (colour, s) not in draft.names_used()]
        if not shapes:
            return False
        shape = detail = rng.choice(shapes)
    seg = Segment(t, obj.centre(t), (0.0, 0.0), colour, shape, True)
    if not draft.fits(i, obj.with_segment(seg)):
        return False
    _set(draft, i, seg)
    draft.events.append(TimedEvent(second, kind, i, detail))
    return True


def _set(draft: _Draft, i: int, seg: Segment) -> None:
    draft.objects[i] = draft.objects[i].with_segment(seg)


def _start_move(draft: _Draft, rng: random.Random, i: int, second: int, seconds: list[int]) -> bool:
    """Plans a move of object i from `second` to a later free event second, ending in a stop, a meet or a
    leave: every (direction, end, ending) that fits is a candidate, one is drawn. Records the start event
    and the planned end."""
    reserved_ends = {sec for sec, _, _ in draft.pending.values()}
    ends = [s for s in seconds if second < s <= second + MOVE_SECONDS[1] and s not in reserved_ends]
    candidates = []
    for end in ends:
        for direction in DIRECTIONS:
            for ending in ("stops", "meets", "leaves"):
                for plan in _move_plans(draft, rng, i, second, end, direction, ending):
                    candidates.append((end, direction, ending, *plan))
    if not candidates:
        return False
    # Endings drawn evenly, then a plan of that ending: stops are the easiest to fit and would crowd out the rest.
    ending = rng.choice(sorted({c[2] for c in candidates}))
    end, direction, ending, other, planned = rng.choice([c for c in candidates if c[2] == ending])
    draft.objects[i] = planned
    draft.events.append(TimedEvent(second, "starts", i, direction))
    draft.pending[i] = (end, ending, other)
    return True


def _move_plans(draft: _Draft, rng: random.Random, i: int, second: int, end: int, direction: str,
                ending: EventKind) -> list[tuple[int | None, TrackedObject]]:
    """(the object met, the mover's planned timeline) for each way object i can move `direction` from
    `second` to `end` and end with `ending` (none, one, or one per object it could meet)."""
    obj = draft.objects[i]
    t0, t1 = frame_of(second), frame_of(end)
    x, y = obj.centre(t0)
    colour, shape = obj.colour_at(t0), obj.shape_at(t0)
    dx, dy = DIRECTIONS[direction]
    rx, ry = draft.half_extents(obj.size)
    axis_px = draft.width if dx else draft.height
    options: list[tuple[int | None, float]] = []  # (other, speed in pixels per frame)
    if ending == "leaves":
        gap = (x + rx if dx < 0 else 1 + rx - x) if dx else (y + ry if dy < 0 else 1 + ry - y)
        options.append((None, (gap + BORDER_MARGIN) * axis_px / (t1 - t0)))
    elif ending == "meets":
        for j in draft.visible_at(t1):
            if j == i or j in draft.reserved() or draft.objects[j].moving(t0) or draft.objects[j].moving(t1):
                continue
            ox, oy = draft.objects[j].centre(t1)
            along = (ox - x) * draft.width if dx else (oy - y) * draft.height
            across = abs(oy - y) * draft.height if dx else abs(ox - x) * draft.width
            if across < 1e-6 and along * (dx or dy) > 0:
                # Stop on the lattice cell nearest the other object that leaves a gap: both centres sit on
                # the lattice, so the travel is whole lattice steps and the gap is exact.
                reach = BOUNDING_FACTOR * (obj.radius + draft.objects[j].radius) * min(draft.height, draft.width)
                steps = math.ceil((reach + MEET_MIN_GAP_PX) / LATTICE)
                travel = abs(along) - steps * LATTICE
                options.append((j, travel / (t1 - t0)))
    else:
        options.append((None, rng.uniform(*SPEED_PX)))
    plans = []
    for other, speed_px in options:
        low, high = LEAVE_SPEED_PX if ending == "leaves" else SPEED_PX
        if not low <= speed_px <= high:
            continue
        velocity = (dx * speed_px / draft.width, dy * speed_px / draft.height)
        planned = obj.with_segment(Segment(t0, obj.centre(t0), velocity, colour, shape, True))
        if ending == "leaves":
            cx, cy = planned.centre(t1 - 1)
            if not (-rx < cx < 1 + rx and -ry < cy < 1 + ry):  # some of it shows until it is gone
                continue
            planned = planned.with_segment(Segment(t1, planned.centre(t1), (0.0, 0.0), colour, shape, False))
        else:
            planned = planned.with_segment(Segment(t1, planned.centre(t1), (0.0, 0.0), colour, shape, True))
        if not draft.fits(i, planned, leaving=ending == "leaves"):
            continue
        if ending == "meets":
            gap = _gap_px(planned, draft.objects[other], t1, draft.height, draft.width)
            if not MEET_MIN_GAP_PX - 1e-6 <= gap <= MEET_GAP_PX:
                continue
        if ending != "leaves":
            rest = [draft.objects[j] for j in draft.visible_at(t1) if j not in (i, other)]
            if any(_gap_px(planned, o, u, draft.height, draft.width) <= 3 * MEET_GAP_PX
                   for o in rest for u in range(t1, draft.num_frames) if o.visible(u) and planned.visible(u)):
                continue
        plans.append((other, planned))
    return plans


def _end_move(draft: _Draft, i: int, second: int) -> None:
    end, kind, other = draft.pending.pop(i)
    draft.events.append(TimedEvent(second, kind, i, other=other))

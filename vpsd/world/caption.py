"""Captions generated from a `Scene` with a small fixed grammar, plus the prompts that ask for them.

Contract:
- `caption(scene)` is a pure function of the scene: lowercase words separated by single spaces, each
  sentence ending with a period glued to its last word ("moves left."); 20-28 words (see scene.py).
- Grammar, in this order:
    intro:    "there are two objects on a textured grey background."
    initial:  "a large red circle moves left."          one per object seen in frame 0, left to right
    events:   "then a small blue square appears at the top left and stays still."
              "then the red circle disappears." / "then the red circle leaves the frame."
              "then the green triangle turns yellow."   in time order
- `VOCABULARY` lists every token `words(caption)` can yield (punctuation included), derived from the
  same tables the grammar uses, so a tokenizer trained on it never meets an unknown caption word.
- `PROMPTS` are the questions the model is trained to answer with the caption.
"""

from __future__ import annotations

from vpsd.world.scene import BACKGROUNDS, COLOURS, SHAPES, SIZES, Scene, SceneObject, half

PROMPTS = (
    "Describe the video.",
    "What happens in this video?",
    "Describe what happens in the video.",
    "Write a short caption for this video.",
)

NUMBERS = ("one", "two")
MOTION_PHRASES = {
    "left": "moves left",
    "right": "moves right",
    "up": "moves up",
    "down": "moves down",
    "still": "stays still",
}
# LOCATIONS[row half][column half]: quadrants, whose lines are video-token boundaries (vpsd.world.scene)
LOCATIONS = (
    ("at the top left", "at the top right"),
    ("at the bottom left", "at the bottom right"),
)
# Fixed words of the sentence templates below; keep in sync when a template changes.
TEMPLATE_WORDS = (
    "there is are object objects on a plain textured background "
    "then the and appears disappears leaves frame turns"
)


def caption(scene: Scene) -> str:
    objects = scene.objects
    count = len(objects)
    bg = scene.background
    noun = "object" if count == 1 else "objects"
    verb = "is" if count == 1 else "are"
    texture = "textured" if bg.textured else "plain"
    sentences = [f"there {verb} {NUMBERS[count - 1]} {noun} on a {texture} {bg.colour} background"]

    initial = sorted((o for o in objects if o.first_frame == 0), key=lambda o: o.centre(0))
    sentences += [f"{_indefinite(o)} {MOTION_PHRASES[o.motion]}" for o in initial]

    # Stable sort: simultaneous events keep scene order, so the caption is a function of the scene.
    for obj in sorted((o for o in objects if o.event), key=lambda o: o.event.frame):
        sentences.append("then " + _event_clause(obj))
    return " ".join(s + "." for s in sentences)


def location(x: float, y: float) -> str:
    return LOCATIONS[half(y)][half(x)]


def words(text: str) -> list[str]:
    """Split a caption into vocabulary tokens: words, with sentence-final periods as their own token."""
    out: list[str] = []
    for w in text.split():
        if w.endswith("."):
            out += [w[:-1], "."]
        else:
            out.append(w)
    return out


def _build_vocabulary() -> tuple[str, ...]:
    phrases = [
        TEMPLATE_WORDS,
        *NUMBERS,
        *BACKGROUNDS,
        *SIZES,
        *COLOURS,
        *SHAPES,
        *MOTION_PHRASES.values(),
        *(loc for row in LOCATIONS for loc in row),
    ]
    return tuple(sorted({w for p in phrases for w in p.split()} | {"."}))


VOCABULARY = _build_vocabulary()


def _indefinite(obj: SceneObject) -> str:
    return f"a {obj.size} {obj.colour} {obj.shape}"


def _definite(obj: SceneObject) -> str:
    # Colours are unique in a scene, so colour + shape always names one object.
    return f"the {obj.colour} {obj.shape}"


def _event_clause(obj: SceneObject) -> str:
    kind = obj.event.kind
    if kind == "appears":
        return f"{_indefinite(obj)} appears {location(*obj.centre(obj.first_frame))} and {MOTION_PHRASES[obj.motion]}"
    if kind == "disappears":
        return f"{_definite(obj)} disappears"
    if kind == "leaves":
        return f"{_definite(obj)} leaves the frame"
    return f"{_definite(obj)} turns {obj.event.new_colour}"

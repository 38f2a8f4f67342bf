"""What a long scene is asked and answered: dense time-stamped captions and questions about one moment.

Contract:
- `dense_caption(scene)` is a pure function of the scene: lowercase words separated by single spaces, each
  sentence ending with a period glued to its last word. Grammar, in this order:
      intro:   "there are two objects on a textured grey background."
      objects: "a large red circle is at the top left."          one per object seen at 0 s, left to right
      events:  "at 5 seconds the red circle starts moving right."  one per event, in time order:
               "... a small blue square appears at the bottom right." / "... the red circle disappears."
               "... the red circle stops." / "... the red circle meets the blue square."
               "... the red circle leaves the frame." / "... the red circle turns green."
               "... the red circle becomes a square."
  An object is named by its colour and shape at the moment of the sentence (unique, vpsd.world.long_scene).
- `question(scene, rng)` picks one question about a single moment and its short answer:
      "what happened at 12 seconds?"                      -> "the red circle turns green."
      "when did the red circle leave the frame?"          -> "at 25 seconds."
      "what colour was the square when the red circle left the frame?" -> "the square was blue."
  Only events a question names unambiguously are asked about (one such event of that object and kind; one
  visible object of that shape at that moment).
- `long_example_text(scene, seed)` is the prompt and answer of the example with that seed: a dense caption for
  three seeds in four, a question for the fourth, so every run of consecutive seeds mixes the two.
- `LONG_VOCABULARY` lists every word a caption, question or answer can hold.
"""

from __future__ import annotations

import random

from vpsd.world.caption import LOCATIONS, NUMBERS
from vpsd.world.long_scene import DURATION_S, LongScene, TimedEvent, TrackedObject, frame_of
from vpsd.world.scene import BACKGROUNDS, COLOURS, SHAPES, SIZES, half

DENSE_PROMPTS = (
    "List every event in the video and when it happened.",
    "Describe the video in detail, with the time of each event.",
    "What happens in this video, and when?",
    "Write a dense caption of the video with timestamps.",
)
QUESTION_KINDS = ("what", "when", "colour")
# Phrases of each event kind: the caption's present tense, the question's base form, and the past tense.
DIRECTION_WORDS = ("left", "right", "up", "down")
PRESENT = {"disappears": "disappears", "stops": "stops", "leaves": "leaves the frame"}
BASE = {"appears": "appear", "disappears": "disappear", "stops": "stop", "leaves": "leave the frame",
        "starts": "start moving", "meets": "meet", "turns": "turn", "becomes": "become"}
PAST = {"appears": "appeared", "disappears": "disappeared", "stops": "stopped", "leaves": "left the frame",
        "starts": "started moving", "meets": "met", "turns": "turned", "becomes": "became"}
NUMBER_WORDS = ("one", "two", "three", "four")
TEMPLATE_WORDS = (
    "there is are object objects on a plain textured background a the at top bottom left right seconds "
    "second starts moving meets turns becomes appears what happened when did colour was of in video"
)


def dense_caption(scene: LongScene) -> str:
    count = len([o for o in scene.objects if o.visible(0)])
    bg = scene.background
    noun, verb = ("object", "is") if count == 1 else ("objects", "are")
    texture = "textured" if bg.textured else "plain"
    sentences = [f"there {verb} {NUMBER_WORDS[count - 1]} {noun} on a {texture} {bg.colour} background"]
    initial = sorted((o for o in scene.objects if o.visible(0)), key=lambda o: o.centre(0))
    sentences += [f"{_indefinite(o, 0)} is {_location(o, 0)}" for o in initial]
    sentences += [f"at {seconds(e.second)} {event_clause(scene, e)}" for e in scene.events]
    return " ".join(s + "." for s in sentences)


def seconds(n: int) -> str:
    return f"{n} second" if n == 1 else f"{n} seconds"


def event_clause(scene: LongScene, event: TimedEvent) -> str:
    """What happened, in the caption's words, naming objects as they were just before the event."""
    obj = scene.objects[event.obj]
    t = frame_of(event.second)
    if event.kind == "appears":
        return f"{_indefinite(obj, t)} appears {_location(obj, t)}"
    before = max(0, t - 1)
    subject = _definite(obj, before)
    if event.kind == "starts":
        return f"{subject} starts moving {event.detail}"
    if event.kind == "meets":
        return f"{subject} meets {_definite(scene.objects[event.other], t)}"
    if event.kind == "turns":
        return f"{subject} turns {event.detail}"
    if event.kind == "becomes":
        return f"{subject} becomes a {event.detail}"
    return f"{subject} {PRESENT[event.kind]}"


def question(scene: LongScene, rng: random.Random) -> tuple[str, str]:
    """(question, answer) about one moment of the scene; see the module docstring."""
    events = [e for e in scene.events if _unambiguous(scene, e)]
    for kind in rng.sample(QUESTION_KINDS, len(QUESTION_KINDS)):
        rng.shuffle(events)
        for event in events:
            qa = _ask(scene, event, kind)
            if qa is not None:
                return qa
    # Every scene has events at distinct seconds, so "what happened at" always has an answer.
    event = scene.events[0]
    return f"what happened at {seconds(event.second)}?", event_clause(scene, event) + "."


def long_example_text(scene: LongScene, seed: int) -> tuple[str, str, str]:
    """(prompt, answer, kind) of the example with this seed: kind "caption" or "question"."""
    rng = random.Random(seed * 7919 + 17)
    if seed % 4 == 3:
        q, a = question(scene, rng)
        return q[0].upper() + q[1:], a, "question"
    return rng.choice(DENSE_PROMPTS), dense_caption(scene), "caption"


def _ask(scene: LongScene, event: TimedEvent, kind: str) -> tuple[str, str] | None:
    t = frame_of(event.second)
    if kind == "what":
        return f"what happened at {seconds(event.second)}?", event_clause(scene, event) + "."
    obj = scene.objects[event.obj]
    name = _definite(obj, t if event.kind == "appears" else max(0, t - 1))
    if kind == "when":
        return f"when did {name} {_base_phrase(scene, event)}?", f"at {seconds(event.second)}."
    # colour: of another object, named by its shape alone, the only visible one of that shape then
    moment = t if event.kind == "appears" else max(0, t - 1)
    for j, other in enumerate(scene.objects):
        if j in (event.obj, event.other) or not other.visible(moment):
            continue
        shape = other.shape_at(moment)
        same_shape = [o for o in scene.objects if o.visible(moment) and o.shape_at(moment) == shape]
        if len(same_shape) == 1 and obj.shape_at(moment) != shape:
            past = _past_phrase(scene, event)
            return (f"what colour was the {shape} when {name} {past}?",
                    f"the {shape} was {other.colour_at(moment)}.")
    return None


def _base_phrase(scene: LongScene, event: TimedEvent) -> str:
    return _phrase(scene, event, BASE[event.kind])


def _past_phrase(scene: LongScene, event: TimedEvent) -> str:
    return _phrase(scene, event, PAST[event.kind])


def _phrase(scene: LongScene, event: TimedEvent, verb: str) -> str:
    if event.kind == "starts":
        return f"{verb} {event.detail}"
    if event.kind == "meets":
        return f"{verb} {_definite(scene.objects[event.other], frame_of(event.second))}"
    if event.kind == "turns":
        return f"{verb} {event.detail}"
    if event.kind == "becomes":
        return f"{verb} a {event.detail}"
    return verb


def _unambiguous(scene: LongScene, event: TimedEvent) -> bool:
    """The only event of its kind for its object, so "when did the red circle stop?" has one answer."""
    return sum(e.obj == event.obj and e.kind == event.kind for e in scene.events) == 1


def _location(obj: TrackedObject, t: int) -> str:
    x, y = obj.centre(t)
    return LOCATIONS[half(y)][half(x)]


def _indefinite(obj: TrackedObject, t: int) -> str:
    return f"a {obj.size} {obj.colour_at(t)} {obj.shape_at(t)}"


def _definite(obj: TrackedObject, t: int) -> str:
    return f"the {obj.colour_at(t)} {obj.shape_at(t)}"


def _build_vocabulary() -> tuple[str, ...]:
    phrases = [
        TEMPLATE_WORDS, *NUMBERS, *NUMBER_WORDS, *BACKGROUNDS, *SIZES, *COLOURS, *SHAPES, *DIRECTION_WORDS,
        *PRESENT.values(), *BASE.values(), *PAST.values(),
        *(loc for row in LOCATIONS for loc in row),
        *(str(s) for s in range(DURATION_S[1])),
    ]
    words = {w for p in phrases for w in p.split()}
    return tuple(sorted(words | {".", "?"}))


LONG_VOCABULARY = _build_vocabulary()

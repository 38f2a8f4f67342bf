"""The `vpsd_world` task's document functions (lmms-eval imports them by name from vpsd_world.yaml).

A document is one line of examples/world/manifest.jsonl; its video path is relative to that manifest's folder.
Scores: `scene_correct`, the first sentence of the answer equals the reference's (the scene: how many objects
on which background), and `caption_exact`, the whole caption does; both ignore case and spacing.
"""

from __future__ import annotations

from pathlib import Path

WORLD = Path(__file__).resolve().parents[1] / "world"


def doc_to_visual(doc: dict) -> list[str]:
    return [str(WORLD / doc["video"])]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    return doc["prompt"]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _first_sentence(text: str) -> str:
    return _norm(text).split(".")[0]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    answer = results[0]
    return {"scene_correct": float(_first_sentence(answer) == _first_sentence(doc["reference"])),
            "caption_exact": float(_norm(answer) == _norm(doc["reference"]))}

"""Decoding methods: each name is a preset of a decoding mode and a pruning strategy.

`ar` and `sd` are the serial references; the parallel methods run draft and target on separate ranks.
A method fixes the mode; the strategy it names is its default and `--pruning` may override it (that is
how baselines and ablations run through the same pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    parallel: bool  # draft and target on separate ranks, overlapping
    uses_draft: bool
    default_strategy: str  # pruning strategy when the run does not name one
    default_ratio: float | None = None  # None: the config's ratio


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("ar", parallel=False, uses_draft=False, default_strategy="none", default_ratio=0.0),
        Method("sd", parallel=False, uses_draft=True, default_strategy="none", default_ratio=0.0),
        Method("pearl", parallel=True, uses_draft=True, default_strategy="none", default_ratio=0.0),
        Method("specvlm", parallel=False, uses_draft=True, default_strategy="specvlm"),
        Method("parallelvlm", parallel=True, uses_draft=True, default_strategy="uv"),
        Method("hippo", parallel=True, uses_draft=True, default_strategy="hippo"),
    ]
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]

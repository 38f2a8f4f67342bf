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
    # How the draft sees the video: "pruned_input" (a draft model, or the target with `draft: self`, prefilled
    # with the kept video tokens), "sparse_kv" (the target's own weights on a per-head top-K subset of its
    # prefill KV cache, Sparse-to-Dense), "views" (TABED: several drafting views of the draft model, ensembled).
    draft: str = "pruned_input"

    @property
    def loads_draft_model(self) -> bool:
        """Whether the run loads the config's draft model (sparse_kv drafts with the target's weights)."""
        return self.uses_draft and self.draft != "sparse_kv"


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("ar", parallel=False, uses_draft=False, default_strategy="none", default_ratio=0.0),
        Method("sd", parallel=False, uses_draft=True, default_strategy="none", default_ratio=0.0),
        Method("pearl", parallel=True, uses_draft=True, default_strategy="none", default_ratio=0.0),
        Method("specvlm", parallel=False, uses_draft=True, default_strategy="specvlm"),
        Method("parallelvlm", parallel=True, uses_draft=True, default_strategy="uv"),
        Method("hippo", parallel=True, uses_draft=True, default_strategy="hippo"),
        # STD reads only the ratio (K per KV head); it prunes no input, so its strategy is "none".
        Method("std", parallel=False, uses_draft=True, default_strategy="none", draft="sparse_kv"),
        # TABED's multimodal view sees the video pruned by `uniform` (no target signals: its prefill
        # overlaps the target's); `--pruning` picks another strategy for that view.
        Method("tabed", parallel=True, uses_draft=True, default_strategy="uniform", draft="views"),
    ]
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]

"""Decoding methods: each name is a preset of a decoding mode and a pruning strategy.

`ar` and `sd` are the serial references; the parallel methods run draft and target on separate ranks.
A method fixes the mode; the strategy it names is its default and `--pruning` may override it (that is
how baselines and ablations run through the same pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from vpsd.pipeline.tree import DraftTree, parse_tree


class DraftPlace(str, Enum):
    """Where a method's draft runs (`Method.draft_place` says which, the one place that decides it)."""

    NONE = "none"  # `ar`: the engine alone
    REMOTE = "remote"  # its own rank beside the target, with the pruner's (engine/drafters/remote.py)
    THREADS = "threads"  # the same draft and pruner roles on threads of the target's process (launch/in_process.py)
    LOCAL = "local"  # in the target's process, taking turns with it (engine/drafters/local.py and its kin)


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
    # The static tree the method drafts and verifies each round (pipeline/tree.py; `decoding.tree` overrides
    # it, "chain" turning it off); None: a chain of gamma tokens, whatever `decoding.tree` says.
    tree: str | None = None

    @property
    def loads_draft_model(self) -> bool:
        """Whether the run loads the config's draft model (sparse_kv drafts with the target's weights)."""
        return self.uses_draft and self.draft != "sparse_kv"

    def draft_place(self, batch: int, pipelined: bool = False, draft_on: str = "rank") -> DraftPlace:
        """Where this method's draft runs at `--batch batch` (the one place that decides it):
        NONE         `ar`;
        REMOTE       a parallel method at batch 1, or over a batch when it is pipelined (`batching.pipelined`);
        THREADS      where it would be REMOTE but the run says `draft_on: thread`;
        LOCAL        a serial method (a chain, engine/drafters/local.py; a tree, engine/drafters/tree.py;
                     Sparse-to-Dense's sparse KV, engine/drafters/sparse_kv.py), or a parallel one over a batch
                     that is not pipelined;
        raises ValueError where the method cannot run at that batch."""
        if not self.uses_draft:
            return DraftPlace.NONE
        if self.parallel and (batch == 1 or pipelined):
            return DraftPlace.THREADS if draft_on == "thread" else DraftPlace.REMOTE
        if self.draft != "views":
            return DraftPlace.LOCAL
        raise ValueError(f"it drafts with TABED's views, which batch only beside the target: --batch {batch} needs "
                         f"batching.pipelined=true")

    def draft_tree(self, setting: Any = None) -> DraftTree | None:
        """The tree this method drafts under the `decoding.tree` setting (None: it drafts a chain)."""
        if self.tree is None:
            return None
        return parse_tree(self.tree if setting is None else setting)


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("ar", parallel=False, uses_draft=False, default_strategy="none", default_ratio=0.0),
        Method("sd", parallel=False, uses_draft=True, default_strategy="none", default_ratio=0.0),
        # HIPPO's SD-tree baseline (and SpecVLM Table 1's): serial SD drafting EAGLE's static tree, no pruning.
        Method("sd-tree", parallel=False, uses_draft=True, default_strategy="none", default_ratio=0.0, tree="eagle"),
        Method("pearl", parallel=True, uses_draft=True, default_strategy="none", default_ratio=0.0),
        # As the paper runs it: two-stage pruning and the EAGLE tree (App. B); `decoding.tree: chain` is
        # its Table 4 "SpecVLM-Chain".
        Method("specvlm", parallel=False, uses_draft=True, default_strategy="specvlm", tree="eagle"),
        Method("parallelvlm", parallel=True, uses_draft=True, default_strategy="uv"),
        Method("hippo", parallel=True, uses_draft=True, default_strategy="hippo"),
        # STD reads only the ratio (K per KV head); it prunes no input, so its strategy is "none".
        Method("std", parallel=False, uses_draft=True, default_strategy="none", draft="sparse_kv"),
        # TABED's multimodal view sees the video pruned by `uniform` (no target signals: its prefill
        # overlaps the target's); `--pruning` picks another strategy for that view.
        Method("tabed", parallel=True, uses_draft=True, default_strategy="uniform", draft="views"),
    ]
}


# Methods that run at any --batch in turns with the target (tabed: pipelined only); methods that draft a chain.
BATCHABLE = tuple(name for name, m in METHODS.items() if m.draft != "views")
CHAINS = tuple(name for name, m in METHODS.items() if not m.uses_draft or (m.tree is None and m.draft == "pruned_input"))


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]

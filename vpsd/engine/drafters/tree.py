"""A draft tree in the target's process (`sd-tree`, and `specvlm` as SpecVLM runs it): every request in flight
drafts a static tree a round, all of them in one batched forward per depth.

A round (SpecVLM Sec. "Seamless Tree Attention Integration", Appendix B; EAGLE's static tree), per request:
  1. its draft row is brought in line with what it committed (`CacheCursor.sync`), then ONE forward feeds every
     row its pending committed tokens (the last is the root) and scores each root's candidates;
  2. the tree grows one depth per forward: each row feeds the nodes of that depth that have children, all at
     once, at rotary position root + depth under the tree mask (a node sees the prefix and its ancestors,
     `DraftTree.draft_visibility`), so a tree of depth D costs D draft forwards for the whole batch, as a chain
     of D tokens does;
  3. the engine verifies every row's tree in its round's one target forward (`Proposal.tree`, a tree mask per
     row) and commits the longest accepted path plus the target's own token (pipeline/tree.py);
  4. the verdict's path is kept in the draft row too (`BatchedCache.keep`): the accepted nodes it was fed (the
     path's internal nodes) stay, the rest are dropped, and the next round feeds what the row still lacks.

Each request's candidates are drawn by its own sampler, seeded as its batch-1 run seeds it (pipeline/seeds.py),
in the order that run draws them, so a sampled item's tokens never depend on the batch. With one request in flight
every forward is the batch-1 forward (models/batch.py), so at --batch 1 this is the reference tree decoder
(decoders/tree_sd.py), forward for forward.

The window: the engine asks for a tree where the serial window drafts (gamma > 0), a plain round where it does
not; the tree's shape is the config's (never past a request's max_new_tokens: `DraftTree.truncated`). Departure
from the papers: they draft a tree every round at batch 1 only; over a batch the serial window's goodput rule
(pipeline/cost.py) decides, with the tree's depth as its window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vpsd.config import DecodingConfig, PruningConfig
from vpsd.engine.drafters.protocol import DraftedTree, Proposal
from vpsd.engine.drafters.chain import feed_missing
from vpsd.engine.drafters.local import LocalDrafter, record_draft_steps
from vpsd.engine.request import Request
from vpsd.models.base import VideoLMAdapter
from vpsd.models.batch import TreeFeed
from vpsd.pipeline.messages import VerifyResult
from vpsd.pipeline.tree import DraftTree, propose_level
from vpsd.tracing import span


@dataclass
class _Growing:
    """One request's tree while it is drafted: the DraftedTree the engine verifies, and what the draft row holds."""

    drafted: DraftedTree
    root_index: int  # the root's index in the row's chain sequence
    pos: int  # the output position of the root's successor (its request's committed length)
    live: bool = True  # it has nodes still to expand
    fed: list[int] = field(default_factory=list)  # nodes whose entries follow the root in the draft row, in order
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # expanded node -> (V,) draft logits


class TreeDrafter(LocalDrafter):
    def __init__(self, target: VideoLMAdapter, draft: VideoLMAdapter, decoding: DecodingConfig,
                 pruning: PruningConfig, tree: DraftTree) -> None:
        super().__init__(target, draft, decoding, pruning)
        self.tree = tree
        self.grown: dict[str, _Growing] = {}  # request id -> its tree, until the verdict

    def proposals(self, requests: list[Request], gamma: int) -> dict[str, Proposal]:
        trees = {r.id: self.tree.truncated(r.max_new_tokens - len(r.committed) - 1) for r in requests}
        active = {r.id: r for r in requests if trees[r.id] is not None}  # one token left: a plain step
        if gamma == 0 or not active:
            return {}
        self.grown = {}  # every tree of the last round was verified (or its request left)
        with span("draft", items=list(active), gamma=self.tree.depth):
            watches = [w for w in [self._roots(active, trees)] if w is not None]
            for depth in range(1, self.tree.depth + 1):
                feeds, shapes = self._expand(depth)
                if not feeds:
                    break
                logits, watch = self.proposer.feed_tree(feeds, shapes)
                watches.append(watch)
                for item, rows in logits.items():
                    grown = self.grown[item]
                    new = grown.fed[len(grown.fed) - len(feeds[item]):]
                    grown.logits.update(zip(new, rows))
        self._step = record_draft_steps(watches, list(active)) if watches else None
        return {item: Proposal(self.grown[item].drafted.tokens[1:], None, len(r.committed), self.tree.depth,
                               tree=self.grown[item].drafted) for item, r in active.items()}

    def _roots(self, active: dict[str, Request], trees: dict[str, DraftTree | None]):
        """Every row in line with its committed tokens, in one forward whose last row scores its root."""
        # (the rollback also drops what is left of an unverified tree)
        watch = feed_missing(self.proposer, self.cursors, {item: r.committed for item, r in active.items()})
        for item, r in active.items():
            tree = trees[item]
            grown = _Growing(DraftedTree(tree, [r.committed[-1]] + [0] * tree.num_nodes),
                             root_index=self.cursors[item].length - 1, pos=len(r.committed))
            grown.logits[0] = self.proposer.last[item]
            self.grown[item] = grown
        return watch

    def _expand(self, depth: int) -> tuple[dict[str, list[int]], dict[str, TreeFeed]]:
        """Each live tree's candidates for the nodes at depth - 1, and the nodes at `depth` that have children,
        to feed (a tree with none left is done)."""
        feeds, shapes = {}, {}
        for item, grown in self.grown.items():
            if not grown.live:
                continue
            tree, out = grown.drafted.tree, grown.drafted
            new = propose_level(tree, depth, grown.logits, out.tokens, out.probs, self.samplers[item], grown.pos)
            if not new:
                grown.live = False
                continue
            shapes[item] = TreeFeed(torch.tensor([grown.root_index + depth] * len(new)),
                                    tree.draft_visibility(grown.fed, new))
            feeds[item] = [out.tokens[n] for n in new]
            grown.fed += new
        return feeds, shapes

    def verified(self, request: Request, verdict: VerifyResult, target_rows: torch.Tensor) -> None:
        """The accepted path's nodes the row was fed stay in it (a prefix of the path), the rest go."""
        grown = self.grown.pop(request.id)
        tree, tokens = grown.drafted.tree, grown.drafted.tokens
        path, node = [], 0
        for token in request.committed[verdict.start : verdict.start + verdict.num_accepted]:
            node = next(c for c in tree.children[node] if tokens[c] == token)  # siblings' tokens are distinct
            path.append(node)
        kept = [n for n in path if n in grown.fed]
        cursor = self.cursors[request.id]
        self.proposer.keep(request.id, cursor.length, [grown.fed.index(n) for n in kept])
        cursor.feed([tokens[n] for n in kept])

    def finish(self, request: Request, error: str | None) -> None:
        self.grown.pop(request.id, None)
        super().finish(request, error)

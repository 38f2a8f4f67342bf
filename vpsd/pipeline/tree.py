"""Static draft trees and their lossless verification (pure: no model, no I/O).

A tree is a set of node paths, as in EAGLE's and SpecVLM's `tree_choices` (SpecVLM Sec. "Seamless Tree
Attention Integration", Appendix B, Fig. 9): the path (0, 2) is the third candidate (rank 2) under the
first candidate of the root. Node 0 is the root, the last committed token, whose successor the first
candidates propose; nodes 1..N follow in breadth-first order. A node at depth d sits at sequence position
root + d, so every node gets exactly the rotary position it would have in a plain chain (all three M-RoPE
rows advance together, as a chain's decoded tokens do) and attends to the committed prefix and its own
ancestors only.

Candidates: greedy drafting takes a node's top-k draft tokens (k = its number of children); sampling draws
them from the draft's q WITHOUT replacement, in order, and verification then applies recursive rejection
over the siblings (SpecInfer, Miao et al. 2024, Sec. 4.2 multi-step speculative sampling; the
without-replacement form of Jeon et al. 2024, "Recursive Speculative Decoding"):

    p <- target distribution at the node, q <- the draft's distribution the candidates were drawn from
    for candidate x_i in rank order:
        accept x_i with probability min(1, p(x_i) / q(x_i))        -> descend into x_i
        else: p <- norm(max(p - q, 0)); q <- norm(q with x_i removed)
    nobody accepted: emit a token drawn from p (the last residual)
    a leaf was accepted: emit a bonus token drawn from the target's distribution at that leaf

Why it keeps the target's law: each sibling step is one speculative sampling step (Leviathan et al., 2023)
with proposal q_i = q minus the earlier candidates and target p_i, so conditioned on the history the step
outputs a token distributed as p_i, either the accepted x_i or, on rejection, a draw from
r_i = norm(max(p_i - q_i, 0)). Replacing that draw by the next step (target r_i, proposal q_{i+1}, which
depends on the history only through the removed tokens, and r_i gives those tokens zero mass since each was
rejected only where p_i(x_i) < q_i(x_i)) keeps the law by induction; the last residual is sampled directly.
Greedy is the temperature-0 case (p one-hot): a candidate is accepted iff it is the target's argmax. The
position-keyed rule (pipeline/sampling.py, the default when sampling) is that greedy rule on keyed scores: a
node's candidates are the draft's k best keyed scores at its position (Gumbel-top-k: k draws without
replacement, the first the draft's own keyed sample), and a candidate is accepted iff it is the target's keyed
sample at that position, so the accepted path and the round's token are what `ar` samples there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from vpsd.pipeline.sampling import ItemSampler, on_generator
from vpsd.pipeline.verification import residual

Path = tuple[int, ...]

# EAGLE's static tree (`mc_sim_7b_63` in EAGLE's model/choices.py), which SpecVLM adopts unchanged
# (its tree_choices/choices.py; Appendix B, Fig. 9): 25 candidates, depth 5, wider where the draft is surer.
EAGLE_TREE: tuple[Path, ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip

NAMED_TREES = {"eagle": EAGLE_TREE}


@dataclass(frozen=True)
class DraftTree:
    """A static tree: `paths[i - 1]` is node i's path of child ranks from the root (breadth-first order)."""

    paths: tuple[Path, ...]

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a draft tree needs at least one node")
        if list(self.paths) != sorted(self.paths, key=lambda p: (len(p), p)):
            raise ValueError("tree paths must be in breadth-first order (use DraftTree.from_paths)")
        known = set(self.paths)
        if len(known) != len(self.paths):
            raise ValueError("tree paths repeat a node")
        for p in self.paths:
            if not p or any(r < 0 for r in p):
                raise ValueError(f"tree path {list(p)} must be a non-empty list of ranks >= 0")
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])}")
            # Ranks are the top-k order of one node's candidates: rank r needs ranks 0..r-1 beside it.
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known:
                raise ValueError(f"tree path {list(p)} skips rank {p[-1] - 1} among its siblings")

    @classmethod
    def from_paths(cls, paths) -> "DraftTree":
        return cls(tuple(sorted((tuple(int(r) for r in p) for p in paths), key=lambda p: (len(p), p))))

    @classmethod
    def from_branching(cls, factors: list[int]) -> "DraftTree":
        """The full tree where every node at depth d has factors[d] children: [4, 2, 1] is 4 + 8 + 8 nodes."""
        if not factors or any(int(f) < 1 for f in factors):
            raise ValueError(f"branching factors must be >= 1, got {list(factors)}")
        level: list[Path] = [()]
        paths: list[Path] = []
        for f in factors:
            level = [p + (r,) for p in level for r in range(int(f))]
            paths += level
        return cls.from_paths(paths)

    @classmethod
    def chain(cls, depth: int) -> "DraftTree":
        return cls.from_branching([1] * depth)

    # ---- structure (node 0 is the root) ----------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Candidates, the root excluded."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @functools.cached_property
    def parents(self) -> list[int]:
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [-1] + [index.get(p[:-1], 0) for p in self.paths]

    @functools.cached_property
    def depths(self) -> list[int]:
        return [0] + [len(p) for p in self.paths]

    @functools.cached_property
    def children(self) -> list[list[int]]:
        """Each node's children in rank order (the order verification tries them)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.paths, start=1):
            out[self.parents[i]].append(i)
        for kids in out:
            kids.sort(key=lambda c: self.paths[c - 1][-1])
        return out

    def level(self, depth: int) -> list[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]

    @functools.cached_property
    def ancestry(self) -> torch.Tensor:
        """(N+1, N+1) bool: [i, j] is True when node j is node i or one of its ancestors (the root included)."""
        n = self.num_nodes + 1
        out = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                out[i, j] = True
                j = self.parents[j]
        return out

    def truncated(self, depth: int) -> "DraftTree | None":
        """The nodes down to `depth` (None when that leaves none): the last rounds draft no past max_new_tokens."""
        if depth >= self.depth:
            return self
        kept = tuple(p for p in self.paths if len(p) <= depth)
        return DraftTree(kept) if kept else None

    # ---- what the target's one verify forward feeds ------------------------------------------------

    def verify_inputs(self, num_pending: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence offsets and visibility of the tokens a verify forward feeds after the target's cache.

        The forward feeds the committed tokens the cache lacks (`num_pending` >= 1, the last is the root),
        then nodes 1..N. Returns offsets (P + N,) from the first fed token's sequence index (pending j: j;
        node i: P - 1 + depth_i) and visible (P + N, P + N) bool among the fed tokens: pending tokens are
        causal, a node sees every pending token and its own ancestors and itself (the cache before them is
        visible to all).
        """
        if num_pending < 1:
            raise ValueError("a verify forward feeds at least the root (the last committed token)")
        p, n = num_pending, self.num_nodes
        depths = torch.tensor(self.depths[1:], dtype=torch.long)
        offsets = torch.cat([torch.arange(p), p - 1 + depths])
        visible = torch.zeros(p + n, p + n, dtype=torch.bool)
        visible[:p, :p] = torch.tril(torch.ones(p, p, dtype=torch.bool))
        visible[p:, :p] = True
        visible[p:, p:] = self.ancestry[1:, 1:]
        return offsets, visible

    def draft_visibility(self, cached: list[int], new: list[int]) -> torch.Tensor:
        """(len(new), len(cached) + len(new)) bool: which of the tree nodes already in the draft's cache
        (`cached`, in cache order) and of the nodes fed now each new node attends to."""
        cols = torch.tensor(cached + new, dtype=torch.long)
        return self.ancestry[torch.tensor(new, dtype=torch.long)][:, cols]


def parse_tree(spec: Any) -> DraftTree | None:
    """A tree setting: None or "chain" (no tree: chain drafting), a name ("eagle"), a list of per-depth
    branching factors ([4, 2, 2, 1]) or a list of node paths ([[0], [1], [0, 0]])."""
    if spec is None or spec == "chain":
        return None
    if isinstance(spec, str):
        if spec not in NAMED_TREES:
            raise ValueError(f"unknown tree {spec!r}; known: chain, {', '.join(sorted(NAMED_TREES))}, or a list")
        return DraftTree.from_paths(NAMED_TREES[spec])
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(f, int) for f in spec):
        return DraftTree.from_branching(list(spec))
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(p, (list, tuple)) for p in spec):
        if not all(isinstance(r, int) for p in spec for r in p):
            raise ValueError(f"tree paths must be lists of integer ranks, got {spec!r}")
        return DraftTree.from_paths(spec)
    raise ValueError(f"a tree is chain, a name, branching factors [4, 2, 1] or paths [[0], [0, 0]], got {spec!r}")


# ---- drafting a node's candidates ------------------------------------------------------------------


def propose_level(tree: DraftTree, depth: int, logits: dict[int, torch.Tensor], tokens: list[int],
                  probs: dict[int, torch.Tensor], sampler: ItemSampler, root_pos: int) -> list[int]:
    """One depth of a tree's drafting: the candidates of every node at depth - 1 that has children, from its draft
    `logits` row (`ItemSampler.children`: at output position root_pos + depth - 1, `root_pos` the first drafted
    token's), written into `tokens` (and the q drawn from into `probs`, under the rejection rule), in
    breadth-first order. Returns the nodes at `depth` to feed next, those with children (a leaf is never fed:
    nothing expands it)."""
    for parent in tree.level(depth - 1):
        kids = tree.children[parent]
        if kids:
            chosen, q = sampler.children(logits[parent], len(kids), root_pos + depth - 1)
            for c, x in zip(kids, chosen):
                tokens[c] = x
            if q is not None:
                probs[parent] = q
    return [n for n in tree.level(depth) if tree.children[n]]


# ---- verification ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeVerification:
    path: list[int]  # accepted nodes, root to deepest, node 0 excluded
    next_token: int  # recovered token (all candidates of the last node rejected) or bonus token (a leaf)
    num_drafted: int  # the tree's depth: the most candidates one round can accept

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def emitted(self, node_tokens: list[int]) -> list[int]:
        """Tokens the round commits: the accepted path's tokens, then the recovered or bonus token."""
        return [node_tokens[i] for i in self.path] + [self.next_token]


def verify_tree_greedy(tree: DraftTree, node_tokens: list[int], target_logits: torch.Tensor) -> TreeVerification:
    """node_tokens (N+1,) with node 0 the root; target_logits (N+1, V): row i scores node i's successor.

    From the root, descend into the child holding the target's argmax while there is one; the argmax where
    none does (or at a leaf) is the round's own token."""
    if target_logits.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"need {tree.num_nodes + 1} target rows, got {target_logits.shape[0]}")
    best = target_logits.argmax(-1).tolist()
    node, path = 0, []
    while True:
        nxt = next((c for c in tree.children[node] if node_tokens[c] == best[node]), None)
        if nxt is None:
            return TreeVerification(path, int(best[node]), tree.depth)
        path.append(nxt)
        node = nxt


def verify_tree_sampling(
    tree: DraftTree,
    node_tokens: list[int],
    draft_probs: dict[int, torch.Tensor],  # node -> (V,) q its candidates were drawn from (nodes with children)
    target_probs: torch.Tensor,  # (N+1, V) p: row i is the target's distribution for node i's successor
    generator: torch.Generator | None,
) -> TreeVerification:
    """Recursive rejection over siblings (module docstring); the emitted tokens follow the target's law."""
    if target_probs.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"need {tree.num_nodes + 1} target rows, got {target_probs.shape[0]}")
    target_probs = on_generator(target_probs, generator)  # the draws run on the host (pipeline/sampling.py)
    draft_probs = {node: on_generator(q, generator) for node, q in draft_probs.items()}
    node, path = 0, []
    while True:
        p = target_probs[node]
        kids = tree.children[node]
        if not kids:
            return TreeVerification(path, int(torch.multinomial(p, 1, generator=generator)), tree.depth)
        q = draft_probs[node].clone()
        accepted = None
        for c in kids:
            x = node_tokens[c]
            r = float(torch.rand((), generator=generator))
            # r < p/q, written without the division so q(x) == 0 is safe.
            if r * float(q[x]) < float(p[x]):
                accepted = c
                break
            p = residual(p, q)
            q[x] = 0.0
            total = float(q.sum())
            q = q / total if total > 0 else q
        if accepted is None:
            return TreeVerification(path, int(torch.multinomial(p, 1, generator=generator)), tree.depth)
        path.append(accepted)
        node = accepted


def verify_tree(
    tree: DraftTree,
    node_tokens: list[int],
    draft_probs: dict[int, torch.Tensor] | None,
    target_logits: torch.Tensor,  # (N+1, V)
    sampler: ItemSampler,  # the item's target side
    root_pos: int,  # the output position of the root's successor (the first drafted token)
) -> TreeVerification:
    """The one entry point decoders use: the greedy rule on the rows' keyed scores (greedy, or position-keyed
    sampling: row i at position root_pos + depth_i), else recursive rejection."""
    if sampler.rule.keyed:
        positions = [root_pos + d for d in tree.depths]
        return verify_tree_greedy(tree, node_tokens, sampler.scores(target_logits, positions))
    return verify_tree_sampling(tree, node_tokens, draft_probs, sampler.rule.probs(target_logits), sampler.gen)

"""How often a draft agrees with the target, from one teacher-forced pass (pure: no model, no clock).

The reference is the target's own output (`ar`'s tokens: greedy, or its position-keyed samples). The draft, shown
the reference's prefix, ranks its candidates for the next position (measure.py); under greedy or keyed drafting a
draft token is accepted iff it is the reference token, and the draft's next proposal is made on exactly that prefix
again, so the rounds a serial run would make follow from the ranks alone, for any window:

- a chain of gamma tokens from position p accepts the run of rank-0 positions from p, at most gamma, and commits one
  token more (the target's), as decoders/sd.py does, the window shortened before max_new_tokens;
- a static tree (pipeline/tree.py) descends from the root while the reference token at the next depth is among the
  node's children (its rank is a child's rank), then commits one token more;
- TABED's views (pipeline/ensemble.py) propose from the ensemble whose weights the verified positions chose at
  the start of each block, as the drafter does (AdaptiveWeights, grid policy): each weight candidate's hit at each
  position and each view's probability of the reference token are enough.

What the rounds give: MAT (tokens committed per round) and tau_hat = A / (A + R) (pipeline/theory.py), the
quantities App. C predicts with. A parallel pipeline's rounds differ (windows drafted ahead, conservative rounds
after a rejection); its prediction takes this tau_hat into Theorem 6, as `vpsd bench methods` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vpsd.pipeline.tree import DraftTree


@dataclass(frozen=True)
class Rounds:
    rounds: int  # verify rounds (plain last steps included)
    committed: int  # tokens the rounds committed
    drafted: int  # draft tokens proposed
    accepted: int  # of them accepted (tau_hat's A)
    rejections: int  # rounds that ended in a rejection (tau_hat's R)
    draft_steps: int = 0  # draft forwards (a chain: its window; a tree: its depth)

    @property
    def mat(self) -> float:
        return self.committed / self.rounds if self.rounds else 1.0

    @property
    def tau(self) -> float:
        return self.accepted / (self.accepted + self.rejections) if self.accepted + self.rejections else 0.0

    def __add__(self, other: "Rounds") -> "Rounds":
        return Rounds(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, ...]:
        return (self.rounds, self.committed, self.drafted, self.accepted, self.rejections, self.draft_steps)


NONE = Rounds(0, 0, 0, 0, 0, 0)


def _window(gamma: int, p: int, max_new: int) -> int:
    """The window a serial round at output position p drafts (decoders/sd.py: never past max_new_tokens)."""
    return max(0, min(gamma, max_new - p - 1))


def chain_rounds(ranks: list[int], length: int, max_new: int, gamma: int) -> Rounds:
    """A chain of `gamma` draft tokens a round over one item: ranks[j] is the draft's rank of the reference token at
    output position j + 1, `length` the reference's tokens (the first from the target's prefill)."""
    p, out = 1, [0, 0, 0, 0, 0, 0]
    while p < length:
        k = _window(gamma, p, max_new)
        a = 0
        while a < k and p + a < length and ranks[p + a - 1] == 0:
            a += 1
        out = [out[0] + 1, out[1] + min(a + 1, length - p), out[2] + k, out[3] + a, out[4] + (a < k), out[5] + k]
        p += a + 1
    return Rounds(*out)


def tree_rounds(ranks: list[int], length: int, max_new: int, tree: DraftTree) -> Rounds:
    """A static tree a round (its depth capped before max_new_tokens, as `DraftTree.truncated`)."""
    p, out = 1, [0, 0, 0, 0, 0, 0]
    while p < length:
        depth = _window(tree.depth, p, max_new)
        node, d = 0, 0
        while d < depth and p + d < length:
            kids = [c for c in tree.children[node] if tree.depths[c] <= depth]
            r = ranks[p + d - 1]
            if r >= len(kids):
                break
            node, d = kids[r], d + 1
        out = [out[0] + 1, out[1] + min(d + 1, length - p), out[2] + depth, out[3] + d, out[4] + (d < depth),
               out[5] + depth]
        p += d + 1
    return Rounds(*out)


def views_rounds(view_q: list[list[float]], hits: list[list[bool]], grid: list[list[float]], length: int,
                 max_new: int, gamma: int, distance: str = "kl", window: int | None = None) -> Rounds:
    """TABED's chain over one item: view_q[j][i] is view i's probability of the reference token at position j + 1,
    hits[j][c] whether weight candidate c's ensemble proposes it there; `grid` the candidates' weights (their order).
    Each block takes the candidate of least distance over the last `window` verified positions (ties: nearest to
    uniform, then the first), as AdaptiveWeights.weights does."""
    m = len(grid[0]) if grid else 1
    uniform = [1.0 / m] * m
    spread = [sum((w - u) ** 2 for w, u in zip(ws, uniform)) for ws in grid]
    verified: list[list[float]] = []
    p, out = 1, [0, 0, 0, 0, 0, 0]
    while p < length:
        errors = [sum(row[c] for row in (verified[-window:] if window else verified)) for c in range(len(grid))]
        best = min(range(len(grid)), key=lambda c: (errors[c], spread[c], c)) if verified else _nearest(spread)
        k = _window(gamma, p, max_new)
        a = 0
        while a < k and p + a < length and hits[p + a - 1][best]:
            a += 1
        for j in range(p, min(p + a + 1, length)):  # the accepted positions and the one the target decided
            verified.append([_distance(view_q[j - 1], ws, hits[j - 1][c], distance) for c, ws in enumerate(grid)])
        out = [out[0] + 1, out[1] + min(a + 1, length - p), out[2] + k, out[3] + a, out[4] + (a < k), out[5] + k]
        p += a + 1
    return Rounds(*out)


def _nearest(spread: list[float]) -> int:
    return min(range(len(spread)), key=lambda c: (spread[c], c))


def _distance(q: list[float], weights: list[float], hit: bool, kind: str) -> float:
    """D(p, q^j) with p one-hot on the reference token (ensemble.py): KL = -log q^j(y), TVD = 1 - q^j(y)."""
    qy = sum(w * v for w, v in zip(weights, q))
    if kind == "kl":
        return -math.log(max(qy, 1.1754943508222875e-38))
    if kind == "tvd":
        return 1.0 - qy
    return 0.0 if hit else 1.0

"""TABED (Algorithm 1): weighted-average ensembles of drafting views, weights adapted from verified tokens.

m drafting views of one draft model give distributions q^(1..m) at every position. The draft proposes
from q = sum_i w_i q^(i) (W-AVG, line 6). At the start of each drafting block it picks w* among the
candidates W_t of a weight sampling policy S_W (line 2) by the accumulated distance over the last h
verified positions t' (line 3):

    w* = argmin_j  sum_{t'} D(p_t', q_t'^j),   q_t'^j = sum_i w^j_i q_t'^(i)

D is the KL divergence D_KL(p || q^j) (Sec. 5.1, the paper's choice), the total variation distance
(1/2) sum |p - q^j| (the paper's alternative), or token mismatch (hard labels: the paper maximises the
matches of q^j's token with the committed y_t'; we count argmax q^j != y_t' and minimise).
Policies (Appendix B.2): "grid" = every w with non-negative integer coefficients summing to n, over n
(for m = 2 exactly the paper's [1 - j/n, j/n], n = 10); "softmax" = the single candidate
softmax([1 / e^(1), ..., 1 / e^(m)] / tau) built from each view's own accumulated distance e^(i).
Window h = None uses every verified position (Appendix B.1's default "ALL").

Choices the paper leaves open, fixed here: with no verified position yet the weights are uniform (the
static ensemble MT); ties in the argmin go to the candidate nearest to uniform, then the lowest index.

Which p: the distribution the target verifies with. At temperature 0 that is one-hot on the target's
token, i.e. on the committed token y_t' (KL then equals -log q^j(y_t') and TVD 1 - q^j(y_t')), so the
draft needs nothing but the verdicts; at temperature > 0 the target ships its rows p_t'.
Pure: no I/O, no models.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

DISTANCES = ("kl", "tvd", "match")
POLICIES = ("grid", "softmax")
VIEWS = ("multimodal", "text", "pooled")


@dataclass(frozen=True)
class TabedConfig:
    """The `tabed:` section of a run config."""

    views: tuple[str, ...] = VIEWS  # multimodal (pruned video), text (no video), pooled (2x2-pooled video)
    distance: str = "kl"
    window: int | None = None  # h; None: all verified positions
    policy: str = "grid"
    grid_steps: int = 10  # n of the grid policy
    tau: float = 1.0  # temperature of the softmax policy
    pool: int = 2  # side of the pooling kernel of the pooled view

    def __post_init__(self) -> None:
        if not self.views or len(set(self.views)) != len(self.views) or set(self.views) - set(VIEWS):
            raise ValueError(f"tabed views must be distinct names among {VIEWS}, got {self.views}")
        if self.distance not in DISTANCES:
            raise ValueError(f"tabed distance must be one of {DISTANCES}, got {self.distance!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"tabed policy must be one of {POLICIES}, got {self.policy!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"tabed window must be >= 1 or None, got {self.window}")
        if self.grid_steps < 1 or self.tau <= 0 or self.pool < 1:
            raise ValueError("tabed grid_steps and pool must be >= 1 and tau > 0")

    @staticmethod
    def from_dict(data: dict | None) -> "TabedConfig":
        data = dict(data or {})
        if "views" in data:
            data["views"] = tuple(data["views"])
        unknown = set(data) - set(TabedConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown keys in tabed: {sorted(unknown)}")
        return TabedConfig(**data)

    def needs_target_probs(self, temperature: float) -> bool:
        """Whether verdicts must carry the target's rows p (soft labels that are not one-hot)."""
        return temperature > 0.0 and self.distance != "match"


def weight_grid(num_views: int, steps: int) -> torch.Tensor:
    """(J, m) every weight vector with non-negative integer coefficients summing to `steps`, over `steps`."""
    rows = [c for c in itertools.product(range(steps + 1), repeat=num_views) if sum(c) == steps]
    return torch.tensor(rows, dtype=torch.float32) / steps


def weighted_average(view_probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """W-AVG: view_probs (m, V), weights (..., m) summing to 1 -> (..., V) ensemble distributions (the weights
    live on the host, the views where the draft runs)."""
    return weights.to(view_probs) @ view_probs


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """D_KL(p || q) = sum_v p(v) log(p(v) / q(v)) over the last axis, 0 log 0 = 0.

    q is floored at the smallest positive float32 so a token the ensemble underflowed to 0 costs a
    large finite amount instead of making every candidate infinite.
    """
    q = q.clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TVD(p, q) = (1/2) sum_v |p(v) - q(v)| over the last axis."""
    return 0.5 * (p - q).abs().sum(-1)


def distance(p: torch.Tensor, q: torch.Tensor, token: int, kind: str) -> torch.Tensor:
    """D between the target's p (V,) and ensembles q (..., V); `token` is the committed y_t' (for "match")."""
    if kind == "kl":
        return kl_divergence(p, q)
    if kind == "tvd":
        return total_variation(p, q)
    if kind == "match":
        return (q.argmax(-1) != token).float()
    raise ValueError(f"unknown distance {kind!r}")


def argmin_nearest_uniform(errors: torch.Tensor, candidates: torch.Tensor) -> int:
    """Index of the smallest error; ties (exact) to the candidate nearest to uniform, then the lowest index."""
    best = errors.min()
    tied = torch.nonzero(errors == best).squeeze(1)
    uniform = torch.full((candidates.shape[1],), 1.0 / candidates.shape[1])
    spread = ((candidates[tied] - uniform) ** 2).sum(-1)
    return int(tied[int(torch.argmin(spread))])  # argmin returns the first minimum: the lowest index


class AdaptiveWeights:
    """The test-time adaptation state of one item: distances at verified positions, weights per block."""

    def __init__(self, cfg: TabedConfig, num_views: int):
        self.cfg = cfg
        self.num_views = num_views
        # grid: scores every candidate; softmax: scores each view alone (its candidate is built from them)
        self.candidates = weight_grid(num_views, cfg.grid_steps) if cfg.policy == "grid" else torch.eye(num_views)
        self.window: deque[torch.Tensor] = deque(maxlen=cfg.window)  # per verified position: (J,) distances

    def observe(self, view_probs: torch.Tensor, token: int, target_probs: torch.Tensor | None) -> None:
        """One verified position: the views' q^(i) (m, V), the committed token, the target's p (None: one-hot)."""
        p = target_probs
        if p is None:
            p = torch.zeros(view_probs.shape[-1], dtype=view_probs.dtype, device=view_probs.device)
            p[token] = 1.0
        q = weighted_average(view_probs, self.candidates)  # (J, V)
        # The weight search stays on the host: one (J,) copy per verified position.
        self.window.append(distance(p.to(q), q, token, self.cfg.distance).cpu())

    def weights(self) -> torch.Tensor:
        """w* for the block that starts now (uniform before any verified position)."""
        if not self.window:
            return torch.full((self.num_views,), 1.0 / self.num_views)
        errors = torch.stack(list(self.window)).sum(0)
        if self.cfg.policy == "grid":
            return self.candidates[argmin_nearest_uniform(errors, self.candidates)]
        # e = 0 (a view never wrong) would divide by zero: floor it, that view then takes all the weight
        inverse = 1.0 / errors.clamp_min(1e-12)
        return torch.softmax(inverse / self.cfg.tau, dim=0)


def verdicts_carry_target_probs(draft_kind: str, tabed: TabedConfig, temperature: float) -> bool:
    """The one rule both roles apply: a tensor of the target's p rows follows each VerifyResult.

    Only for TABED (Method.draft == "views") with soft labels at temperature > 0. Rows: one per verified
    position (the accepted ones and, after a rejection, the rejected one), (n, V) float32.
    """
    return draft_kind == "views" and tabed.needs_target_probs(temperature)

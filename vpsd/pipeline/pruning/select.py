"""Turn a score, or a fixed rule, into the set of video tokens the draft keeps.

Contract (shared by every function here and every strategy built on them):
- the result is a 1-D int64 tensor of video token indices, sorted and unique;
- it holds every non-prunable token (newlines) plus exactly `layout.budget(ratio)` prunable ones;
- the choice is deterministic: scores are ranked with ties going to the lower index, baselines use
  integer arithmetic, and `random_keep` draws from its own seeded generator.

Baselines (all score-free):
- `random_keep`: a uniform random subset of the prunable tokens;
- `uniform_keep`: a regular spatial lattice inside every frame (budget split over frames in proportion
  to their size), so kept tokens are spread evenly over rows and columns;
- `frame_keep`: whole frames at regular temporal intervals (HIPPO-Frame), trimmed or topped up with
  evenly spaced tokens so the count is exactly the budget.
"""

from __future__ import annotations

import math

import torch

from vpsd.pipeline.layout import VideoTokenLayout


def evenly_spaced(n: int, k: int) -> torch.Tensor:
    """k distinct indices into range(n), spread evenly; for k > 1 both ends are included (linspace).

    Integer arithmetic so that the choice never depends on float rounding; distinct because the
    step (n - 1) / (k - 1) is at least 1 whenever k <= n.
    """
    if not 0 <= k <= n:
        raise ValueError(f"cannot pick {k} of {n}")
    if k == 1:
        return torch.tensor([(n - 1) // 2], dtype=torch.long)  # the middle, not an arbitrary edge
    i = torch.arange(k, dtype=torch.long)
    return (i * (n - 1)) // max(k - 1, 1)


def keep_with_fixed(layout: VideoTokenLayout, chosen: torch.Tensor) -> torch.Tensor:
    """Kept indices: the chosen prunable tokens (N_chosen,) plus every non-prunable token."""
    fixed = torch.nonzero(~layout.prunable.cpu()).squeeze(1)
    kept = torch.cat([fixed, chosen.cpu().long()])
    return torch.unique(kept)  # unique() also sorts


def rank_descending(score: torch.Tensor) -> torch.Tensor:
    """Argsort, highest first, ties broken by lower index (stable sort keeps the index order)."""
    return torch.sort(score, descending=True, stable=True).indices


def top_k_keep(score: torch.Tensor, layout: VideoTokenLayout, ratio: float) -> torch.Tensor:
    """Keep the `budget(ratio)` prunable tokens with the highest score (N,)."""
    prunable = torch.nonzero(layout.prunable.cpu()).squeeze(1)
    order = rank_descending(score.detach().cpu().float()[prunable])
    return keep_with_fixed(layout, prunable[order[: layout.budget(ratio)]])


def random_keep(layout: VideoTokenLayout, ratio: float, seed: int) -> torch.Tensor:
    """Keep a uniform random subset of the prunable tokens (seeded, so runs are reproducible)."""
    prunable = torch.nonzero(layout.prunable.cpu()).squeeze(1)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(prunable.numel(), generator=gen)
    return keep_with_fixed(layout, prunable[perm[: layout.budget(ratio)]])


def split_budget(budget: int, sizes: torch.Tensor) -> torch.Tensor:
    """Split `budget` over groups in proportion to `sizes` (G,), largest remainders first.

    Each share is at most its group's size because budget <= sizes.sum().
    """
    total = int(sizes.sum())
    exact = sizes.double() * budget / total
    share = exact.floor().long()
    left = budget - int(share.sum())
    # remainders tie on equal-sized groups; the stable sort gives the extra token to the earlier frame
    share[rank_descending(exact - share)[:left]] += 1
    return share


def lattice_1d(n: int, k: int) -> torch.Tensor:
    """k positions in range(n) at the centres of k equal bands (stride n/k, offset half a stride)."""
    return ((2 * torch.arange(k, dtype=torch.long) + 1) * n) // (2 * k)


def _frame_lattice(rows: torch.Tensor, cols: torch.Tensor, k: int, h: int, w: int) -> torch.Tensor:
    """Pick k of one frame's tokens (given by their rows/cols, each (n,)) on a regular lattice.

    The lattice has ny x nx points with ny / nx close to h / w and ny * nx >= k; surplus lattice points
    are dropped evenly. Lattice points with no token (a ragged frame) are made up from the tokens left.
    """
    n = rows.numel()
    ny = min(h, max(1, round(math.sqrt(k * h / w))))
    nx = min(w, math.ceil(k / ny))
    ny = min(h, math.ceil(k / nx))
    ly, lx = lattice_1d(h, ny), lattice_1d(w, nx)
    on_row = (rows[:, None] == ly[None, :]).any(1)
    on_col = (cols[:, None] == lx[None, :]).any(1)
    on_lattice = torch.nonzero(on_row & on_col).squeeze(1)  # raster order, as tokens are
    if on_lattice.numel() >= k:
        return on_lattice[evenly_spaced(on_lattice.numel(), k)]
    mask = torch.ones(n, dtype=torch.bool)
    mask[on_lattice] = False
    rest = torch.nonzero(mask).squeeze(1)
    extra = rest[evenly_spaced(rest.numel(), k - on_lattice.numel())]
    return torch.cat([on_lattice, extra])


def uniform_keep(layout: VideoTokenLayout, ratio: float) -> torch.Tensor:
    """Keep a regular spatial lattice in every frame, with the budget split over frames by size."""
    prunable = torch.nonzero(layout.prunable.cpu()).squeeze(1)
    frame = layout.frame.cpu()[prunable]
    _, h, w = layout.grid
    frames, sizes = torch.unique(frame, return_counts=True)
    shares = split_budget(layout.budget(ratio), sizes)
    chosen = []
    for f, k in zip(frames.tolist(), shares.tolist()):
        if k == 0:
            continue
        idx = prunable[frame == f]
        pick = _frame_lattice(layout.row.cpu()[idx], layout.col.cpu()[idx], k, h, w)
        chosen.append(idx[pick])
    return keep_with_fixed(layout, torch.cat(chosen))


def frame_keep(layout: VideoTokenLayout, ratio: float) -> torch.Tensor:
    """Keep whole frames at regular intervals (HIPPO-Frame), then trim / top up to the exact budget.

    The number of frames kept is the one whose token count is closest to the budget; the kept frames
    sit at the centres of equal temporal bands. The few tokens by which whole frames miss the budget are
    dropped from (or added from) the rest at evenly spaced positions, so no frame edge is favoured.
    """
    prunable = torch.nonzero(layout.prunable.cpu()).squeeze(1)
    frame = layout.frame.cpu()[prunable]
    frames = torch.unique(frame)
    budget = layout.budget(ratio)
    per_frame = prunable.numel() / frames.numel()
    n_keep = min(frames.numel(), max(1, round(budget / per_frame)))
    kept_frames = frames[lattice_1d(frames.numel(), n_keep)]
    in_kept = torch.isin(frame, kept_frames)
    inside, outside = prunable[in_kept], prunable[~in_kept]
    if inside.numel() >= budget:
        chosen = inside[evenly_spaced(inside.numel(), budget)]
    else:
        extra = outside[evenly_spaced(outside.numel(), budget - inside.numel())]
        chosen = torch.cat([inside, extra])
    return keep_with_fixed(layout, chosen)

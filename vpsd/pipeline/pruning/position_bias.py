"""Position bias of a kept set (HIPPO Sec. 4, Fig. 2 / 8): what share of it sits at the frame's edges.

A token is a boundary token when its row is within `band` (normalised distance) of the top or bottom edge:
the first and last max(1, round(band * rows)) rows, about 20% of a frame for band = 0.1. An unbiased
selection keeps about that share; attention-only selection is reported at 44-58%.

Contract: one share per frame, over that frame's kept prunable tokens; NaN for a frame with none kept.
"""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout


def is_boundary_row(row: torch.Tensor, rows: int, band: float = 0.1) -> torch.Tensor:
    """(n,) rows -> (n,) bool, True in the top or bottom `band` of a frame with `rows` rows."""
    edge = max(1, round(band * rows))
    return (row < edge) | (row >= rows - edge)


def boundary_share(
    kept: torch.Tensor,  # (K,) kept video token indices
    layout: VideoTokenLayout,
    band: float = 0.1,
) -> torch.Tensor:  # (T,) float32, NaN where a frame keeps nothing
    kept = kept.cpu()
    kept = kept[layout.prunable.cpu()[kept]]
    frames, rows = layout.grid[0], layout.grid[1]
    frame = layout.frame.cpu()[kept]
    edge = is_boundary_row(layout.row.cpu()[kept], rows, band).float()
    total = torch.zeros(frames).index_add_(0, frame, torch.ones_like(edge))
    at_edge = torch.zeros(frames).index_add_(0, frame, edge)
    return torch.where(total > 0, at_edge / total.clamp(min=1), torch.full_like(total, float("nan")))


def boundary_fraction(layout: VideoTokenLayout, band: float = 0.1) -> float:
    """Share of all prunable tokens that are boundary tokens: what an unbiased selection keeps."""
    row = layout.row.cpu()[layout.prunable.cpu()]
    return float(is_boundary_row(row, layout.grid[1], band).float().mean())

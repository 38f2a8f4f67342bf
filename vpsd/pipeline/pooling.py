"""Spatial average pooling of video tokens on their frame grid (TABED's pooled-multimodal view, Sec. 6.1).

Tokens of one frame are grouped in side x side blocks of the token grid (a 2x2 kernel by default, as the
paper); each block becomes one token: the mean of its members' features, placed at the sequence and
rotary position of the block's first member (its top-left token), so the pooled sequence is a pruned
sequence whose kept tokens carry averaged features. Non-prunable tokens (newlines) are their own block.
Pure: indices and averages, no model.
"""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout


def pool_groups(layout: VideoTokenLayout, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(representatives (G,) ascending video token indices, group_of (N,) block of every video token)."""
    n = layout.num_tokens
    _, rows, cols = layout.grid
    blocks_per_row = -(-cols // side)
    blocks_per_frame = -(-rows // side) * blocks_per_row
    key = layout.frame * blocks_per_frame + (layout.row // side) * blocks_per_row + layout.col // side
    # non-prunable tokens get keys past every grid block, one each
    extra = torch.arange(n) + int(layout.grid[0]) * blocks_per_frame
    key = torch.where(layout.prunable, key, extra)
    uniq, group_of = torch.unique(key, return_inverse=True)
    # the first member (lowest index) of each block represents it
    first = torch.full((uniq.numel(),), n, dtype=torch.long).scatter_reduce(0, group_of, torch.arange(n), "amin")
    order = torch.argsort(first)  # number the blocks in sequence order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return first[order], rank[group_of]


def average_by_group(features: torch.Tensor, group_of: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(N, D) features -> (G, D) mean of each group's rows."""
    sums = torch.zeros(num_groups, features.shape[1], dtype=torch.float32, device=features.device)
    sums.index_add_(0, group_of.to(features.device), features.float())
    counts = torch.bincount(group_of, minlength=num_groups).to(sums)
    return (sums / counts[:, None]).to(features.dtype)

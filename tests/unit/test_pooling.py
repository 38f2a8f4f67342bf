"""2x2 pooling of the video token grid (TABED's pooled view) by hand."""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pooling import average_by_group, pool_groups


def test_pool_groups_on_a_3x3_frame_by_hand():
    """One 3x3 frame, 2x2 kernel: blocks {0,1,3,4}, {2,5}, {6,7}, {8}; two frames are pooled apart."""
    layout = VideoTokenLayout.from_grid(torch.arange(18) + 5, (2, 3, 3))
    reps, group_of = pool_groups(layout, 2)
    assert reps.tolist() == [0, 2, 6, 8, 9, 11, 15, 17]
    assert group_of[:9].tolist() == [0, 0, 1, 0, 0, 1, 2, 2, 3]
    assert group_of[9:].tolist() == [g + 4 for g in group_of[:9].tolist()]


def test_newline_tokens_are_their_own_group():
    grid = VideoTokenLayout.from_grid(torch.arange(4), (1, 2, 2))
    layout = VideoTokenLayout(
        seq_positions=torch.arange(5), frame=torch.tensor([0, 0, 0, 0, -1]), row=torch.tensor([0, 0, 1, 1, -1]),
        col=torch.tensor([0, 1, 0, 1, -1]), prunable=torch.tensor([True] * 4 + [False]), grid=grid.grid,
    )
    reps, group_of = pool_groups(layout, 2)
    assert reps.tolist() == [0, 4] and group_of.tolist() == [0, 0, 0, 0, 1]


def test_average_by_group():
    feats = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0]])
    got = average_by_group(feats, torch.tensor([0, 0, 1]), 2)
    assert got.tolist() == [[2.0, 1.0], [5.0, 4.0]]

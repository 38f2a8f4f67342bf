"""Boundary share of a kept set (HIPPO Fig. 2): top / bottom 10% of rows."""

from __future__ import annotations

import math

import pytest
import torch
from pruning_fixtures import grid_layout, newline_layout

from vpsd.pipeline.pruning.position_bias import boundary_fraction, boundary_share


def test_hand_checked_share_per_frame():
    layout = grid_layout(3, 10, 10)
    idx = layout.patch_index_grid()
    kept = torch.tensor(sorted([idx[0, 0, 3], idx[0, 5, 5], idx[0, 9, 0], idx[0, 4, 4], idx[1, 1, 1]]))
    share = boundary_share(kept, layout)
    assert share[0].item() == 0.5  # rows 0 and 9 are boundary, rows 4 and 5 are not
    assert share[1].item() == 0.0  # row 1 is interior on a 10-row frame
    assert math.isnan(share[2].item())  # nothing kept there


def test_boundary_fraction_is_about_twenty_percent():
    assert boundary_fraction(grid_layout(1, 10, 10)) == pytest.approx(0.2)
    assert boundary_fraction(newline_layout(2, 16, 4)) == pytest.approx(0.25)  # 2 edge rows of 16 on each side


def test_newlines_do_not_count():
    layout = newline_layout(1, 10, 3)
    kept = torch.nonzero(~layout.prunable).squeeze(1)
    assert math.isnan(boundary_share(kept, layout)[0].item())

"""kept.jsonl round trip and the pruner's check of the kept-index contract before anything reaches the draft."""

from __future__ import annotations

import pytest
import torch
from pruning_fixtures import grid_layout, newline_layout

from vpsd.reports.kept_log import KeptRecord, append_kept, read_kept
from vpsd.roles.context import RoleFailure
from vpsd.roles.pruner import check_keep


def test_round_trip_keeps_the_layout_and_survives_a_cut_line(tmp_path):
    layout = newline_layout(2, 3, 4)
    kept = torch.tensor([0, 4, 5, 9, 14, 19, 22, 25, 29])
    append_kept(tmp_path, KeptRecord("x/1", "hippo", 0.5, kept, layout))
    with (tmp_path / "kept.jsonl").open("a") as f:
        f.write('{"id": "cut", "strat')  # a crash mid-line
    (got,) = read_kept(tmp_path)
    assert got.item_id == "x/1" and got.strategy == "hippo" and got.ratio == 0.5
    assert torch.equal(got.kept, kept) and got.layout.grid == (2, 3, 4)
    for name in ("frame", "row", "col", "prunable"):
        assert torch.equal(getattr(got.layout, name), getattr(layout, name))


def test_contract_check_accepts_exact_budget_only():
    layout = newline_layout(1, 4, 4)  # 16 patches + 4 newlines (indices 4, 9, 14, 19)
    newlines = [4, 9, 14, 19]
    budget = layout.budget(0.75)  # 4 prunable tokens
    good = torch.tensor(sorted(newlines + [0, 5, 10, 15]))
    check_keep(good, layout, 0.75)
    check_keep(torch.arange(layout.num_tokens), layout, 0.0)
    bad = {
        "unsorted": good.flip(0),
        "duplicate": torch.tensor(sorted(newlines + [0, 0, 5, 10])),
        "one short": torch.tensor(sorted(newlines + [0, 5, 10])),
        "one over": torch.tensor(sorted(newlines + [0, 1, 5, 10, 15])),
        "newline missing": torch.tensor(sorted(newlines[1:] + [0, 1, 5, 10, 15])),
        "out of range": torch.tensor(sorted(newlines + [0, 5, 10, 20])),
        "int32": good.int(),
    }
    assert budget == 4
    for name, keep in bad.items():
        with pytest.raises(RoleFailure, match="contract"):
            check_keep(keep, layout, 0.75)


def test_grid_layout_budget_is_exact():
    layout = grid_layout(2, 5, 5)
    with pytest.raises(RoleFailure, match="budget 5"):
        check_keep(torch.arange(6), layout, 0.9)
    check_keep(torch.arange(5), layout, 0.9)

"""`vpsd bias` on hand-made kept sets: per-frame boundary shares and the uniform expectation, checked by hand."""

from __future__ import annotations

import json

import pytest
import torch
from pruning_fixtures import grid_layout, newline_layout

from vpsd.reports.bias import bias_report
from vpsd.launch.cli import main as cli
from vpsd.reports.kept_log import KeptRecord, append_kept, read_kept


def _record(item: str, strategy: str, layout, cells: list[tuple[int, int, int]]) -> KeptRecord:
    """Kept set from (frame, row, col) cells, plus every non-prunable token."""
    idx = layout.patch_index_grid()
    chosen = [int(idx[f, r, c]) for f, r, c in cells] + torch.nonzero(~layout.prunable).squeeze(1).tolist()
    return KeptRecord(item, strategy, 0.9, torch.tensor(sorted(chosen)), layout)


def _hand_made() -> list[KeptRecord]:
    a = grid_layout(2, 10, 10)  # edge = 1 row each side: rows 0 and 9 are boundary, 20% of a frame
    b = grid_layout(3, 10, 10)
    return [
        # attn, item a: frame 0 keeps rows 0, 9, 5 -> 2/3; frame 1 keeps rows 0, 4 -> 1/2
        _record("a", "attn", a, [(0, 0, 1), (0, 9, 2), (0, 5, 5), (1, 0, 0), (1, 4, 4)]),
        # attn, item b: frame 0 keeps row 9 -> 1; frame 1 nothing (NaN); frame 2 row 3 -> 0
        _record("b", "attn", b, [(0, 9, 9), (2, 3, 3)]),
        # hippo, item a: frame 0 rows 4 and 5 -> 0; frame 1 row 9 and 1 -> 1/2
        _record("a", "hippo", a, [(0, 4, 0), (0, 5, 0), (1, 9, 0), (1, 1, 0)]),
    ]


def test_per_frame_shares_by_hand():
    reports = bias_report(_hand_made())
    assert list(reports) == ["attn", "hippo"]
    attn = reports["attn"]
    assert attn.items == 2 and attn.counts == [2, 1, 1]
    assert attn.share[0] == pytest.approx((2 / 3 + 1) / 2)  # mean over the items that keep something there
    assert attn.share[1] == pytest.approx(1 / 2)  # item b keeps nothing in frame 1: not counted
    assert attn.share[2] == pytest.approx(0.0)  # only item b has a third frame
    assert attn.uniform == pytest.approx([0.2, 0.2, 0.2])
    assert attn.overall == pytest.approx(4 / 7)  # 4 boundary tokens among the 7 kept, pooled
    assert attn.overall_uniform == pytest.approx(0.2)
    hippo = reports["hippo"]
    assert hippo.share == pytest.approx([0.0, 0.5]) and hippo.overall == pytest.approx(1 / 4)


def test_newline_tokens_are_not_counted_and_the_band_scales():
    layout = newline_layout(1, 20, 4)  # newline after every row: never prunable, never counted
    rec = _record("n", "uv", layout, [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 10, 1)])
    report = bias_report([rec], band=0.1)["uv"]  # edge = 2 rows: rows 0, 1, 18, 19
    assert report.share == pytest.approx([0.5]) and report.uniform == pytest.approx([0.2])
    wide = bias_report([rec], band=0.15)["uv"]  # edge = 3 rows: rows 0..2 and 17..19
    assert wide.share == pytest.approx([0.75]) and wide.uniform == pytest.approx([0.3])


def test_command_prints_writes_json_and_draws(tmp_path, capsys):
    for rec in _hand_made():
        append_kept(tmp_path, rec)
    append_kept(tmp_path, _record("a", "hippo", grid_layout(2, 10, 10), [(0, 0, 0), (1, 9, 9)]))  # a rerun of a
    assert len(read_kept(tmp_path)) == 3  # the last record per (item, strategy) counts
    fig = tmp_path / "fig.png"
    assert cli(["bias", str(tmp_path), "--out", str(fig)]) == 0
    text = capsys.readouterr().out
    assert "strategy attn: 2 items" in text and "strategy hippo: 2 items" not in text
    assert "    1             50.0%                20.0%      1" in text  # attn, frame 1
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and fig.stat().st_size > 5000
    saved = json.loads((tmp_path / "bias.json").read_text())
    assert saved["hippo"]["share"] == [1.0, 1.0]  # the rerun's kept set: one boundary token per frame
    assert saved["attn"]["share"][1] == 0.5

    assert cli(["bias", str(tmp_path), "--strategy", "hippo", "--out", str(fig)]) == 0
    assert "attn" not in capsys.readouterr().out
    assert cli(["bias", str(tmp_path), "--strategy", "nope"]) == 2
    assert cli(["bias", str(tmp_path / "missing")]) == 2


def test_frame_with_nothing_kept_is_null_in_json(tmp_path, capsys):
    append_kept(tmp_path, _record("b", "attn", grid_layout(3, 10, 10), [(0, 9, 9)]))
    assert cli(["bias", str(tmp_path / "kept.jsonl"), "--out", str(tmp_path / "f.png")]) == 0
    saved = json.loads((tmp_path / "bias.json").read_text())["attn"]
    assert saved["share"] == [1.0, None, None] and saved["counts"] == [1, 0, 0]
    assert saved["uniform"][2] == pytest.approx(0.2)

"""Kept-index contract for every strategy (property test), and how each rule spreads its tokens."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pruning_fixtures import check_kept, grid_layout, newline_layout, signals_for

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.select import evenly_spaced, frame_keep, random_keep, top_k_keep, uniform_keep
from vpsd.pipeline.pruning.specvlm import specvlm_select, top_p_count
from vpsd.pipeline.pruning.strategies import STRATEGIES


@st.composite
def layouts(draw) -> VideoTokenLayout:
    t, h, w = draw(st.integers(1, 4)), draw(st.integers(1, 7)), draw(st.integers(1, 7))
    kind = draw(st.sampled_from(["grid", "row", "frame"]))
    if kind == "grid":
        return grid_layout(t, h, w, start=2)
    return newline_layout(t, h, w, start=2, per=kind)


@settings(max_examples=100, deadline=None)
@given(
    layout=layouts(),
    ratio=st.floats(0.0, 0.99),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(sorted(STRATEGIES)),
)
def test_every_strategy_keeps_exactly_the_budget(layout, ratio, seed, name):
    kept = STRATEGIES[name].select(signals_for(layout, seed), layout, ratio, seed)
    if name == "none":
        assert torch.equal(kept, torch.arange(layout.num_tokens))
    else:
        check_kept(kept, layout, ratio)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), data=st.data())
def test_evenly_spaced_is_distinct_and_in_range(n, data):
    k = data.draw(st.integers(0, n))
    idx = evenly_spaced(n, k)
    assert idx.numel() == k and torch.equal(idx, torch.unique(idx))
    assert k == 0 or (0 <= int(idx.min()) and int(idx.max()) < n)


def test_top_k_ties_go_to_lower_index():
    layout = grid_layout(1, 2, 5)
    score = torch.tensor([1.0, 2.0, 2.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 2.0])
    assert top_k_keep(score, layout, 0.7).tolist() == [1, 2, 4]


def test_top_k_ignores_newline_scores():
    layout = newline_layout(1, 2, 2)  # tokens: p p nl p p nl
    score = torch.tensor([0.0, 1.0, 99.0, 3.0, 2.0, 99.0])
    assert top_k_keep(score, layout, 0.5).tolist() == [2, 3, 4, 5]


def test_random_keep_is_seeded():
    layout = grid_layout(2, 5, 5)
    assert torch.equal(random_keep(layout, 0.8, 7), random_keep(layout, 0.8, 7))
    assert not torch.equal(random_keep(layout, 0.8, 7), random_keep(layout, 0.8, 8))


def test_uniform_keep_is_an_exact_lattice_when_the_budget_allows():
    layout = grid_layout(2, 8, 8)
    kept = uniform_keep(layout, 0.75)  # 16 per frame: a 4 x 4 lattice at stride 2, offset 1
    for f in range(2):
        sel = kept[layout.frame[kept] == f]
        assert set(layout.row[sel].tolist()) == {1, 3, 5, 7}
        assert set(layout.col[sel].tolist()) == {1, 3, 5, 7}
        assert sel.numel() == 16


def test_uniform_keep_spreads_over_rows_and_columns_of_every_frame():
    layout = newline_layout(4, 16, 28)  # a LLaVA-like grid with newlines, 90% pruned
    kept = uniform_keep(layout, 0.9)
    check_kept(kept, layout, 0.9)
    kept = kept[layout.prunable[kept]]
    counts = torch.bincount(layout.frame[kept], minlength=4)
    assert int(counts.max() - counts.min()) <= 1
    for f in range(4):
        sel = kept[layout.frame[kept] == f]
        rows, cols = torch.unique(layout.row[sel]), torch.unique(layout.col[sel])
        # no band of the frame is left empty: gaps between kept rows / cols stay near the stride
        assert int(rows.min()) <= 3 and int(rows.max()) >= 12 and int(rows.diff().max()) <= 4
        assert int(cols.min()) <= 3 and int(cols.max()) >= 24 and int(cols.diff().max()) <= 4
        per_row = torch.bincount(layout.row[sel])[rows]
        assert int(per_row.max() - per_row.min()) <= 1


def test_frame_keep_keeps_whole_frames_at_regular_intervals():
    layout = grid_layout(10, 4, 4)
    kept = frame_keep(layout, 0.8)  # budget 32 = exactly 2 frames, at the centres of 2 halves
    assert torch.unique(layout.frame[kept]).tolist() == [2, 7]
    assert kept.numel() == 32


def test_frame_keep_trims_and_tops_up_to_the_exact_budget():
    layout = grid_layout(10, 4, 4)
    kept = frame_keep(layout, 0.72)  # budget 45: 3 whole frames (1, 5, 8) hold 48, so 3 are dropped
    check_kept(kept, layout, 0.72)
    assert torch.unique(layout.frame[kept]).tolist() == [1, 5, 8]
    kept = frame_keep(layout, 0.74)  # budget 42 (round(2.6) = 3 frames): also trimmed from 48
    assert torch.unique(layout.frame[kept]).tolist() == [1, 5, 8]
    kept = frame_keep(layout, 0.78)  # budget 35: 2 whole frames (2, 7) plus 3 tokens from the rest
    check_kept(kept, layout, 0.78)
    per_frame = torch.bincount(layout.frame[kept], minlength=10)
    assert per_frame[2] == 16 and per_frame[7] == 16 and int(per_frame.sum()) == 35


def test_specvlm_top_p_then_uniform():
    layout = grid_layout(1, 1, 10)
    score = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0, 0.0, 0.0])
    # lambda = 0.5: token 0 alone covers half the attention; then 3 of the 9 left, evenly: 1, 5, 9
    assert specvlm_select(score, layout, 0.6, lam=0.5).tolist() == [0, 1, 5, 9]
    # lambda = 1 would need 6 tokens: stage I is capped by the budget of 4
    assert specvlm_select(score, layout, 0.6, lam=1.0).tolist() == [0, 1, 2, 3]


def test_top_p_count_matches_eq6():
    score = torch.tensor([0.1, 0.4, 0.3, 0.2])
    assert [top_p_count(score, lam) for lam in (0.0, 0.4, 0.41, 0.7, 0.9, 1.0)] == [0, 1, 2, 2, 3, 4]

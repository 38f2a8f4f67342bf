"""HIPPO s_temp / s_spa / fusion and ParallelVLM UV-Prune, each against its equation written as loops."""

from __future__ import annotations

import math

import pytest
import torch
from pruning_fixtures import grid_layout, newline_layout

from vpsd.pipeline.pruning.fusion import hippo_score, zscore_within_frame
from vpsd.pipeline.pruning.spatial import spatial_score
from vpsd.pipeline.pruning.temporal import temporal_score
from vpsd.pipeline.pruning.uv import uv_score


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.double() @ b.double()) / (float(a.double().norm()) * float(b.double().norm()))


def cells(layout):
    """{(frame, row, col): token index} for the patch tokens."""
    return {
        (int(layout.frame[i]), int(layout.row[i]), int(layout.col[i])): i
        for i in range(layout.num_tokens)
        if layout.prunable[i]
    }


def ref_temporal(emb, layout):
    """Eq. 3-4: 1 - mean cosine with the same cell in frames f-1 and f+1 that exist."""
    at = cells(layout)
    out = [0.0] * layout.num_tokens
    for (f, r, c), i in at.items():
        sims = [cos(emb[i], emb[at[(g, r, c)]]) for g in (f - 1, f + 1) if (g, r, c) in at]
        out[i] = 1 - sum(sims) / len(sims) if sims else 0.0
    return torch.tensor(out, dtype=torch.float64)


def ref_spatial_tile(emb, layout, crop):
    """Eq. 5-6 on non-overlapping crops from the top-left: variance of S_j. over the M crop tokens."""
    at = cells(layout)
    out = [0.0] * layout.num_tokens
    for (f, r, c), i in at.items():
        r0, c0 = (r // crop) * crop, (c // crop) * crop
        crop_tokens = [
            at[(f, rr, cc)] for rr in range(r0, r0 + crop) for cc in range(c0, c0 + crop) if (f, rr, cc) in at
        ]
        row = [cos(emb[i], emb[k]) for k in crop_tokens]  # includes S_jj = 1
        mu = sum(row) / len(row)
        out[i] = sum((s - mu) ** 2 for s in row) / len(row)
    return torch.tensor(out, dtype=torch.float64)


def ref_spatial_window(emb, layout, crop):
    at = cells(layout)
    half = crop // 2
    out = [0.0] * layout.num_tokens
    for (f, r, c), i in at.items():
        crop_tokens = [
            at[(f, r + dy, c + dx)]
            for dy in range(-half, crop - half)
            for dx in range(-half, crop - half)
            if (f, r + dy, c + dx) in at
        ]
        row = [cos(emb[i], emb[k]) for k in crop_tokens]
        mu = sum(row) / len(row)
        out[i] = sum((s - mu) ** 2 for s in row) / len(row)
    return torch.tensor(out, dtype=torch.float64)


def ref_zscore(score, layout):
    out = [0.0] * layout.num_tokens
    for f in range(layout.grid[0]):
        idx = [i for i in range(layout.num_tokens) if layout.prunable[i] and int(layout.frame[i]) == f]
        vals = [float(score[i]) for i in idx]
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
        for i, v in zip(idx, vals):
            out[i] = (v - mu) / sd if sd > 0 else 0.0
    return torch.tensor(out, dtype=torch.float64)


def ref_uv(video_hidden, text_hidden, num_layers):
    """Eq. 3 literally: sum over text tokens j and layers l = 1..L of S^l_ij - S^(l-1)_ij."""
    last = min(num_layers, video_hidden.shape[0] - 1)
    out = []
    for i in range(video_hidden.shape[1]):
        total = 0.0
        for j in range(text_hidden.shape[1]):
            for layer in range(1, last + 1):
                now = cos(video_hidden[layer, i], text_hidden[layer, j])
                before = cos(video_hidden[layer - 1, i], text_hidden[layer - 1, j])
                total += now - before
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


LAYOUTS = {
    "grid": lambda: grid_layout(3, 4, 6, start=3),
    "newlines": lambda: newline_layout(3, 7, 6, start=5),
    "one_frame": lambda: grid_layout(1, 3, 3),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_temporal_matches_eq3_eq4(name):
    layout = LAYOUTS[name]()
    emb = torch.randn(layout.num_tokens, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(temporal_score(emb, layout).double(), ref_temporal(emb, layout), atol=1e-5, rtol=0)


def test_temporal_hand_checked():
    """Two frames of one cell: orthogonal embeddings give 1 - 0 = 1; a repeated frame gives 1 - 1 = 0."""
    layout = grid_layout(3, 1, 1)
    emb = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 1.0]])
    # frame 0: cos with frame 1 = 0 -> 1; frame 1: mean(0, 1) -> 0.5; frame 2: cos with frame 1 = 1 -> 0
    torch.testing.assert_close(temporal_score(emb, layout), torch.tensor([1.0, 0.5, 0.0]))


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("crop", [2, 3, 5])
def test_spatial_tile_matches_eq5_eq6(name, crop):
    layout = LAYOUTS[name]()
    emb = torch.randn(layout.num_tokens, 5, generator=torch.Generator().manual_seed(1))
    got = spatial_score(emb, layout, crop=crop, mode="tile", tile_batch=3)
    torch.testing.assert_close(got.double(), ref_spatial_tile(emb, layout, crop), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", LAYOUTS)
def test_spatial_window_matches_loops(name):
    layout = LAYOUTS[name]()
    emb = torch.randn(layout.num_tokens, 5, generator=torch.Generator().manual_seed(2))
    got = spatial_score(emb, layout, crop=5, mode="window")
    torch.testing.assert_close(got.double(), ref_spatial_window(emb, layout, 5), atol=1e-5, rtol=0)


def test_spatial_hand_checked():
    """A 1x2 crop of orthogonal tokens: each row of S is (1, 0), variance 1/4; identical tokens: 0."""
    layout = grid_layout(2, 1, 2)
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 1.0], [3.0, 1.0]])
    torch.testing.assert_close(spatial_score(emb, layout), torch.tensor([0.25, 0.25, 0.0, 0.0]))


def test_zscore_matches_loops_and_ignores_newlines():
    layout = newline_layout(2, 3, 4)
    score = torch.randn(layout.num_tokens, generator=torch.Generator().manual_seed(3))
    got = zscore_within_frame(score, layout)
    torch.testing.assert_close(got.double(), ref_zscore(score, layout), atol=1e-5, rtol=0)
    assert (got[~layout.prunable] == 0).all()


def test_zscore_constant_frame_is_zero():
    layout = grid_layout(2, 2, 2)
    score = torch.tensor([3.0] * 4 + [1.0, 2.0, 3.0, 4.0])
    got = zscore_within_frame(score, layout)
    assert (got[:4] == 0).all()
    torch.testing.assert_close(got[4:].sum(), torch.tensor(0.0))


def test_hippo_score_sums_enabled_components():
    layout = grid_layout(2, 3, 3)
    gen = torch.Generator().manual_seed(4)
    attn, temp, spa = (torch.rand(layout.num_tokens, generator=gen) for _ in range(3))
    z = [ref_zscore(s, layout) for s in (attn, temp, spa)]
    torch.testing.assert_close(hippo_score(layout, attn, temp, spa).double(), z[0] + z[1] + z[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(hippo_score(layout, attn=attn, spa=spa).double(), z[0] + z[2], atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        hippo_score(layout)


@pytest.mark.parametrize("num_layers", [1, 3, 20])
def test_uv_matches_eq3_loops(num_layers):
    gen = torch.Generator().manual_seed(5)
    video_hidden = torch.randn(5, 6, 4, generator=gen)  # 4 layers + input: fewer than 20 -> use all
    text_hidden = torch.randn(5, 3, 4, generator=gen)
    got = uv_score(video_hidden, text_hidden, num_layers=num_layers)
    torch.testing.assert_close(got.double(), ref_uv(video_hidden, text_hidden, num_layers), atol=1e-5, rtol=0)


def test_uv_sign_rewards_growing_alignment():
    """Token 0 turns towards the text between layers, token 1 turns away: 0 must outrank 1."""
    text = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])  # (L+1=2, Nt=1, D=2)
    video = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])
    torch.testing.assert_close(uv_score(video, text), torch.tensor([1.0, -1.0]))

"""HIPPO's intra-frame spatial score s_spa (Eq. 5-6): how varied a token's similarities are in its crop.

Each frame's token grid is cut into crops of `crop` x `crop` tokens (M = 25 by default). Inside a crop,
S = E E^T over the L2-normalised embeddings, and a token's score is the variance of its row of S:
(1/M) sum_k (S_jk - mu_j)^2 with mu_j = (1/M) sum_k S_jk. The sum runs over all M tokens of the crop,
the token itself included (S_jj = 1), exactly as Eq. 6 is written. High variance: the token relates
very differently to its neighbours (edges, objects); low: a flat region (walls, desk).

Crop geometry, `mode`:
- "tile" (default, the paper's reading): non-overlapping crops tiled from the frame's top-left corner;
  crops at the right / bottom edge are clipped, so M is smaller there. Eq. 5 builds one S per crop c and
  every token belongs to exactly one crop, which is what tiling gives.
- "window": a crop centred on each token (clipped at the frame edge), for comparison; no token sits on
  a crop border there, at the cost of M matrix rows per token instead of one per crop.

Contract: one score per video token; non-prunable tokens score 0; cells without a token are left out.
Tokens with a zero embedding count as orthogonal to everything (normalise() maps them to zero).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from vpsd.pipeline.layout import VideoTokenLayout

CropMode = Literal["tile", "window"]


def _padded_grid(layout: VideoTokenLayout, pad_to: int, margin: int, device: torch.device) -> torch.Tensor:
    """(T, H', W') token-index grid, -1 padded: `margin` cells on each side, then up to a multiple of pad_to."""
    grid = layout.patch_index_grid().to(device)
    t, h, w = grid.shape
    hp = -(-(h + 2 * margin) // pad_to) * pad_to
    wp = -(-(w + 2 * margin) // pad_to) * pad_to
    out = torch.full((t, hp, wp), -1, dtype=torch.long, device=device)
    out[:, margin : margin + h, margin : margin + w] = grid
    return out


def _tile_variance(unit: torch.Tensor, layout: VideoTokenLayout, crop: int, tile_batch: int) -> torch.Tensor:
    t = layout.grid[0]
    grid = _padded_grid(layout, crop, 0, unit.device)
    hp, wp = grid.shape[1:]
    tiles = grid.view(t, hp // crop, crop, wp // crop, crop).permute(0, 1, 3, 2, 4).reshape(-1, crop * crop)
    out = torch.zeros(layout.num_tokens, dtype=torch.float32, device=unit.device)
    for start in range(0, tiles.shape[0], tile_batch):  # bounds the (tiles, M, D) gather
        idx = tiles[start : start + tile_batch]  # (B, M)
        valid = idx >= 0
        e = unit[idx.clamp(min=0)] * valid[..., None]  # (B, M, D), zero rows for empty cells
        sim = e @ e.transpose(1, 2)  # (B, M, M) = S^c per crop
        m = valid.sum(-1, keepdim=True).clamp(min=1)  # (B, 1) tokens in the crop
        cols = valid[:, None, :]  # only real tokens k enter the sums over k
        mu = (sim * cols).sum(-1) / m  # (B, M)
        var = (((sim - mu[..., None]) ** 2) * cols).sum(-1) / m
        out[idx[valid]] = var[valid]
    return out


def _window_variance(unit: torch.Tensor, layout: VideoTokenLayout, crop: int) -> torch.Tensor:
    r = crop // 2
    t, h, w = layout.grid
    grid = _padded_grid(layout, 1, r, unit.device)
    centre = grid[:, r : r + h, r : r + w]  # (T, H, W)
    present = centre >= 0
    centre_unit = unit[centre.clamp(min=0)]  # (T, H, W, D)
    rows = []  # per offset: the centre token's similarity to the neighbour there (0 where absent)
    masks = []
    for dy in range(-r, crop - r):
        for dx in range(-r, crop - r):
            nbr = grid[:, r + dy : r + dy + h, r + dx : r + dx + w]
            ok = present & (nbr >= 0)
            sim = (centre_unit * unit[nbr.clamp(min=0)]).sum(-1)
            rows.append(torch.where(ok, sim, torch.zeros_like(sim)))
            masks.append(ok)
    sim = torch.stack(rows, -1)  # (T, H, W, M)
    mask = torch.stack(masks, -1).float()
    m = mask.sum(-1).clamp(min=1)
    mu = (sim * mask).sum(-1) / m
    var = (((sim - mu[..., None]) ** 2) * mask).sum(-1) / m
    out = torch.zeros(layout.num_tokens, dtype=torch.float32, device=unit.device)
    out[centre[present]] = var[present]
    return out


HIPPO_DEFAULT_CROP = 5  # crop side: M = 25 tokens (Sec. 4.2)


def spatial_score(
    visual_embeds: torch.Tensor,  # (N, D) one embedding per video token
    layout: VideoTokenLayout,
    crop: int = HIPPO_DEFAULT_CROP,
    mode: CropMode = "tile",
    tile_batch: int = 512,
) -> torch.Tensor:  # (N,) float32
    unit = F.normalize(visual_embeds.float(), dim=-1)
    if mode == "tile":
        return _tile_variance(unit, layout, crop, tile_batch)
    if mode == "window":
        return _window_variance(unit, layout, crop)
    raise ValueError(f"unknown crop mode {mode!r}")

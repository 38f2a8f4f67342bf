"""HIPPO's inter-frame temporal score s_temp (Eq. 3-4): how much a token changed since the frames beside it.

s_temp(v_j^f) = 1 - mean over f' in N(f) of cos(v_j^f, v_j^{f'}), with N(f) = {f-1, f+1} inside the video
and v_j^{f'} the token at the same (row, col) in frame f'. Static background scores near 0, motion high.

Contract: input is one embedding per video token (the vision tower's output after the projector);
the output is one score per video token. Non-prunable tokens (no grid cell) score 0. A neighbour cell
with no token (a ragged grid) is left out of the mean; a token with no neighbour at all (a one-frame
video) scores 0, since there is no evidence that it changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vpsd.pipeline.layout import VideoTokenLayout


def temporal_score(
    visual_embeds: torch.Tensor,  # (N, D) one embedding per video token
    layout: VideoTokenLayout,
) -> torch.Tensor:  # (N,) float32
    grid = layout.patch_index_grid().to(visual_embeds.device)  # (T, H, W) token index or -1
    unit = F.normalize(visual_embeds.float(), dim=-1)
    present = grid >= 0
    cell = unit[grid.clamp(min=0)]  # (T, H, W, D); absent cells are masked below
    # cosine between each frame and the next, where both cells hold a token
    step = (cell[1:] * cell[:-1]).sum(-1)  # (T-1, H, W)
    both = present[1:] & present[:-1]
    step = torch.where(both, step, torch.zeros_like(step))
    sim_sum = torch.zeros(grid.shape, dtype=torch.float32, device=grid.device)
    count = torch.zeros(grid.shape, dtype=torch.float32, device=grid.device)
    sim_sum[1:] += step  # frame f sees f-1
    sim_sum[:-1] += step  # frame f sees f+1
    count[1:] += both
    count[:-1] += both
    score_grid = torch.where(count > 0, 1.0 - sim_sum / count.clamp(min=1), torch.zeros_like(sim_sum))
    out = torch.zeros(layout.num_tokens, dtype=torch.float32, device=grid.device)
    out[grid[present]] = score_grid[present]
    return out

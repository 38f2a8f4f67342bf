"""HIPPO's holistic fusion (Eq. 7): z-score each signal within its frame, then add them up.

Per frame f and per score type, s_hat = (s - mu_f) / sigma_f over that frame's prunable tokens, so a
score that is large everywhere in one frame (attention on the frame nearest the prompt) cannot crowd
out the others; the fused score is the sum of the z-scored components that are enabled.

Choices where the paper is silent: sigma_f is the population standard deviation (divide by n); a frame
where a score is constant (sigma_f = 0, e.g. a one-token frame) contributes 0 for that score.
Non-prunable tokens are left out of mu_f / sigma_f and score 0: they are kept anyway.
"""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout


def zscore_within_frame(
    score: torch.Tensor,  # (N,) one score per video token
    layout: VideoTokenLayout,
) -> torch.Tensor:  # (N,) float32
    device = score.device
    idx = torch.nonzero(layout.prunable.to(device)).squeeze(1)
    s = score.float()[idx]
    frame = layout.frame.to(device)[idx]
    num_frames = layout.grid[0]
    count = torch.zeros(num_frames, device=device).index_add_(0, frame, torch.ones_like(s))
    mean = torch.zeros(num_frames, device=device).index_add_(0, frame, s) / count.clamp(min=1)
    dev = s - mean[frame]
    var = torch.zeros(num_frames, device=device).index_add_(0, frame, dev**2) / count.clamp(min=1)
    std = var.sqrt()[frame]
    # a relative floor, so a frame that is constant up to rounding noise reads as constant
    flat = std <= 1e-6 * (mean[frame].abs() + 1e-12)
    out = torch.zeros(layout.num_tokens, dtype=torch.float32, device=device)
    out[idx] = torch.where(flat, torch.zeros_like(dev), dev / std.clamp(min=1e-30))
    return out


def hippo_score(
    layout: VideoTokenLayout,
    attn: torch.Tensor | None = None,  # (N,) s_attn, or None to leave it out (HIPPO w/o attn)
    temp: torch.Tensor | None = None,  # (N,) s_temp, or None (HIPPO w/o temp)
    spa: torch.Tensor | None = None,  # (N,) s_spa, or None (HIPPO w/o spa)
) -> torch.Tensor:  # (N,) float32
    parts = [zscore_within_frame(s, layout) for s in (attn, temp, spa) if s is not None]
    if not parts:
        raise ValueError("hippo_score needs at least one of attn, temp, spa")
    return torch.stack(parts).sum(0)

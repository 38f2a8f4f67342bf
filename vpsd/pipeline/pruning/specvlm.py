"""SpecVLM's two-stage pruning (Sec. 3.2): attention top-P, then spatially uniform sampling of the rest.

Stage I (Eq. 6): rank the prunable tokens by the verifier's text-to-video attention a_j and keep the
fewest top tokens whose attention adds up to at least lambda of the total; never more than the budget.
Stage II (Eq. 7): fill the rest of the budget from the tokens left, at a fixed interval over them in
video order (frame-major raster, i.e. the frame grid), both ends included.

Where the paper and its code differ we follow the code (zju-jiyicheng/SpecVLM, drop_visual_tokens_specvlm):
Eq. 7 reads I = (|V| - |V_R|) / ((1 - r)|V|), which would keep |V_R| tokens over budget; the code, like
the text ("KV cache reduced to 1 - r of its original size"), fills only budget - |V_R|.

lambda is calibrated per model family offline; the paper uses 0.4 for LLaVA-OneVision (Table 1) and 0.5
for Qwen2.5-VL (Table 2). 0.5 is the default here.
"""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.select import evenly_spaced, keep_with_fixed, rank_descending

SPECVLM_DEFAULT_LAMBDA = 0.5
SPECVLM_LAMBDA_BY_FAMILY = {"llava_onevision": 0.4, "qwen2_5_vl": 0.5}


def specvlm_lambda(family: str | None, configured: float | None = None) -> float:
    """lambda for a run: the configured value, else the paper's for the family (Tables 1-2), else 0.5
    (Qwen3-VL is not in the paper)."""
    if configured is not None:
        return float(configured)
    return SPECVLM_LAMBDA_BY_FAMILY.get(family or "", SPECVLM_DEFAULT_LAMBDA)


def top_p_count(score: torch.Tensor, lam: float) -> int:
    """Eq. 6: the fewest top scores (n,) whose sum reaches lam of the total (0 when lam = 0)."""
    ranked = torch.sort(score.double(), descending=True).values
    cum = torch.cumsum(ranked, 0)
    if lam * cum[-1] <= 0:
        return 0
    # a share that meets lambda up to float rounding (e.g. 0.4 read from float32) counts as met
    target = (lam - 1e-6) * cum[-1]
    # cum[-1] is the total, so the search always lands inside the array even when lam = 1
    return int(torch.searchsorted(cum, target.reshape(1)).item()) + 1


def specvlm_select(
    attn_score: torch.Tensor,  # (N,) text-to-video attention a_j (Eq. 5), non-negative
    layout: VideoTokenLayout,
    ratio: float,
    lam: float = SPECVLM_DEFAULT_LAMBDA,
) -> torch.Tensor:  # kept indices, see select.py
    prunable = torch.nonzero(layout.prunable.cpu()).squeeze(1)
    score = attn_score.detach().cpu().float()[prunable]
    budget = layout.budget(ratio)
    n_top = min(top_p_count(score, lam), budget)
    order = rank_descending(score)
    top = order[:n_top]
    left = torch.ones(prunable.numel(), dtype=torch.bool)
    left[top] = False
    rest = torch.nonzero(left).squeeze(1)  # in video order, so evenly spaced = spatially uniform
    uniform = rest[evenly_spaced(rest.numel(), budget - n_top)]
    return keep_with_fixed(layout, prunable[torch.cat([top, uniform])])

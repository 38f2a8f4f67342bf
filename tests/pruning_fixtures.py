"""Pruning test fixtures: Qwen-style and LLaVA-style (newline) layouts, random signals, the kept contract."""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.strategies import PruningSignals


def grid_layout(t: int, h: int, w: int, start: int = 0) -> VideoTokenLayout:
    return VideoTokenLayout.from_grid(torch.arange(start, start + t * h * w), (t, h, w))


def newline_layout(t: int, h: int, w: int, start: int = 0, per: str = "row") -> VideoTokenLayout:
    """Patches in raster order with a non-prunable newline token after every row (or every frame)."""
    frame, row, col, prunable = [], [], [], []
    for f in range(t):
        for r in range(h):
            for c in range(w):
                frame.append(f), row.append(r), col.append(c), prunable.append(True)
            if per == "row" or r == h - 1:
                frame.append(f), row.append(-1), col.append(-1), prunable.append(False)
    n = len(frame)
    return VideoTokenLayout(
        seq_positions=torch.arange(start, start + n),
        frame=torch.tensor(frame),
        row=torch.tensor(row),
        col=torch.tensor(col),
        prunable=torch.tensor(prunable),
        grid=(t, h, w),
    )


def check_kept(kept: torch.Tensor, layout: VideoTokenLayout, ratio: float) -> None:
    """The kept-index contract of vpsd.pipeline.pruning.select."""
    assert kept.dtype == torch.int64 and kept.dim() == 1
    assert torch.equal(kept, torch.unique(kept)), "kept indices must be sorted and unique"
    assert int(kept.min()) >= 0 and int(kept.max()) < layout.num_tokens
    fixed = torch.nonzero(~layout.prunable).squeeze(1)
    assert torch.isin(fixed, kept).all(), "every non-prunable token must be kept"
    assert int(layout.prunable[kept].sum()) == layout.budget(ratio)


def signals_for(layout: VideoTokenLayout, seed: int) -> PruningSignals:
    """Random signals of the right shapes: 2 layers, 2 KV heads, 3 text tokens after the video."""
    gen = torch.Generator().manual_seed(seed)
    n, nt = layout.num_tokens, 3
    return PruningSignals(
        visual_embeds=torch.randn(n, 6, generator=gen),
        # peaked like real attention; 80% of each head's attention on video, the rest on other tokens
        video_attention=0.8 * torch.softmax(3 * torch.randn(2, 2, n, generator=gen), dim=-1),
        video_hidden=torch.randn(3, n, 6, generator=gen),
        text_hidden=torch.randn(3, nt, 6, generator=gen),
    )

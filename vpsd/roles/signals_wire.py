"""How pruning signals and the video token layout travel between ranks as tensors.

The tensor announce names the fields in order (`names`: visual_embeds, video_attention, ..., layout, grid), so
the receiver rebuilds them without any shared state. Floating fields arrive as float32 (the strategies
score in float32; the attention mass already is). Pure packing; the roles do the sending.
"""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.strategies import PruningSignals

TAG = "signals"


def pack(signals: dict[str, torch.Tensor], layout: VideoTokenLayout) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of the signals and the layout, in the announce's order."""
    tensors = [value.contiguous() for value in signals.values()]
    rows = torch.stack([layout.seq_positions, layout.frame, layout.row, layout.col, layout.prunable.long()])
    tensors += [rows, torch.tensor(layout.grid, dtype=torch.long)]
    return list(signals) + ["layout", "grid"], tensors


def unpack(names: list[str], tensors: list[torch.Tensor]) -> tuple[PruningSignals, VideoTokenLayout]:
    if len(names) != len(tensors):
        raise ValueError(f"signals tag names {len(names)} tensors, {len(tensors)} arrived")
    named = dict(zip(names, tensors))
    rows, grid = named.pop("layout"), named.pop("grid")
    layout = VideoTokenLayout(
        seq_positions=rows[0], frame=rows[1], row=rows[2], col=rows[3], prunable=rows[4].bool(),
        grid=tuple(int(v) for v in grid),
    )
    signals = PruningSignals(**{k: (v.float() if v.is_floating_point() else v) for k, v in named.items()})
    return signals, layout

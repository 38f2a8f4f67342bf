"""How pruning signals and the video token layout travel between ranks as tensors.

The tag of the tensor announce names the fields in order ("signals:visual_embeds,keys*28,layout,grid"),
so the receiver rebuilds them without any shared state; "name*n" is a field sent as n tensors (the keys,
one per layer, straight from the target's KV cache, never stacked into a copy). The receiver keeps the
text queries and keys in the target's dtype (attention.py widens one layer at a time), so a bf16 target's
keys are not doubled into float32 on the pruner. Pure packing; the roles do the sending.
"""

from __future__ import annotations

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.pruning.strategies import PruningSignals

PREFIX = "signals:"


# Fields the strategies widen themselves, chunk by chunk: kept in the sender's dtype.
_KEEP_DTYPE = frozenset({"keys", "text_queries"})


def pack(
    signals: dict[str, torch.Tensor | tuple[torch.Tensor, ...]], layout: VideoTokenLayout
) -> tuple[str, list[torch.Tensor]]:
    names, tensors = [], []
    for name, value in signals.items():
        if isinstance(value, (tuple, list)):
            names.append(f"{name}*{len(value)}")
            tensors.extend(t.contiguous() for t in value)
        else:
            names.append(name)
            tensors.append(value.contiguous())
    rows = torch.stack([layout.seq_positions, layout.frame, layout.row, layout.col, layout.prunable.long()])
    tensors += [rows, torch.tensor(layout.grid, dtype=torch.long)]
    return PREFIX + ",".join(names + ["layout", "grid"]), tensors


def unpack(tag: str, tensors: list[torch.Tensor]) -> tuple[PruningSignals, VideoTokenLayout]:
    if not tag.startswith(PREFIX):
        raise ValueError(f"not a signals tag: {tag!r}")
    named: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    rest = iter(tensors)
    for name in tag[len(PREFIX) :].split(","):
        field, star, count = name.partition("*")
        named[field] = tuple(next(rest) for _ in range(int(count))) if star else next(rest)
    rows, grid = named.pop("layout"), named.pop("grid")
    layout = VideoTokenLayout(
        seq_positions=rows[0], frame=rows[1], row=rows[2], col=rows[3], prunable=rows[4].bool(),
        grid=tuple(int(v) for v in grid),
    )
    signals = PruningSignals(
        **{k: (v.float() if k not in _KEEP_DTYPE and v.is_floating_point() else v) for k, v in named.items()}
    )
    return signals, layout

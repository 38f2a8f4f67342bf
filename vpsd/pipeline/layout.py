"""Where the video tokens sit, on the frame grid and in the sequence.

Every pruning score needs each video token's frame, row and column; every model family lays its
video tokens out differently (Qwen merges 2x2 patches and pairs frames, LLaVA-OneVision pools and
appends a newline token per row). The adapters describe their layout with this one dataclass, so the
scoring code never sees an architecture.

Conventions used across vpsd:
- "video token index" i in [0, N): the i-th video token in sequence order.
- `seq_positions[i]`: where token i sits in the input_ids sequence.
- kept indices are video token indices, sorted, unique; non-prunable tokens (newlines) are always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VideoTokenLayout:
    seq_positions: torch.Tensor  # (N,) int64, index of each video token in input_ids
    frame: torch.Tensor  # (N,) int64, temporal index on the token grid (after temporal merging)
    row: torch.Tensor  # (N,) int64, row on the token grid (-1 for non-patch tokens)
    col: torch.Tensor  # (N,) int64, column on the token grid (-1 for non-patch tokens)
    prunable: torch.Tensor  # (N,) bool, False for newline / separator tokens that are never pruned
    grid: tuple[int, int, int]  # (frames, rows, cols) of the patch-token grid

    @property
    def num_tokens(self) -> int:
        return int(self.seq_positions.numel())

    @property
    def num_prunable(self) -> int:
        return int(self.prunable.sum())

    def check_same_grid(self, target_grid: tuple[int, ...] | list[int], who: str = "draft") -> None:
        """Raises ValueError unless this (the draft's) token grid is the target's: kept indices are
        positions on the target's grid, so on another grid they would silently name other tokens."""
        if tuple(int(v) for v in target_grid) != tuple(self.grid):
            raise ValueError(
                f"{who} video grid {tuple(self.grid)} differs from the target's {tuple(int(v) for v in target_grid)}: "
                f"the two checkpoints' vision settings (patch, merge, temporal patch, pixel bounds) must agree"
            )

    def budget(self, ratio: float) -> int:
        """Number of prunable tokens kept when a share `ratio` of them is pruned (at least 1)."""
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"pruning ratio must be in [0, 1), got {ratio}")
        return max(1, round((1.0 - ratio) * self.num_prunable))

    def patch_index_grid(self) -> torch.Tensor:
        """(frames, rows, cols) tensor holding the video token index of each patch token."""
        t, h, w = self.grid
        out = torch.full((t, h, w), -1, dtype=torch.long)
        idx = torch.nonzero(self.prunable).squeeze(1)
        out[self.frame[idx], self.row[idx], self.col[idx]] = idx
        return out

    @staticmethod
    def from_grid(seq_positions: torch.Tensor, grid: tuple[int, int, int]) -> "VideoTokenLayout":
        """Layout of a plain frame-major, row-major patch grid with no extra tokens (Qwen)."""
        t, h, w = grid
        n = t * h * w
        if seq_positions.numel() != n:
            raise ValueError(f"{seq_positions.numel()} video tokens do not fill a {grid} grid")
        ar = torch.arange(n)
        return VideoTokenLayout(
            seq_positions=seq_positions.long(),
            frame=ar // (h * w),
            row=(ar // w) % h,
            col=ar % w,
            prunable=torch.ones(n, dtype=torch.bool),
            grid=grid,
        )

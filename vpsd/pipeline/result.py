"""What every decoder returns: the tokens, the acceptance statistics and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.stats import AcceptanceStats


@dataclass
class DecodeResult:
    token_ids: list[int]
    stats: AcceptanceStats
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_kept: int | None = None  # video tokens the draft saw (None: no draft)
    num_video_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # finer spans (vision, prune, draft, verify)
    # The video tokens a pruned-input draft saw and the layout that places them (serial runs log them to
    # kept.jsonl as the pruner rank does for parallel ones); None when no draft was pruned by index.
    kept: torch.Tensor | None = None
    layout: VideoTokenLayout | None = None
    gamma: float | None = None  # the draft window, averaged over rounds when it moved (gamma auto); None: no draft

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0

    def stats_dict(self) -> dict:
        return {
            **self.stats.as_dict(),
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "num_kept": self.num_kept,
            "num_video_tokens": self.num_video_tokens,
            "gamma": self.gamma,
            **{f"{k}_s": v for k, v in self.timings.items()},
        }

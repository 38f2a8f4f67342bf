"""kept.jsonl: the video tokens the draft kept, per item, with the layout needed to place them on the frame.

Written by the pruner rank of a parallel run (RUN_DIR/kept.jsonl) and by `vpsd bench pruning`; read by
`vpsd bias` (reports/bias.py). One JSON object per line, appended and flushed like results.jsonl:

    {"id": "world-0", "strategy": "hippo", "ratio": 0.9, "grid": [T, H, W],
     "kept":     [video token indices, sorted, unique],
     "frame":    [frame of every video token],        # the VideoTokenLayout rows, one entry per video token
     "row":      [row of every video token],          # -1 for non-patch tokens (LLaVA-OneVision newlines)
     "col":      [column of every video token],
     "prunable": [0 / 1 for every video token]}

The layout travels explicitly (not rebuilt from the grid) because families lay tokens out differently
(newline tokens, pooling); sequence positions are left out (a report never needs them). A rerun appends:
`read_kept` keeps the last record per (id, strategy). Human-readable JSON rather than npz: about 4 small
ints per video token, ~150 kB for a 10k-token item, and a person can grep it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.storage import LineFile

FILENAME = "kept.jsonl"


@dataclass
class KeptRecord:
    item_id: str
    strategy: str
    ratio: float
    kept: torch.Tensor  # (K,) int64 video token indices
    layout: VideoTokenLayout  # seq_positions are 0..N-1 placeholders

    def to_json(self) -> dict:
        lay = self.layout
        return {
            "id": self.item_id, "strategy": self.strategy, "ratio": self.ratio, "grid": list(lay.grid),
            "kept": self.kept.tolist(), "frame": lay.frame.tolist(), "row": lay.row.tolist(),
            "col": lay.col.tolist(), "prunable": lay.prunable.int().tolist(),
        }

    @staticmethod
    def from_json(row: dict) -> "KeptRecord":
        frame = torch.tensor(row["frame"], dtype=torch.long)
        layout = VideoTokenLayout(
            seq_positions=torch.arange(frame.numel()), frame=frame,
            row=torch.tensor(row["row"], dtype=torch.long), col=torch.tensor(row["col"], dtype=torch.long),
            prunable=torch.tensor(row["prunable"], dtype=torch.bool), grid=tuple(int(v) for v in row["grid"]),
        )
        return KeptRecord(str(row["id"]), str(row["strategy"]), float(row["ratio"]),
                          torch.tensor(row["kept"], dtype=torch.long), layout)


def append_kept(out_dir: Path, record: KeptRecord) -> None:
    path = Path(out_dir) / FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with LineFile(path) as f:  # whole lines only, also on a full disk (vpsd/storage.py)
        f.write(json.dumps(record.to_json()) + "\n")
        f.fsync()


def read_kept(path: Path) -> list[KeptRecord]:
    """Records of a kept.jsonl (or of RUN_DIR/kept.jsonl), the last per (id, strategy), in first-seen order.

    A line cut by a crash is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    latest: dict[tuple[str, str], KeptRecord] = {}
    for line in path.read_text().splitlines():
        try:
            record = KeptRecord.from_json(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        latest[(record.item_id, record.strategy)] = record
    return list(latest.values())

"""results.jsonl: one line per finished item, appended and flushed, so a crash loses at most the item
in flight; a rerun with the same output directory skips the ids already done."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ResultsFile:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / "results.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def finished(self, method: str, include_failed: bool = True) -> set[str]:
        """Ids with a result for `method` (failed ones too unless include_failed is False)."""
        done: set[str] = set()
        if not self.path.exists():
            return done
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash: that item runs again
            if row.get("method") == method and (include_failed or row.get("error") is None):
                done.add(str(row["id"]))
        return done

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

"""How fast vpsd answered a task's requests, written beside lmms-eval's results.

One file a task and method, `<results dir>/vpsd_speed_<task>_<method>.json`; <results dir> is where lmms-eval
writes its `<date>_results.json` (model.py `results_dir`). It holds:
- the sums vpsd's own summary.json holds for a job (reports/summary.py `summarize_rows`): items done and failed,
  tokens, rounds, `mean_accepted_tokens` (MAT), acceptance rate, `tokens_per_s` (tokens over the items' vision +
  prefill + decode seconds), `decode_s`, `prefill_s`, `decode_wall_s`, seconds per decoded token;
- `generate_wall_s`: the seconds the `generate` calls that held the task's requests took (videos read, prefills
  and decodes, as the evaluation waited for them; a call holding several tasks counts for each);
- `settings`: the method and the backend's model args; `ranks`: the data-parallel ranks that answered;
- `rows`: one a document in results.jsonl's form (`id`, `method`, `token_ids`, `stats`, `error`);
- when the same folder holds the `ar` file of the task, the comparison on the documents both finished
  (reports/summary.py `compare_rows`): `speedup_vs_ar` (wall), `decode_speedup_vs_ar`, `tokens_per_s_vs_ar`,
  `identical_outputs` of `items_compared`.
A later run of the same task and method replaces its file. Data-parallel ranks each hold their share of the
rows; `SpeedLog.write` gathers them to rank 0, which writes (every rank must call it, once: it is a collective).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from vpsd.reports.summary import compare_rows, summarize_rows

BASELINE = "ar"


def speed_file(results_dir: Path, task: str, method: str) -> Path:
    return Path(results_dir) / f"vpsd_speed_{re.sub(r'[^A-Za-z0-9_.-]+', '_', task)}_{method}.json"


class SpeedLog:
    """The rows of the tasks this process answered, until `write` gathers and writes them."""

    def __init__(self, method: str, settings: dict[str, Any]) -> None:
        self.method, self.settings = method, settings
        self.rows: dict[str, list[dict]] = defaultdict(list)
        self.wall: dict[str, float] = defaultdict(float)

    def add(self, task: str, row: dict) -> None:
        self.rows[task].append({**row, "method": self.method})

    def add_wall(self, tasks: set[str], seconds: float) -> None:
        for task in tasks:
            self.wall[task] += seconds

    def write(self, results_dir: Path | None) -> dict[str, dict]:
        """Every task's summary (all ranks' rows), written on rank 0 when `results_dir` is known."""
        parts = _gather((dict(self.rows), dict(self.wall)))
        rows: dict[str, list[dict]] = defaultdict(list)
        wall: dict[str, float] = defaultdict(float)
        for part_rows, part_wall in parts:
            for task, task_rows in part_rows.items():
                rows[task] += task_rows
            for task, seconds in part_wall.items():
                wall[task] = max(wall[task], seconds)  # ranks decode side by side: the eval waits for the slowest
        out = {task: self._summary(task, task_rows, wall[task], len(parts), results_dir)
               for task, task_rows in rows.items()}
        if results_dir is not None and _rank() == 0:
            Path(results_dir).mkdir(parents=True, exist_ok=True)
            for task, summary in out.items():
                speed_file(results_dir, task, self.method).write_text(json.dumps(summary, indent=2))
        return out

    def _summary(self, task: str, rows: list[dict], wall: float, ranks: int, results_dir: Path | None) -> dict:
        rows = sorted(rows, key=lambda r: r["id"])
        summary = {"task": task, "method": self.method, **summarize_rows(rows), "generate_wall_s": wall,
                   "ranks": ranks, "settings": self.settings}
        baseline = speed_file(results_dir, task, BASELINE) if results_dir is not None else None
        if self.method != BASELINE and baseline is not None and baseline.is_file():
            base = json.loads(baseline.read_text())
            compared = compare_rows(base["rows"], rows)
            summary.update({"baseline": baseline.name, "items_compared": compared["items_compared"],
                            "identical_outputs": compared["identical_outputs"],
                            "speedup_vs_ar": compared["speedup_vs_baseline"],
                            "decode_speedup_vs_ar": compared["decode_speedup_vs_baseline"],
                            "tokens_per_s_vs_ar": (summary["tokens_per_s"] / base["tokens_per_s"]
                                                   if base.get("tokens_per_s") else 0.0)})
        return {**summary, "rows": rows}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather(part: Any) -> list[Any]:
    """Every rank's `part` (lmms-eval's process group, when it runs data-parallel), else this one's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [part]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts

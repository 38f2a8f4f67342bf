"""results.jsonl: one line per finished item, appended and flushed, so a crash loses at most the item
in flight; a rerun with the same output directory skips the ids already done.

Only the target rank writes it. `resume` is called once at the start of every run (and of every
torchrun restart) before anything is appended:
- a last line cut by a crash (no trailing newline) is cut off, so the next append starts a line of its
  own instead of gluing onto the fragment; that item simply runs again;
- with `retry_failed`, the error rows of the method are removed (rewritten to a temporary file and
  renamed over, so a crash leaves the old file or the new one, never half of one): the file keeps
  exactly one line per id and those ids run again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

from vpsd.pipeline.stopping import StopCut, cut_at_stop
from vpsd.storage import LineFile


@dataclass(frozen=True)
class ItemError:
    """Why an item has no output: the exception's type and message, and for a video that cannot be read the
    kind (`missing`, `empty`, `corrupt`, `no_video_stream`, `too_long`)."""

    type: str
    message: str
    kind: str | None = None

    def to_json(self) -> dict[str, str]:
        out = {"type": self.type, "message": self.message}
        return out if self.kind is None else {**out, "kind": self.kind}


@dataclass
class ResultRow:
    """One line of results.jsonl. `stats` holds the decode's counters and times (DecodeStats, the item's video
    timings, frames, batch size); `extra`, the manifest line's own fields, carried through untouched."""

    id: str
    method: str
    token_ids: list[int]
    text: str
    stats: dict[str, Any]
    error: ItemError | None = None
    strategy: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "ResultRow":
        known = {"id", "method", "strategy", "token_ids", "text", "stats", "error"}
        err = row.get("error")
        return cls(str(row["id"]), row["method"], list(row.get("token_ids", [])), row.get("text", ""),
                   dict(row.get("stats", {})), None if err is None else ItemError(**err), row.get("strategy"),
                   {k: v for k, v in row.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        head = {"id": self.id, "method": self.method} | ({} if self.strategy is None else {"strategy": self.strategy})
        return {**head, **self.extra, "token_ids": self.token_ids, "text": self.text, "stats": self.stats,
                "error": None if self.error is None else self.error.to_json()}


def output_of(decode: Callable[[Sequence[int]], str], token_ids: Sequence[int], stop: Sequence[str],
              eos_token_ids: Collection[int]) -> tuple[StopCut, str]:
    """A decoded item's output as plain decoding returns it (cut at its first stop string: pipeline/stopping.py)
    and its `finish_reason`: "stop" when it ended at an EOS token or a stop string, "length" at the token budget
    (max_new_tokens). `decode`: the tokenizer's, as results read it."""
    out = cut_at_stop(decode, token_ids, stop)
    ended = out.stopped or bool(out.tokens and out.tokens[-1] in eos_token_ids)
    return out, "stop" if ended else "length"


class ResultsFile:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / "results.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def resume(self, method: str, retry_failed: bool = False) -> set[str]:
        """Repair and compact the file as the module docstring says; the ids not to run again."""
        self._drop_cut_tail()
        if retry_failed:
            self._drop_errors(method)
        return self.finished(method)

    def finished(self, method: str, include_failed: bool = True) -> set[str]:
        """Ids with a result for `method` (failed ones too unless include_failed is False)."""
        done: set[str] = set()
        for row in self._rows():
            if row.get("method") == method and (include_failed or row.get("error") is None):
                done.add(str(row["id"]))
        return done

    def append(self, row: ResultRow) -> None:
        """One whole line, on disk (fsync) before returning; DiskFull (vpsd/storage.py) leaves the file as it was."""
        with LineFile(self.path) as f:
            f.write(json.dumps(row.to_json(), ensure_ascii=False) + "\n")
            f.fsync()

    def _rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash: that item runs again
        return rows

    def _drop_cut_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                os.fsync(f.fileno())

    def _drop_errors(self, method: str) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines(keepends=True)
                if not _is_error_of(line, method)]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _is_error_of(line: str, method: str) -> bool:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return False
    return row.get("method") == method and row.get("error") is not None

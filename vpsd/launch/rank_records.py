"""What each rank tells its launcher (vpsd/launch/launcher.py) about itself, so that the launcher can say in one
line who ended a job and how: a small JSON file a rank, in a directory the launcher makes for the launch.

- `record_rank(role, rank)`: written by every rank as soon as it knows its role, before the rendezvous: its
  role, global rank, node (torchrun's GROUP_RANK), pipeline and pid.
- `note(rank, item=, said=, ended_by=)`: added as the rank ends: the item it was on (the target's, for "while
  the target was on item X"), the line it would have said itself (a peer gone silent or stuck: the launcher says
  it, unless it knows better, so that a job ends on one line), or, in a peer's record, that this rank ended it
  (a silent rank it killed: its SIGKILL is then not the cause to name).
- `read_records(directory)`: the launcher's side, by global rank.

Only under ./torchrun.sh (`VPSD_LAUNCH_DIR` set); a rank started any other way writes nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

LAUNCH_DIR = "VPSD_LAUNCH_DIR"  # set by the launcher for the ranks it starts


@dataclass(frozen=True)
class RankRecord:
    role: str
    rank: int
    node: int
    pipeline: int | None
    pid: int
    item: str | None = None  # the item it was on when it ended
    said: str | None = None  # why it ended, in its own words
    ended_by: str | None = None  # the peer that killed it, and why


def launch_dir() -> Path | None:
    value = os.environ.get(LAUNCH_DIR)
    return Path(value) if value else None


def record_rank(role: str, rank: int, pipeline: int | None) -> None:
    directory = launch_dir()
    if directory is not None:
        _write(directory, RankRecord(role, rank, int(os.environ.get("GROUP_RANK", "0")), pipeline, os.getpid()))


def note(rank: int, **fields: str | None) -> None:
    """Add `fields` (item, said, ended_by) to rank `rank`'s record; None values are left out. From a signal
    handler too: one small write, no lock taken."""
    directory = launch_dir()
    fields = {k: v for k, v in fields.items() if v is not None}
    if directory is None or not fields:
        return
    try:
        record = RankRecord(**json.loads((directory / f"rank{rank}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return
    _write(directory, RankRecord(**{**asdict(record), **fields}))


def read_records(directory: Path) -> dict[int, RankRecord]:
    records = {}
    for path in directory.glob("rank*.json"):
        try:
            record = RankRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # half-written by a rank killed mid-write: that rank is then named by its number alone
        records[record.rank] = record
    return records


def _write(directory: Path, record: RankRecord) -> None:
    path = directory / f"rank{record.rank}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, path)  # whole or absent: the launcher never reads half a record
    except OSError:
        pass  # the launcher's directory is gone (it ended): nobody will read this

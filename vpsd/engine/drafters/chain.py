"""The one batched chain step of the draft's side: every row brought in line with its sequence, then ONE forward.

Each row's cache is described by a `CacheCursor` (pipeline/kv.py): the tokens it was fed. Given each row's sequence
(what it must hold: the committed tokens, then what it drafted on top), `lacking` rolls every row back to the
longest prefix its cache agrees with and `feed_rows` feeds all rows what they lack in one forward of the proposer
(`feed_missing`: both); a row lacking nothing is not fed, and its last logits stay what its next proposal reads. Proposing is the proposer's
(`propose(item, pos, sampler)`, engine/proposers.py). The drafters in the target's process (local.py, tree.py)
and the draft role on its rank or thread (roles/draft.py) all draft with these two calls, so a draft step is
written once: whichever place runs it, a row is fed and proposes exactly as at batch 1.
"""

from __future__ import annotations

from typing import Protocol

from vpsd.models.timing import Stopwatch
from vpsd.pipeline.kv import CacheCursor


class FeedsRows(Protocol):
    def rollback(self, item: str, length: int) -> None: ...

    def feed(self, feeds: dict[str, list[int]]) -> tuple[int, Stopwatch]: ...


def lacking(proposer: FeedsRows, cursors: dict[str, CacheCursor],
            sequences: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each row `sequences` names rolled back to what its cache shares with its sequence; returns what the rows
    lack, by row (a row lacking nothing is left out)."""
    feed = {}
    for item, sequence in sequences.items():
        length, pending = cursors[item].sync(sequence)
        proposer.rollback(item, length)  # nothing when the cache holds no more than that
        if pending:
            feed[item] = pending
    return feed


def feed_rows(proposer: FeedsRows, cursors: dict[str, CacheCursor], feed: dict[str, list[int]]) -> Stopwatch:
    """ONE forward of every row's tokens (`lacking`'s); returns its stopwatch (read its `seconds` after a proposal
    from it: on a GPU earlier would wait for the forward)."""
    _, watch = proposer.feed(feed)
    for item, pending in feed.items():
        cursors[item].feed(pending)
    return watch


def feed_missing(proposer: FeedsRows, cursors: dict[str, CacheCursor],
                 sequences: dict[str, list[int]]) -> Stopwatch | None:
    """`lacking`, then `feed_rows` when a row lacks anything (None: none did)."""
    feed = lacking(proposer, cursors, sequences)
    return feed_rows(proposer, cursors, feed) if feed else None

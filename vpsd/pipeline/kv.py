"""KV-cache bookkeeping: which generated tokens a model's cache holds, and how to bring it in line.

A model's cache holds the prefill plus some generated tokens it was fed. After verification the
committed sequence may diverge from what the cache holds (rejected drafts), or run ahead of it
(accepted tokens the model has not been fed, the recovered / bonus token). `CacheCursor.sync`
returns the length to roll back to and the tokens to feed next. Pure: the caller applies it with
`adapter.rollback` and `adapter.step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheCursor:
    prefill_len: int
    fed: list[int] = field(default_factory=list)  # generated tokens in the cache, in order

    @property
    def length(self) -> int:
        return self.prefill_len + len(self.fed)

    def feed(self, token_ids: list[int]) -> None:
        self.fed.extend(token_ids)

    def sync(self, committed: list[int]) -> tuple[int, list[int]]:
        """Keeps the longest prefix of `fed` that agrees with `committed`.

        Returns (cache length to roll back to, committed tokens the cache still lacks) and updates
        the cursor to the rolled-back state (the caller feeds the pending tokens and calls feed()).
        """
        n = 0
        limit = min(len(self.fed), len(committed))
        while n < limit and self.fed[n] == committed[n]:
            n += 1
        del self.fed[n:]
        return self.prefill_len + n, list(committed[n:])

    def verify_feed(self, committed: list[int], window: list[int]) -> tuple[int, list[int], int]:
        """The one verify step's bookkeeping (serial, batched and the target role alike): the length to roll
        the cache back to, the tokens to feed (the committed ones it lacks, then the window), and the index of
        the first logits row that scores the window (`verification.window_rows`). -1: the cache lacks nothing,
        so the row for the window's first token is the one the previous forward produced (the kept row).
        Records the feed."""
        length, pending = self.sync(committed)
        self.feed(pending + window)
        return length, pending + window, len(pending) - 1


"""The progress bar of a batch job: items done (of the manifest), failures, tokens/s, ETA.

Only the target rank shows one (it owns the item loop). Quiet when asked (`--quiet`) or when stderr
is not a terminal: a batch system's log file gets no carriage-return noise; the per-item
`item_done` events in the target's trace and the final summary say the same things.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def wants_bar(quiet: bool, stream: TextIO | None = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    return not quiet and bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """Counts what this run finished; `total` and `initial` are over the whole manifest, so a
    resumed job shows where it stands and its ETA covers only what is left."""

    def __init__(self, total: int, initial: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.failed = 0
        self.tokens = 0
        self._start = time.perf_counter()
        self._bar = tqdm(total=total, initial=initial, unit="item", dynamic_ncols=True, disable=not enabled,
                         file=stream if stream is not None else sys.stderr, desc="vpsd")

    def item_done(self, tokens: int, failed: bool) -> None:
        self.tokens += tokens
        self.failed += int(failed)
        elapsed = time.perf_counter() - self._start
        self._bar.set_postfix(failed=self.failed, tok_s=f"{self.tokens / elapsed:.1f}" if elapsed > 0 else "-",
                              refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()

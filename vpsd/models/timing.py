"""Clock reads that time a forward, not its launch.

On a GPU a forward returns as soon as its kernels are queued; a clock read right after it measures the launch,
and the window's costs (T_p, T_q: pipeline/cost.py) would be wrong by the whole forward.
- `Stopwatch` is what the decode loop uses: on a GPU two CUDA events around the forward, read once the host has
  read a result of that work anyway (the round's token ids), so timing adds no synchronisation to a step; on a
  CPU the clock.
- `settle` / `settled_clock` wait for the device first (a synchronisation: for benchmarks, never in a round).
"""

from __future__ import annotations

import threading
import time

import torch

# Held while a CUDA graph records (models/step_graphs.py): a device synchronisation from another thread of the
# process (a role on a thread timing its work) waits for it, rather than meet a capture in progress.
RECORDING = threading.RLock()


def settle(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        with RECORDING:
            torch.cuda.synchronize(device)


def settled_clock(device: torch.device | str) -> float:
    """`time.perf_counter()` once the device's queued work is done."""
    settle(device)
    return time.perf_counter()


class Stopwatch:
    """Started at construction, `stop()` after the work is queued; `seconds` once the host has read something the
    work produced (on a GPU reading it earlier waits for the work: the synchronisation this class avoids)."""

    def __init__(self, device: torch.device | str) -> None:
        self.started = time.time()  # wall clock, to place the work on the timeline (tracing.record_span)
        self._events = torch.device(device).type == "cuda"
        self._seconds: float | None = None
        if self._events:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> "Stopwatch":
        if self._events:
            self._end.record()
        else:
            self._seconds = time.perf_counter() - self._t0
        return self

    @property
    def seconds(self) -> float:
        if self._seconds is None:
            self._end.synchronize()  # already done when read after the work's result
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds

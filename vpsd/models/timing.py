"""Clock reads that time a forward, not its launch.

On a GPU a forward returns as soon as its kernels are queued; a clock read right after it measures the launch,
and the window's costs (T_p, T_q: pipeline/cost.py) would be wrong by the whole
forward. `settle` waits for the device first; on a CPU it does nothing.
"""

from __future__ import annotations

import time

import torch


def settle(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settled_clock(device: torch.device | str) -> float:
    """`time.perf_counter()` once the device's queued work is done."""
    settle(device)
    return time.perf_counter()

"""What a forward dispatches: its aten ops, and the host reads among them (each one a GPU queue drained).

On a GPU a step's cost is its kernels plus what the CPU spends launching them, and a read of a device value by the
host (`.item()`, `.tolist()`, `int(t)`, a mask's `nonzero`, a device synchronisation to read a clock) stops the CPU
until the GPU's queue is empty: nothing can be launched ahead, and a captured step's single launch waits on it.
So two counts tell, on any machine (tests/models/test_step_dispatch.py runs them on CPU in CI), whether a step can run at
its memory's speed on a GPU:
- `ops`: aten ops dispatched (each is one or more kernel launches on a GPU: ~5-15 us of CPU each, eager);
- `host_reads`: the reads of a tensor's value by the host. Seen two ways, since on a CPU some never reach the
  dispatcher: the aten ops whose output the host must read (`_local_scalar_dense` behind `.item()`, `int()`,
  `bool()`; `nonzero`, `masked_select`, `unique` whose output shape is data), and the Python-level reads of a
  tensor (`tolist`, `item`, `numpy`, `cpu`, `__bool__`, `__int__`, `__index__`, `__float__`), plus every
  `vpsd.models.timing.settle` (a device synchronisation to read a clock).

`audit()` is a context manager recording both while it is open (this thread's tensors; use it around one step).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vpsd.models import timing

# aten ops whose result the host must read before it can go on (their output's value or shape is data).
HOST_OPS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                      "aten._unique2.default", "aten.unique_consecutive.default", "aten.is_nonzero.default",
                      "aten.equal.default"})
# Tensor methods that hand a tensor's value to Python (some never dispatch an aten op on a CPU tensor).
HOST_METHODS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__index__", "__float__")


@dataclass
class Audit:
    ops: Counter = field(default_factory=Counter)  # aten op name -> times dispatched
    host_reads: list[str] = field(default_factory=list)  # what read the host, in order (one entry a read)
    _inside_read: int = 0  # a Python-level read's own aten ops are that read, not another

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())


class _Recorder(TorchDispatchMode):
    def __init__(self, out: Audit) -> None:
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.out.ops[name] += 1
        if name in HOST_OPS and not self.out._inside_read:
            self.out.host_reads.append(name)
        return func(*args, **(kwargs or {}))


_patch_lock = threading.Lock()


@contextlib.contextmanager
def audit() -> Iterator[Audit]:
    """Records what runs inside (see the module docstring). Not reentrant; one at a time in a process."""
    out = Audit()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}
    settle = timing.settle

    def reading(name: str):
        method = originals[name]

        def read(self, *args, **kwargs):
            if not out._inside_read:
                out.host_reads.append(name)
            out._inside_read += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                out._inside_read -= 1
        return read

    def settling(device):
        out.host_reads.append("settle")  # counted on every device: on a GPU it is a synchronisation
        return settle(device)

    with _patch_lock:
        for name in HOST_METHODS:
            setattr(torch.Tensor, name, reading(name))
        timing.settle = settling
        try:
            with _Recorder(out):
                yield out
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
            timing.settle = settle

"""A safetensors file read into tensors that are already where they belong: no mapping, no copy of the whole.

The format (huggingface/safetensors, "Format"): 8 bytes little-endian N, then N bytes of JSON naming every
tensor's dtype, shape and [begin, end) byte range in the data that follows, row-major. `SafetensorsFile(path)`
reads the header; `read_into(name, out, dim, start)` fills `out` with the tensor's rows [start, start + rows)
(dim 0) or columns [start, start + cols) (dim 1), or the whole tensor, with `pread`s straight into `out`'s
memory (rows: one read; columns: one read a row, into that row of `out`). Nothing is mapped, so what was read
is never part of this process's resident memory beyond `out` itself (safetensors' own `safe_open` maps the
file: every page a slice touches stays resident while the mapping is open, and unmapping a large mapping costs
time per tensor). A tensor stored in another dtype than `out`'s, or an `out` on a GPU, goes through one
temporary of the slice's size.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class SafetensorsFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.base = 8 + size
        self.entries: dict[str, dict] = header

    def keys(self) -> list[str]:
        return list(self.entries)

    def read_into(self, name: str, out: torch.Tensor, dim: int | None = None, start: int = 0) -> None:
        """`out` := the tensor `name`, or its slice along `dim` starting at `start` of out's size (module docstring)."""
        entry = self.entries[name]
        dtype, shape = DTYPES[entry["dtype"]], list(entry["shape"])
        want = list(shape)
        if dim is not None:
            want[dim] = out.shape[dim]
        if list(out.shape) != want or (dim is not None and not 0 <= start <= shape[dim] - want[dim]):
            raise ValueError(f"{self.path.name}: {name} {shape} has no slice {list(out.shape)} at {start} on dim {dim}")
        direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        buf = out if direct else torch.empty(want, dtype=dtype)
        self._read(entry, shape, buf, dim or 0, start if dim is not None else 0)
        if not direct:
            out.copy_(buf)

    def _read(self, entry: dict, shape: list[int], buf: torch.Tensor, dim: int, start: int) -> None:
        item = buf.element_size()
        inner = item * int(np.prod(shape[dim + 1:], dtype=np.int64))  # bytes of one index along dim
        view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
        begin = self.base + entry["data_offsets"][0]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if dim == 0:  # one contiguous range
                _pread_all(fd, view, begin + start * inner)
                return
            if dim != 1 or len(shape) != 2:
                raise ValueError(f"{self.path.name}: only rows or matrix columns are read in slices, not dim {dim}")
            width = buf.shape[1] * item  # bytes of this slice in one row
            row = shape[1] * item
            for r in range(shape[0]):
                _pread_all(fd, view[r * width:(r + 1) * width], begin + r * row + start * item)
        finally:
            os.close(fd)


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n

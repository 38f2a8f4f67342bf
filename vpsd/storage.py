"""Appending whole lines to the files of a run directory, also when the disk fills up.

`LineFile(path)` appends text (one or more whole lines per `write`) with unbuffered `os.write` calls on an
O_APPEND descriptor. When a write fails part way (ENOSPC, EDQUOT, any OSError) the file is cut back to where the
write began, so it always ends on a whole line: a results file never holds half a row and a trace never half an
event. A full disk (or quota) raises `DiskFull`, which names the directory and what to do; the caller stops the
job (vpsd/launch/entry.py) and a rerun of the same command resumes once there is room.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """No room left where a run directory's file is written."""

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, f"no space left on the device of {Path(path).parent} (writing {Path(path).name}); "
                                      f"what was written is whole. Free space there and rerun the same command: "
                                      f"the job resumes where it stopped")
        self.path = Path(path)

    def __str__(self) -> str:
        return self.strerror


class LineFile:
    """A file opened for appending whole lines (see the module doc). Not thread-safe: callers hold a lock."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size  # one writer per file (the run directory's lock): we know its end

    def write(self, text: str) -> int:
        encoded = text.encode("utf-8")
        data = memoryview(encoded)
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as e:
            try:
                os.ftruncate(self._fd, self._size)  # back to the last whole line
            except OSError:
                pass
            if e.errno in FULL:
                raise DiskFull(self.path, e) from e
            raise
        self._size += len(encoded)
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered: every write went to the OS."""

    def fsync(self) -> None:
        os.fsync(self._fd)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def __enter__(self) -> "LineFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

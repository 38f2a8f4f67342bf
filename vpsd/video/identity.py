"""What a video is on disk, known without reading it: a key that changes whenever its bytes may have.

`source_identity(path)`:
- a file: its resolved path and (st_dev, st_ino, st_size, st_mtime_ns). A file rewritten in place (a new
  modification time or size), replaced by a rename (another inode) or another file mounted at the path never
  keys as the old one, so whatever was kept for the old bytes is never taken for the new;
- a folder of frame images (video/folder.py): the folder's identity and every frame image's, in order (an image
  edited in place changes its own modification time, not the folder's);
- a file whose bytes the caller holds (a `data:` URL the server wrote to a temporary file, serve/media.py):
  a hash of those bytes (`note_content`), while the file is still the one noted (its identity unchanged) and
  until `forget_content`. Two requests sending the same bytes then share a key though each has a temporary file
  of its own;
- None where the path cannot be looked at (missing, unreadable): nothing may be keyed by it, and the read
  fails as it does.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Hashable

from vpsd.video.folder import frame_files

# Resolved path -> (the file's identity when noted, the hash of its bytes). Small: one entry a request in flight.
_CONTENT: dict[str, tuple[tuple, str]] = {}
_LOCK = threading.Lock()


def file_identity(path: str | os.PathLike[str]) -> tuple:
    """(resolved path, st_dev, st_ino, st_size, st_mtime_ns) of a file or folder; OSError when it cannot be
    looked at."""
    real = Path(path).resolve()
    st = real.stat()
    return str(real), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def source_identity(path: str | os.PathLike[str]) -> Hashable | None:
    """The key of the video at `path` (module docstring); None: it cannot be keyed."""
    try:
        identity = file_identity(path)
        with _LOCK:
            noted = _CONTENT.get(identity[0])
        if noted is not None and noted[0] == identity:
            return "content", noted[1]
        if Path(identity[0]).is_dir():
            return "folder", identity, tuple(file_identity(f) for f in frame_files(Path(identity[0])))
        return "file", identity
    except OSError:
        return None


def note_content(path: str | os.PathLike[str], payload: bytes) -> None:
    """The file at `path` was just written with exactly `payload`: key it by their hash (module docstring)."""
    digest = hashlib.blake2b(payload, digest_size=20).hexdigest()
    identity = file_identity(path)
    with _LOCK:
        _CONTENT[identity[0]] = (identity, digest)


def forget_content(path: str | os.PathLike[str]) -> None:
    """The file noted at `path` is going away (deleted by its request's end)."""
    with _LOCK:
        _CONTENT.pop(str(Path(path).resolve()), None)

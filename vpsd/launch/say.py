"""What the launcher's processes tell the user: one `vpsd: ...` line on stderr, written whole.

The ranks, the coordinator and torchrun's agent share one terminal (or one pipe, when a script reads it), and
`print` writes a line and its newline in two calls (two write(2)s where stderr is unbuffered, as torchrun's
ranks run): another process's warning landed between them once, so the user read `...do the restW1126 02:14:24
... Sending process closing signal SIGINT`. One write of the whole line, then a flush, is one write(2), which a
pipe does not split (POSIX: writes up to PIPE_BUF, 4096 bytes, are atomic).
"""

from __future__ import annotations

import sys


def say(line: str) -> None:
    sys.stderr.flush()  # whatever Python still buffers goes first, in order
    sys.stderr.write(f"vpsd: {line}\n")
    sys.stderr.flush()

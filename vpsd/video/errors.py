"""The one exception that video reading raises.

Callers (the manifest runner, the CLI) decide per `kind` whether to skip an item, retry or stop, so
the kind is part of the contract; the message is for people and names the path. Raw PyAV errors are
translated here and never escape `vpsd.video`.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

VideoErrorKind = Literal["missing", "empty", "corrupt", "no_video_stream", "too_long", "too_large",
                         "bad_request"]

# How each kind reads in front of the path, e.g. "corrupt video /x/a.mp4: ...".
_LABELS: dict[str, str] = {
    "missing": "missing video",
    "empty": "empty video",
    "corrupt": "corrupt video",
    "no_video_stream": "no video stream in",
    "too_long": "video too long",
    "too_large": "video too large to hold",
    "bad_request": "bad request for video",
}


class VideoError(Exception):
    """A video that cannot be read as asked; `kind` says why, `path` says which."""

    def __init__(self, kind: VideoErrorKind, path: str | os.PathLike[str], detail: str) -> None:
        if kind not in get_args(VideoErrorKind):
            raise ValueError(f"unknown VideoError kind {kind!r}")
        self.kind: VideoErrorKind = kind
        self.path = str(path)
        self.detail = detail
        super().__init__(f"{_LABELS[kind]} {self.path}: {detail}")

    def __reduce__(self):  # keep the three fields when pickled across processes
        return (type(self), (self.kind, self.path, self.detail))


def describe_av_error(err: BaseException) -> str:
    """FFmpeg's own words for an error, without the errno and path PyAV wraps around them."""
    text = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return text[:1].lower() + text[1:]

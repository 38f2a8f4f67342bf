"""The reference a seeking reader must equal: a full front to back decode, as vpsd read videos before it
seeked (count from the stored frame count or the packets, select, decode from the first frame up to the last
wanted one, select again from the frames that exist when the stream ends early, any decoding error "corrupt").

Frames are converted as the reader converts them (`vpsd.video.frames`: the same swscale call and turn), so a
difference can only come from which frame was decoded, and how.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from vpsd.video.errors import VideoError
from vpsd.video.frames import geometry, to_rgb
from vpsd.video.sampling import select_indices


@dataclass
class Decoded:
    frames: np.ndarray
    timestamps: np.ndarray
    indices: np.ndarray
    source_num_frames: int


def stored_count_and_rate(path: Path) -> tuple[int, float]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or stream.base_rate)
        return stream.frames or sum(1 for p in container.demux(stream) if p.size), rate


def front_to_back(path: Path, *, size: tuple[int, int] | None = None, max_side: int | None = None,
                  **request) -> Decoded:
    count, rate = stored_count_and_rate(path)
    while True:
        if count <= 0:
            raise VideoError("empty", path, "video stream has no frames")
        indices = select_indices(count, rate, **request)
        wanted, last = set(indices.tolist()), int(indices[-1])
        frames: dict[int, np.ndarray] = {}
        times: dict[int, float] = {}
        n, start, g = 0, None, None
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            try:
                for frame in container.decode(stream):
                    i, n = n, n + 1
                    time = frame.time if frame.time is not None else i / rate
                    if g is None:
                        g = geometry(frame.height, frame.width, stream.sample_aspect_ratio, frame.rotation,
                                     size, max_side)
                        start = time
                    if i in wanted:
                        frames[i], times[i] = to_rgb(frame, g), time - start
                    if i == last:
                        break
            except av.FFmpegError as err:
                raise VideoError("corrupt", path, f"{err} (at frame {n})") from None
        if n > last:
            return Decoded(np.stack([frames[i] for i in indices.tolist()]),
                           np.array([times[i] for i in indices.tolist()]), indices, count)
        count = n

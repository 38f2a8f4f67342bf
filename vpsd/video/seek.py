"""Reading the wanted frames of a video by seeking, with a trusted packet index (`vpsd.video.index`).

Exact (`read_exact`): for each wanted frame, in order, seek to the last seek point at or before it when that
point lies after the last frame read (decoding on would cost more), else decode on; decode forward to the
frame, never past the last wanted one. Frames are known by their pts, looked up in the index. Everything that
could make the result differ from a front to back decode raises `Untrusted`, and the caller decodes front to
back instead: a seek that lands after its target or on a packet that is not a keyframe, a first frame the
decoder does not itself call a keyframe, frames that do not come out one after another in index order (a
dropped or extra frame), a frame size that changes, a decoding error after a seek (a damaged file: the front to
back decode then reports it where it is), or a stream that ends early. The decoder is set up as for the front
to back decode (no frame threading: `vpsd.video.decode._decode` says why).

Keyframes (`read_keyframes`, approximate): each wanted frame is replaced by the seek point shown closest to it,
and only that keyframe's packet is decoded.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

import av
import numpy as np

from vpsd.video.errors import describe_av_error
from vpsd.video.index import PacketIndex

Convert = Callable[[av.VideoFrame], np.ndarray]


class Untrusted(Exception):
    """Seeking cannot give what a front to back decode gives; the message says why."""


class _Reader:
    def __init__(self, container: av.container.InputContainer, index: PacketIndex, coded: tuple[int, int]) -> None:
        self.container, self.index, self.coded = container, index, coded
        self.stream = container.streams.video[0]
        self.decoded = 0  # frames the decoder returned: the work done
        self.fresh = True  # nothing demuxed yet

    def seek(self, frame: int) -> Iterator[av.Packet]:
        """Packets from seek point `frame` on, or from the nearest earlier one a seek reaches.

        Containers seek by different clocks: mkv's cues by pts, mp4's index by dts shifted by the stream's
        initial delay (pts - dts of its first packet), which a variable frame rate makes differ from the pts.
        So up to four offsets are tried, each a cheap index lookup: the frame's pts, its dts plus that delay,
        the last tick before the next seek point (the latest that cannot reach it) and its dts; the first that
        lands on the frame wins, else the one landing closest before it. Packets before the first seek point
        reached are skipped, undecoded (mpeg-ts seeks by bisection and lands anywhere)."""
        if self.fresh and frame == int(self.index.seek_points[0]):
            self.fresh = False  # a container just opened is at its first packet: frame 0's
            return self.container.demux(self.stream)
        self.fresh = False
        target = int(self.index.decode_pos[frame])
        later = np.searchsorted(self.index.seek_points, frame, side="right")
        last_tick = (int(self.index.pts[self.index.seek_points[later]]) - 1 if later < len(self.index.seek_points)
                     else int(self.index.pts[-1]))
        best: tuple[int, int] | None = None  # (landing, offset)
        pts, dts = int(self.index.pts[frame]), int(self.index.dts[frame])
        delay = int(self.index.pts[0]) - int(self.index.dts[0])
        for offset in dict.fromkeys((pts, dts + delay, last_tick, dts)):
            landed, packets = self._land(frame, offset, target)
            if landed == target:
                return packets
            if landed is not None and (best is None or landed > best[0]):
                best = (landed, offset)
        if best is not None:
            landed, packets = self._land(frame, best[1], target)
            if landed == best[0]:
                return packets
        raise Untrusted(f"a seek to frame {frame} did not land at or before it")

    def _land(self, frame: int, offset: int, target: int) -> tuple[int | None, Iterator[av.Packet]]:
        """Seek to `offset`: (decode position of the first seek point reached, packets from it on), or
        (None, nothing) when the seek went past `target` or to packets the index does not have."""
        try:
            self.container.seek(offset, stream=self.stream, backward=True, any_frame=False)
        except av.FFmpegError as err:
            raise Untrusted(f"seeking to frame {frame} failed: {describe_av_error(err)}") from None
        packets = self.container.demux(self.stream)
        for packet in packets:
            pos = None if packet.pts is None else self.index.position.get(int(packet.pts))
            if pos is None or pos > target:
                break
            if pos in self.index.seek_positions:
                return pos, itertools.chain([packet], packets)
        return None, iter(())

    def frames_from(self, start: int) -> Iterator[tuple[int, av.VideoFrame]]:
        """(index, frame) for frames start, start + 1, ... decoded after seeking to seek point `start`."""
        expect = start
        for packet in self.seek(start):
            try:
                out = packet.decode()
            except av.FFmpegError as err:
                raise Untrusted(f"decoding after a seek to frame {start} failed: {describe_av_error(err)}") from None
            for frame in out:
                self.decoded += 1
                i = None if frame.pts is None else self.index.rank.get(int(frame.pts))
                if i is None:
                    raise Untrusted(f"the decoder gave a frame (pts {frame.pts}) the index does not have")
                if i < expect:
                    continue  # a leading frame of the seek point: shown before it, read from an earlier one
                if i != expect:
                    raise Untrusted(f"after a seek to frame {start} the decoder gave frame {i} for frame {expect}")
                if i == start and not (frame.key_frame or frame.pict_type == av.video.frame.PictureType.I):
                    raise Untrusted(f"frame {start}, flagged a keyframe, does not decode as one")
                if (frame.height, frame.width) != self.coded:
                    raise Untrusted("the frame size changes within the stream")
                expect += 1
                yield i, frame

    def keyframe(self, frame: int) -> av.VideoFrame:
        """Seek point `frame`, decoding its packet alone."""
        pts, target = int(self.index.pts[frame]), int(self.index.decode_pos[frame])
        for packet in self.seek(frame):
            if packet.pts is None or self.index.position.get(int(packet.pts), target + 1) > target:
                break
            if int(packet.pts) != pts:
                continue
            try:
                # The packet, then a drain: the decoder hands the frame over without waiting for more.
                out = self.stream.decode(packet) + self.stream.decode(None)
            except av.FFmpegError as err:
                raise Untrusted(f"decoding keyframe {frame} failed: {describe_av_error(err)}") from None
            self.decoded += len(out)
            for f in out:
                if f.pts == pts and (f.height, f.width) == self.coded:
                    return f
            break
        raise Untrusted(f"keyframe {frame} did not decode on its own")


def read_exact(container: av.container.InputContainer, index: PacketIndex, wanted: np.ndarray,
               coded: tuple[int, int], convert: Convert) -> tuple[dict[int, np.ndarray], int]:
    """(frame index -> converted frame, frames decoded) for the sorted, unique `wanted`; raises Untrusted."""
    reader = _Reader(container, index, coded)
    frames: dict[int, np.ndarray] = {}
    stream: Iterator[tuple[int, av.VideoFrame]] | None = None
    last = -1  # the last frame read
    for w in wanted.tolist():
        start = index.seek_point(w)
        if stream is None or start > last:
            stream = reader.frames_from(start)
        for i, frame in stream:
            if i == w:
                frames[w] = convert(frame)
                last = w
                break
        else:
            raise Untrusted(f"the stream ended before frame {w}")
    return frames, reader.decoded


def read_keyframes(container: av.container.InputContainer, index: PacketIndex, wanted: np.ndarray,
                   coded: tuple[int, int], convert: Convert) -> tuple[dict[int, np.ndarray], dict[int, int], int]:
    """(seek point -> converted frame, wanted frame -> the seek point read for it, frames decoded)."""
    reader = _Reader(container, index, coded)
    chosen = {w: index.nearest_seek_point(w) for w in wanted.tolist()}
    frames = {k: convert(reader.keyframe(k)) for k in sorted(set(chosen.values()))}
    return frames, chosen, reader.decoded

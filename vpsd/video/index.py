"""The packet index of a video stream: each frame's presentation time and where a seek may start, read by
demuxing the file once without decoding it (no pixels: cheap), and whether seeking by it can be trusted.

Frame i is the frame with the i-th smallest pts. A decoder outputs frames in presentation order, so a front to
back decode gives frame i as its i-th frame exactly when every packet holds one frame with its own pts. The
index says when the packets cannot promise that (`untrusted`, the reason), and the reader then decodes front
to back as it always did: a packet without a pts, two with the same, decode times that do not increase, a packet
flagged corrupt or to be discarded (an mp4 edit list: the decoder drops those frames), a stream that does not
start on a keyframe at its first frame, or a stored frame count the packets do not match (checked by the
caller, which knows the count a read selects from).

Seek points: a keyframe packet is one when nothing before it in decode order is shown after it. The frames
decoded after it that are shown before it (an open GOP's leading frames) may be undecodable after a seek;
they belong to earlier frames, which a read reaches from an earlier seek point, and the reader ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

from vpsd.video.errors import describe_av_error


@dataclass(frozen=True)
class PacketIndex:
    pts: np.ndarray  # (N,) int64: frame i's pts, in the stream's time base; ascending
    dts: np.ndarray  # (N,) int64: frame i's dts (its pts where the packet has none)
    decode_pos: np.ndarray  # (N,) int64: frame i's packet's position in decode order
    seek_points: np.ndarray  # (K,) int64: ascending frame indices a seek may start at
    time_base: Fraction
    untrusted: str | None  # why seeking by this index is unsafe; None: it is safe
    count: int  # packets holding data: frames, when the index is trusted (the arrays are empty when no pts)
    rank: dict[int, int] = field(default_factory=dict, repr=False)  # pts -> frame index
    position: dict[int, int] = field(default_factory=dict, repr=False)  # pts -> decode position
    seek_positions: frozenset[int] = frozenset()  # decode positions of the seek points

    def __len__(self) -> int:
        return self.count

    def time(self, i: int) -> float:
        """Frame i's time in seconds, computed as PyAV computes `frame.time` (so the floats are equal)."""
        return float(int(self.pts[i])) * self.time_base.numerator / self.time_base.denominator

    def seek_point(self, frame: int) -> int:
        """The last seek point at or before `frame`."""
        return int(self.seek_points[np.searchsorted(self.seek_points, frame, side="right") - 1])

    def nearest_seek_point(self, frame: int) -> int:
        """The seek point shown closest in time to `frame` (the earlier one on a tie)."""
        j = int(np.searchsorted(self.seek_points, frame, side="right"))
        before = int(self.seek_points[j - 1])
        if j == len(self.seek_points):
            return before
        after = int(self.seek_points[j])
        return after if self.pts[after] - self.pts[frame] < self.pts[frame] - self.pts[before] else before


def scan_packets(container: av.container.InputContainer, stream: av.video.stream.VideoStream
                 ) -> tuple[PacketIndex, av.VideoFrame | None, str | None]:
    """(index, the stream's first frame, a demuxing error or None). Demuxes every packet of `stream`; decodes
    only until the first frame comes out (what only a decoded frame carries: its size as decoded, the display
    rotation). A decoding error there propagates (av.FFmpegError); a demuxing error ends the scan and is
    returned, the index then holding the packets read so far, untrusted."""
    pts: list[int | None] = []
    dts: list[int | None] = []
    keys: list[bool] = []
    flagged: str | None = None
    first: av.VideoFrame | None = None
    error: str | None = None
    packets = container.demux(stream)
    while True:
        try:
            packet = next(packets)
        except StopIteration:
            break
        except av.FFmpegError as err:
            error = describe_av_error(err)
            break
        if first is None:
            first = next(iter(packet.decode()), None)  # the last, empty packet flushes the decoder
        if not packet.size:
            continue
        if flagged is None and (packet.is_corrupt or packet.is_discard):
            flagged = ("a packet is flagged corrupt" if packet.is_corrupt
                       else "packets are flagged to be discarded (an edit list)")
        pts.append(packet.pts)
        dts.append(packet.dts)
        keys.append(bool(packet.is_keyframe))
    untrusted = (f"demuxing failed after {len(pts)} packets: {error}" if error else flagged)
    return _index(pts, dts, keys, stream.time_base or Fraction(1), untrusted), first, error


def _index(pts: list[int | None], dts: list[int | None], keys: list[bool], time_base: Fraction,
           untrusted: str | None) -> PacketIndex:
    n = len(pts)
    empty = np.zeros(0, np.int64)
    if untrusted is None and n and any(p is None for p in pts):
        untrusted = "packets without a presentation time"
    if untrusted is not None and any(p is None for p in pts):
        return PacketIndex(empty, empty, empty, empty, time_base, untrusted, n)
    by_decode = np.array(pts, dtype=np.int64)
    order = np.argsort(by_decode, kind="stable")  # order[i]: decode position of frame i
    sorted_pts = by_decode[order]
    known_dts = np.array([d for d in dts if d is not None], dtype=np.int64)
    if untrusted is None and n and not keys[0]:
        untrusted = "the stream does not start on a keyframe"
    if untrusted is None and np.any(np.diff(sorted_pts) == 0):
        untrusted = "two packets share a presentation time"
    if untrusted is None and np.any(np.diff(known_dts) <= 0):
        untrusted = "decode times do not increase"
    if untrusted is None and n and order[0] != 0:
        untrusted = "frames shown before the first keyframe"
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    # A keyframe is a seek point when every packet before it in decode order is shown before it.
    shown_before = np.maximum.accumulate(np.concatenate([[-1], rank[:-1]])) if n else empty
    key_pos = np.flatnonzero(np.array(keys, dtype=bool) & (shown_before < rank)) if n else empty
    with_dts = np.array([p if d is None else d for p, d in zip(pts, dts)], dtype=np.int64)
    return PacketIndex(
        pts=sorted_pts, dts=with_dts[order], decode_pos=order.astype(np.int64),
        seek_points=np.sort(rank[key_pos]), time_base=time_base, untrusted=untrusted, count=n,
        rank={p: i for i, p in enumerate(sorted_pts.tolist())},
        position={p: d for p, d in zip(sorted_pts.tolist(), order.tolist())},
        seek_positions=frozenset(key_pos.tolist()),
    )

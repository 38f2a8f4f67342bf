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

Skipping (exact reads): a packet whose frame is not wanted is sent to the decoder with `skip_frame = "NONREF"`,
a wanted one with "DEFAULT". FFmpeg's decoder then drops the unwanted frame only when no other frame references
it (H.264: nal_ref_idc 0; HEVC: a sub-layer non-reference picture; MPEG-4 part 2: a B-frame), so the reference
chain, and every wanted frame's pixels, are those of a full decode; a dense read (one frame in two, or fps 2 of
30) skips most B-frames instead of decoding them. Decoders read `skip_frame` as each packet is sent (no frame
threading), and a frame that does not come out is allowed only where its packet was sent under NONREF and it is
not wanted. Only decoders whose NONREF is known to keep the reference chain skip (`NONREF_DECODERS`); should a
skipping read turn out untrusted, it is read again without skipping before the caller gives up on seeking.

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

# FFmpeg decoders whose skip_frame="NONREF", set before a packet is sent, drops that packet's frame only when no
# frame references it, and reads it for that packet alone (checked on the corpus, tests/video/test_skipping.py).
# h264: slices with nal_ref_idc 0 (b-pyramid's reference B-frames have nal_ref_idc > 0 and are decoded).
# mpeg4: B-frames, which MPEG-4 part 2 never references.
# hevc: sub-layer non-reference pictures (NAL types TRAIL_N, RASL_N...), which a picture of a HIGHER temporal
# sub-layer may reference: FFmpeg drops them whatever the layer, so HEVC skips only when its parameter sets
# promise a single sub-layer (`_one_hevc_sublayer`).
# Not here, so never skipped: libdav1d (AV1), whose frames, with NONREF toggled per packet, came out different
# from a full decode's (same frames, other pixels: it does not apply skip_frame per packet sent, nor as a promise
# to keep references); FFmpeg's vp9, which dropped nothing under NONREF on the corpus (no gain); any other
# decoder, unchecked.
NONREF_DECODERS = frozenset({"h264", "hevc", "mpeg4"})
_HEVC_SPS = 33


class Untrusted(Exception):
    """Seeking cannot give what a front to back decode gives; the message says why."""


def skips_nonref(stream: av.video.stream.VideoStream) -> bool:
    """Whether `stream`'s decoder may be sent unwanted packets under skip_frame="NONREF" (`NONREF_DECODERS`)."""
    name = stream.codec_context.name
    if name not in NONREF_DECODERS:
        return False
    return name != "hevc" or _one_hevc_sublayer(stream.codec_context.extradata or b"")


def _one_hevc_sublayer(extradata: bytes) -> bool:
    """Whether the HEVC parameter sets in `extradata` (hvcC, as mp4 and mkv store them, or Annex B) have SPSs, each
    with sps_max_sub_layers_minus1 = 0: every picture is then of temporal sub-layer 0, and a sub-layer
    non-reference picture is referenced by none."""
    nals: list[bytes] = []
    if len(extradata) > 22 and extradata[0] == 1:  # hvcC: 22 bytes of header, then arrays of NAL units
        pos = 23
        for _ in range(extradata[22]):
            count = int.from_bytes(extradata[pos + 1:pos + 3], "big")
            pos += 3
            for _ in range(count):
                if pos >= len(extradata):
                    break
                size = int.from_bytes(extradata[pos:pos + 2], "big")
                nals.append(extradata[pos + 2:pos + 2 + size])
                pos += 2 + size
    else:  # Annex B: NAL units after 00 00 01 start codes
        nals = extradata.split(b"\x00\x00\x01")[1:]
    # An SPS: a 2-byte NAL header, then sps_video_parameter_set_id (4 bits), sps_max_sub_layers_minus1 (3 bits).
    sub_layers = [(nal[2] >> 1) & 7 for nal in nals if len(nal) > 2 and (nal[0] >> 1) & 0x3F == _HEVC_SPS]
    return bool(sub_layers) and not any(sub_layers)


class _Reader:
    def __init__(self, container: av.container.InputContainer, index: PacketIndex, coded: tuple[int, int],
                 keep: frozenset[int] | None = None) -> None:
        """keep: the pts of the wanted frames, when the others' packets may be sent under NONREF; None: no skipping."""
        self.container, self.index, self.coded, self.keep = container, index, coded, keep
        self.stream = container.streams.video[0]
        self.context = self.stream.codec_context
        self.decoded = 0  # frames the decoder returned: the work done
        self.fresh = True  # nothing demuxed yet
        self.skipping = False  # the decoder's skip_frame is NONREF
        self.context.skip_frame = "DEFAULT"  # the context is the container's: an earlier reader may have set it

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
        """(index, frame) for frames start, start + 1, ... decoded after seeking to seek point `start`, but for the
        unwanted frames the decoder skipped as non-reference (`keep`)."""
        expect = start
        skipped: set[int] = set()  # pts of the frames whose packets went in under NONREF, since this seek
        for packet in self.seek(start):
            pts = None if packet.pts is None else int(packet.pts)
            skip = self.keep is not None and pts is not None and packet.size > 0 and pts not in self.keep
            if skip != self.skipping:  # read by the decoder as this packet goes in
                self.context.skip_frame = "NONREF" if skip else "DEFAULT"
                self.skipping = skip
            if skip:
                skipped.add(pts)
            try:
                out = self.context.decode(packet)
            except av.FFmpegError as err:
                raise Untrusted(f"decoding after a seek to frame {start} failed: {describe_av_error(err)}") from None
            for frame in out:
                self.decoded += 1
                i = None if frame.pts is None else self.index.rank.get(int(frame.pts))
                if i is None:
                    raise Untrusted(f"the decoder gave a frame (pts {frame.pts}) the index does not have")
                if i < expect:
                    continue  # a leading frame of the seek point: shown before it, read from an earlier one
                if i != expect and not all(int(self.index.pts[j]) in skipped for j in range(expect, i)):
                    raise Untrusted(f"after a seek to frame {start} the decoder gave frame {i} for frame {expect}")
                if i == start and not (frame.key_frame or frame.pict_type == av.video.frame.PictureType.I):
                    raise Untrusted(f"frame {start}, flagged a keyframe, does not decode as one")
                if (frame.height, frame.width) != self.coded:
                    raise Untrusted("the frame size changes within the stream")
                expect = i + 1
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
               coded: tuple[int, int], convert: Convert, skip: bool = True) -> tuple[dict[int, np.ndarray], int]:
    """(frame index -> converted frame, frames decoded) for the sorted, unique `wanted`; raises Untrusted.
    skip: send unwanted frames' packets under NONREF where the decoder allows it (`skips_nonref`)."""
    if not (skip and skips_nonref(container.streams.video[0])):
        return _read_exact(_Reader(container, index, coded), wanted, convert)
    keep = frozenset(int(index.pts[w]) for w in wanted.tolist())
    reader = _Reader(container, index, coded, keep)
    try:
        return _read_exact(reader, wanted, convert)
    except Untrusted:
        # Skipping may be what changed the decoder's output (a frame it dropped, or held back differently): read
        # again without it; an untrusted read then is the file's doing, and the caller decodes front to back.
        again = _Reader(container, index, coded)
        again.fresh = False  # the container has moved: seek, even to frame 0
        frames, decoded = _read_exact(again, wanted, convert)
        return frames, reader.decoded + decoded


def _read_exact(reader: _Reader, wanted: np.ndarray, convert: Convert) -> tuple[dict[int, np.ndarray], int]:
    index = reader.index
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
            if i > w:
                raise Untrusted(f"the decoder gave frame {i} before wanted frame {w}")
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

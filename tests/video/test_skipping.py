"""Exact reads skip the unwanted non-reference frames (`vpsd.video.seek`, skip_frame="NONREF") and still give, bit
for bit, what a full front to back decode gives: over the whole corpus, for dense requests (half the frame rate,
every 2nd frame from 0 and from 1, every 3rd) and sparse ones; the decoders that skip do decode fewer frames, the
others (VP9, AV1) none fewer; a skipping read that goes wrong is read again without skipping; HEVC skips only
when its parameter sets promise one temporal sub-layer.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from tests.video.corpus import ENTRIES, X265, encode
from tests.video.reference import front_to_back
from vpsd.video import seek
from vpsd.video.decode import probe_video, read_video
from vpsd.video.frames import geometry, to_rgb
from vpsd.video.info import inspect_video, open_container
from vpsd.video.seek import _one_hevc_sublayer, read_exact, skips_nonref

EXACT = [e for e in ENTRIES if e.mode == "exact"]
SKIPPING = {"h264", "hevc", "mpeg4"}  # the corpus's decoders that skip


def read_frames(path, wanted, skip=True):
    """(frames, frames decoded) of read_exact for the frame indices `wanted`, at display size."""
    info, index = inspect_video(path)
    g = geometry(info.coded_height, info.coded_width, info.sample_aspect_ratio, info.rotation)
    with open_container(path) as container:
        frames, decoded = read_exact(container, index, np.asarray(wanted, dtype=np.int64), g.coded,
                                     partial(to_rgb, g=g), skip=skip)
    return np.stack([frames[w] for w in wanted]), decoded


def decoder(path) -> str:
    with open_container(path) as container:
        return container.streams.video[0].codec_context.name


@pytest.mark.parametrize("entry", EXACT, ids=str)
def test_dense_reads_skip_and_equal_a_full_decode(entry, corpus):
    path = corpus(entry)
    every = front_to_back(path)  # every frame
    n = len(every.frames)
    for wanted in (range(0, n, 2), range(1, n, 2), range(0, n, 3), range(2, n, 3), [0, n - 1], [n // 2]):
        wanted = list(wanted)
        got, decoded = read_frames(path, wanted)
        assert np.array_equal(got, every.frames[wanted]), (entry.name, wanted[:3])
        plain, plain_decoded = read_frames(path, wanted, skip=False)
        assert np.array_equal(plain, got)
        if len(wanted) >= n // 3:  # dense: where the decoder skips, it decodes fewer frames
            name = decoder(path)
            assert (decoded < plain_decoded) == (name in SKIPPING), (name, decoded, plain_decoded)


@pytest.mark.parametrize("entry", ENTRIES, ids=str)
def test_dense_requests_read_what_a_full_decode_reads(entry, corpus):
    path = corpus(entry)
    if entry.error is not None:
        pytest.skip("a corrupt file: test_reader checks its error")
    half = probe_video(path).fps / 2
    for request in (dict(fps=half), dict(fps=half, max_side=40), dict(num_frames=3)):
        want, got = front_to_back(path, **request), read_video(path, **request)
        assert got.indices.tolist() == want.indices.tolist(), request
        assert np.array_equal(got.frames, want.frames), request
        assert got.timestamps.tolist() == want.timestamps.tolist(), request
        assert got.read_mode == entry.mode


def test_a_skipping_read_that_goes_wrong_is_read_again_without(corpus, monkeypatch):
    path = corpus(next(e for e in ENTRIES if e.name == "h264-open-gop.mp4"))
    wanted = list(range(0, 48, 2))
    want, _ = read_frames(path, wanted, skip=False)
    real = seek._Reader.frames_from

    def failing(self, start):
        if self.keep is not None:
            raise seek.Untrusted("as if skipping had dropped a wanted frame")
        return real(self, start)

    monkeypatch.setattr(seek._Reader, "frames_from", failing)
    got, _ = read_frames(path, wanted)
    assert np.array_equal(got, want)


def test_hevc_skips_only_with_one_temporal_sub_layer(corpus, tmp_path):
    path = corpus(next(e for e in ENTRIES if e.name == "hevc-open-gop.mp4"))
    with open_container(path) as container:
        stream = container.streams.video[0]
        extradata = bytes(stream.codec_context.extradata)
        assert skips_nonref(stream)
    assert _one_hevc_sublayer(extradata)
    # The same SPS saying 3 sub-layers (sps_max_sub_layers_minus1 = 2), in hvcC and as Annex B.
    sps = bytes([33 << 1, 1, 0x01 | (2 << 1)]) + b"\x00" * 8
    assert _one_hevc_sublayer(b"\x00\x00\x00\x01" + bytes([33 << 1, 1, 0x01]) + b"\x00" * 8)
    assert not _one_hevc_sublayer(b"\x00\x00\x00\x01" + sps)
    hvcc = extradata[:22] + bytes([1, 0x80 | 33, 0, 1]) + len(sps).to_bytes(2, "big") + sps
    assert not _one_hevc_sublayer(hvcc)
    assert not _one_hevc_sublayer(b"")  # no parameter sets: no promise
    # A real stream with temporal sub-layers reads exactly, unskipped.
    layered = tmp_path / "hevc-layers.mkv"
    try:
        encode(layered, "libx265", options={"x265-params": X265["x265-params"] + ":temporal-layers=3"})
    except Exception as err:  # an x265 without the option
        pytest.skip(f"x265 cannot write temporal layers here: {err}")
    with open_container(layered) as container:
        assert not skips_nonref(container.streams.video[0])
    every = front_to_back(layered)
    got, _ = read_frames(layered, list(range(0, 48, 2)))
    assert np.array_equal(got, every.frames[::2])

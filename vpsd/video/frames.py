"""From a decoded frame to the RGB array the model sees: upright, at display aspect, at the requested size.

- Display size: a frame of coded size H x W with sample aspect ratio `sar` (non-square pixels) is shown
  round(W * sar) wide and H high (FFmpeg's `scale=iw*sar:ih`); a display matrix that turns it by 90 or 270
  degrees swaps the two. `upright_size` is that size, the one a read returns when no size is asked for.
- Requested size: `size` (height, width of the upright frame) or `max_side` (the upright size shrunk so its
  longest side is at most that, `max_side_size`: the rounding `vpsd.video.item.scale_to_max_side` uses).
- Conversion: one swscale call per frame scales and converts to RGB at once (bicubic when it scales), so a
  full-size RGB frame is never made; a quarter turn of the small RGB array then stands it upright. A frame
  kept at its coded size is converted exactly as the reader always has (swscale's default filter), so such
  reads give the same pixels as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np


def quarter_turns(rotation: int | float | None) -> int:
    """Counterclockwise quarter turns (0-3) that stand a frame upright; `rotation` is PyAV's `frame.rotation`
    (degrees the display matrix turns the frame counterclockwise), rounded to the nearest quarter turn."""
    return int(round((rotation or 0) / 90)) % 4


def upright_size(coded_h: int, coded_w: int, sar: Fraction | None, turns: int) -> tuple[int, int]:
    """(height, width) as displayed: pixels stretched to their aspect, then turned."""
    width = coded_w if not sar or sar <= 0 or sar == 1 else max(1, round(coded_w * Fraction(sar)))
    return (width, coded_h) if turns % 2 else (coded_h, width)


def max_side_size(height: int, width: int, max_side: int | None) -> tuple[int, int]:
    """(height, width) shrunk so the longest side is at most `max_side`; unchanged when it already is."""
    if max_side is None or max(height, width) <= max_side:
        return height, width
    scale = max_side / max(height, width)
    return max(1, round(height * scale)), max(1, round(width * scale))


@dataclass(frozen=True)
class Geometry:
    """How every frame of one read is converted: swscale to `scaled` (coded orientation), then `turns`."""

    coded: tuple[int, int]  # (height, width) of the decoded frames (the first frame's)
    scaled: tuple[int, int]  # (height, width) swscale converts to, before turning
    turns: int  # counterclockwise quarter turns after conversion

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the frames the read returns."""
        h, w = self.scaled
        return (w, h) if self.turns % 2 else (h, w)


def geometry(coded_h: int, coded_w: int, sar: Fraction | None, rotation: int | float | None,
             size: tuple[int, int] | None = None, max_side: int | None = None) -> Geometry:
    """The conversion that gives frames upright at `size` (or within `max_side`, or at display size)."""
    turns = quarter_turns(rotation)
    if size is None:
        size = max_side_size(*upright_size(coded_h, coded_w, sar, turns), max_side)
    height, width = size
    return Geometry((coded_h, coded_w), (width, height) if turns % 2 else (height, width), turns)


def to_rgb(frame: av.VideoFrame, g: Geometry) -> np.ndarray:
    """(H, W, 3) uint8 RGB of `frame` as `g` says. A frame whose size differs from the first's (a stream that
    changes size mid-way) is scaled to the same output, so the clip stacks."""
    height, width = g.scaled
    if g.scaled == g.coded:
        rgb = frame.to_ndarray(format="rgb24", height=height, width=width)
    else:
        rgb = frame.to_ndarray(format="rgb24", height=height, width=width, interpolation="BICUBIC")
    return np.ascontiguousarray(np.rot90(rgb, g.turns)) if g.turns else rgb

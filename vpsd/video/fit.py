"""Make a clip fit the model's context, or say clearly that it does not.

The token count of a clip is the family's business (patches, temporal pairs, pooling, timestamps in
the prompt), so the caller hands in `count_tokens(frames)`: everything the sequence will hold,
prompt, video and the tokens still to generate. No model is imported here.

- fits: the frames come back unchanged, with `max_frames` None;
- too long and `subsample` off: VideoError("too_long") naming both numbers;
- too long and `subsample` on: the largest `k` for which `cap_frames(frames, k)` fits, found from
  a linear estimate of tokens per frame (counts at 1 and at T frames) and then stepped down, since
  families round frames up (Qwen pairs them); VideoError("too_long") when one frame is too many.
`fit_count` is the same rule on a frame count alone, for a video not yet decoded.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from vpsd.video.errors import VideoError
from vpsd.video.item import cap_frames


def fit_to_context(
    frames: np.ndarray,
    count_tokens: Callable[[np.ndarray], int],
    limit: int,
    subsample: bool,
    path: str | os.PathLike[str],
) -> tuple[np.ndarray, int | None]:
    """(frames that fit, the frame cap applied or None); see the module docstring."""
    cap = fit_count(len(frames), lambda k: count_tokens(cap_frames(frames, k)), limit, subsample, path)
    return cap_frames(frames, cap), cap


def fit_count(
    total: int,
    count_tokens: Callable[[int], int],
    limit: int,
    subsample: bool,
    path: str | os.PathLike[str],
) -> int | None:
    """The frame cap that makes `total` frames fit (None: they fit as they are), `count_tokens(k)` being the
    sequence's length with the first-k cap of them (`cap_frames`): a video's fit is decided from its metadata
    before a frame of it is decoded (launch/items.py), and again from the frames read."""
    needed = count_tokens(total)
    if needed <= limit:
        return None
    if not subsample:
        raise VideoError(
            "too_long", path,
            f"{total} frames need {needed} tokens with the prompt and max_new_tokens, the context allows {limit} "
            f"(ask for fewer frames, or set video.subsample_to_fit)",
        )
    one = count_tokens(1)
    if one > limit or total == 1:
        raise VideoError("too_long", path, f"even one frame needs {one} tokens, the context allows {limit}")
    per_frame = max((needed - one) / (total - 1), 1e-9)
    k = min(total - 1, 1 + int((limit - one) / per_frame))
    while k > 1 and count_tokens(k) > limit:
        k -= 1
    return k

"""What "lossless" can promise, checked with the target's own margins (docs/design.md, "Lossless").

Greedy speculative decoding returns, at every position, the target's argmax of a logits row. `ar` computes
that row with one-token forwards; a verify computes it inside a k-token forward. Same math, other kernel
shapes: the rows differ by float noise (up to about 1e-5 in float32, 0.125 in bf16 on the world pair), so where the
target's top-2 logits are closer than that noise the two can pick different tokens, and from there on the
outputs differ. That is a tie in the target's own distribution, not a wrong draft getting through.

`first_divergence` finds where a speculative output first leaves `ar`'s and measures the target's top-2
margin there, on `ar`'s own row (the same one-token forwards `ar` ran); `judge` passes identical outputs and
divergences at a margin below the tolerance (a tie in float noise), and fails any other: a real divergence.
`decoding.exact_verify` removes even the ties (the target verifies with `ar`'s one-token forwards).

    python -m vpsd.launch.lossless --config CONFIG --manifest M --ar AR_DIR --runs DIR [DIR ...]

(vpsd/launch/lossless.py) compares batch results (results.jsonl) against an `ar` run of the same manifest and prints, per run, the
identity rate and every differing item with its position and margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vpsd.models.base import VideoLMAdapter

# Top-2 margins below these are float noise of a k-row forward against a 1-row one. Measured on the world
# pair: |k-row - 1-row| up to 1.1e-5 in float32 and 0.125 in bf16 (one bf16 step at logits of 16-32), and
# each of the two logits may move by that much, so a margin under twice the noise can flip.
TIE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.03}


@dataclass(frozen=True)
class Divergence:
    position: int  # index of the first differing token
    ar_token: int | None  # None: `ar`'s output ended there
    other_token: int | None  # None: the other output ended there
    margin: float  # the target's top-1 minus top-2 logit at that position (on `ar`'s row)


def top2_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def first_divergence(
    target: VideoLMAdapter,
    frames: np.ndarray,
    prompt: str,
    ar_tokens: list[int],
    other: list[int],
    frame_times: np.ndarray | None = None,
) -> Divergence | None:
    """None when the outputs are identical; else where they first differ and the target's margin there."""
    if ar_tokens == other:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(ar_tokens, other)) if a != b), min(len(ar_tokens), len(other)))
    pre = target.prefill(target.embed(target.prepare(frames, prompt, frame_times)))
    logits = pre.logits
    for token in ar_tokens[:pos]:  # `ar`'s own one-token forwards up to the differing position
        logits = target.step(pre.state, torch.tensor([token]))[-1]
    at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
    return Divergence(pos, at(ar_tokens), at(other), top2_margin(logits))


def judge(divergence: Divergence | None, tolerance: float) -> bool:
    """True for identical outputs or a first difference at a top-2 margin below `tolerance` (a tie)."""
    return divergence is None or divergence.margin < tolerance

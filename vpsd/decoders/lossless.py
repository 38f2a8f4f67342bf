"""What "lossless" can promise, checked with the target's own margins (README "What lossless means").

Greedy speculative decoding returns, at every position, the target's argmax of a logits row. `ar` computes
that row with one-token forwards; a verify computes it inside a k-token forward. Same math, other kernel
shapes: the rows differ by float noise (up to about 1e-5 in float32, 0.125 in bf16 on the world pair), so where the
target's top-2 logits are closer than that noise the two can pick different tokens, and from there on the
outputs differ. That is a tie in the target's own distribution, not a wrong draft getting through.

`first_divergence` finds where a speculative output first leaves `ar`'s and measures the target's top-2
margin there, on `ar`'s own row (the same one-token forwards `ar` ran); `judge` passes identical outputs and
divergences at a margin below the tolerance (a tie in float noise), and fails any other: a real divergence.
`decoding.exact_verify` removes even the ties (the target verifies with `ar`'s one-token forwards).

    python -m vpsd.decoders.lossless --config CONFIG --ar AR_DIR --runs DIR [DIR ...]

compares batch results (results.jsonl) against an `ar` run of the same manifest and prints, per run, the
identity rate and every differing item with its position and margin.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

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


def _results(out: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["id"]: r for r in rows if r.get("error") is None}


def main(argv: list[str] | None = None) -> None:
    from vpsd.config import load_config, parse_overrides
    from vpsd.launch.manifest import load_manifest
    from vpsd.models.registry import load_adapter
    from vpsd.video.item import load_item_frames

    p = argparse.ArgumentParser(description="identity of speculative outputs with ar, with top-2 margins")
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--ar", type=Path, required=True, help="results directory of the ar run")
    p.add_argument("--runs", type=Path, nargs="+", required=True)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides (as the runs had)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, parse_overrides(args.set))
    target = load_adapter(cfg.family, cfg.target)
    tolerance = TIE_TOLERANCE[target.model.dtype]
    items = {it.id: it for it in load_manifest(args.manifest)[0]}
    ar = _results(args.ar)
    for run in args.runs:
        rows = _results(run)
        same, report = 0, []
        for item_id, row in rows.items():
            if row["token_ids"] == ar[item_id]["token_ids"]:
                same += 1
                continue
            it = items[item_id]
            frames, times = load_item_frames(it.video, it.num_frames or cfg.video.num_frames, it.fps or cfg.video.fps,
                                             cfg.video.max_side)
            d = first_divergence(target, frames, it.prompt, ar[item_id]["token_ids"], row["token_ids"], times)
            report.append(f"  {item_id}: differs at token {d.position} ({d.ar_token} vs {d.other_token}), "
                          f"top-2 margin {d.margin:.4g} -> {'tie' if judge(d, tolerance) else 'REAL DIVERGENCE'}")
        print(f"{run}: {same}/{len(rows)} identical to ar ({target.model.dtype}, tie tolerance {tolerance})")
        print("\n".join(report))


if __name__ == "__main__":
    main()

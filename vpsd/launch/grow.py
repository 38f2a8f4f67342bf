"""`vpsd grow`: build a scale model from a checkpoint (vpsd/models/grow.py) and check it against its source.

    vpsd grow SRC DST --width 4 --layers 12 [--dtype bfloat16] [--manifest M --items 2] [--max-new-tokens 16]
    python -m vpsd.launch.grow ...   (the same)

The check loads source and grown checkpoint through vpsd's own adapters and runs the `ar` decoder on both, so
it checks exactly what a vpsd job will run: prefill logits within tolerance, greedy outputs identical. Inputs
are the first items of a manifest, or (without one) seeded random videos: exactness holds on any input.
This module lives in launch/ because it drives decoders; the growth itself is models/grow.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from vpsd.config import DecodingConfig
from vpsd.decoders.ar import decode_ar
from vpsd.models.base import VideoLMAdapter
from vpsd.models.grown_checkpoint import checkpoint_family, grow_checkpoint, is_grown
from vpsd.models.registry import load_adapter
from vpsd.models.spec import ModelSpec

# Largest |logit diff| allowed, relative to the source's largest |logit|. Growth only reorders float sums
# (over kD instead of D): in fp32 that measured ~1e-7 relative on the tiny models and the default (docs/design.md,
# "Scale models"), so 1e-5 leaves room for longer contexts and deeper sums. Half precisions round every
# activation, so their bound is loose and greedy identity is the criterion that matters (a near-tie can flip).
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}


@dataclass
class GrowthCheck:
    """Grown checkpoint vs its source on the same inputs, both run by vpsd's adapters and `ar` decoder."""

    num_inputs: int
    num_identical: int  # greedy outputs identical to the source's
    max_logit_diff: float  # max |grown - source| over every input's prefill logits (first generated token)
    logit_scale: float  # max |source prefill logit|, what the tolerance is relative to
    tolerance: float  # allowed max_logit_diff / logit_scale
    differing: list[int] = field(default_factory=list)  # indices of inputs whose greedy outputs differ

    @property
    def relative_diff(self) -> float:
        return self.max_logit_diff / self.logit_scale if self.logit_scale > 0 else self.max_logit_diff

    @property
    def ok(self) -> bool:
        return self.num_identical == self.num_inputs and self.relative_diff <= self.tolerance

    def describe(self) -> str:
        return (
            f"max |logit diff| {self.max_logit_diff:.3g} (logit scale {self.logit_scale:.3g}, relative "
            f"{self.relative_diff:.3g}, tolerance {self.tolerance:.3g}); greedy outputs identical "
            f"{self.num_identical}/{self.num_inputs}: {'OK' if self.ok else 'FAILED'}"
        )


def check_growth(
    src: Path,
    dst: Path,
    family: str,
    frames_and_prompts: Iterable[tuple[np.ndarray, str]],
    max_new_tokens: int,
    dtype: str = "float32",
) -> GrowthCheck:
    """Runs source and grown checkpoint on each (frames (T, H, W, 3) uint8, prompt) through the family's
    adapter (vpsd.models.registry.load_adapter): prefill logits compared, greedy `ar` outputs of
    max_new_tokens compared token for token.

    Tolerance: TOLERANCE[dtype] relative to the logit scale (fp32: 1e-5; measured ~1e-7).
    """
    source = load_adapter(family, ModelSpec(path=str(src), dtype=dtype))
    grown = load_adapter(family, ModelSpec(path=str(dst), dtype=dtype))
    return compare_adapters(source, grown, frames_and_prompts, max_new_tokens, TOLERANCE[dtype])


def compare_adapters(
    source: VideoLMAdapter,
    grown: VideoLMAdapter,
    frames_and_prompts: Iterable[tuple[np.ndarray, str]],
    max_new_tokens: int,
    tolerance: float = TOLERANCE["float32"],
) -> GrowthCheck:
    """check_growth on two loaded adapters of one family (a grown model need not be on disk)."""
    greedy = DecodingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    n = identical = 0
    max_diff = scale = 0.0
    differing: list[int] = []
    for i, (frames, prompt) in enumerate(frames_and_prompts):
        ref = source.prefill(source.embed(source.prepare(frames, prompt))).logits
        got = grown.prefill(grown.embed(grown.prepare(frames, prompt))).logits
        max_diff = max(max_diff, float((got - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
        same = decode_ar(source, frames, prompt, greedy).token_ids == decode_ar(grown, frames, prompt, greedy).token_ids
        identical += same
        if not same:
            differing.append(i)
        n += 1
    if n == 0:
        raise ValueError("a growth check needs at least one (frames, prompt) input")
    return GrowthCheck(n, identical, max_diff, scale, tolerance, differing)


def random_inputs(count: int, num_frames: int = 8, side: int = 112) -> list[tuple[np.ndarray, str]]:
    """Seeded random videos: a check input when no manifest is given (function preservation needs none real)."""
    prompts = ["Describe the video.", "What happens in this video?"]
    return [
        (np.random.default_rng(i).integers(0, 256, (num_frames, side, side, 3), dtype=np.uint8), prompts[i % 2])
        for i in range(count)
    ]


def manifest_inputs(path: Path, count: int, num_frames: int | None, fps: float | None = None) -> list[tuple[np.ndarray, str]]:
    from vpsd.launch.manifest import load_manifest
    from vpsd.video.item import load_item_frames

    items, problems = load_manifest(path)
    if problems:
        raise ValueError(f"{path}: line {problems[0].line}: {problems[0].message}")
    return [
        (load_item_frames(it.video, it.num_frames or (None if it.fps else num_frames), it.fps or fps, None)[0], it.prompt)
        for it in items[:count]
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd grow", description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, nargs="?", help="source checkpoint directory (local)")
    p.add_argument("dst", type=Path, nargs="?", help="grown checkpoint directory to write (replaced only if grown before)")
    p.add_argument("--config", type=Path, default=None,
                   help="instead of SRC DST: the models a run config names with `grow:` (each built on first use into "
                        "its grown path, reused while it matches its source, then checked)")
    p.add_argument("--width", type=int, help="width factor k >= 1 (powers of 2 split exactly)")
    p.add_argument("--layers", type=int, help="decoder layers N >= the source's")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: the source's")
    p.add_argument("--manifest", type=Path, default=None, help="check on its first items (default: random videos)")
    p.add_argument("--items", type=int, default=2, help="inputs to check (default 2)")
    p.add_argument("--num-frames", type=int, default=8, help="frames per manifest item without its own (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens compared per input (default 16)")
    p.add_argument("--no-check", action="store_true", help="write the checkpoint without checking it")
    args = p.parse_args(argv)
    try:
        if args.config is not None:
            return max(grow_and_check(args, *grown) for grown in config_growths(args.config, args))
        if args.src is None or args.dst is None or args.width is None or args.layers is None:
            p.error("give SRC DST --width K --layers N, or --config CONFIG")
        grow_checkpoint(args.src, args.dst, args.width, args.layers, args.dtype)
        return grow_and_check(args, "wrote", args.src, args.dst, args.width, args.layers, args.dtype or "float32")
    except (ValueError, OSError) as err:  # GrowthError is a ValueError
        print(f"vpsd grow: {err}", file=sys.stderr)
        return 2


def config_growths(config: Path, args: argparse.Namespace) -> list[tuple]:
    """Builds (or reuses) every model of `config` that has `grow:`; (what, src, dst, width, layers, dtype) each.
    The checks read the manifest at the config's frame sampling."""
    from vpsd.config import load_config
    from vpsd.models.grown_checkpoint import ensure_grown

    cfg = load_config(config)
    args.num_frames, args.fps = cfg.video.num_frames, cfg.video.fps
    specs = [spec for spec in (cfg.target, cfg.draft) if spec is not None and spec.grow is not None]
    if not specs:
        raise ValueError(f"{config}: no model has a `grow:` section")
    out = []
    for spec in specs:
        src, dst, width, layers = Path(spec.path), Path(spec.grown_path()), spec.grow["width"], spec.grow["layers"]
        built = not is_grown(src, dst, width, layers)
        ensure_grown(src, dst, width, layers)
        out.append(("built" if built else "reused", src, dst, width, layers, spec.dtype))
    return out


def grow_and_check(args: argparse.Namespace, what: str, src: Path, dst: Path, width: int, layers: int,
                   check_dtype: str) -> int:
    """Says what was grown and checks it (unless --no-check): 0 when its outputs are the source's."""
    family = checkpoint_family(src)
    print(f"{what} {dst} ({family}, width x{width}, {layers} layers, from {src})")
    if args.no_check:
        return 0
    inputs = (manifest_inputs(args.manifest, args.items, args.num_frames, getattr(args, "fps", None))
              if args.manifest else random_inputs(args.items))
    result = check_growth(src, dst, family, inputs, args.max_new_tokens, check_dtype)
    print(result.describe())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())

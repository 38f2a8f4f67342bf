"""Examples of the procedural worlds, mp4 files, and the JSONL manifest the decoders read.

Two worlds (`--kind`): `short` (16-frame 112x112 clips, one event, one caption: the shipped default pair's)
and `long` (64-256 frames of 112x224 at 4 fps, 4-12 events, dense time-stamped captions and questions about
one moment: vpsd.world.long_scene, vpsd.world.long_caption).

Contract:
- `make_example(seed, ...)` / `make_long_example(seed)` are deterministic per seed: frames, answer, prompt, scene.
- `write_video` encodes RGB frames to mp4 with PyAV: H.264 (libx264) at near-lossless quality when the
  build has it, else MPEG-4 Part 2 at a high bit rate; colours survive well enough to name them.
- `write_manifest(out_dir, seeds, ...)` writes `videos/<id>.mp4` and `manifest.jsonl` in `out_dir`, one line
  per seed: {"id", "video" (path relative to out_dir), "prompt", "max_new_tokens", "reference"}.
- CLI: `vpsd world [--kind short|long] --out DIR --count N --seed S` (or `python -m vpsd.world.dataset ...`)
  writes seeds S .. S+N-1. Long-world seeds below `LONG_HELD_OUT_FROM` are for training and tuning; seeds
  from it on are held out.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from vpsd.world.caption import PROMPTS, caption
from vpsd.world.long_caption import long_example_text
from vpsd.world.long_scene import FPS as LONG_FPS
from vpsd.world.long_sampler import sample_long_scene
from vpsd.world.long_scene import LongScene
from vpsd.world.render import render
from vpsd.world.scene import Scene, sample_scene

# crf 10 is visually lossless; the files stay small (about 20 kB for 16 frames at 112x112).
H264_OPTIONS = {"crf": "10", "preset": "medium"}
MPEG4_BIT_RATE = 8_000_000
# 4:2:0 is what every video reader decodes; 4:4:4 H.264 is not universally supported.
PIX_FMT = "yuv420p"
DEFAULT_MAX_NEW_TOKENS = 64  # a caption is at most 28 words + 3 periods, with room for a wordy model
# Long world: a dense caption is at most ~180 tokens, an answer ~12; the caps leave room for a wordy model.
LONG_MAX_NEW_TOKENS = {"caption": 320, "question": 32}
LONG_HELD_OUT_FROM = 100_000  # long-world seeds from here on are never trained or tuned on


@dataclass(frozen=True)
class Example:
    frames: np.ndarray  # (T, H, W, 3) uint8 RGB
    caption: str
    prompt: str
    scene: Scene


def make_example(seed: int, num_frames: int = 16, size: tuple[int, int] = (112, 112)) -> Example:
    scene = sample_scene(seed, num_frames, size)
    # The prompt does not depend on the scene: the answer must come from the pixels, not the question.
    return Example(render(scene), caption(scene), PROMPTS[seed % len(PROMPTS)], scene)


@dataclass(frozen=True)
class LongExample:
    frames: np.ndarray  # (T, 112, 224, 3) uint8 RGB, T = 4 x duration in seconds
    answer: str
    prompt: str
    kind: str  # "caption" or "question"
    scene: LongScene


def make_long_example(seed: int) -> LongExample:
    scene = sample_long_scene(seed)
    prompt, answer, kind = long_example_text(scene, seed)
    return LongExample(render(scene), answer, prompt, kind, scene)


def pick_codec() -> str:
    for name in ("libx264", "mpeg4"):
        try:
            av.codec.Codec(name, "w")
            return name
        except (av.codec.codec.UnknownCodecError, ValueError):
            continue
    raise RuntimeError("this PyAV build can encode neither libx264 nor mpeg4")


def write_video(path: str | Path, frames: np.ndarray, fps: int = 8) -> None:
    """Encode (T, H, W, 3) uint8 RGB frames (H, W even) to an mp4 at `path`."""
    codec = pick_codec()
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = PIX_FMT
        if codec == "libx264":
            stream.options = H264_OPTIONS
        else:
            stream.bit_rate = MPEG4_BIT_RATE
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush frames the encoder still holds (B-frames)


def write_manifest(
    out_dir: str | Path,
    seeds: list[int] | range,
    num_frames: int = 16,
    size: tuple[int, int] = (112, 112),
    fps: int = 8,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> Path:
    """Write one video per seed and the manifest; returns the manifest's path."""
    out_dir = Path(out_dir)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "manifest.jsonl"
    with manifest.open("w") as f:
        for seed in seeds:
            example = make_example(seed, num_frames, size)
            video_id = f"world-{seed:06d}"
            video = Path("videos") / f"{video_id}.mp4"
            write_video(out_dir / video, example.frames, fps)
            line = {
                "id": video_id,
                "video": video.as_posix(),
                "prompt": example.prompt,
                "max_new_tokens": max_new_tokens,
                "reference": example.caption,
            }
            f.write(json.dumps(line) + "\n")
    return manifest


def write_long_manifest(out_dir: str | Path, seeds: list[int] | range) -> Path:
    """Write one long-world video per seed and the manifest (prompts mixed: vpsd.world.long_caption)."""
    out_dir = Path(out_dir)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "manifest.jsonl"
    with manifest.open("w") as f:
        for seed in seeds:
            example = make_long_example(seed)
            video_id = f"long-{seed:06d}"
            video = Path("videos") / f"{video_id}.mp4"
            write_video(out_dir / video, example.frames, LONG_FPS)
            line = {
                "id": video_id,
                "video": video.as_posix(),
                "prompt": example.prompt,
                "max_new_tokens": LONG_MAX_NEW_TOKENS[example.kind],
                "reference": example.answer,
                "kind": example.kind,
            }
            f.write(json.dumps(line) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vpsd world", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("short", "long"), default="short",
                        help="short: 16-frame clips, one event; long: 16-64 s, 4-12 events, dense captions and questions")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--count", required=True, type=int)
    parser.add_argument("--seed", type=int, default=0, help="first seed; seeds are consecutive")
    parser.add_argument("--frames", type=int, default=16, help="short world only")
    parser.add_argument("--size", type=int, nargs=2, default=(112, 112), metavar=("H", "W"), help="short world only")
    parser.add_argument("--fps", type=int, default=8, help="short world only (the long world is 4 fps)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="short world only")
    args = parser.parse_args(argv)
    if args.count < 1 or args.seed < 0:
        parser.error("--count must be at least 1 and --seed at least 0")
    seeds = range(args.seed, args.seed + args.count)
    if args.kind == "long":
        path = write_long_manifest(args.out, seeds)
    else:
        path = write_manifest(args.out, seeds, args.frames, tuple(args.size), args.fps, args.max_new_tokens)
    print(f"wrote {args.count} videos and {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

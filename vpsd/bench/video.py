"""What reading a real-length video costs: vpsd's reader against a full decode (and torchcodec where it imports),
over the video's length and size, and where a long-video job's wall goes.

    vpsd bench video [--lengths 1,10,60] [--sizes 720] [--frames 16,64,128] [--fps 2] [--repeats 3]
                     [--videos DIR] [--job CONFIG [--job-items 8]]

- The videos are made here, once, with PyAV's libx264 (30 fps, a keyframe every 2 s, B-frames: the GOP of a
  typical H.264 upload; a moving pattern so each frame differs) and kept in --videos (default
  ~/.cache/vpsd/bench_videos) between runs: an hour of 720p takes minutes to encode on two cores.
- Each cell is a video and a request (N frames uniformly, or one every 1/fps s): vpsd's reader (`read_video`,
  exact seeks), a full decode (every frame front to back up to the last wanted one, the wanted ones converted:
  what vpsd read before, and what lmms-eval's PyAV path does), and torchcodec's `get_frames_at` (exact seek
  mode, one FFmpeg thread) when torchcodec imports. The readers take turns within a repeat (interleaved), each
  at full size; a table of medians, the spread (max/min - 1) and vpsd's speedup over the full decode. Every
  cell's frames are checked bit for bit against the full decode's.
- --job CONFIG: an `ar` job over --job-items of the bench's videos (64 frames each, the config's model) through
  ./torchrun.sh, and its wall split into what the target spent reading (`video_read_s`), waiting for frames
  (`video_wait_s`: the read the pool did not hide), prefill and decode, from the job's own results.
Single-threaded readers throughout (OMP and FFmpeg), so the numbers are a core's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable

import av
import numpy as np

from vpsd.video.decode import read_video
from vpsd.video.sampling import select_indices

HEIGHTS = {480: 854, 720: 1280, 1080: 1920}  # 16:9
RATE = 30
GOP = 60  # a keyframe every 2 s


def default_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vpsd" / "bench_videos"


def video_path(folder: Path, minutes: float, height: int) -> Path:
    return folder / f"h264_{height}p{RATE}_{minutes:g}min_gop{GOP}.mp4"


def make_video(path: Path, minutes: float, height: int) -> Path:
    """An H.264 video of `minutes` at `height`p30 (keyframes every GOP frames, 2 B-frames), written once."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    width = HEIGHTS[height]
    frames = int(round(minutes * 60 * RATE))
    tmp = path.with_suffix(".partial.mp4")
    print(f"vpsd bench video: encoding {path.name} ({frames} frames), once", file=sys.stderr, flush=True)
    y0 = (np.add.outer(np.arange(height), np.arange(width)) % 256).astype(np.uint8)
    chroma = np.full((height // 2, width), 128, np.uint8)
    with av.open(str(tmp), "w") as out:
        stream = out.add_stream("libx264", rate=RATE)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": str(GOP), "keyint_min": str(GOP), "bf": "2", "crf": "28",
                          "sc_threshold": "0"}
        stream.codec_context.time_base = Fraction(1, RATE)
        box = max(16, height // 8)
        for i in range(frames):
            y = np.roll(y0, i * 3, axis=1)
            r, c = (i * 5) % (height - box), (i * 7) % (width - box)
            y[r:r + box, c:c + box] = (i * 11) % 256  # a moving square: every frame differs
            frame = av.VideoFrame.from_ndarray(np.concatenate([y, chroma]), format="yuv420p")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    tmp.rename(path)
    return path


def full_decode(path: Path, indices: np.ndarray) -> np.ndarray:
    """Every frame front to back up to the last wanted one, the wanted ones converted to RGB at full size."""
    wanted = set(indices.tolist())
    last = int(indices[-1])
    got: dict[int, np.ndarray] = {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "SLICE"
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                got[i] = frame.to_ndarray(format="rgb24")
            if i == last:
                break
    return np.stack([got[i] for i in indices.tolist()])


def torchcodec_reader() -> Callable[[Path, np.ndarray], np.ndarray] | None:
    try:
        from torchcodec.decoders import VideoDecoder  # noqa: PLC0415 - optional
    except Exception:  # noqa: BLE001 - absent or built for another torch: the column is left out
        return None

    def read(path: Path, indices: np.ndarray) -> np.ndarray:
        decoder = VideoDecoder(str(path), seek_mode="exact", num_ffmpeg_threads=1)
        return decoder.get_frames_at(indices=indices.tolist()).data.permute(0, 2, 3, 1).numpy()

    return read


def request_indices(path: Path, request: dict) -> np.ndarray:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return select_indices(stream.frames, float(stream.average_rate), **request, max_frames=None, processor=None)


def timed(call: Callable[[], np.ndarray]) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    out = call()
    return time.perf_counter() - t, out


def bench_reads(videos: list[Path], requests: list[dict], repeats: int) -> list[dict]:
    readers: dict[str, Callable[[Path, np.ndarray, dict], np.ndarray]] = {
        "vpsd": lambda p, idx, req: read_video(p, **req).frames,
        "full": lambda p, idx, req: full_decode(p, idx),
    }
    if (tc := torchcodec_reader()) is not None:
        readers["torchcodec"] = lambda p, idx, req: tc(p, idx)
    rows = []
    for path in videos:
        for req in requests:
            idx = request_indices(path, req)
            times: dict[str, list[float]] = {name: [] for name in readers}
            identical = True
            for rep in range(repeats):
                ref = None
                order = list(readers) if rep % 2 == 0 else list(reversed(readers))
                outs = {}
                for name in order:
                    seconds, outs[name] = timed(lambda: readers[name](path, idx, req))
                    times[name].append(seconds)
                ref = outs["full"]
                identical &= all(np.array_equal(ref, o) for o in outs.values())
            rows.append({"video": path.name, "request": req, "frames": len(idx), "identical": identical,
                         **{f"{n}_s": statistics.median(t) for n, t in times.items()},
                         **{f"{n}_spread": max(t) / min(t) - 1 for n, t in times.items()}})
            r = rows[-1]
            print(f"  {path.name:34s} {describe(req):>9s} {r['frames']:5d} frames  vpsd {r['vpsd_s']:7.2f} s  "
                  f"full {r['full_s']:7.2f} s  {r['full_s'] / r['vpsd_s']:6.1f}x  "
                  f"{'identical' if identical else 'FRAMES DIFFER'}", file=sys.stderr, flush=True)
    return rows


def describe(req: dict) -> str:
    return f"{req['num_frames']} fr" if req.get("num_frames") else f"fps {req['fps']:g}"


def table(rows: list[dict]) -> str:
    tc = any("torchcodec_s" in r for r in rows)
    head = f"{'video':34s} {'request':>9s} {'frames':>6s} {'vpsd s':>14s} {'full decode s':>14s}" + (
        f" {'torchcodec s':>14s}" if tc else "") + f" {'vpsd speedup':>12s}  frames"
    lines = [head]
    for r in rows:
        cell = lambda n: f"{r[n + '_s']:7.2f} ({r[n + '_spread']:4.0%})"  # noqa: E731
        lines.append(f"{r['video']:34s} {describe(r['request']):>9s} {r['frames']:6d} {cell('vpsd'):>14s} "
                     f"{cell('full'):>14s}" + (f" {cell('torchcodec'):>14s}" if tc else "")
                     + f" {r['full_s'] / r['vpsd_s']:11.1f}x  {'identical' if r['identical'] else 'DIFFER'}")
    return "\n".join(lines)


def bench_job(config: str, videos: list[Path], items: int, out: Path) -> dict:
    """An `ar` job over `items` of the videos, 64 frames each; its wall split from its own results."""
    manifest = out / "manifest.jsonl"
    with open(manifest, "w") as f:
        for i in range(items):
            f.write(json.dumps({"id": f"v{i}", "video": str(videos[i % len(videos)]),
                                "prompt": "Describe the video.", "num_frames": 64, "max_new_tokens": 32}) + "\n")
    root = Path(__file__).resolve().parents[2]
    run = out / "job"
    shutil.rmtree(run, ignore_errors=True)
    t = time.perf_counter()
    proc = subprocess.run([str(root / "torchrun.sh"), "run", "--config", config, "--manifest", str(manifest),
                           "--out", str(run), "--method", "ar", "--quiet"], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode not in (0, 3):
        raise SystemExit(f"vpsd bench video: the job exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    loop = json.loads((run / "summary.json").read_text()).get("run", {}).get("loop_s") or wall
    split = {k: sum((r["stats"].get(k) or 0.0) for r in rows)
             for k in ("video_read_s", "preprocess_s", "video_wait_s", "prefill_s", "decode_s")}
    return {"items": len(rows), "failed": sum(r["error"] is not None for r in rows), "wall_s": wall,
            "loop_s": loop, **split, "wait_share": split["video_wait_s"] / loop}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench video", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1,10,60", help="video lengths in minutes")
    p.add_argument("--sizes", default="720", help="heights: 480, 720, 1080")
    p.add_argument("--frames", default="16,64,128", help="uniformly sampled frame counts")
    p.add_argument("--fps", default="2", help="sampling rates (frames a second); empty for none")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--videos", type=Path, default=None, help="where the bench's videos are kept")
    p.add_argument("--job", metavar="CONFIG", default=None, help="also run an ar job over the videos")
    p.add_argument("--job-items", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = a.videos or default_dir()
    lengths = [float(x) for x in a.lengths.split(",") if x]
    sizes = [int(x) for x in a.sizes.split(",") if x]
    if bad := [s for s in sizes if s not in HEIGHTS]:
        p.error(f"--sizes: {bad} not among {sorted(HEIGHTS)}")
    videos = [make_video(video_path(folder, m, h), m, h) for h in sizes for m in lengths]
    requests = [{"num_frames": int(n)} for n in a.frames.split(",") if n] + [
        {"fps": float(f)} for f in a.fps.split(",") if f]
    print(f"vpsd bench video: {len(videos)} videos x {len(requests)} requests, {a.repeats} interleaved repeats",
          file=sys.stderr)
    rows = bench_reads(videos, requests, a.repeats)
    print(table(rows))
    report = {"reads": rows}
    if a.job:
        with tempfile.TemporaryDirectory(prefix="vpsd_bench_video_") as tmp:
            job = bench_job(a.job, videos, a.job_items, Path(tmp))
        report["job"] = job
        print(f"\nar job, {job['items']} items of 64 frames ({job['failed']} failed): wall {job['wall_s']:.1f} s, "
              f"loop {job['loop_s']:.1f} s; the target's reading {job['video_read_s']:.1f} s + preprocessing "
              f"{job['preprocess_s']:.1f} s (off the decode's path but for the wait), waiting for frames "
              f"{job['video_wait_s']:.2f} s ({job['wait_share']:.1%} of the loop), prefill {job['prefill_s']:.1f} s, "
              f"decode {job['decode_s']:.1f} s")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(r["identical"] for r in rows) else 1

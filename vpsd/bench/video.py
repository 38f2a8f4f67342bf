"""What reading a real-length video costs: vpsd's reader against a full decode (and torchcodec where it imports),
over the video's length and size, and where a long-video job's wall goes.

    vpsd bench video [--lengths 1,10,60] [--sizes 720] [--frames 16,64,128] [--fps 2] [--repeats 3]
                     [--videos DIR] [--job CONFIG [--job-items 8]]

- The videos are made here, once, with PyAV's libx264 (30 fps, a keyframe every 2 s, B-frames: the GOP of a
  typical H.264 upload; a moving pattern so each frame differs) and kept in --videos (default
  ~/.cache/vpsd/bench_videos) between runs: an hour of 720p takes minutes to encode on two cores.
- Each cell is a video and a request (N frames uniformly, or one every 1/fps s): vpsd's reader (`read_video`,
  exact seeks) and torchcodec's `get_frames_at` (exact seek mode, one FFmpeg thread) when torchcodec imports,
  against a full decode of the video (every frame front to back up to the last wanted one, the wanted ones
  converted: what vpsd read before, and what lmms-eval's PyAV path does; one pass a video and repeat serves all
  its requests, since it costs the same whichever frames it keeps). The full decode runs first in even repeats
  and last in odd ones; a table of medians, the spread (max/min - 1) and vpsd's speedup over the full decode.
  Every cell's frames are checked bit for bit against the full decode's. Rate requests run on videos up to
  --fps-max-minutes (fps 2 over an hour is 20 GB of full-size RGB).
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

from vpsd.video.decode import probe_video, read_video
from vpsd.video.item import scale_to_max_side

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


def full_decode(path: Path, wanted: list[np.ndarray], max_side: int | None = None) -> list[np.ndarray]:
    """Every frame front to back up to the last wanted one, each request's frames converted to RGB at full size (then
    scaled to `max_side` as vpsd's reader did before it scaled as it converted): one pass serves every request of a
    video (a full decode costs the same whichever frames it keeps)."""
    union = sorted(set(np.concatenate(wanted).tolist()))
    last = union[-1]
    keep = set(union)
    got: dict[int, np.ndarray] = {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for i, frame in enumerate(container.decode(stream)):
            if i in keep:
                got[i] = frame.to_ndarray(format="rgb24")
            if i == last:
                break
    return [scale_to_max_side(np.stack([got[i] for i in idx.tolist()]), max_side) for idx in wanted]


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
    return probe_video(path).indices(**request)


def timed(call: Callable[[], np.ndarray]) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    out = call()
    return time.perf_counter() - t, out


def bench_reads(videos: list[Path], requests: list[dict], repeats: int, fps_max_minutes: float,
                max_side: int | None = None) -> list[dict]:
    """Per video and repeat: one full decode serving all its requests, then vpsd's reader (and torchcodec's) on each
    request, the order flipped every repeat. A rate request runs on videos up to `fps_max_minutes` long (fps 2 over
    an hour is 7,200 full-size frames: 20 GB of RGB)."""
    tc = torchcodec_reader()
    rows = []
    for path in videos:
        info = probe_video(path)
        mine = [r for r in requests if "fps" not in r or info.duration_s <= fps_max_minutes * 60]
        if not mine:
            continue
        idx = [request_indices(path, r) for r in mine]
        full_s: list[float] = []
        times: dict[str, list[list[float]]] = {"vpsd": [[] for _ in mine], "torchcodec": [[] for _ in mine]}
        identical = [True] * len(mine)
        for rep in range(repeats):
            def full() -> list[np.ndarray]:
                seconds, refs = timed(lambda: full_decode(path, idx, max_side))
                full_s.append(seconds)
                return refs

            refs = full() if rep % 2 == 0 else None
            outs = []
            for j, req in enumerate(mine):
                seconds, out = timed(lambda: read_video(path, **req, max_side=max_side).frames)
                times["vpsd"][j].append(seconds)
                outs.append(out)
                if tc is not None and max_side is None:
                    seconds, got = timed(lambda: tc(path, idx[j]))
                    times["torchcodec"][j].append(seconds)
                    outs[-1] = (out, got)
            refs = refs if refs is not None else full()
            for j, out in enumerate(outs):
                pair = out if isinstance(out, tuple) else (out,)
                # Scaled, the two differ by design (swscale as it converts, torch's antialiased bicubic after).
                identical[j] = None if max_side is not None else (
                    identical[j] and all(np.array_equal(refs[j], o) for o in pair))
            del refs, outs
        for j, req in enumerate(mine):
            row = {"video": path.name, "minutes": info.duration_s / 60, "request": req, "frames": len(idx[j]),
                   "identical": identical[j], "full_s": statistics.median(full_s),
                   "full_spread": max(full_s) / min(full_s) - 1}
            for name, t in times.items():
                if t[j]:
                    row[f"{name}_s"], row[f"{name}_spread"] = statistics.median(t[j]), max(t[j]) / min(t[j]) - 1
            rows.append(row)
            print(f"  {path.name:34s} {describe(req):>9s} {row['frames']:5d} frames  vpsd {row['vpsd_s']:7.2f} s  "
                  f"full {row['full_s']:7.2f} s  {row['full_s'] / row['vpsd_s']:6.1f}x  "
                  f"{ {True: 'identical', False: 'FRAMES DIFFER', None: '-'}[row['identical']]}", file=sys.stderr, flush=True)
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
                     + f" {r['full_s'] / r['vpsd_s']:11.1f}x  { {True: 'identical', False: 'DIFFER', None: '-'}[r['identical']]}")
    return "\n".join(lines)


def bench_job(config: str, videos: list[Path], items: int, out: Path, sets: list[str]) -> dict:
    """An `ar` job over `items` of the videos, 64 frames each; its wall split from its own results."""
    manifest = out / "manifest.jsonl"
    with open(manifest, "w") as f:
        for i in range(items):
            # Each item a file of its own (a hard link): items of one file would share its prefix (reuse), and this
            # measures reading, not that.
            link = out / f"v{i}{videos[i % len(videos)].suffix}"
            os.link(videos[i % len(videos)], link)
            f.write(json.dumps({"id": f"v{i}", "video": str(link),
                                "prompt": "Describe the video.", "num_frames": 64, "max_new_tokens": 32}) + "\n")
    root = Path(__file__).resolve().parents[2]
    run = out / "job"
    shutil.rmtree(run, ignore_errors=True)
    t = time.perf_counter()
    proc = subprocess.run([str(root / "torchrun.sh"), "run", "--config", config, "--manifest", str(manifest),
                           "--out", str(run), "--method", "ar", "--quiet", *[f"--set={s}" for s in sets]],
                          capture_output=True, text=True)
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
    p.add_argument("--fps-max-minutes", type=float, default=10.0, help="rate requests on videos up to this long")
    p.add_argument("--max-side", type=int, default=None,
                   help="frames at this longest side: vpsd scales as it converts, the full decode converts at full "
                        "size and scales after (vpsd's reader before); frames then not compared")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--videos", type=Path, default=None, help="where the bench's videos are kept")
    p.add_argument("--job", metavar="CONFIG", default=None, help="also run an ar job over the videos")
    p.add_argument("--job-items", type=int, default=8)
    p.add_argument("--job-set", action="append", default=[], metavar="KEY=VALUE", help="the job's config settings")
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
    rows = bench_reads(videos, requests, a.repeats, a.fps_max_minutes, a.max_side)
    print(table(rows))
    report = {"reads": rows}
    if a.job:
        with tempfile.TemporaryDirectory(prefix="vpsd_bench_video_") as tmp:
            job = bench_job(a.job, videos, a.job_items, Path(tmp), a.job_set)
        report["job"] = job
        print(f"\nar job, {job['items']} items of 64 frames ({job['failed']} failed): wall {job['wall_s']:.1f} s, "
              f"loop {job['loop_s']:.1f} s; the target's reading {job['video_read_s']:.1f} s + preprocessing "
              f"{job['preprocess_s']:.1f} s (off the decode's path but for the wait), waiting for frames "
              f"{job['video_wait_s']:.2f} s ({job['wait_share']:.1%} of the loop), prefill {job['prefill_s']:.1f} s, "
              f"decode {job['decode_s']:.1f} s")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(r["identical"] is not False for r in rows) else 1

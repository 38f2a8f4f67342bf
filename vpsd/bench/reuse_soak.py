"""`vpsd bench reuse-soak`: a server's memory over a long load whose prefix cache keeps evicting (issue 62: "memory
within the budget always; 1,000 server requests over 50 videos hold flat memory").

    vpsd bench reuse-soak [--config configs/world_qwen2_5_vl.yaml] [--method hippo] [--requests 1000] [--videos 50]
                          [--clients 4] [--batch 4] [--max-tokens 8] [--budget-mib 4] [--set KEY=VALUE] [--out DIR]

- Videos: V distinct clips: the --manifest's first (examples/world: 8), then clips of the procedural short world
  (vpsd/world/dataset.py, held-out seeds from --seed) up to V, every one copied or written into DIR/videos (the
  server's --allowed-media-dir). Distinct content, checked (no two files alike): a hard link or a copy of one clip
  would be one video to the cache, which keys what the model sees.
- Load: `vpsd serve --config C --method M --batch B --set reuse.budget_mib=BUDGET` on a free loopback port (vpsd/bench/
  server_process.py), one warm-up request (not counted), then N chat completions, each video asked N / V times
  (the world's prompts in turn), in a shuffled order (--order-seed), from C client threads with OpenAI's client,
  each video by its path, each answer at most --max-tokens (short: the load is prefills, where the cache works).
  The budget is small (4 MiB: a prefix of this pair, its KV and vision features, is ~0.3 MiB, so ~12 of 50 videos
  fit), so the cache fills early and evicts for the rest of the load: what is measured is memory under eviction.
- Sampled every --sample-s (1 s) and at 10, 25, 50, 75 and 100% of the requests: the resident memory of the
  server's process tree (the server and its child ranks; psutil where installed, else /proc) against the requests
  answered; every few samples the prefix cache's gauges from /metrics (the target rank's too when the method runs
  on ranks: serve/on_ranks.py).
- Reported: requests answered and failed (by kind), RSS after the warm-up, at 10%, 50% and 100% of the requests and
  the most seen, the slope of RSS over the second half (MiB per 100 requests, a least-squares line through its
  samples), the cache's bytes now, its peak and its budget (the peak never above it), hits, misses and evictions,
  and one verdict line. Everything goes to DIR/soak.json too (every sample).

The verdict: flat when the second half's growth (the fitted slope times the second half's requests, so that no one
sample's noise decides) is under max(2% of the RSS at 50%, 20 MiB). Why those numbers: what this bench hunts is
memory kept per request and never freed (a prefix, a request's frames, a record of it), and on this pair each
weighs 0.1-0.3 MiB (a prefix's KV ~270 KiB, 8 frames at 112x112 ~300 KiB): 500 leaked over the second half grow
it by 50-150 MiB, far over the line. A healthy torch server's RSS moves without leaking (glibc's arenas and torch's
CPU allocator keep freed blocks; a full batch's first growth: docs/benchmarks.md saw +25-30 MB from the warm-up
into the first serving load, then +2 MB over 500 more requests): 20 MiB sits above that noise for this pair, and 2%
scales it for a larger server whose allocator slack grows with its tensors. So a leak below ~40 KiB a request
(20 MiB / 500) is under what this bench can tell from noise; the first half (the cache filling, the allocator
warming) is reported but not judged. Exit 0 when flat, no request failed, and the cache stayed within its budget;
1 otherwise. Never in a test at full size: it measures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from vpsd.bench.server_process import ServerFailed, start_server, tree_rss_mib

FLAT_SHARE = 0.02  # of the RSS at 50% (module docstring: the verdict)
FLAT_FLOOR_MIB = 20.0
METRICS_EVERY = 5  # samples between two scrapes of /metrics


# ---- videos and the order of the requests ----------------------------------------------------------------------


def prepare_videos(count: int, manifest: Path | None, out: Path, seed: int) -> list[Path]:
    """`count` distinct clips in `out`: the manifest's first videos copied, then short-world clips of seeds `seed`,
    `seed` + 1, ... written (an existing file is kept: a rerun writes nothing). SystemExit when two are alike."""
    out.mkdir(parents=True, exist_ok=True)
    videos: list[Path] = []
    if manifest is not None:
        seen: set[Path] = set()
        for line in manifest.read_text().splitlines():
            if len(videos) == count:
                break
            if not line.strip():
                continue
            src = (manifest.parent / json.loads(line)["video"]).resolve()
            if src in seen:
                continue
            seen.add(src)
            dst = out / src.name
            if not dst.exists():
                shutil.copyfile(src, dst)
            videos.append(dst)
    if len(videos) < count:
        from vpsd.world.dataset import make_example, write_video

        for k in range(count - len(videos)):
            dst = out / f"soak-{seed + k:06d}.mp4"
            if not dst.exists():
                write_video(dst, make_example(seed + k).frames)
            videos.append(dst)
    digests: dict[str, Path] = {}
    for v in videos:
        d = hashlib.sha256(v.read_bytes()).hexdigest()
        if d in digests:
            raise SystemExit(f"vpsd bench reuse-soak: {v} and {digests[d]} are the same video; pick another --seed")
        digests[d] = v
    return videos


def schedule(requests: int, videos: int, questions: tuple[str, ...], seed: int) -> list[tuple[int, str]]:
    """(video index, question) per request: every video asked requests / videos times (the first ones once more
    when it does not divide), its k-th ask the k-th question in turn, the whole shuffled at `seed`."""
    asks = [(n % videos, questions[(n // videos) % len(questions)]) for n in range(requests)]
    random.Random(seed).shuffle(asks)
    return asks


# ---- memory ------------------------------------------------------------------------------------------------------


def reuse_metrics(base: str) -> dict[str, float]:
    """The server's `vpsd_prefix_reuse_*` lines (serve/metrics.py), by name; {} when it has none (yet)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("vpsd_prefix_reuse_")}


@dataclass
class Sample:
    t: float  # seconds since the load began
    done: int  # requests answered (or failed) by then
    rss_mib: float


class Sampler:
    """A thread sampling the server tree's RSS every `every_s` against the requests done, and /metrics' prefix
    cache every METRICS_EVERY samples (its largest `bytes` kept)."""

    def __init__(self, pid: int, base: str, every_s: float, done) -> None:
        self.pid, self.base, self.every_s, self.done = pid, base, every_s, done
        self.samples: list[Sample] = []
        self.most_bytes = 0.0  # the cache's bytes, the most any scrape saw
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the clients' threads sample too (at the progress marks)
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> Sample:
        rss = round(tree_rss_mib(self.pid), 2)
        with self._lock:
            s = Sample(round(time.perf_counter() - self._t0, 3), self.done(), rss)
            self.samples.append(s)
        return s

    def scrape(self) -> dict[str, float]:
        try:
            m = reuse_metrics(self.base)
        except OSError:
            return {}
        self.most_bytes = max(self.most_bytes, m.get("vpsd_prefix_reuse_bytes", 0.0))
        return m

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.every_s):
            self.sample()
            n += 1
            if n % METRICS_EVERY == 0:
                self.scrape()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# ---- the report (pure) -------------------------------------------------------------------------------------------


def rss_at(samples: list[Sample], done: int) -> float | None:
    """The RSS of the first sample (in the order of requests done) taken once `done` requests were done (the last
    sample if none was)."""
    for s in samples:
        if s.done >= done:
            return s.rss_mib
    return samples[-1].rss_mib if samples else None


def slope_per_request(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x; None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def summarize(samples: list[Sample], requests: int) -> dict:
    """RSS at 10%, 50% and 100% of the requests, the most, and the second half's fitted slope and growth against
    the flat threshold (module docstring)."""
    samples = sorted(samples, key=lambda s: (s.done, s.t))
    half = requests / 2
    second = [(s.done, s.rss_mib) for s in samples if s.done >= half]
    slope = slope_per_request(second)
    at50 = rss_at(samples, math.ceil(half))
    growth = None if slope is None else slope * (requests - half)
    threshold = max(FLAT_SHARE * (at50 or 0.0), FLAT_FLOOR_MIB)
    return {"rss_at_10": rss_at(samples, math.ceil(0.1 * requests)), "rss_at_50": at50,
            "rss_at_100": rss_at(samples, requests), "rss_max": max((s.rss_mib for s in samples), default=None),
            "slope_mib_per_100": None if slope is None else 100 * slope, "second_half_growth_mib": growth,
            "threshold_mib": threshold, "flat": None if growth is None else growth < threshold}


def verdict(summary: dict) -> str:
    threshold = (f"max({FLAT_SHARE:.0%} of {summary['rss_at_50']:.0f} MiB, {FLAT_FLOOR_MIB:.0f} MiB) = "
                 f"{summary['threshold_mib']:.1f} MiB") if summary["rss_at_50"] is not None else "no samples"
    if summary["flat"] is None:
        return f"verdict: not judged (too few samples in the second half; threshold {threshold})"
    word = "flat" if summary["flat"] else "GROWING"
    return (f"verdict: {word}: the second half grew {summary['second_half_growth_mib']:+.1f} MiB by its fitted slope "
            f"({summary['slope_mib_per_100']:+.2f} MiB per 100 requests), threshold {threshold}")


def report_lines(a: argparse.Namespace, done: int, errors: Counter, rss_warm: float | None, summary: dict,
                 reuse: dict[str, float], most_bytes: float) -> list[str]:
    def mib(v) -> str:
        return "-" if v is None else f"{v:.0f} MiB"

    lines = [f"{a.requests} requests over {a.videos} videos from {a.clients} clients, {a.method} at --batch {a.batch}, "
             f"reuse.budget_mib {a.budget_mib:g}, max_tokens {a.max_tokens} ({a.config})",
             f"  answered {done}, failed {sum(errors.values())}"
             + (f" ({', '.join(f'{k} {n}' for k, n in errors.most_common())})" if errors else ""),
             f"  server RSS (with its ranks): {mib(rss_warm)} after the warm-up; {mib(summary['rss_at_10'])} at 10%, "
             f"{mib(summary['rss_at_50'])} at 50%, {mib(summary['rss_at_100'])} at 100%; "
             f"most {mib(summary['rss_max'])}",
             "  second half: " + ("-" if summary["slope_mib_per_100"] is None else
                                  f"{summary['slope_mib_per_100']:+.2f} MiB per 100 requests")]
    if reuse:
        budget = reuse.get("vpsd_prefix_reuse_budget_bytes", 0.0)
        peak = reuse.get("vpsd_prefix_reuse_peak_bytes", 0.0)
        lines.append(f"  prefix cache: {reuse.get('vpsd_prefix_reuse_bytes', 0) / 2**20:.2f} MiB held at the end, "
                     f"most seen {most_bytes / 2**20:.2f}, peak {peak / 2**20:.2f} of its {budget / 2**20:.2f} MiB "
                     f"budget ({'within' if peak <= budget else 'OVER'}); hits "
                     f"{reuse.get('vpsd_prefix_reuse_hits_total', 0):.0f}, misses "
                     f"{reuse.get('vpsd_prefix_reuse_misses_total', 0):.0f}, evictions "
                     f"{reuse.get('vpsd_prefix_reuse_evictions_total', 0):.0f}")
        if not reuse.get("vpsd_prefix_reuse_evictions_total"):
            lines.append("  (nothing was evicted: the budget held every video; lower --budget-mib to soak eviction)")
    else:
        lines.append("  prefix cache: not on /metrics (reuse off?)")
    lines.append(verdict(summary))
    return lines


# ---- the load ----------------------------------------------------------------------------------------------------


def _ask(client, model: str, video: Path, question: str, max_tokens: int) -> None:
    r = client.chat.completions.create(
        model=model, max_tokens=max_tokens,
        messages=[{"role": "user", "content": [{"type": "text", "text": question},
                                               {"type": "video_url", "video_url": {"url": str(video)}}]}])
    if r.choices[0].finish_reason == "error":
        raise RuntimeError("finish_reason error")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vpsd bench reuse-soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/world_qwen2_5_vl.yaml")
    p.add_argument("--method", default="hippo")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--videos", type=int, default=50)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--batch", type=int, default=4,
                   help="the server's --batch (a parallel method at 1 runs on child ranks, batched in process)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--budget-mib", type=float, default=4.0, help="reuse.budget_mib: small, so that the cache evicts")
    p.add_argument("--manifest", type=Path, default=Path("examples/world/manifest.jsonl"),
                   help="its videos first; the rest from the short world ('none': all from the world)")
    p.add_argument("--seed", type=int, default=5000, help="the first short-world seed for the videos written")
    p.add_argument("--order-seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None, help="videos, server log, soak.json (default: a temp dir)")
    a = p.parse_args(argv)
    if a.requests < 2 or a.videos < 1 or a.clients < 1:
        p.error("--requests must be at least 2, --videos and --clients at least 1")
    if str(a.manifest).lower() == "none":
        a.manifest = None
    return a


def _load(a, base: str, videos: list[Path], todo: list[tuple[int, str]], sampler: "Sampler", done: list[int],
          errors: Counter) -> tuple[float, dict, float]:
    """The load: a warm-up request, then every request of `todo` from `a.clients` threads, RSS sampled throughout
    (and at 10/25/50/75/100% of the requests); (RSS after the warm-up, /metrics' reuse counters at the end, the
    load's seconds)."""
    import openai

    lock = threading.Lock()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    _ask(client, model, videos[todo[0][0]], todo[0][1], a.max_tokens)  # warm-up: not counted
    rss_warm = tree_rss_mib(sampler.pid)
    marks = {math.ceil(f * a.requests) for f in (0.1, 0.25, 0.5, 0.75, 1.0)}
    started = time.perf_counter()

    def one(job: tuple[int, str]) -> None:
        try:
            _ask(client, model, videos[job[0]], job[1], a.max_tokens)
            failed = None
        except Exception as e:  # noqa: BLE001 - counted by kind, the load goes on
            failed = getattr(e, "status_code", None) or type(e).__name__
        with lock:
            done[0] += 1
            if failed is not None:
                errors[str(failed)] += 1
            n = done[0]
        if n in marks:  # sampled there too: a short load has samples in its second half
            print(f"  {n}/{a.requests} requests, {time.perf_counter() - started:.0f} s, RSS "
                  f"{sampler.sample().rss_mib:.0f} MiB", file=sys.stderr, flush=True)

    sampler.sample()
    sampler.start()
    with ThreadPoolExecutor(a.clients) as pool:
        list(pool.map(one, todo))
    sampler.stop()
    sampler.sample()  # at 100%
    return rss_warm, sampler.scrape(), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    from vpsd.world.caption import PROMPTS

    a = _parse(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="vpsd-bench-reuse-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    videos = prepare_videos(a.videos, a.manifest, out / "videos", a.seed)
    todo = schedule(a.requests, len(videos), PROMPTS, a.order_seed)
    args = ["--config", a.config, "--method", a.method, "--batch", str(a.batch), "--max-queue",
            str(max(64, 2 * a.clients)), "--allowed-media-dir", str(out / "videos"),
            f"--set=reuse.budget_mib={a.budget_mib}", *(f"--set={kv}" for kv in a.set)]
    t0 = time.perf_counter()
    try:
        proc, base = start_server(args, out / "server.log", a.startup_timeout)
    except ServerFailed as e:
        raise SystemExit(f"vpsd bench reuse-soak: {e}") from None
    print(f"server up in {time.perf_counter() - t0:.1f} s; {len(videos)} videos in {out / 'videos'}", flush=True)
    done, errors = [0], Counter()
    sampler = Sampler(proc.pid, base, a.sample_s, lambda: done[0])
    try:
        rss_warm, reuse, wall = _load(a, base, videos, todo, sampler, done, errors)
    finally:
        sampler.stop()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    summary = summarize(sampler.samples, a.requests)
    answered = done[0] - sum(errors.values())
    lines = report_lines(a, answered, errors, rss_warm, summary, reuse, sampler.most_bytes)
    lines.insert(1, f"  load: {wall:.0f} s, {len(sampler.samples)} samples of RSS")
    print("\n".join(lines))
    within = not reuse or reuse.get("vpsd_prefix_reuse_peak_bytes", 0) <= reuse.get("vpsd_prefix_reuse_budget_bytes", 0)
    (out / "soak.json").write_text(json.dumps({
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "answered": answered, "errors": dict(errors), "rss_after_warmup_mib": rss_warm, "load_s": wall,
        "summary": summary, "reuse": reuse, "reuse_most_bytes_seen": sampler.most_bytes, "within_budget": within,
        "samples": [asdict(s) for s in sampler.samples]}, indent=1))
    print(f"  (server log, videos and soak.json with every sample in {out})")
    return 0 if summary["flat"] and not errors and within else 1


if __name__ == "__main__":
    sys.exit(main())

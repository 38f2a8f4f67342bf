"""One video, many questions: items/hour with the prefix reuse against the same questions each on its own copy of
the video, and a chat's second turn against its first.

    vpsd bench reuse --config C --videos DIR_OR_MANIFEST [--count 4] [--questions 3] [--methods ar,hippo]
                     [--batch 1] [--repeats 2] [--max-new-tokens N] [--generic] [--out DIR]

- A VideoMME-shaped manifest: --count videos (the first of a manifest's, or a folder's), --questions questions each,
  a video's questions in a row as a benchmark's file lists them. From a manifest the questions are its own prompts
  (each distinct one, in order, cycled) at its own answer lengths, so the pair answers what it was made for (the
  world's captions and event questions); from a folder, or with --generic, fixed English questions. --max-new-tokens
  caps every answer (32: VideoMME-like short answers). Beside it the
  same items with each question on a copy of its video (a hard link under another name: a job then keeps no prefix,
  since no other item asks about that file, launch/manifest.py shares_video).
- Every (method, manifest) is a real job (vpsd bench's run_one, torchrun), the cells interleaved and repeated;
  items/hour from each job's own loop time, medians and the spread; every output checked against `ar` with reuse
  (token for token: a kept prefix is prefilled in two forwards hit or miss, so methods agree with `ar` with reuse;
  against the copies, only float near-ties may differ, counted apart).
- --chat: in this process, the target's time to first token of a two-turn chat's second turn (the first turn's
  answer in it) against the first turn's, reuse on, medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from vpsd.bench.methods import BenchRun, run_one
from vpsd.bench.throughput import read_cell

QUESTIONS = ["What happens in this video, and when?", "How many objects are there?",
             "What colour is the background?", "Which object moves first?", "Describe the video."]


def manifests(source: Path, count: int, questions: int, max_new: int | None, out: Path,
              generic: bool = False) -> tuple[Path, Path]:
    """(shared, copies): `count` videos x `questions` questions; in `copies` every item has its own hard link."""
    asks: list[tuple[str, int | None]] = [(q, None) for q in QUESTIONS]
    if source.is_dir():
        videos = sorted(p for p in source.iterdir() if p.suffix in (".mp4", ".mkv", ".webm", ".mov"))[:count]
    else:
        rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        videos = [(source.parent / r["video"]).resolve() for r in rows][:count]
        if not generic:
            own = {r["prompt"]: r.get("max_new_tokens") for r in rows if isinstance(r.get("prompt"), str)}
            asks = list(own.items()) or asks
    if len(videos) < count:
        raise SystemExit(f"vpsd bench reuse: {source} has {len(videos)} videos, --count asks for {count}")
    links = out / "copies"
    links.mkdir(parents=True, exist_ok=True)
    shared, copies = out / "shared.jsonl", out / "copies.jsonl"
    with open(shared, "w") as a, open(copies, "w") as b:
        for v, video in enumerate(videos):
            for q in range(questions):
                prompt, own_max = asks[q % len(asks)]
                item = {"id": f"v{v}-q{q}", "prompt": prompt}
                if max_new or own_max:
                    item["max_new_tokens"] = min(n for n in (max_new, own_max) if n)
                a.write(json.dumps({**item, "video": str(video)}) + "\n")
                link = links / f"v{v}-q{q}{video.suffix}"
                if not link.exists():
                    os.link(video, link)
                b.write(json.dumps({**item, "video": str(link)}) + "\n")
    return shared, copies


def jobs(a: argparse.Namespace, shared: Path, copies: Path, out: Path) -> dict[str, list]:
    cells: dict[str, list] = {}
    torchrun = ["--standalone", "--nproc-per-node", "3"]
    for rep in range(a.repeats):
        order = [(m, kind) for m in a.methods.split(",") for kind in ("reuse", "copies")]
        for method, kind in order if rep % 2 == 0 else list(reversed(order)):
            label = f"{method} {kind}"
            path = out / "runs" / f"{method}_{kind}_r{rep}"
            t = time.time()
            code = run_one(BenchRun(label, method), a.config, str(shared if kind == "reuse" else copies), path,
                           torchrun, ["--batch", str(a.batch), *[f"--set={s}" for s in a.set]])
            if code not in (0, 3):
                raise SystemExit(f"vpsd bench reuse: {label} exited {code} (see {path}/launch.log)")
            cell = read_cell(path)
            cells.setdefault(label, []).append(cell)
            print(f"  {label:16s} r{rep}: {cell.items_per_hour:8.0f} items/hour ({time.time() - t:.0f} s)",
                  file=sys.stderr, flush=True)
    return cells


def report(cells: dict[str, list], methods: list[str]) -> str:
    ref = cells["ar reuse"][0].outputs
    base = statistics.median(c.items_per_hour for c in cells["ar reuse"])
    lines = [f"{'cell':16s} {'items/hour':>10s} {'spread':>7s} {'x ar reuse':>10s} {'= ar reuse':>10s}"]
    for label, cs in cells.items():
        iph = statistics.median(c.items_per_hour for c in cs)
        rates = [c.items_per_hour for c in cs]
        same = sum(c.outputs.get(k) == v for c in cs[:1] for k, v in ref.items())
        lines.append(f"{label:16s} {iph:10.0f} {max(rates) / min(rates) - 1:6.0%} {iph / base:9.2f}x "
                     f"{same:>5d}/{len(ref)}")
    for m in methods:
        with_, without = (statistics.median(c.items_per_hour for c in cells[f"{m} {k}"]) for k in ("reuse", "copies"))
        lines.append(f"{m}: reuse {with_ / without:.2f}x its copies")
    return "\n".join(lines)


def chat_ttft(config: str, video: Path, repeats: int, sets: list[str]) -> tuple[float, float]:
    """Medians of the first turn's and the second turn's time to first token, in process, reuse on."""
    from vpsd.api import LLM, SamplingParams, VideoRequest

    overrides = dict(s.split("=", 1) for s in sets)
    first, second = [], []
    with LLM(config, method="ar", settings=overrides) as llm:
        for rep in range(repeats):
            turn1 = [{"role": "user", "content": [{"type": "video"},
                                                  {"type": "text", "text": f"What happens in this video? ({rep})"}]}]
            t = time.perf_counter()
            answer = llm.generate(VideoRequest(str(video), turn1), SamplingParams(max_new_tokens=1))[0].text
            first.append(time.perf_counter() - t)
            turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
            t = time.perf_counter()
            llm.generate(VideoRequest(str(video), turn2), SamplingParams(max_new_tokens=1))
            second.append(time.perf_counter() - t)
    return statistics.median(first), statistics.median(second)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpsd bench reuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--videos", type=Path, required=True, help="a manifest or a folder of videos")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--methods", default="ar,hippo")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap every answer (default: the manifest's own lengths, else the config's)")
    p.add_argument("--generic", action="store_true", help="fixed English questions, not the manifest's prompts")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--chat", action="store_true", help="also a two-turn chat's time to first token")
    p.add_argument("--out", type=Path, default=Path("runs/bench_reuse"))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    shared, copies = manifests(a.videos, a.count, a.questions, a.max_new_tokens, a.out, a.generic)
    methods = a.methods.split(",")
    if "ar" not in methods:
        p.error("--methods must include ar (every output is checked against it)")
    cells = jobs(a, shared, copies, a.out)
    text = report(cells, methods)
    if a.chat:
        video = Path(json.loads(shared.read_text().splitlines()[0])["video"])
        t1, t2 = chat_ttft(a.config, video, a.repeats, a.set)
        text += f"\nchat, time to first token: first turn {t1:.2f} s, second turn {t2:.2f} s ({t2 / t1:.2f}x)"
    print(text)
    (a.out / "reuse.txt").write_text(text + "\n")
    return 0

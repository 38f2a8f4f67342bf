"""`vpsd bench serve`: a load against `vpsd serve`, from concurrent clients, and the batch job on the same items.

    vpsd bench serve --config C --method M --manifest M [--requests N] [--clients C] [--batch B] [--job]
                     [--url http://127.0.0.1:8000/v1 --api-key K]

Starts `vpsd serve --config C --method M --batch B` on a free loopback port (or uses a running server, --url),
sends one warm-up request, then N streamed chat completions (the manifest's items in turn, each video as a
data: URL, each item's own max_new_tokens) from C client threads with OpenAI's client, and prints: every request
answered exactly once, each item's outputs identical across its repeats, latency and time to first token (p50,
p99; the first content chunk), completion tokens/s and items/hour over the load's wall time, the mean batch a
request decoded in, and the server's resident memory (itself and its child ranks) before and after the load.
With --job, the batch job (`vpsd.launch.entry` under torchrun, --batch B, the same method) decodes the same N
requests as a manifest, and its items/hour (over its item loop: models loaded, as the server's load is), its
median read + preprocess + prefill per item (what a first token costs it) and its outputs are set beside the
server's. Never in a test: it measures.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from vpsd.bench.methods import BenchRun, run_one
from vpsd.bench.server_process import ServerFailed, start_server, tree_rss_mib


@dataclass
class Answer:
    item: str
    id: str
    text: str
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    batch_size: int | None


def _items(manifest: Path) -> list[dict]:
    items = []
    for line in manifest.read_text().splitlines():
        if line.strip():
            it = json.loads(line)
            path = (manifest.parent / it["video"]).resolve()
            it["path"] = str(path)
            it["data_url"] = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
            items.append(it)
    return items


def _start_server(a: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    args = ["--config", a.config, "--method", a.method, "--batch", str(a.batch), "--max-queue",
            str(max(64, a.requests)), *(f"--set={kv}" for kv in a.set)]
    t0 = time.perf_counter()
    try:
        proc, base = start_server(args, log, 600)
    except ServerFailed as e:
        raise SystemExit(f"vpsd bench serve: {e}") from None
    print(f"server up in {time.perf_counter() - t0:.1f} s ({a.method}, batch {a.batch})", flush=True)
    return proc, f"{base}/v1"


def _ask(client, model: str, item: dict) -> Answer:
    t0 = time.perf_counter()
    first = None
    text, usage, rid = [], None, ""
    stream = client.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True},
        max_tokens=item.get("max_new_tokens"), stop=item.get("stop") or None,
        messages=[{"role": "user", "content": [{"type": "text", "text": item["prompt"]},
                                               {"type": "video_url", "video_url": {"url": item["data_url"]}}]}])
    for chunk in stream:
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    extra = getattr(usage, "vpsd", None) or {}
    return Answer(item["id"], rid, "".join(text), time.perf_counter() - t0, first,
                  usage.completion_tokens if usage else 0, extra.get("batch_size"))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def _load(a: argparse.Namespace, url: str, items: list[dict], pid: int | None) -> tuple[list[Answer], float]:
    import openai

    client = openai.OpenAI(base_url=url, api_key=a.api_key or "none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    _ask(client, model, items[0])  # warm-up: not counted
    if pid is not None:
        a.rss_before = tree_rss_mib(pid)
    todo = [items[n % len(items)] for n in range(a.requests)]
    t0, cpu0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(a.clients) as pool:
        answers = list(pool.map(lambda it: _ask(client, model, it), todo))
    # The clients run on the server's machine here: their CPU is not the server's, but it is taken from it.
    a.clients_cpu_s = time.process_time() - cpu0
    return answers, time.perf_counter() - t0


def _job(a: argparse.Namespace, items: list[dict], out: Path) -> tuple[float, float, dict[str, str]]:
    """The batch job on the load's requests: its items/hour over its item loop, its median first-token cost (read,
    preprocess and prefill of an item), and its texts by item."""
    manifest = out / "load.jsonl"
    lines = []
    for n in range(a.requests):
        it = items[n % len(items)]
        row = {"id": f"{it['id']}#{n}", "video": it["path"], "prompt": it["prompt"]}
        for key in ("max_new_tokens", "stop"):
            if it.get(key) is not None:
                row[key] = it[key]
        lines.append(json.dumps(row))
    manifest.write_text("\n".join(lines) + "\n")
    run_dir = out / "job"
    code = run_one(BenchRun(a.method, a.method), a.config, str(manifest), run_dir,
                   ["--standalone", "--nproc-per-node", str(a.nproc)], [f"--set={kv}" for kv in a.set]
                   + ["--batch", str(a.batch)])
    if code != 0:
        raise SystemExit(f"vpsd bench serve: the job exited {code} (see {run_dir}/launch.log)")
    run = json.loads((run_dir / "summary.json").read_text())["run"]
    texts: dict[str, str] = {}
    first: list[float] = []
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("error") is None and row.get("method") == a.method:
            texts.setdefault(str(row["id"]).split("#")[0], row["text"])
            st = row["stats"]
            first.append(sum(float(st.get(k) or 0.0) for k in ("video_read_s", "preprocess_s", "prefill_s")))
    return 3600 * run["items"] / run["loop_s"], statistics.median(first), texts


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vpsd bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/world_qwen2_5_vl.yaml")
    p.add_argument("--method", default="hippo")
    p.add_argument("--manifest", type=Path, default=Path("examples/world/manifest.jsonl"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="the server's and the job's --batch")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--url", default=None, help="a running server's base URL (.../v1); default: start one")
    p.add_argument("--api-key", default=os.environ.get("VPSD_API_KEY"))
    p.add_argument("--job", action="store_true", help="also run the batch job on the same requests")
    p.add_argument("--nproc", type=int, default=1,
                   help="the job's ranks (default 1: one process, as the server where the method drafts in it; a "
                        "parallel method at batch 1 needs its draft and pruner ranks: 3)")
    p.add_argument("--out", type=Path, default=None, help="the server's log and the job's run (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="vpsd-bench-serve-"))
    out.mkdir(parents=True, exist_ok=True)
    items = _items(a.manifest)
    proc = None
    url = a.url
    if url is None:
        proc, url = _start_server(a, out / "server.log")
    try:
        answers, wall = _load(a, url, items, proc.pid if proc is not None else None)
        rss_after = tree_rss_mib(proc.pid) if proc is not None else None
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    ok = len(answers) == a.requests and len({x.id for x in answers}) == a.requests
    by_item: dict[str, set[str]] = {}
    for x in answers:
        by_item.setdefault(x.item, set()).add(x.text)
    consistent = all(len(texts) == 1 for texts in by_item.values())
    # Each item's answer, to hold one method's run to another's (`ar`'s) side by side.
    (out / "answers.jsonl").write_text("".join(json.dumps({"item": i, "text": sorted(t)[0]}) + "\n"
                                               for i, t in sorted(by_item.items())))
    iph = _report(a, answers, wall, rss_after, ok, consistent)
    same = True
    if a.job:
        job_iph, job_first, job_texts = _job(a, items, out)
        same = all(by_item[i] == {t} for i, t in job_texts.items() if i in by_item)
        print(f"  batch job at --batch {a.batch}: {job_iph:.0f} items/hour (item loop); server / job = "
              f"{iph / job_iph:.2f}; outputs identical to the job's: {same}")
        ttft = _pct([x.ttft_s for x in answers if x.ttft_s is not None], 0.5)
        ratio = (f"; the server's time to first token p50 / that = {ttft / job_first:.2f}"
                 if a.clients == 1 else " (time to first token compares at one client: more queue for a slot)")
        print(f"  the job's read + preprocess + prefill of an item, median {job_first:.3f} s{ratio}")
    print(f"  (server log, answers.jsonl and the job's run in {out})")
    return 0 if ok and consistent and same else 1


def _report(a: argparse.Namespace, answers: list[Answer], wall: float, rss_after: float | None, ok: bool,
            consistent: bool) -> float:
    """The load's lines; returns its items/hour."""
    lat = [x.latency_s for x in answers]
    ttft = [x.ttft_s for x in answers if x.ttft_s is not None]
    tokens = sum(x.completion_tokens for x in answers)
    iph = 3600 * len(answers) / wall
    print(f"{a.requests} requests from {a.clients} clients, {a.method} at --batch {a.batch} ({a.config})")
    print(f"  answered once each: {ok}; each item's outputs identical across repeats: {consistent}")
    print(f"  latency p50 {_pct(lat, 0.5):.3f} s  p99 {_pct(lat, 0.99):.3f} s;  time to first token p50 "
          f"{_pct(ttft, 0.5):.3f} s  p99 {_pct(ttft, 0.99):.3f} s")
    print(f"  {tokens / wall:.1f} completion tokens/s, {iph:.0f} items/hour over {wall:.1f} s; mean batch at first "
          f"token {statistics.mean([x.batch_size or 1 for x in answers]):.2f}")
    print(f"  the clients' own CPU: {a.clients_cpu_s:.1f} s ({a.clients_cpu_s / wall / (os.cpu_count() or 1):.0%} of "
          f"this machine's {os.cpu_count()} cores over the load)")
    if rss_after is not None:
        print(f"  server memory (with its ranks) {a.rss_before:.0f} MiB after the warm-up, {rss_after:.0f} MiB after "
              f"the load")
    return iph

if __name__ == "__main__":
    sys.exit(main())

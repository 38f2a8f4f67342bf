"""The Python API against the torchrun job on the same items: decode speed per item and start-up, side by side.

    python scripts/api_vs_job.py [--config configs/world_qwen2_5_vl.yaml] [--method hippo] [--repeats 2]
                                 [--draft-on rank,thread]

Each repeat runs, in turn, the job (`./torchrun.sh run`, one rank a role) and the API in a fresh process for each
`--draft-on` value (`LLM(...)`, then one `generate` of every manifest item), all over the same manifest. It prints
per run: start-up (the job: its wall less its item loop, `loop_s`, so launch, imports, model loads and the end;
the API: from the process's start to a ready `LLM`, imports included), the items' wall (the job's `loop_s`, the
API's `generate`), and the mean decode seconds an item; then medians over the repeats, and the API's ratios to the
job (the issue's goals: decode within 10%, start-up under 1.5x), with the repeats' spread as the noise. Outputs
are checked equal to the job's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

API_RUN = r"""
import json, sys, time
t0 = float(sys.argv[1])
import vpsd
from vpsd.launch.manifest import load_manifest
cfg, method, manifest, draft_on = sys.argv[2:6]
listed = load_manifest(manifest)[0]
items = [vpsd.VideoRequest(str(it.video), it.prompt, id=it.id) for it in listed]
budgets = {it.max_new_tokens for it in listed}  # the manifest's own, as the job uses them (one for all here)
assert len(budgets) == 1, "one max_new_tokens for every item, so that one call decodes them as the job does"
llm = vpsd.LLM(cfg, method=method, draft_on=draft_on)
ready = time.time()
outs = llm.generate(items, vpsd.SamplingParams(max_new_tokens=budgets.pop()))
done = time.time()
llm.close()
print(json.dumps({"startup_s": ready - t0, "items_s": done - ready,
                  "decode_s": [o.stats["decode_s"] for o in outs], "tokens": {o.id: o.token_ids for o in outs}}))
"""


def run_job(config: str, method: str, manifest: str, out: Path) -> dict:
    start = time.time()
    proc = subprocess.run(["./torchrun.sh", "run", "--config", config, "--manifest", manifest, "--out", str(out),
                           "--method", method, "--quiet"], cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        sys.exit(f"the job failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    loop = summary["run"]["loop_s"] if "run" in summary else summary["loop_s"]
    return {"startup_s": wall - loop, "items_s": loop, "decode_s": [r["stats"]["decode_s"] for r in rows],
            "tokens": {r["id"]: r["token_ids"] for r in rows}}


def run_api(config: str, method: str, manifest: str, draft_on: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", API_RUN, str(time.time()), config, method, manifest, draft_on],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the API run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/world_qwen2_5_vl.yaml")
    p.add_argument("--manifest", default="examples/world/manifest.jsonl")
    p.add_argument("--method", default="hippo")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--draft-on", default="rank", help="comma-separated: rank, thread")
    args = p.parse_args()
    ways = ["job", *[f"api:{d}" for d in args.draft_on.split(",")]]
    got: dict[str, list[dict]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for way in ways:  # interleaved: each repeat runs every way once, in turn
                res = (run_job(args.config, args.method, args.manifest, Path(tmp) / f"job{r}") if way == "job"
                       else run_api(args.config, args.method, args.manifest, way.split(":")[1]))
                got[way].append(res)
                print(f"repeat {r} {way:10s} start-up {res['startup_s']:6.2f} s  items {res['items_s']:6.2f} s  "
                      f"decode/item {statistics.mean(res['decode_s']):.3f} s", flush=True)
    ref = got["job"][0]["tokens"]
    for way in ways:
        assert all(res["tokens"] == ref for res in got[way]), f"{way}'s outputs differ from the job's"
    med = {w: {k: statistics.median(statistics.mean(x[k]) if isinstance(x[k], list) else x[k] for x in got[w])
               for k in ("startup_s", "items_s", "decode_s")} for w in ways}

    def spread(way: str, key: str) -> float:
        xs = [statistics.mean(x[key]) if isinstance(x[key], list) else x[key] for x in got[way]]
        return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0

    print(f"\nmedians over {args.repeats} repeats ({args.method}, {args.config}, {len(ref)} items; outputs equal):")
    for way in ways:
        m = med[way]
        print(f"  {way:10s} start-up {m['startup_s']:6.2f} s  items {m['items_s']:6.2f} s  decode/item "
              f"{m['decode_s']:.3f} s  (spread: start-up {spread(way, 'startup_s'):.0%}, decode "
              f"{spread(way, 'decode_s'):.0%})")
    for way in ways[1:]:
        m, j = med[way], med["job"]
        print(f"  {way} / job: decode per item {m['decode_s'] / j['decode_s']:.2f}x, items' wall "
              f"{m['items_s'] / j['items_s']:.2f}x, start-up {m['startup_s'] / j['startup_s']:.2f}x")


if __name__ == "__main__":
    main()

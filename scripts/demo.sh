#!/usr/bin/env bash
# The main job on the embedded default, at a realistic cost: the world-trained Qwen2.5-VL pair with its
# target grown function-preservingly to 82 M parameters (configs/world_qwen2_5_vl_scaled.yaml; built on first
# use in seconds and checked against the shipped target). Then `ar` and `hippo` decode the example manifest
# (examples/world, 8 held-out videos) through the torchrun pipeline, three times each, interleaved
# (ar, hippo, ar, hippo, ar, hippo, ar): the printed speedups are medians over those paired runs, every
# hippo output is checked against ar's, and the hippo run's captions, timeline and Perfetto trace are written.
#   Usage: ./scripts/demo.sh [OUT_DIR]        Environment: CONFIG, MANIFEST, REPEATS (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
out="${1:-runs/demo}"
config="${CONFIG:-configs/world_qwen2_5_vl_scaled.yaml}"
manifest="${MANIFEST:-examples/world/manifest.jsonl}"
rm -rf "$out" && mkdir -p "$out"
echo "== scale model (grown from the shipped target on first use, then checked against it)"
python -m vpsd.launch.grow --config "$config" --manifest "$manifest" --items 2
echo "== ar vs hippo, ${REPEATS:-3} paired runs, interleaved"
python -m vpsd.reports.bench --config "$config" --manifest "$manifest" --out "$out" --methods hippo --strategies "" \
  --repeats "${REPEATS:-3}"
python -m vpsd.reports.timeline "$out/hippo" > /dev/null
echo "== captions (hippo; = exact reference caption, ~ otherwise)"
python - "$out/hippo/results.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    mark = "=" if r.get("text", "").strip() == r.get("reference", "") else "~"
    print(f"{r['id']} {mark} {r.get('text', '').strip() or r.get('error')}")
PY
echo "table: $out/bench.txt   results: $out/hippo/results.jsonl   timeline: $out/hippo/timeline.png   perfetto: $out/hippo/trace.json"

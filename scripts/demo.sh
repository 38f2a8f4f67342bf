#!/usr/bin/env bash
# The main job on the embedded default: the world-trained Qwen2.5-VL pair (checkpoints/world_qwen2_5_vl)
# decodes the example manifest of procedural videos (examples/world) with `ar` and with `hippo` through
# the torchrun pipeline, in one run; then it checks every hippo output equals ar's, prints the summary
# with the measured speedup and writes the timeline of the hippo run.
#   Usage: ./scripts/demo.sh [OUT_DIR] [extra vpsd.launch.entry options, e.g. --pruning uv]
#   Environment: CONFIG (default configs/world_qwen2_5_vl.yaml), MANIFEST (default examples/world/manifest.jsonl)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
out="${1:-runs/demo}"
config="${CONFIG:-configs/world_qwen2_5_vl.yaml}"
manifest="${MANIFEST:-examples/world/manifest.jsonl}"
rm -rf "$out" && mkdir -p "$out"
for method in ar hippo; do
  echo "== $method"
  ./torchrun.sh run --config "$config" --manifest "$manifest" --out "$out/$method" --method "$method" "${@:2}" \
    2> "$out/$method.log" || { tail -20 "$out/$method.log"; exit 1; }
done
echo "== hippo vs ar (same manifest, same run)"
python -m vpsd.reports.summary "$out/hippo" --baseline "$out/ar"
python -m vpsd.reports.timeline "$out/hippo" > /dev/null
echo "== captions (hippo)"
python - "$out/hippo/results.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    mark = "=" if r.get("text", "").strip() == r.get("reference", "") else "~"
    print(f"{r['id']} {mark} {r.get('text', '').strip() or r.get('error')}")
PY
echo "results: $out/hippo/results.jsonl   timeline: $out/hippo/timeline.png   breakdown: $out/hippo/breakdown.txt"

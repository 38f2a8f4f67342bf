#!/usr/bin/env bash
# The main job on the embedded default, at a realistic cost: the world-trained Qwen2.5-VL pair with its
# target grown function-preservingly to 82 M parameters (configs/world_qwen2_5_vl_scaled.yaml; built on first
# use in seconds and checked against the shipped target). Then `ar` and `hippo` decode the example manifest
# (examples/world, 8 held-out videos) through the torchrun pipeline, three times each, interleaved
# (ar, hippo, ar, hippo, ar, hippo, ar): the printed speedups are medians over those paired runs, every
# hippo output is checked against ar's, and the hippo run's captions, timeline and Perfetto trace are written.
#   Usage: ./scripts/demo.sh [OUT_DIR]        Environment: CONFIG, MANIFEST, REPEATS (default 3), METHODS (default
#   hippo; pearl adds PEARL-video and pearl: HIPPO Table 3's rows), ITEMS (the manifest's first N items)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
out="${1:-runs/demo}"
config="${CONFIG:-configs/world_qwen2_5_vl_scaled.yaml}"
manifest="${MANIFEST:-examples/world/manifest.jsonl}"
rm -rf "$out" && mkdir -p "$out"
if [ -n "${ITEMS:-}" ]; then  # the first ITEMS lines, their videos where the manifest's are
  head -n "$ITEMS" "$manifest" | python -c "import json, os, sys; d = os.path.abspath(os.path.dirname(sys.argv[1]))
for line in sys.stdin: r = json.loads(line); r['video'] = os.path.join(d, r['video']); print(json.dumps(r))" "$manifest" \
    > "$out/manifest.jsonl"
  manifest="$out/manifest.jsonl"
fi
echo "== scale models (grown from the shipped weights on first use, then checked against them)"
python -m vpsd.launch.grow --config "$config" --manifest "$manifest" --items 2
echo "== ar vs ${METHODS:-hippo}, ${REPEATS:-3} rounds, interleaved"
python -m vpsd.bench methods --config "$config" --manifest "$manifest" --out "$out" --methods "${METHODS:-hippo}" \
  --strategies "" --repeats "${REPEATS:-3}"
python -m vpsd.reports.timeline_command "$out/hippo" > /dev/null
echo "== captions (hippo; = exact reference caption, ~ otherwise)"
python - "$out/hippo/results.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    mark = "=" if r.get("text", "").strip() == r.get("reference", "") else "~"
    print(f"{r['id']} {mark} {r.get('text', '').strip() or r.get('error')}")
PY
echo "table: $out/bench.txt   results: $out/hippo/results.jsonl   timeline: $out/hippo/timeline.png   perfetto: $out/hippo/trace.json"

#!/usr/bin/env bash
# The main job on the embedded default: generate a small manifest of procedural videos, decode it with
# `ar` and with `hippo` through the torchrun pipeline, check the outputs are identical, print the
# measured speedup and write the timeline of the hippo run.   Usage: ./scripts/demo.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
out="${1:-runs/demo}"
config="${CONFIG:-configs/tiny_qwen2_5_vl.yaml}"
rm -rf "$out"
python -m vpsd.world.dataset --out "$out/data" --count 4 --seed 1000
for method in ar hippo; do
  ./torchrun.sh run --config "$config" --manifest "$out/data/manifest.jsonl" --out "$out/$method" --method "$method" "${@:2}" \
    2> "$out/$method.log" || { tail -20 "$out/$method.log"; exit 1; }
done
echo "== hippo vs ar (same manifest, same run)"
python -m vpsd.launch.summary "$out/hippo" --baseline "$out/ar"
python -m vpsd.launch.timeline "$out/hippo" > /dev/null
echo "results: $out/hippo/results.jsonl   timeline: $out/hippo/timeline.png   breakdown: $out/hippo/breakdown.txt"

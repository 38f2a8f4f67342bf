#!/usr/bin/env bash
# Retrains the embedded default pair (checkpoints/world_qwen2_5_vl) from scratch, the way the shipped weights
# were made: one run of python -m training.world_short (stage 1: the vision towers on per-patch and per-token
# labels; stage 2: the language models and mergers on captions, tower blocks frozen), then the held-out
# evaluation.
# 52 min on the 2-core CPU machine with one torch thread: the DataLoader worker that renders and
# round-trips the mp4s takes the other core.
#   Usage: ./scripts/train_world.sh [OUT_DIR]   (default checkpoints/world_qwen2_5_vl)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
out="${1:-checkpoints/world_qwen2_5_vl}"
export OMP_NUM_THREADS=1
python -m training.world_short --out "$out"
python -m training.evaluate --set "target.path=$out/target" --set "draft.path=$out/draft" --count 100

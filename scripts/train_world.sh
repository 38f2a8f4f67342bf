#!/usr/bin/env bash
# Retrains the embedded default pair (checkpoints/world_qwen2_5_vl) the way the shipped weights were made:
# four phases, each continuing from the previous one's checkpoints (python -m vpsd.world.train --help).
#   1-3: 14-pixel vision patches. 1: caption loss only, which learns the captions' grammar and the colours
#        but leaves the towers blind to shapes; 2-3: plus the per-token auxiliary vision loss.
#   4:   7-pixel patches merged 4x4 (same 28-pixel LM tokens): fresh towers, the language models kept;
#        a linear probe had shown the 14-pixel tower could not encode shape.
# Wall time on the 2-core CPU machine, shared with other jobs: about 14 + 20 + 5 + 48 min (85 min).
#   Usage: ./scripts/train_world.sh [OUT_DIR]   (default checkpoints/world_qwen2_5_vl; phases under OUT_DIR/phases)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
out="${1:-checkpoints/world_qwen2_5_vl}"
p="$out/phases"
export OMP_NUM_THREADS=1
python -m vpsd.world.train --out "$p/1" --patch 14 --aux-weight 0 --steps 2000 --stop-after 500 --seed 0
python -m vpsd.world.train --out "$p/2" --patch 14 --steps 1200 --seed 1 --init "$p/1"
python -m vpsd.world.train --out "$p/3" --patch 14 --steps 1500 --stop-after 250 --lr 1.5e-3 --seed 2 --init "$p/2"
python -m vpsd.world.train --out "$out" --patch 7 --steps 1100 --seed 3 --init "$p/3"
python -m vpsd.world.evaluate --set "target.path=$out/target" --set "draft.path=$out/draft" --count 100

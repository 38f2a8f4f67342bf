#!/usr/bin/env bash
# Retrains a shipped world pair the way its weights were made, then runs its held-out evaluation.
#   --kind short (default): checkpoints/world_qwen2_5_vl from scratch, python -m training.world_short
#     (stage 1: the vision towers on per-patch and per-token labels; stage 2: the language models and mergers on
#     captions, tower blocks frozen). 52 min on the 2-core CPU machine.
#   --kind long: checkpoints/world_long_qwen2_5_vl from the short pair in two stages: python -m training.world_long
#     (the language models on long-world captions and questions, towers frozen, the draft also on pruned video;
#     2.4 h on the 2-core CPU machine), then python -m training.distill_long (the draft distilled toward the
#     target's own greedy outputs, seeing the video as the pipeline prunes it; ~1 h). Resumable: run the same
#     command again and it goes on from the last save (OUT/resume/state.pt every 25 steps, OUT/distill/state.pt
#     every 10).
# One torch thread: the DataLoader worker that renders and round-trips the mp4s takes the other core.
#   Usage: ./scripts/train_world.sh [--kind short|long] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
kind=short
if [ "${1:-}" = "--kind" ]; then kind="$2"; shift 2; fi
export OMP_NUM_THREADS=1
case "$kind" in
  short)
    out="${1:-checkpoints/world_qwen2_5_vl}"
    python -m training.world_short --out "$out"
    python -m training.evaluate --set "target.path=$(realpath -m "$out")/target" \
      --set "draft.path=$(realpath -m "$out")/draft" --count 100 ;;
  long)
    out="${1:-checkpoints/world_long_qwen2_5_vl}"
    python -m training.world_long --out "$out"
    python -m training.distill_long --out "$out"
    python -m training.evaluate --kind long --config configs/world_long_qwen2_5_vl.yaml \
      --set "target.path=$(realpath -m "$out")/target" --set "draft.path=$(realpath -m "$out")/draft" --count 100 ;;
  *) echo "train_world.sh: --kind must be short or long, got '$kind'" >&2; exit 2 ;;
esac

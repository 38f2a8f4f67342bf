#!/usr/bin/env bash
# vpsd launcher: ./torchrun.sh run --config C --manifest M --out DIR [--method NAME] [--pruning NAME] [--ratio R] [--gamma G]
#
# Every torchrun option placed before `run` passes through, e.g. multi-node:
#   ./torchrun.sh --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29500 --rdzv-id job1 run --config ...
# Environment: NPROC (ranks on this node, default 3), VPSD_HOST (address peers use to reach this node's
# control sockets, default 127.0.0.1), LOG_RANK (ranks whose output is shown, default all).
set -euo pipefail
cd "$(dirname "$0")"
[ -f .venv/bin/activate ] && [ -z "${VIRTUAL_ENV:-}" ] && . .venv/bin/activate
torchrun_args=()
while [ $# -gt 0 ] && [ "$1" != "run" ]; do torchrun_args+=("$1"); shift; done
[ "${1:-}" = "run" ] || { echo "usage: $0 [torchrun options] run --config C --manifest M --out DIR [...]" >&2; exit 2; }
shift
if ! printf '%s\n' "${torchrun_args[@]:-}" | grep -q -- '--nnodes\|--rdzv'; then
  torchrun_args=(--standalone "${torchrun_args[@]}")
fi
extra=()
[ -n "${LOG_RANK:-}" ] && extra+=(--local-ranks-filter "$LOG_RANK")
exec python -m torch.distributed.run "${torchrun_args[@]}" --nproc-per-node "${NPROC:-3}" "${extra[@]}" \
  -m vpsd.launch.entry "$@"

#!/usr/bin/env bash
# vpsd launcher: ./torchrun.sh run --config C --manifest M --out DIR [--method NAME] [--pruning NAME] [--ratio R] [--gamma G]
#           or:  ./torchrun.sh serve --config C [--method NAME] [vpsd serve's options]  (docs/serving.md: rank 0 serves HTTP)
#
# Every torchrun option placed before `run` passes through, e.g. multi-node:
#   ./torchrun.sh --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29500 --rdzv-id job1 run --config ...
# This script's process becomes torchrun's agent (vpsd/launch/launcher.py): signal it, and you signal the job.
# Exit status: 0 all items done; 3 the job finished but some items failed; 2 refused at launch (bad settings, an
# --out another job holds), said in vpsd's lines alone, no torchrun failure block; 1 a rank failed (one line names
# it: role, rank, node, its signal or exit code); 130 / 143 / 129 stopped by SIGINT (Ctrl-C) / SIGTERM / SIGHUP,
# to this process or its whole group: every rank stops within seconds and one line says what is kept. SIGKILL
# cannot be caught: the ranks then die with this process. After any stop the same command resumes the rest.
# Environment: NPROC (ranks on this node, default 3), VPSD_HOST (address peers use to reach this node's
# control sockets, default 127.0.0.1), LOG_RANK (ranks whose output is shown, default all), VPSD_JOB_SECRET
# (the control plane's keys derive from it; made fresh for a single-node run, required on every node of a
# multi-node one: README "Security").
set -euo pipefail
# The caller's directory stays the working directory: --config, --manifest and --out are read relative to it.
here="$(cd "$(dirname "$0")" && pwd)"
if [ -f "$here/.venv/bin/activate" ] && [ -z "${VIRTUAL_ENV:-}" ]; then . "$here/.venv/bin/activate"; fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's vpsd, wherever the command runs
exec python -m vpsd.launch.launcher "$@"

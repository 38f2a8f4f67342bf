#!/usr/bin/env bash
# vpsd launcher: ./torchrun.sh run --config C --manifest M --out DIR [--method NAME] [--pruning NAME] [--ratio R] [--gamma G]
#
# Every torchrun option placed before `run` passes through, e.g. multi-node:
#   ./torchrun.sh --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29500 --rdzv-id job1 run --config ...
# Exit status: 0 all items done, 3 the job finished but some items failed, other: the job failed.
# Environment: NPROC (ranks on this node, default 3), VPSD_HOST (address peers use to reach this node's
# control sockets, default 127.0.0.1), LOG_RANK (ranks whose output is shown, default all), VPSD_JOB_SECRET
# (the control plane's keys derive from it; made fresh for a single-node run, required on every node of a
# multi-node one: README "Security").
set -euo pipefail
# The caller's directory stays the working directory: --config, --manifest and --out are read relative to it.
here="$(cd "$(dirname "$0")" && pwd)"
if [ -f "$here/.venv/bin/activate" ] && [ -z "${VIRTUAL_ENV:-}" ]; then . "$here/.venv/bin/activate"; fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's vpsd, wherever the command runs
torchrun_args=()
while [ $# -gt 0 ] && [ "$1" != "run" ]; do torchrun_args+=("$1"); shift; done
[ "${1:-}" = "run" ] || { echo "usage: $0 [torchrun options] run --config C --manifest M --out DIR [...] (run --help)" >&2; exit 2; }
shift
# --help: answered once, by one process, before any rank starts.
for a in "$@"; do case "$a" in -h|--help) exec python -m vpsd.launch.arguments --help ;; esac; done
if ! printf '%s\n' "${torchrun_args[@]:-}" | grep -q -- '--nnodes\|--rdzv'; then
  torchrun_args=(--standalone "${torchrun_args[@]}")
  # One node: a fresh secret for this job alone (ranks inherit it; other users cannot read it).
  [ -n "${VPSD_JOB_SECRET:-}" ] || export VPSD_JOB_SECRET="$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"
  # A rank that refuses to start (bad settings, an --out holding another job) says why, marks this file and
  # exits 0, so torchrun adds no failure block of its own; the mark makes this launcher exit 2. One node only:
  # there every rank reads the same files and refuses alike (vpsd/launch/entry.py, REFUSAL_MARK).
  export VPSD_REFUSAL_MARK="$(mktemp -u "${TMPDIR:-/tmp}/vpsd-refused.XXXXXX")"
  # Ctrl-C: the target rank says so once and marks this file; the launcher then exits 130, as the shells do.
  export VPSD_INTERRUPT_MARK="$(mktemp -u "${TMPDIR:-/tmp}/vpsd-interrupted.XXXXXX")"
fi
# torchrun keeps a log directory per launch (empty unless its output is redirected) and never removes it: without
# --log-dir, give it one of ours and remove it with the marks, so a job leaves nothing outside --out.
if ! printf '%s\n' "${torchrun_args[@]:-}" | grep -q -- '--log[-_]dir'; then
  VPSD_TORCHRUN_LOGS="$(mktemp -d "${TMPDIR:-/tmp}/vpsd-torchrun.XXXXXX")"
  torchrun_args+=(--log-dir "$VPSD_TORCHRUN_LOGS")
fi
trap 'rm -f "${VPSD_REFUSAL_MARK:-}" "${VPSD_INTERRUPT_MARK:-}"; [ -n "${VPSD_TORCHRUN_LOGS:-}" ] && rm -rf "$VPSD_TORCHRUN_LOGS"' EXIT
extra=()
[ -n "${LOG_RANK:-}" ] && extra+=(--local-ranks-filter "$LOG_RANK")
out=""; prev=""
for a in "$@"; do
  case "$a" in --out=*) out="${a#--out=}" ;; esac
  [ "$prev" = "--out" ] && out="$a"
  prev="$a"
done
rc=0
python -m torch.distributed.run "${torchrun_args[@]}" --nproc-per-node "${NPROC:-3}" "${extra[@]}" \
  -m vpsd.launch.entry "$@" || rc=$?
[ -n "${VPSD_REFUSAL_MARK:-}" ] && [ -e "$VPSD_REFUSAL_MARK" ] && exit 2
[ -n "${VPSD_INTERRUPT_MARK:-}" ] && [ -e "$VPSD_INTERRUPT_MARK" ] && exit 130
if [ "$rc" -gt 128 ]; then
  # torchrun itself was killed. Its ranks die with it (they asked the kernel to), so nothing writes to the
  # output directory any more: what finished is kept and the same command resumes the rest.
  echo "vpsd: torchrun was killed by signal $(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128))); its ranks" \
       "were stopped with it. Finished items are kept${out:+ in $out}: rerun the same command to do the rest." >&2
  exit "$rc"
fi
[ "$rc" -ne 0 ] && exit "$rc"
# torchrun says 0 or 1. A job that ran to the end but has failed items exits 3, read from its summary
# (on the node that holds the output directory; elsewhere 0).
# (Not exec: the EXIT trap must still remove what this launcher made.)
if [ -n "$out" ] && [ -f "$out/summary.json" ]; then
  rc=0; python -m vpsd.reports.summary "$out" --status || rc=$?
  exit "$rc"
fi
exit 0

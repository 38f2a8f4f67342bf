#!/usr/bin/env bash
# The GPU check: validate and measure vpsd's CUDA path, the moment a session is lent a GPU, as two prepared calls.
#
#   On the GPU machine (through the `device` tool's run, from the repository root, carrying .gpu):
#       run(command="OUT=$OUT scripts/gpu_check.sh --run 1", carry=[".gpu"], timeout_s=570)   # <= 9 min
#       run(command="OUT=$OUT scripts/gpu_check.sh --run 2", carry=[".gpu"], timeout_s=570)   # if time is left
#   (call the second at once: an idle machine goes back after 30 s, and the first call's grown models with it).
#   `--only NAME` runs one step of either run (after `grow`). Here, on CPU, every step of both runs with the same
#   commands on small inputs (CI runs it: the check cannot rot):
#       scripts/gpu_check.sh --dry-run
#   Once, here, before the first GPU run (and after requirements.lock moves):
#       scripts/gpu_check.sh --pack                   builds .gpu/site.tar.xz (git-ignored, ~31 MB)
#
# The GPU machine has its own torch (2.11 + CUDA) and no package index: vpsd's other runtime packages travel as
# .gpu/site.tar.xz (requirements.lock's transformers, pyzmq, msgspec, structlog and av, unpacked wheels, xz: the
# wheels themselves are 50 MB, over what a call may carry beside the tree). The machine's torch, numpy, tokenizers,
# safetensors, huggingface-hub, pyyaml, tqdm and matplotlib are used as they are.
#
# Run 1, what issue 52 is judged by first (the 3B long pair: configs/gpu_long_3b.yaml, a 2.9 B target and a
# 0.45 B draft grown from the shipped long pair, bf16, every rank on the one GPU; examples/world_long's 8 items):
#   grow          the 3B pair grown to disk once (later steps load it)
#   cuda_tests    tests/gpu/test_on_cuda.py: greedy equal to `ar` on the GPU in fp32 and bf16 (serial methods, the
#                 engine at B = 1 and 8, captured steps and what a recorded step copies, the draft on a thread of
#                 its own stream), sampling
#   profile       python -m vpsd.bench steps --profile: an eager step and an 8-row verify of each model split
#                 into kernels, launches and host waits; aten ops and host reads against transformers' own
#                 generate() step, and its wall time (vpsd's eager `ar` is held to within 10% of it)
#   step_cost     eager against captured (CUDA graphs), interleaved: T_p, T_q and c = T_p / T_q both ways
#   b1_captured   vpsd bench throughput --batch 1, target and draft captured: ar, pearl, hippo (ranks
#                 time-slicing the GPU), hippo:thread (draft and pruner on threads and streams of the target's
#                 process, draft_on: thread); every output judged against batch-1 `ar`'s (a bf16 tie passes)
#   Every B = 1 cell's target profiles 30 of its rounds in the job (profile_rounds: vpsd/profiling.py): kernels,
#   launches, host waits and the rest (Python, other threads holding the GIL) where the step really runs.
# Run 2: b1_mps (ar, pearl, hippo at B = 1 captured again, the ranks under CUDA MPS: the check starts its own
#   daemon with its own pipe directory, checks the clients reach it, and stops it, no GPU setting changes; with
#   b1_captured's rows, the measurement that chooses draft_on), b8 (ar, hippo, hippo:pipelined+thread at B = 8),
#   b32 (ar, hippo at B = 32, the 8 items tiled 4x), and the trained world pair's one-GPU pipeline at B = 1 and 8
#   (world_pair).
# Each step runs under its own time limit (their sum fits the call) and the next runs whatever it did. On the GPU
# $OUT ends as three files (the device tool brings back 8): steps.txt (each step's exit status and seconds),
# report.txt (issue 52's goals judged first, vpsd/reports/gpu_goals.py; then every step's table and each profiled
# cell's split) and gpu_check.tgz (the logs, the tables' JSON, the profiles); the dry run leaves them unpacked in
# $OUT, with goals.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0; run=1; only=; pack=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; run=all ;;
    --run) run="$2"; shift ;;
    --only) only="$2"; shift ;;
    --pack) pack=1 ;;
    *) echo "usage: $0 [--dry-run] [--run 1|2|all] [--only STEP] | --pack" >&2; exit 2 ;;
  esac
  shift
done

if [ "$pack" = 1 ]; then  # here: requirements.lock's versions of what the GPU machine lacks, for its Python 3.12
  [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
  pins=$(grep -E '^(transformers|pyzmq|msgspec|structlog|av)==' requirements.lock | sed 's/ .*//')
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp/whl" $pins || exit 1
  mkdir -p "$tmp/site" .gpu
  for w in "$tmp"/whl/*.whl; do python -m zipfile -e "$w" "$tmp/site"; done
  tar -C "$tmp/site" -cf - . | xz -T0 -6 > .gpu/site.tar.xz
  echo "$pins" > .gpu/pins.txt
  ls -la .gpu; exit 0
fi

# $OUT: the logs, steps.txt and each bench's table as JSON (packed at the end on a GPU: the device tool brings back
# 8 files); the runs themselves (traces, results) go to $WORK, outside $OUT.
OUT="${OUT:-runs/gpu_check}"; WORK="${WORK:-${TMPDIR:-/tmp}/vpsd_gpu_check_work}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
  [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
  export VPSD_TEST_DEVICE=cpu
  on=(--set target.device=cpu --set draft.device=cpu)
  # The config's own dtype (bf16), as the GPU run loads it: a dry run in float32 passed while every bf16 job of
  # the long pair died at lm_head, on any device (issue 60).
  small=(--set target.grow=null --set draft.grow=null)
  answers=24  # tokens an item may answer with (the long items ask for up to 320)
  # Each command once on the smallest inputs that take its paths: a couple of minutes on 2 cores. Both dtypes, as
  # the GPU run takes them, one case of each kind: the CPU suite runs the rest on the CPU. The benches are
  # one command on other inputs: b8 runs it here (a variant on threads at B = 2, --tile), b1_captured, b1_mps
  # (the same under a daemon), b32 and world_pair do not.
  cuda_tests=(-k "serial_method_greedy_equals_ar and sd- or engine_greedy and hippo-8 or batches_ar or sd_runs or sampled_batch or captured and 2- or thread or recorded_steps")
  items=1; tile=1; capture=trace; cost=(--widths 1,4 --steps 2 --repeats 1); prof=(--widths 1,4 --steps 2)
  b1=; mps=; b8=ar,hippo:pipelined+thread; b8batch=2; wide=; world=; worldb=2; tile=2
  L_grow=60; L_tests=240; L_profile=120; L_cost=120; L_b1=240; L_mps=120; L_b8=240; L_b32=120; L_world=240
else
  if [ -f .gpu/site.tar.xz ]; then
    mkdir -p /tmp/vpsd-site && tar -C /tmp/vpsd-site -xJf .gpu/site.tar.xz || exit 1
    # On PYTHONPATH, so before the machine's own site-packages: the lock's transformers wins over the image's.
    export PYTHONPATH="/tmp/vpsd-site:$PYTHONPATH"
  fi
  on=(--set target.device=cuda --set draft.device=cuda)
  small=(); cuda_tests=(); answers=
  items=8; tile=4; capture=cudagraphs; cost=(--widths 1,8 --steps 16 --repeats 5); prof=(--widths 1,8 --steps 16)
  b1=ar,pearl,hippo,hippo:thread; mps=ar,pearl,hippo; b8batch=8
  b8=ar,hippo,hippo:pipelined+thread
  wide=32; world=8; worldb=1,8
  # Each run's limits sum to 535 s (a 570 s call). Sized from the H200's eager runs of 2026-11-26 (growth and the
  # 8 items of an eager B = 1 cell ~40 s, ~700 tokens) and, for a captured cell, this estimate: its processes'
  # start and load, then each model's traces (a decode step and one for every verify width, a cache bucket each:
  # ~10 s for the 28-layer target on this project's 2-core CPU, models/step_graphs.py), then ~700 tokens. A
  # bench cut at its limit still leaves the table of its finished cells (`bench` below).
  L_grow=60; L_tests=75; L_profile=80; L_cost=70; L_b1=250
  L_mps=120; L_b8=150; L_b32=150; L_world=115
fi
: > "$OUT/steps.txt"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log, record status and time
  local name="$1" limit="$2"; shift 2
  [ -n "$only" ] && [ "$only" != "$name" ] && [ "$name" != env ] && [ "$name" != grow ] && return 0
  local t0=$SECONDS rc=0
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
}

subset() {  # subset MANIFEST N DEST: the first N lines, video paths made absolute, answers cut to $answers
  python - "$1" "$2" "$answers" > "$3" <<'PY'
import json, os, sys
d = os.path.abspath(os.path.dirname(sys.argv[1]))
for line in open(sys.argv[1]).readlines()[: int(sys.argv[2])]:
    r = json.loads(line); r["video"] = os.path.join(d, r["video"])
    if sys.argv[3]:
        r["max_new_tokens"] = min(int(sys.argv[3]), r.get("max_new_tokens") or int(sys.argv[3]))
    print(json.dumps(r))
PY
}

bench() {  # bench NAME LIMIT CONFIG MANIFEST BATCHES METHODS [ARGS...]: vpsd bench throughput --batch, its table to $OUT
  local name="$1" limit="$2" config="$3" manifest="$4" batches="$5" methods="$6"; shift 6
  step "$name" "$limit" python -m vpsd.bench throughput --config "$config" --manifest "$manifest" \
    --out "$WORK/$name" --batch "$batches" --methods "$methods" "${on[@]}" "$@"
  if [ ! -f "$WORK/$name/throughput.json" ] && [ -f "$WORK/$name/schedule.json" ]; then
    # Stopped by its limit: the table of the cells that finished (the others read as 0 items), not nothing.
    echo "$name: cut at its limit; the table of its finished cells follows" | tee -a "$OUT/steps.txt"
    timeout 90 python -m vpsd.bench throughput --report-only --out "$WORK/$name" >> "$OUT/$name.log" 2>&1
  fi
  cp "$WORK/$name/throughput.json" "$OUT/$name.json" 2>/dev/null
}

step env 60 python - <<'PY'
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import vpsd.launch.entry  # every runtime import resolves
PY
[ "$dry" = 0 ] && command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

LONG=configs/gpu_long_3b.yaml
subset examples/world_long/manifest.jsonl "$items" "$WORK/world_long.jsonl"
captured=(--set target.capture="$capture" --set draft.capture="$capture")
[ "$dry" = 1 ] && captured=()  # the dry run's captured steps are cuda_tests' and step_cost's: a bench would compile

if [ "$run" = 1 ] || [ "$run" = all ]; then
  if [ "$dry" = 0 ]; then  # grown once, here, so that no later step's time includes it
    step grow "$L_grow" python - "$LONG" <<'PY'
import sys
from pathlib import Path
from vpsd.config import load_config
from vpsd.models.grown_checkpoint import ensure_grown
cfg = load_config(sys.argv[1])
for spec in (cfg.target, cfg.draft):
    print(ensure_grown(Path(spec.path), Path(spec.grown_path()), spec.grow["width"], spec.grow["layers"]))
PY
  fi
  step cuda_tests "$L_tests" python -m pytest -q -p no:cacheprovider tests/gpu/test_on_cuda.py "${cuda_tests[@]}"
  step profile "$L_profile" python -m vpsd.bench steps --config "$LONG" --manifest "$WORK/world_long.jsonl" \
    --profile "${prof[@]}" --json "$OUT/profile.json" "${on[@]}" "${small[@]}"
  step step_cost "$L_cost" python -m vpsd.bench steps --config "$LONG" --manifest "$WORK/world_long.jsonl" \
    --mode "$capture" "${cost[@]}" --json "$OUT/step_cost.json" "${on[@]}" "${small[@]}"
  [ -n "$b1" ] && bench b1_captured "$L_b1" "$LONG" "$WORK/world_long.jsonl" 1 "$b1" "${small[@]}" "${captured[@]}" \
    --set profile_rounds=30  # every cell's target profiles 30 rounds in the job (vpsd/profiling.py)
fi
if [ "$run" = 2 ] || [ "$run" = all ]; then
  if [ "$dry" = 1 ]; then  # b8's bench with --tile: what b32 adds
    bench b8 "$L_b8" "$LONG" "$WORK/world_long.jsonl" "$b8batch" "$b8" --tile "$tile" "${small[@]}" "${captured[@]}"
  else
    # The ranks under CUDA MPS: one GPU context for the three processes, their kernels free to run at once.
    if [ "$dry" = 0 ] && command -v nvidia-cuda-mps-control > /dev/null; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/vpsd-mps CUDA_MPS_LOG_DIRECTORY=/tmp/vpsd-mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && echo "mps: daemon up in $CUDA_MPS_PIPE_DIRECTORY" | tee -a "$OUT/steps.txt"
      ( sleep 40; echo ps | nvidia-cuda-mps-control > "$OUT/mps_clients.txt" 2>&1 ) &  # during a job: its clients
      bench b1_mps "$L_mps" "$LONG" "$WORK/world_long.jsonl" 1 "$mps" "${small[@]}" "${captured[@]}" \
        --set profile_rounds=30
      echo quit | nvidia-cuda-mps-control
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    elif [ "$dry" = 0 ]; then
      echo "mps: no nvidia-cuda-mps-control on this machine" | tee -a "$OUT/steps.txt"
    fi
    bench b8 "$L_b8" "$LONG" "$WORK/world_long.jsonl" "$b8batch" "$b8" "${small[@]}" "${captured[@]}"
    bench b32 "$L_b32" "$LONG" "$WORK/world_long.jsonl" "$wide" ar,hippo --tile "$tile" "${small[@]}" "${captured[@]}"
    subset examples/world/manifest.jsonl "$world" "$WORK/world.jsonl"
    bench world_pair "$L_world" configs/world_qwen2_5_vl.yaml "$WORK/world.jsonl" "$worldb" ar,pearl,hippo \
      --set cpu_affinity=null
  fi
fi
echo "== steps"; cat "$OUT/steps.txt"
ok=0; grep -qv ' rc=0 \|^mps:' "$OUT/steps.txt" && ok=1
# Each bench cell's own log (its launch.log: the ranks' output, a failing rank's traceback) comes back with the
# tables, so a dead cell's cause is read from the run, not by running it again by hand.
find "$WORK" -name launch.log -printf '%P\0' | while IFS= read -r -d '' p; do
  mkdir -p "$OUT/cells"; tail -c 200000 "$WORK/$p" > "$OUT/cells/$(dirname "$p" | tr '/' '_').log"; done
mkdir -p "$OUT/profiles"  # each profiled cell's split, named by its path (b1_captured_hippo_b1_r1_traces_...)
find "$WORK" -name 'profile_*.summary.json' -printf '%P\0' | while IFS= read -r -d '' p; do
  cp "$WORK/$p" "$OUT/profiles/$(echo "$p" | tr '/' '_')"; done
# Issue 52's goals judged from this run, the term that holds each one missed (vpsd/reports/gpu_goals.py).
python -m vpsd.reports.gpu_goals "$OUT" > "$WORK/goals.txt" 2>&1; cat "$WORK/goals.txt"
if [ "$dry" = 0 ]; then
  # The device tool brings back 8 files of $OUT: steps.txt, report.txt (the goals, every table, and each profiled
  # cell's split), and everything else in gpu_check.tgz (logs, the tables' JSON, the cells' profile summaries).
  cp "$WORK/goals.txt" "$WORK/report.txt"
  for f in "$OUT"/*.log; do [ -f "$f" ] && { echo "=== ${f##*/}"; grep -v '^\[\|^  ' "$f" | tail -40; } ; done \
    >> "$WORK/report.txt" 2>/dev/null
  find "$WORK" -name 'profile_*.summary.json' -printf '=== %P\n' -exec cat {} \; >> "$WORK/report.txt" 2>/dev/null
  # A captured step that could not be recorded runs uncaptured (models/captured.py): each rank's trace says why.
  { echo "=== steps not recorded as CUDA graphs (traces' step_unrecorded)"
    grep -rh '"step_unrecorded"' "$WORK" --include='*.jsonl' | head -20; } >> "$WORK/report.txt" 2>/dev/null
  tar -C "$OUT" -czf "$WORK/gpu_check.tgz" --exclude ./steps.txt . && find "$OUT" -mindepth 1 ! -name steps.txt -delete
  mv "$WORK/gpu_check.tgz" "$WORK/report.txt" "$OUT/"
else
  mv "$WORK/goals.txt" "$OUT/"
fi
exit "$ok"

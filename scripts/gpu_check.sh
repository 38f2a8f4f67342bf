#!/usr/bin/env bash
# The GPU check: validate and measure vpsd's CUDA path in one command, the moment a session is lent a GPU.
#
#   On the GPU machine (through the `device` tool's run, from the repository root, carrying .gpu):
#       scripts/gpu_check.sh [--stage 1|2|3|4|5|all]    everything it prints and writes lands in $OUT
#   A session's 15 device minutes fit stage 1, stage 5 and stage 2, three calls on one warm machine (call each next
#   at once: an idle machine goes back after 30 s):
#       run(command="OUT=$OUT scripts/gpu_check.sh --stage 1", carry=[".gpu"], timeout_s=300)
#       run(command="OUT=$OUT scripts/gpu_check.sh --stage 5", carry=[".gpu"], timeout_s=300)
#       run(command="OUT=$OUT scripts/gpu_check.sh --stage 2", carry=[".gpu"], timeout_s=540)
#   Here, on CPU, the same steps with the same commands on small inputs (CI runs it: the check cannot rot):
#       scripts/gpu_check.sh --dry-run [--stage ...]
#   Once, here, before the first GPU run (and after requirements.lock moves):
#       scripts/gpu_check.sh --pack                   builds .gpu/site.tar.xz (git-ignored, ~31 MB)
#
# The GPU machine has its own torch (2.11 + CUDA) and no package index: vpsd's other runtime packages travel as
# .gpu/site.tar.xz (requirements.lock's transformers, pyzmq, msgspec, structlog and av, unpacked wheels, xz: the
# wheels themselves are 50 MB, over what a call may carry beside the tree). The machine's torch, numpy, tokenizers,
# safetensors, huggingface-hub, pyyaml, tqdm and matplotlib are used as they are.
#
# Stage 1, correctness (~3 min): tests/test_on_cuda.py (every serial method and the engine at B = 1 and 8, greedy
#   equal to `ar` in fp32 and bf16 on the GPU, sampling), then the trained world pair through torchrun with all
#   three ranks on the one GPU (transport/placement.py): ar, pearl, hippo at B = 1 and 8, every output checked
#   against batch-1 `ar`'s by the bench.
# Stage 2, speed (~5.5 min): the long-video pair grown to a 2.9 B target and a 0.45 B draft
#   (configs/gpu_long_3b.yaml, bf16), `vpsd bench --batch 1,8` over ar, pearl and hippo on examples/world_long's 8
#   items (5.0 min on an H200, 2026-11-26, growth included). A bf16 output that differs from batch-1 `ar`'s is
#   judged by the target's top-2 margin there (a tie passes, vpsd/launch/lossless.py).
# Stage 3 (--stage 3 only), CUDA MPS: see below. Stage 4 (--stage 4 only, ~4 min): --batch 32 over ar and hippo on
#   the 8 long items tiled 4x (32 items).
# Stage 5, captured steps (models/captured.py; not yet run on a GPU, sized by estimate at ~4 min): what a step and
#   a verify of the 3B pair cost eager and as CUDA graphs, interleaved (python -m vpsd.launch.step_cost: T_p, T_q
#   and c both ways), then `vpsd bench --batch 1` over ar and hippo with both models captured.
# Each step runs under its own time limit and the next runs whatever it did; $OUT/steps.txt lists each step's
# exit status and seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0; stage=all; pack=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --stage) stage="$2"; shift ;;
    --pack) pack=1 ;;
    *) echo "usage: $0 [--dry-run] [--stage 1|2|3|4|5|all] | --pack" >&2; exit 2 ;;
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

# $OUT: the logs, steps.txt and each bench's table as JSON (8 files: what the device tool brings back); the runs
# themselves (traces, results) go to $WORK.
OUT="${OUT:-runs/gpu_check}"; WORK="${WORK:-$OUT/runs}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
  [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
  export VPSD_TEST_DEVICE=cpu
  on=(--set target.device=cpu --set draft.device=cpu)
  small=(--set target.grow=null --set draft.grow=null --set target.dtype=float32 --set draft.dtype=float32)
  # Each command once on the smallest inputs that take its paths (a batch of 2 of a parallel method beside `ar`;
  # the long config's one `ar` job): under a minute on 2 cores.
  # fp32 only here (the GPU run does both dtypes), one case of each kind: the CPU suite runs the rest on the CPU
  cuda_tests=(-k "not bfloat16 and (serial_method_greedy_equals_ar and sd- or engine_greedy and hippo-8 or batches_ar or sd_runs or sampled_batch or captured and 2-float32)")
  items=2; batches1=2; methods1=ar,hippo; items2=1; batches2=1; methods2=ar; wide=; tile=1
  capture=trace; cost=(--widths 1,4 --steps 2 --repeats 1); methods5=  # the bench is stage 2's command
  limit0=240; limit1=240; limit2=240; limit5=240
else
  if [ -f .gpu/site.tar.xz ]; then
    mkdir -p /tmp/vpsd-site && tar -C /tmp/vpsd-site -xJf .gpu/site.tar.xz || exit 1
    # On PYTHONPATH, so before the machine's own site-packages: the lock's transformers wins over the image's.
    export PYTHONPATH="/tmp/vpsd-site:$PYTHONPATH"
  fi
  on=(--set target.device=cuda --set draft.device=cuda)
  small=(); cuda_tests=()
  # Limits: stage 1 is one device call of ~3 min, stage 2 one of ~5.5 (measured on an H200, 2026-11-26); run them
  # as two calls (--stage 1, then --stage 2 on the warm machine): both in one outlast a call's 10 minutes.
  items=8; batches1=1,8; methods1=ar,pearl,hippo; items2=8; batches2=1,8; methods2=ar,pearl,hippo; wide=32; tile=4
  capture=cudagraphs; cost=(--widths 1,8 --steps 16 --repeats 5); methods5=ar,hippo
  limit0=120; limit1=180; limit2=450; limit3=220; limit4=280; limit5=260
fi
: > "$OUT/steps.txt"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log, record status and time
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc=0
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
}

subset() {  # subset MANIFEST N DEST: the first N lines, video paths made absolute
  python - "$1" "$2" > "$3" <<'PY'
import json, os, sys
d = os.path.abspath(os.path.dirname(sys.argv[1]))
for line in open(sys.argv[1]).readlines()[: int(sys.argv[2])]:
    r = json.loads(line); r["video"] = os.path.join(d, r["video"]); print(json.dumps(r))
PY
}

step env 120 python - <<'PY'
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import vpsd.launch.entry  # every runtime import resolves
PY
[ "$dry" = 0 ] && command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

one_gpu_bench() {  # one_gpu_bench NAME BATCHES: the world pair's pipeline, every rank on the one GPU
  subset examples/world/manifest.jsonl "$items" "$WORK/world.jsonl"
  step "$1" "$limit1" python -m vpsd.reports.throughput --config configs/world_qwen2_5_vl.yaml \
    --manifest "$WORK/world.jsonl" --out "$WORK/$1" --batch "$2" --methods "$methods1" "${on[@]}" \
    --set cpu_affinity=null
  cp "$WORK/$1/throughput.json" "$OUT/$1.json" 2>/dev/null
}

if [ "$stage" = 1 ] || [ "$stage" = all ]; then
  step cuda_tests "$limit0" python -m pytest -q -p no:cacheprovider tests/test_on_cuda.py "${cuda_tests[@]}"
  one_gpu_bench one_gpu_pipeline "$batches1"
fi

# Stage 3, the one-GPU layout under CUDA MPS (~2 min): the three ranks' kernels time-slice the GPU by default; with
# MPS they share it as one context and may run at once. The same bench at B = 1 (where the ranks overlap most)
# with the MPS daemon up, to set beside stage 1's B = 1 rows (run it right after stage 1, on the same machine).
if [ "$stage" = 3 ]; then
  if [ "$dry" = 0 ] && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/vpsd-mps CUDA_MPS_LOG_DIRECTORY=/tmp/vpsd-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    step mps_start 30 nvidia-cuda-mps-control -d
    one_gpu_bench one_gpu_mps 1
    echo quit | nvidia-cuda-mps-control
  else
    echo "mps: no nvidia-cuda-mps-control here (needs the GPU machine)" | tee -a "$OUT/steps.txt"
  fi
fi

if [ "$stage" = 2 ] || [ "$stage" = all ]; then
  # Two benches: batch 1 and 8 over the 8 items (a 3B step is ~10 ms eager, an item ~4 s at B = 1 on an H200), and
  # batch 32 over them tiled 4x (32 items), each method against `ar` at the same B.
  subset examples/world_long/manifest.jsonl "$items2" "$WORK/world_long.jsonl"
  step long_3b_bench "$limit2" python -m vpsd.reports.throughput --config configs/gpu_long_3b.yaml \
    --manifest "$WORK/world_long.jsonl" --out "$WORK/long_3b" --batch "$batches2" \
    --methods "$methods2" "${on[@]}" "${small[@]}"
  cp "$WORK/long_3b/throughput.json" "$OUT/long_3b.json" 2>/dev/null
fi
if [ "$stage" = 5 ] || [ "$stage" = all ]; then
  # The step's terms side by side (one process, eager and captured interleaved), then the B = 1 bench captured.
  subset examples/world_long/manifest.jsonl "$items2" "$WORK/world_long.jsonl"
  step step_cost 200 python -m vpsd.launch.step_cost --config configs/gpu_long_3b.yaml \
    --manifest "$WORK/world_long.jsonl" --mode "$capture" "${cost[@]}" --json "$OUT/step_cost.json" \
    "${on[@]}" "${small[@]}"
  if [ -n "$methods5" ]; then
    step long_3b_captured "$limit5" python -m vpsd.reports.throughput --config configs/gpu_long_3b.yaml \
      --manifest "$WORK/world_long.jsonl" --out "$WORK/long_3b_captured" --batch 1 --methods "$methods5" \
      "${on[@]}" "${small[@]}" --set target.capture="$capture" --set draft.capture="$capture"
    cp "$WORK/long_3b_captured/throughput.json" "$OUT/long_3b_captured.json" 2>/dev/null
  fi
fi
if [ "$stage" = 4 ] && [ -n "$wide" ]; then
  subset examples/world_long/manifest.jsonl "$items2" "$WORK/world_long.jsonl"
  step long_3b_wide "$limit4" python -m vpsd.reports.throughput --config configs/gpu_long_3b.yaml \
    --manifest "$WORK/world_long.jsonl" --out "$WORK/long_3b_wide" --batch "$wide" --tile "$tile" \
    --methods ar,hippo "${on[@]}" "${small[@]}"
  cp "$WORK/long_3b_wide/throughput.json" "$OUT/long_3b_wide.json" 2>/dev/null
fi
echo "== steps"; cat "$OUT/steps.txt"
! grep -qv ' rc=0 ' "$OUT/steps.txt"

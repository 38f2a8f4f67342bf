#!/usr/bin/env bash
# The newest releases pyproject's ranges allow: a fresh venv without the lock, the versions it got, and the
# fast subset below run against them. CI runs it after the locked suite, so an upstream rename shows up here as
# a named failure with the release that brought it, instead of as a crash for a user.
#
#   ./scripts/test_latest.sh            # the subset (about 1.5 min after the install)
#   ./scripts/test_latest.sh --all      # the whole suite
#   VPSD_LATEST_BASE=.venv ./scripts/test_latest.sh   # torch taken from that venv (CI: the locked one)
#   VPSD_LATEST_VENV=DIR ./scripts/test_latest.sh --install-only   # install into DIR only; a later call reuses it
#
# torch stays the lock's release: a newer one is a CUDA download of gigabytes on these machines (set VPSD_TORCH,
# as for setup.sh, to check another build). Everything else is the newest its range admits. Install: ~1.9 min
# fresh, ~1 min over a base venv's torch.
#
# The subset is what vpsd asks of transformers: every model hook and adapter operation on all three families
# (signals, attention scores, adapters, views, trees, pruned prefill, growth, the processors' frame rules read from
# transformers' source), std's sparse KV and the trees' caches (test_std, test_tree_models), batched forwards and
# captured steps. The engine's logic over those operations, what travels between ranks (torch's, the lock's release
# here too) and a target split over ranks (its worker with --slow, on the lock a job held to ar) are the locked
# suite's.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_pin="torch==$(sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements.lock)"
install_latest() {  # install_latest VENV: a fresh venv with the newest releases (torch: see above)
    local venv="$1"
    python3 -m venv "$venv"
    # torch from the locked venv (VPSD_LATEST_BASE, CI's .venv) when it holds the lock's release: the new venv sees its
    # site-packages after its own, so every other package, upgraded eagerly to the newest its range admits, lands in
    # the new venv and shadows the base's (unpacking torch again was most of this leg's install: ~1.9 min of 2.5).
    base=${VPSD_LATEST_BASE:-}
    have=$([ -n "$base" ] && "$base/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
    if [ -n "$base" ] && [ -z "${VPSD_TORCH:-}" ] && [ "torch==$have" = "$torch_pin" ]; then
        own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        theirs=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "import site; site.addsitedir('$theirs')" > "$own/zz_vpsd_locked_torch.pth"
        . "$venv/bin/activate"
        echo "test_latest: torch from $base"
        python -m pip install -q --no-compile --upgrade --upgrade-strategy eager -c <(echo "$torch_pin") -e ".[test]"
    else
        . "$venv/bin/activate"
        # shellcheck disable=SC2086  # VPSD_TORCH may carry pip options
        python -m pip install -q --no-compile ${VPSD_TORCH:-$torch_pin}
        python -m pip install -q --no-compile --upgrade -e ".[test]"
    fi
    touch "$venv/.vpsd-installed"
}
# VPSD_LATEST_VENV: build the venv there, or reuse it if an earlier call finished installing it (CI installs with
# --install-only beside the locked venv's own install, and tests later).
venv=${VPSD_LATEST_VENV:-$(mktemp -d)/latest}
if [ -f "$venv/.vpsd-installed" ]; then
    . "$venv/bin/activate"
else
    install_latest "$venv"
fi
echo "test_latest: $(python -m vpsd.provenance)"
[ "${1:-}" = "--install-only" ] && exit 0

subset=(
    tests/models/test_hf_compat.py tests/models/test_signals.py tests/models/test_pruning_scores_as_the_papers_define_them.py tests/engine/test_std.py
    tests/models/test_signal_memory.py tests/models/test_adapters.py tests/models/test_views.py tests/models/test_tree_models.py
    tests/models/test_qwen3_vl.py tests/models/test_llava_onevision.py
    tests/models/test_grow.py tests/models/test_checkpoint_sampling.py tests/models/test_qwen_video_processor.py
    tests/models/test_llava_video_processor.py tests/models/test_frame_times.py tests/models/test_eos_ids_and_video_grids_agree.py tests/models/test_captured.py
    # Batched forwards on every family (the upstream-facing part of batching: padded masks, per-row caches); the
    # engine's own logic over every method, strategy and size is the locked suite's (test_batch_decode,
    # test_batch_workers, test_lossless_sd, test_bench_pruning): what it asks of transformers is above.
    tests/engine/test_batch_decode.py::test_a_row_alone_is_stepped_by_the_batch1_forward_bit_for_bit
    tests/engine/test_batch_decode.py::test_batched_rows_score_as_batch1_steps_through_joins_rollbacks_leaves_and_compaction
    tests/engine/test_batch_decode.py::test_exact_verify_in_a_batch_equals_ar
)
if [ "${1:-}" = "--all" ]; then subset=(tests); fi
# Installed without bytecode (as scripts/setup.sh): compiled on first import, once, here (scripts/test.sh says why).
unset PYTHONDONTWRITEBYTECODE
python -c "import vpsd.launch.job, vpsd.roles.draft, vpsd.roles.pruner, vpsd.api, pytest, xdist, hypothesis"
status=0
python -m pytest -q -p no:cacheprovider -n "${VPSD_TEST_WORKERS:-auto}" --dist loadfile "${subset[@]}" || status=$?
if [ "$status" != 0 ]; then
    echo "test_latest: FAILED on the newest releases; what differs from the tested lock:" >&2
    python -m vpsd.provenance >&2
fi
exit "$status"

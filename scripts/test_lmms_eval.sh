#!/usr/bin/env bash
# vpsd as an lmms-eval backend (`--model vpsd`, vpsd/integrations/lmms_eval) against the real lmms-eval:
# scripts/setup_lmms_eval.sh's install in a venv of its own, then tests/torchrun/test_lmms_eval_backend.py (which the main
# suite skips: lmms-eval is not in the lock). CI runs it after the other two legs.
#
#   ./scripts/test_lmms_eval.sh                     # over the active venv's stack (CI: the locked .venv)
#   VPSD_LMMS_FRESH=1 ./scripts/test_lmms_eval.sh   # everything from nothing, as scripts/setup.sh installs it
#   VPSD_LMMS_VENV=DIR ./scripts/test_lmms_eval.sh --install-only   # install into DIR only; a later call reuses it
#
# Times on the 2-core machine (another job beside it): ~1.9 min in all, of which the install over the active venv
# ~50 s (from nothing ~2.5 min) and the tests ~47 s: one `python -m lmms_eval` run (~30 s, two thirds of it
# lmms-eval starting up: its imports and its index of ~2000 task files), the rest in process. `--slow` adds the
# torchrun job and two data-parallel runs (~25 s each).
#
# Why a venv layered over the active one: lmms-eval must not land in the suite's venv, and the stack below it (torch,
# transformers, the lock: 1.3 GB, ~2 min to install) is the one the suite just tested. A .pth line makes the active
# venv's packages importable beneath this venv's own; pip sees them as installed, and the lock given as constraints
# keeps it from changing any (nothing is written to the active venv). Without an active venv holding torch and
# transformers, or with VPSD_LMMS_FRESH=1, the stack is installed from nothing instead.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# VPSD_LMMS_VENV: build the venv there, or reuse it if an earlier call finished installing it (CI installs with
# --install-only while the locked suite starts, and tests after it).
venv=${VPSD_LMMS_VENV:-$tmp/venv}
if [ -f "$venv/.vpsd-installed" ]; then
    . "$venv/bin/activate"
else
    base=$(python -c 'import sys, sysconfig, torch, transformers
assert sys.prefix != sys.base_prefix
print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
    python3 -m venv "$venv"
    if [ -n "$base" ] && [ "${VPSD_LMMS_FRESH:-0}" != 1 ]; then
        own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        [ "$(basename "$(dirname "$own")")" = "$(basename "$(dirname "$base")")" ] \
            || { echo "test_lmms_eval: the active venv ($base) is not python3's version: VPSD_LMMS_FRESH=1" >&2; exit 2; }
        echo "import site; site.addsitedir('$base')" > "$own/zz_vpsd_base.pth"
        . "$venv/bin/activate"
        echo "test_lmms_eval: over $base"
    else
        . "$venv/bin/activate"
        ./scripts/setup.sh
    fi
    ./scripts/setup_lmms_eval.sh
    touch "$venv/.vpsd-installed"
fi
lmms_version=$(python -c 'import importlib.metadata as m; print(m.version("lmms-eval"))')
echo "test_lmms_eval: installed in $((SECONDS - started)) s; lmms-eval $lmms_version; $(python -m vpsd.provenance)"
[ "${1:-}" = "--install-only" ] && exit 0
# The packages set up without their bytecode (setup_lmms_eval.sh's --no-compile) are compiled once, on first
# import, and kept for the next process, whatever PYTHONDONTWRITEBYTECODE the caller's shell has set.
unset PYTHONDONTWRITEBYTECODE
# lmms-eval's datasets cache and anything it fetches stay in this run's folder.
export HF_HOME="$tmp/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m pytest -q -p no:cacheprovider tests/torchrun/test_lmms_eval_backend.py "$@"

#!/usr/bin/env bash
# Installs vpsd into the active Python environment, exactly the set CI tested: requirements.lock pins every
# direct and transitive dependency (scripts/lock.sh regenerates it). torch goes first: on these machines
# `torch==2.13.0` is a local CPU wheel, while any other spec pulls gigabytes of CUDA packages.
# On a GPU machine set VPSD_TORCH to the same release from the CUDA index, e.g.
#   VPSD_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130" ./scripts/setup.sh
# (a +cu build of the locked release satisfies the lock's torch==2.13.0).
# `--torch`: torch alone (CI starts the newest-release venv's install over it while this installs the rest).
# --no-compile: Python compiles a module the first time it is imported and keeps it; torch and transformers ship
# thousands a job never imports, and compiling them all made the install twice as long (105 s -> 53 s here).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC2086  # VPSD_TORCH may carry pip options
python -m pip install -q --no-compile -c requirements.lock ${VPSD_TORCH:-torch==2.13.0}
[ "${1:-}" = "--torch" ] && exit 0
python -m pip install -q --no-compile -c requirements.lock -e ".[test]"

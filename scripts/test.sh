#!/usr/bin/env bash
# The test suite: unit tests, model tests on tiny offline models, and multi-process tests through torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
# On every core (pytest-xdist): most cases launch torchrun jobs whose ranks spend much of their time starting up or
# waiting on each other, so a second worker fills the idle core. --dist loadfile keeps a file's cases (and its
# module fixtures, often a reference job) on one worker. --durations: the slowest cases, so that a CI run says where
# its time went. --slow: the further torchrun combinations.
# Each of the suite's ~200 processes imports torch, transformers and vpsd: compiled once and kept (__pycache__),
# whatever PYTHONDONTWRITEBYTECODE the caller's shell has set (with it, every process compiled vpsd again, ~0.2 s,
# and, after scripts/setup.sh's --no-compile install, torch and transformers too, ~11 s). Compiled here, by one
# process, before the workers and the first jobs' ranks start at once.
unset PYTHONDONTWRITEBYTECODE
python -c "import vpsd.launch.job, vpsd.roles.draft, vpsd.roles.pruner, vpsd.api, pytest, xdist, hypothesis"
exec python -m pytest -q -p no:cacheprovider -n "${VPSD_TEST_WORKERS:-auto}" --dist loadfile --durations=25 tests "$@"

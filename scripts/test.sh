#!/usr/bin/env bash
# The test suite: unit tests, model tests on tiny offline models, and multi-process tests through torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
# --durations: the slowest cases, so that a CI run says where its time went. --slow: the further torchrun combinations.
exec python -m pytest -q -p no:cacheprovider --durations=25 tests "$@"

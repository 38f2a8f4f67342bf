#!/usr/bin/env bash
# The test suite: unit tests, model tests on tiny offline models, and multi-process tests through torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -p no:cacheprovider tests "$@"  # --slow: also the further torchrun combinations

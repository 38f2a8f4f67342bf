#!/usr/bin/env bash
# Regenerates requirements.lock: every direct and transitive dependency of vpsd (and its test extras) pinned,
# resolved from pyproject.toml by `uv pip compile`. scripts/setup.sh installs exactly this set, and CI's main
# leg tests it. Two pins are held, not resolved to the newest (requirements.lock.in says why): torch at the
# release whose CPU wheel these machines carry, and transformers at the oldest release of pyproject's range,
# so that CI's two legs (this lock, then scripts/test_latest.sh) check both ends of the range.
# Run it from the repository root in any venv with pip; it installs uv there if missing. Commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null || python -m pip install -q uv
uv pip compile pyproject.toml --extra test --constraint requirements.lock.in \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --no-header --annotation-style line -o requirements.lock "$@"
sha256sum requirements.lock

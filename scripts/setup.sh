#!/usr/bin/env bash
# Installs vpsd into the active Python environment. torch goes first and pinned: on these machines
# `torch==2.13.0` is a local CPU wheel, while any other spec pulls gigabytes of CUDA packages.
# On a GPU machine set VPSD_TORCH to the torch spec you want (e.g. "torch==2.13.0" from the CUDA index).
set -euo pipefail
python -m pip install -q --upgrade pip
python -m pip install -q "${VPSD_TORCH:-torch==2.13.0}"
python -m pip install -q -e ".[test]"

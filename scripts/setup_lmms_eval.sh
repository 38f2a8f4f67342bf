#!/usr/bin/env bash
# Adds vpsd's lmms-eval backend (`--model vpsd`, vpsd/integrations/lmms_eval) to the active environment, after
# scripts/setup.sh: the `vpsd[lmms-eval]` extra (what lmms-eval imports on the path that backend runs), then
# lmms-eval itself and its table printer without their dependencies, at the versions scripts/lmms_eval.constraints
# pins (the set scripts/test_lmms_eval.sh tests).
#
# Why --no-deps for lmms-eval: its metadata asks for av<16 (vpsd reads video with av 18, so pip finds no
# solution), torchvision (from the registry a CUDA build, which pulls CUDA torch and does not import against the
# CPU one) and ~50 packages of other backends and tasks (wandb, openai, timm, sentence-transformers...) that this
# path never imports. pytablewriter likewise: its typepy[datetime] asks for python-dateutil<3 where the lock holds
# matplotlib's 4.0, and typepy imports it only to parse dates, which printing a results table never does.
# A real task's own imports come on top (VideoMME's utils import cv2: pip install opencv-python-headless).
set -euo pipefail
cd "$(dirname "$0")/.."
pins=(-c requirements.lock -c scripts/lmms_eval.constraints)
# --no-compile: Python compiles what it imports on first use; pip would compile all of pandas and pyarrow up front.
python -m pip install -q --no-compile "${pins[@]}" -e ".[lmms-eval]"
# pip then lists every lmms-eval requirement left out, as an ERROR with exit status 0: dropped, being the point.
python -m pip install -q --no-compile --no-deps "${pins[@]}" lmms-eval pytablewriter DataProperty mbstrdecoder \
    pathvalidate tabledata tcolorpy typepy chardet 2>&1 \
    | { grep -v -E "^(lmms-eval [0-9.]+ requires |ERROR: pip's dependency resolver does not)" || true; }

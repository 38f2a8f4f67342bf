"""vpsd inside other programs (evaluation harnesses), over the Python API (vpsd/api.py).

Each integration imports its host program lazily and only itself: nothing else in vpsd imports this package
(tests/unit/test_layering.py), so vpsd runs and installs without any of the hosts.

  lmms_eval/   an lmms-eval model backend, `--model vpsd` (the `vpsd[lmms-eval]` extra)
"""

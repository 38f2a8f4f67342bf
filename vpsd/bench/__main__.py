"""`python -m vpsd.bench`: the `vpsd bench` command (vpsd/bench/__init__.py)."""

import sys

from vpsd.bench import main

sys.exit(main())

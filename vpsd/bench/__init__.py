"""`vpsd bench`: every benchmark vpsd has, one command. Each measures side by side in one run (interleaved,
repeated, medians and the noise printed), never in a test; those that decode check every output against `ar`'s.

    vpsd bench methods    --manifest M [--config C] [--methods ...]   every method and strategy, one table (B = 1)
    vpsd bench throughput --batch 1,2,4,8 --manifest M [--tile K]     items/hour per method and batch size
    vpsd bench steps      --config C --manifest M [--profile]         a step and a verify, eager against captured
    vpsd bench forwards   --config C [--seeds ...]                    prefill, step and 8-row verify, all or 10% video
    vpsd bench pruning    --config C --manifest M                     every pruning strategy on the same inputs
    vpsd bench trees      [--config C] [--tree T ...]                 tree against chain accept length (no timing)
    vpsd bench signals    --config C --manifest M                     what capturing the pruning signals adds
    vpsd bench signal_memory [--groups G --tokens-side S]             the signals' memory at a real depth
    vpsd bench cache      HIDDEN,LAYERS,HEADS,KV_HEADS,HEAD_DIM,FFN   vpsd's cache and attention against transformers'
    vpsd bench serve      --config C --method M [--requests N --clients C --batch B] [--job]   `vpsd serve` under load
    vpsd bench sampling   --config C --manifest M [--temperatures 0.7,1.0]   position-keyed against rejection sampling
    vpsd bench video      [--lengths 1,10,60 --sizes 720 --frames 16,64,128] [--job C]   reading real-length videos
    vpsd bench reuse      --config C --videos M [--count 4 --questions 3 --batch 1] [--chat]   one video, many questions
    vpsd bench reuse-soak [--config C --requests 1000 --videos 50 --budget-mib 4]   a server's memory as its cache evicts

The first two (and `sampling`) run real torchrun jobs (the launcher users run); `serve` and `reuse-soak` a real server and
its clients (and, with --job, the batch job beside it); the others measure forwards in this process.
Not here: scripts/load_memory.py (a load over torchrun ranks of its own) and scripts/api_vs_job.py (the Python API
against the job), which measure a launch, not a forward.
Without a subcommand, `vpsd bench` is `methods`, or `throughput` when given --batch or --report-only (the form
older scripts use). `python -m vpsd.bench ...` is the same command.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = ("methods", "throughput", "steps", "forwards", "pruning", "trees", "signals", "signal_memory", "cache",
               "serve", "sampling", "video", "reuse", "reuse-soak")  # each a module of this package ("-" as "_")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        name, rest = argv[0], argv[1:]
    else:
        batched = any(a in ("--batch", "--report-only") or a.startswith("--batch=") for a in argv)
        name, rest = ("throughput" if batched else "methods"), argv
    module = importlib.import_module(f"vpsd.bench.{name.replace('-', '_')}")  # only the one asked for: each is heavy
    return module.main(rest)

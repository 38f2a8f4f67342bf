"""`vpsd` command: the tools around a run (jobs themselves start with ./torchrun.sh run ...).

    vpsd check MANIFEST          validate a manifest without loading models
    vpsd summary DIR [--baseline AR_DIR]
    vpsd timeline DIR [--item ID] [--out PNG]
    vpsd bias DIR [--strategy S] [--band 0.1] [--out PNG]   position bias of the kept tokens per frame
    vpsd acceptance DIR [--item ID] [--out PNG]              accepted draft tokens per verification round
    vpsd bench [methods|throughput|steps|forwards|pruning] ...   the benchmarks (`vpsd bench --help`)
    vpsd tune --config C --manifest M --out TUNED [--batch 1,8] ...   the fastest lossless settings here, as a config
    vpsd grow SRC DST --width K --layers N [--manifest M]     a function-preserving scale model, checked
    vpsd plan --config C [--method M] [--set K=V] [--gpu-gib G]  each rank's memory, from the configs alone
    vpsd world [--kind short|long] --out DIR --count N [--seed S]   procedural videos and their manifest
    vpsd serve --config C [--method M] [--host H] [--port P] [--api-key K] [--batch N] ...   OpenAI-compatible server
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "check":
        from vpsd.launch.manifest import main as run
    elif command == "summary":
        from vpsd.reports.summary import main as run
    elif command == "timeline":
        from vpsd.reports.timeline_command import main as run
    elif command == "bias":
        from vpsd.reports.bias import main as run
    elif command == "acceptance":
        from vpsd.reports.acceptance import main as run
    elif command == "bench":
        from vpsd.bench import main as run
    elif command == "tune":
        from vpsd.bench.tune import main as run
    elif command == "grow":
        from vpsd.launch.grow import main as run
    elif command == "plan":
        from vpsd.launch.plan import main as run
    elif command == "world":
        from vpsd.world.dataset import main as run
    elif command == "serve":
        from vpsd.serve.cli import main as run
    else:
        print(f"vpsd: unknown command {command!r}\n{__doc__}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())

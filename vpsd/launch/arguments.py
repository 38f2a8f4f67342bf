"""The command line of a job (`./torchrun.sh run --help`), and how a job that cannot start says so.

Light on purpose: `--help` is answered by this module alone, in one process, before torchrun starts any rank
(./torchrun.sh), so it prints once and at once, with the methods, the pruning strategies and the `vpsd` tools.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vpsd.launch.manifest import Shard
from vpsd.launch.say import say
from vpsd.pipeline.methods import BATCHABLE, METHODS
from vpsd.pipeline.pruning.strategies import STRATEGIES

USAGE = "./torchrun.sh [torchrun options] run --config C --manifest M --out DIR [options]"
TOOLS = """the vpsd command (results, reports and data):
  vpsd check MANIFEST      vpsd summary DIR      vpsd timeline DIR      vpsd acceptance DIR      vpsd bias DIR
  vpsd bench ...           vpsd grow SRC DST ... vpsd world --kind short|long ...   (vpsd --help says more)"""


def _epilog() -> str:
    methods = "\n".join(f"  {name:<12} {describe(m)}" for name, m in METHODS.items())
    strategies = ", ".join(sorted(STRATEGIES))
    return (f"methods (--method):\n{methods}\n\npruning strategies (--pruning): {strategies}\n\n{TOOLS}\n\n"
            "exit status: 0 every item done, 3 the job finished with failed items, 2 refused at launch, "
            "130 interrupted; rerun the same command to resume")


def describe(m) -> str:
    place = "parallel (draft and pruner ranks)" if m.parallel else "serial" if m.uses_draft else "the target alone"
    draft = {"pruned_input": "", "sparse_kv": ", draft = the target on a sparse KV cache",
             "views": ", an ensemble of drafting views"}[m.draft] if m.uses_draft else ""
    tree = f", an {m.tree.upper()} draft tree" if m.tree else ""
    return f"{place}{draft}{tree}; pruning {m.default_strategy}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Every rank meets a bad argument: said once, as a refusal, not a usage block per rank and torchrun's
        failure block after them."""
        raise SystemExit(refuse([f"{message} (--help lists the options)"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="./torchrun.sh run", usage=USAGE, epilog=_epilog(),
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Decode every item of a manifest with a video-LLM and its speculative pipeline; one "
                            "results line per item in --out, resumable.")
    p.add_argument("--config", required=True, help="the run's YAML (configs/): family, target, draft, video, decoding, ...")
    p.add_argument("--manifest", required=True, help="JSONL, one item a line: id, video, prompt (vpsd check M)")
    p.add_argument("--out", required=True, help="results.jsonl, summary.json, traces/: one job per directory")
    p.add_argument("--method", default="hippo",
                   help="see the methods below (default hippo); auto: the choice of a config `vpsd tune` wrote")
    p.add_argument("--pruning", default=None, help="override the method's pruning strategy")
    p.add_argument("--ratio", type=float, default=None, help="share of the video tokens pruned from the draft's input")
    p.add_argument("--gamma", type=_gamma, default=None, metavar="N|auto",
                   help="draft tokens per chunk, or auto: matched live to T_p / T_q (ParallelVLM Eq. 6)")
    p.add_argument("--temperature", type=float, default=None, help="0: greedy (the default); > 0: sampling")
    p.add_argument("--timeout", type=_positive_seconds, default=None,
                   help="seconds a peer may be silent once the job runs (config timeout_s, default 120)")
    p.add_argument("--startup-timeout", type=_positive_seconds, default=None,
                   help="seconds the job may take to start: every rank up, models loaded (config startup_timeout_s, "
                        "default 600)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set draft=self --set video.num_frames=16")
    p.add_argument("--retry-failed", action="store_true", help="run again the items whose result is an error")
    p.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                   help="run only shard I (0-based) of N of the manifest, for independent jobs splitting it; "
                        "give each its own --out")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="items in flight at once (continuous batching; sets batching.size): "
                        f"methods {', '.join(BATCHABLE)}")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no closing line (the bar is off anyway when stderr is not a terminal)")
    args = p.parse_args(argv)
    if args.method == "auto":
        with_tuned_choice(args)
    return args


def with_tuned_choice(args: argparse.Namespace) -> None:
    """`--method auto`: the method and settings the config's tuned: block holds for this --batch (launch/tuned.py;
    ./torchrun.sh tunes on the job's first items first when the config has none), said once; an option given
    on the command line wins over the choice's. A config without a choice for it is refused."""
    from vpsd.config import ConfigError
    from vpsd.launch.settings import auto_method  # the settings' checks import the model stack: only for auto

    try:
        choice = auto_method(args.config, args.batch, args.set)
    except FileNotFoundError as e:
        raise SystemExit(refuse([f"no such config file: {e.filename}"])) from None
    except ConfigError as e:
        raise SystemExit(refuse(e.problems)) from None
    args.method = choice.method
    for name in ("pruning", "ratio", "gamma", "batch"):
        if getattr(args, name) is None:
            setattr(args, name, choice.option(name))
    args.set = choice.sets() + list(args.set)
    if os.environ.get("RANK", "0") == "0":
        say(f"--method auto: {choice.describe()}, the choice of {args.config}'s tuned: block")


def _gamma(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"gamma must be an integer or 'auto', got {text!r}") from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"need a number of seconds > 0, got {text!r}")
    return value


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Set by ./torchrun.sh for a single-node job: a path where a rank that refuses to start leaves a mark, then
# exits 0, so that its peers do not start for nothing; the launcher (vpsd/launch/launcher.py) sees the mark and
# exits 2 itself. Only for refusals every rank reaches on its own (on one node they read the same files): a rank
# exiting 0 while its peers go on would leave them waiting for it. Started any other way, a refusing rank exits 2.
# (The target's refusal of a busy --out marks it too, and exits 2 so that torchrun stops the others: entry.py.)
REFUSAL_MARK = "VPSD_REFUSAL_MARK"
INTERRUPTED = 130  # the shells' status for a command ended by SIGINT (128 + 2)
# Set by the Python API for the ranks it starts (launch/served.py): the job's coordinator is the API's process,
# which hands them the items of each generate call, so pipeline 0's target starts none of its own.
SERVED = "VPSD_SERVED"


def refuse(problems: list[str], reporter: bool | None = None, every_rank: bool = True) -> int:
    """A job that cannot start: one line per problem, said once (by rank 0: every rank finds the same ones,
    before any model loads); exit status 2, or 0 after leaving the launcher's mark (REFUSAL_MARK)."""
    if reporter is None:
        reporter = os.environ.get("RANK", "0") == "0"
    if reporter:
        for problem in problems:
            say(problem)
    mark = os.environ.get(REFUSAL_MARK)
    if mark and every_rank:
        Path(mark).touch()
        return 0
    return 2




if __name__ == "__main__":  # ./torchrun.sh run --help
    parse_args(sys.argv[1:])

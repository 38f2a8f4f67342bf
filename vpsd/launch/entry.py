"""The torchrun entry point: one process per rank, each playing the role the config assigns it.

    torchrun --nproc-per-node 3 -m vpsd.launch.entry --config C --manifest M --out DIR [--method ...]

Rank roles come from the config's `roles:` section (default target 0, draft 1, pruner 2; serial methods
need only the target, extra ranks exit at once). The target rank owns the item loop and the results
file (vpsd.launch.job): a failure on one item is written as that item's error and the job goes on;
a role that dies or falls silent ends the job with an error naming it, within `timeout_s`. Under
`torchrun --max-restarts N` the restarted ranks resume from the results file. A job that ran to the end
exits 0 on every rank, failed items or not: torchrun takes any other code for a crash (and restarts).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Mapping

import torch.distributed as dist

from vpsd.config import ConfigError, RunConfig, load_config, nearest, parse_overrides
from vpsd.launch.job import run_job
from vpsd.launch.job_identity import JobMismatch, check_resume
from vpsd.launch.lifetime import OutDirBusy, die_with_parent, end_silent_peer, lock_out_dir
from vpsd.launch.manifest import Shard
from vpsd.launch.preflight import affinity_problems, checkpoint_problems, path_problems
from vpsd.models.registry import load_adapter
from vpsd.pipeline.methods import BATCHABLE, get_method
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.roles.context import ROLES, RoleContext, RoleFailure
from vpsd.roles.draft import run_draft
from vpsd.roles.pruner import run_pruner
from vpsd.storage import FULL, DiskFull
from vpsd.tracing import configure_tracing, get_logger
from vpsd.transport.auth import MissingSecret, job_secret
from vpsd.transport.control import ControlChannel, PeerTimeout
from vpsd.transport.tensors import TensorChannel, init_distributed


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Every rank meets a bad argument: said once, as a refusal, not a usage block per rank and torchrun's
        failure block after them."""
        raise SystemExit(refuse([f"{message} (--help lists the options)"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="vpsd.launch.entry", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--method", default="hippo")
    p.add_argument("--pruning", default=None, help="override the method's pruning strategy")
    p.add_argument("--ratio", type=float, default=None)
    p.add_argument("--gamma", type=_gamma, default=None, metavar="N|auto",
                   help="draft tokens per chunk, or auto: matched live to T_p / T_q (ParallelVLM Eq. 6)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--timeout", type=_positive_seconds, default=None, help="seconds a role waits for a peer")
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
    return p.parse_args(argv)


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


def resolve_config(args: argparse.Namespace) -> RunConfig:
    method = get_method(args.method)
    overrides = parse_overrides(args.set)
    overrides["pruning.strategy"] = args.pruning or method.default_strategy
    ratio = args.ratio if args.ratio is not None else method.default_ratio
    if ratio is not None:
        overrides["pruning.ratio"] = ratio
    if args.gamma is not None:
        overrides["decoding.gamma"] = args.gamma
    if args.temperature is not None:
        overrides["decoding.temperature"] = args.temperature
    if args.batch is not None:
        overrides["batching.size"] = args.batch
    cfg = load_config(args.config, overrides)  # ConfigError: one line per bad setting (main prints them)
    if cfg.pruning.strategy not in STRATEGIES:  # else a KeyError on the target rank and a ValueError on the pruner's
        raise ConfigError([f"unknown pruning strategy {cfg.pruning.strategy!r}"
                           f"{nearest(cfg.pruning.strategy, STRATEGIES)}; known: {', '.join(sorted(STRATEGIES))}"])
    check_method_settings(method, cfg)
    problems = checkpoint_problems(cfg) + affinity_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def check_method_settings(method, cfg: RunConfig) -> None:
    """Settings only one method reads, checked at launch: a bad one must stop the job before any rank
    loads a model, not crash the draft role on the first item."""
    try:
        method.draft_place(cfg.batching.size, cfg.batching.pipelined)  # ValueError where it cannot run
        if method.draft == "sparse_kv" and cfg.pruning.strategy != "none":
            raise ValueError(f"std picks its own KV entries per head; --pruning {cfg.pruning.strategy} does not apply")
    except (ValueError, TypeError) as e:
        raise SystemExit(f"vpsd: method {method.name}: {e}") from None


def role_ranks(cfg: RunConfig) -> dict[str, int]:
    return dict(cfg.roles)  # checked when the config was read


def restart_problem(env: Mapping[str, str]) -> str | None:
    """Why this torchrun restart cannot work, if it cannot.

    torchrun shares its agent's TCPStore with the ranks by default, across restarts too: a restarted
    rank then finds the dead ranks' addresses in it and hangs in init_process_group
    (pytorch/pytorch#135712). Said at once, and how to avoid it, instead of hanging.
    """
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"torchrun restarted the ranks (attempt {restart}) with the store it shares across attempts, "
                "where the process group hangs (pytorch/pytorch#135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                "for torchrun (./torchrun.sh does)")
    return None


# Set by ./torchrun.sh for a single-node job: a path where a rank that refuses to start leaves a mark, then
# exits 0, so that torchrun does not print its failure block (a traceback-sized "ChildFailedError" report)
# under vpsd's own lines; the launcher sees the mark and exits 2 itself. Only for refusals every rank reaches
# on its own (on one node they read the same files): a rank exiting 0 while its peers go on would leave them
# waiting for it. Started any other way, a refusing rank exits 2.
REFUSAL_MARK = "VPSD_REFUSAL_MARK"
INTERRUPTED = 130  # the shells' status for a command ended by SIGINT (128 + 2)
# Set by ./torchrun.sh for a single-node job: the target rank marks it on Ctrl-C, and the launcher exits 130
# (torchrun itself exits 1 after a SIGINT, whatever its ranks did).
INTERRUPT_MARK = "VPSD_INTERRUPT_MARK"


def refuse(problems: list[str], reporter: bool | None = None, every_rank: bool = True) -> int:
    """A job that cannot start: one line per problem, said once (by rank 0: every rank finds the same ones,
    before any model loads); exit status 2, or 0 after leaving the launcher's mark (REFUSAL_MARK)."""
    if reporter is None:
        reporter = os.environ.get("RANK", "0") == "0"
    if reporter:
        for problem in problems:
            print(f"vpsd: {problem}", file=sys.stderr, flush=True)
    mark = os.environ.get(REFUSAL_MARK)
    if mark and every_rank:
        Path(mark).touch()
        return 0
    return 2


def main(argv: list[str] | None = None) -> int:
    if "LOCAL_RANK" in os.environ:  # started by torchrun: its agent's death must end this rank too
        die_with_parent()
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument already refused (_Parser.error)
        return int(e.code or 0)
    try:
        cfg = resolve_config(args)
    except FileNotFoundError as e:
        return refuse([f"no such config file: {e.filename}"])
    except (ConfigError, ValueError) as e:
        return refuse(str(e).splitlines())
    except SystemExit as e:  # check_method_settings' message
        return refuse([str(e.code).removeprefix("vpsd: ")])
    method = get_method(args.method)
    out = Path(args.out)
    is_target = int(os.environ.get("RANK", "0")) == role_ranks(cfg)["target"]  # the rank that owns --out

    def on_sigint(signum, frame):
        """Ctrl-C reaches every rank (the terminal's process group, and torchrun forwards it): one line from
        the target rank, not a KeyboardInterrupt traceback from each. Results are whole lines (vpsd/storage.py),
        so leaving at once keeps every finished item, and the same command resumes."""
        if is_target:
            print(f"vpsd: interrupted: the items finished are kept in {out}; rerun the same command to do the rest",
                  file=sys.stderr, flush=True)
            if os.environ.get(INTERRUPT_MARK):
                Path(os.environ[INTERRUPT_MARK]).touch()
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGINT, on_sigint)
    problems = path_problems(Path(args.manifest), out)
    if problems:
        # Only the target rank reads them; on one node every rank sees the same files and refuses alike.
        if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
            return refuse(problems)
        if is_target:
            return refuse(problems, reporter=True, every_rank=False)
    timeout_s = float(args.timeout or cfg.timeout_s)
    problem = restart_problem(os.environ)
    if problem is not None:
        return refuse([problem])
    try:
        secret = job_secret()  # before anything binds a socket: no secret, no control plane
        if is_target:
            lock_out_dir(out)  # the results writer holds --out for its whole life: one job per directory
        check_resume(out, method.name, cfg)  # every rank, before any of them loads a model
    except OutDirBusy as e:
        # Only the target rank tried the lock: it reports, and exits 2 so that torchrun stops the others.
        return refuse([str(e)], reporter=True, every_rank=False)
    except OSError as e:  # --out could not be made (what path_problems cannot see: a read-only mount, root's /proc)
        return refuse([f"--out {out}: {e.strerror or e}"], reporter=True, every_rank=False)
    except (JobMismatch, MissingSecret, ValueError) as e:
        return refuse([str(e)])
    rank, world, backend = init_distributed(timeout_s=timeout_s)
    ranks = role_ranks(cfg)
    role = next((r for r, k in ranks.items() if k == rank), "spare")
    configure_tracing(out, role, rank)
    log = get_logger()
    in_roles = method.draft_place(cfg.batching.size, cfg.batching.pipelined) == "remote"
    if in_roles and world < len(ROLES):
        raise SystemExit(f"method {method.name!r} runs draft, target and pruner on separate ranks: launch 3 ranks, got {world}")
    if role == "spare" or (not in_roles and role != "target"):
        dist.barrier()
        dist.destroy_process_group()
        return 0
    # The control channel first: its ZeroMQ I/O thread starts with the socket and keeps the affinity it
    # starts with. Pinned to the role's core it must preempt the role's own compute thread to move every
    # message, on a core shared with whatever else runs there: sends took ~0.1 ms (median) to several ms,
    # 10% of the target's busy time. Unpinned it runs wherever there is room.
    ctrl = ControlChannel.from_process_group(role, secret=secret)
    cpus = (cfg.cpu_affinity or {}).get(role)
    if cpus is not None:  # e.g. pin target and draft to separate cores for a fair CPU benchmark
        os.sched_setaffinity(0, cpus)  # this thread (and threads it starts later) only
    ctx = RoleContext(rank, role, ranks, ctrl, TensorChannel(ctrl), cfg, method, timeout_s=timeout_s,
                      idle_timeout_s=cfg.idle_timeout_s, job_id=out.name, out=out)
    log.info("role_started", method=method.name, backend=backend, world=world, strategy=cfg.pruning.strategy,
             pid=os.getpid(), host=os.uname().nodename)

    def on_sigterm(signum, frame):  # torchrun stops the survivors when a rank dies: say so, and where
        msg = f"{role} (rank {rank}) stopped by torchrun while on item {ctx.item_id or '-'}: another rank failed"
        log.error("role_stopped", error=msg)
        print(f"vpsd: {msg}", file=sys.stderr, flush=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, on_sigterm)
    # Signs of life from a thread of their own: a peer tells "busy" from "stopped or dead" by them (roles/context.py).
    if in_roles:  # a target that runs alone (serial or batched): its peers exited and have no endpoint
        ctrl.start_heartbeat([k for r, k in ranks.items() if k != rank], interval_s=min(1.0, timeout_s / 4))
    try:
        if role == "target":
            run_job(ctx, args, cfg, out)
        elif role == "draft":
            device_cfg = cfg.draft or cfg.target
            adapter = load_adapter(cfg.family, device_cfg)
            run_draft(ctx, adapter)
        else:
            run_pruner(ctx)
    except (RoleFailure, PeerTimeout) as e:
        silent = e.silent_rank if isinstance(e, RoleFailure) else e.rank
        msg = str(e) if isinstance(e, RoleFailure) else f"{role} (rank {rank}) {e} while on item {ctx.item_id or '-'}"
        log.error("role_failed", error=msg)
        print(f"vpsd: {msg}", file=sys.stderr, flush=True)
        if silent is not None:
            try:  # a stopped rank would hold torchrun 30 s past this report
                end_silent_peer(ctrl.peer_record(silent))
            except Exception:  # noqa: BLE001 - the report above is what matters; never mask it
                pass
        os._exit(2)  # a peer is gone: do not wait for it in a collective or a socket linger
    except OSError as e:
        if e.errno not in FULL:
            raise
        # A full disk: the results and traces end on whole lines (vpsd/storage.py); say so once, plainly.
        msg = str(e) if isinstance(e, DiskFull) else f"no space left on the device of {out}: {e}"
        print(f"vpsd: {role} (rank {rank}): {msg}", file=sys.stderr, flush=True)
        os._exit(2)
    ctrl.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

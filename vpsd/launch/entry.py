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
import dataclasses
import faulthandler
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from vpsd.activity import ACTIVITY, START, doing
from vpsd.config import ConfigError, RunConfig
from vpsd.launch.arguments import INTERRUPTED, REFUSAL_MARK, SERVED, parse_args, refuse  # noqa: F401
from vpsd.launch.coordinator import Coordinator
from vpsd.launch.job_identity import JobMismatch, check_resume
from vpsd.launch.layout import FOLLOWER, SOLO, Layout, Pipeline, pinned_cores, plan
from vpsd.launch.lifetime import OutDirBusy, die_with_parent, end_silent_peer, lock_out_dir
from vpsd.launch.preflight import affinity_problems, path_problems
from vpsd.launch.rank_records import launch_dir, note, record_rank
from vpsd.launch.say import say
from vpsd.launch.settings import run_config
from vpsd.pipeline.methods import DraftPlace, Method, get_method
from vpsd.roles.context import RoleContext, RoleFailure
from vpsd.storage import FULL, DiskFull
from vpsd.tracing import close_tracing, configure_tracing, get_logger
from vpsd.transport.auth import MissingSecret, job_secret
from vpsd.transport.control import ControlChannel, PeerTimeout
from vpsd.transport.startup import RanksMissing
from vpsd.transport.tensors import TensorChannel, init_distributed


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a job (vpsd/launch/launcher.py)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The run's checked settings from the command line (launch/settings.py); ConfigError lists what is wrong."""
    return run_config(args.config, args.method, pruning=args.pruning, ratio=args.ratio, gamma=args.gamma,
                      temperature=args.temperature, batch=args.batch, overrides=args.set)


def command_line(argv: list[str]) -> tuple[argparse.Namespace, RunConfig] | int:
    """The options and their checked settings, or the exit status of a refusal (said once, one line a problem).
    `args.serving`: vpsd serve's options when the launch serves HTTP (`serve_command`), else None."""
    made = serve_command(argv)
    if isinstance(made, int):
        return made
    serving, argv = made
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument already refused (_Parser.error)
        return int(e.code or 0)
    args.serving = serving
    try:
        return args, resolve_config(args)
    except FileNotFoundError as e:
        return refuse([f"no such config file: {e.filename}"])
    except (ConfigError, ValueError) as e:
        return refuse(str(e).splitlines())


def main(argv: list[str] | None = None) -> int:
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        as_a_rank()
    settings = command_line(list(sys.argv[1:] if argv is None else argv))
    if isinstance(settings, int):
        return settings
    args, cfg = settings
    method, out = get_method(args.method), Path(args.out)
    in_roles = method.draft_place(cfg.batching.size, cfg.batching.pipelined, cfg.draft_on) is DraftPlace.REMOTE
    try:
        layout = launch_layout(cfg, in_roles)
    except ValueError as e:
        return refuse([f"method {method.name}: {e}"])
    rank = int(os.environ.get("RANK", "0"))
    is_leader = rank == layout.leader.target  # holds --out's lock and runs the job's coordinator
    on_stop_signals(layout, rank, is_leader, out, serving=args.serving is not None)
    secret = preflight(args, cfg, method, out, is_leader, layout)
    if isinstance(secret, int):
        return secret  # refused
    timeout_s = float(args.timeout or cfg.timeout_s)
    startup_timeout_s = float(args.startup_timeout or cfg.startup_timeout_s)
    placed = layout.of_rank(rank)
    role = placed[1] if placed is not None else "spare"
    if placed is not None and (in_roles or role in ("target", FOLLOWER)):
        import_role(role)
    try:  # start-up has its own bound: --timeout takes over once every rank is up
        rank, world, backend = init_distributed(startup_timeout_s, say, progress=not args.quiet)
    except RanksMissing:
        return 2  # said by one rank; non-zero, so that torchrun stops the ranks still starting
    configure_tracing(out, role, rank)
    target_group = None
    if placed is not None and placed[0].followers and role in ("target", FOLLOWER):
        target_group = split_target_group(placed[0], backend)
    if role == FOLLOWER:  # a share of the target: the leader's forwards until it says stop, then leave
        run_follower(cfg, target_group, placed[0].target)
        dist.destroy_process_group()
        return 0
    if is_leader and (line := layout.spare_line()) is not None:
        say(line)
    # A rank leaves when its own work is done, never in a collective: a barrier waits under the process group's
    # timeout (--timeout, for a peer that stopped answering), so ranks a method leaves idle, or a pipeline that
    # ran out of items while another decodes a long video, would time out a job that is still working. Nothing
    # is in flight by then: the protocol's Shutdown exchange ends every pipeline's traffic first.
    if placed is None or (not in_roles and role != "target"):
        dist.destroy_process_group()
        return 0
    pipeline = placed[0]
    args.cores = os.sched_getaffinity(0)  # before the role's pinning: a leader's server thread runs on these
    ctx = start_role(rank, role, pipeline, cfg, method, secret, timeout_s, startup_timeout_s, out)
    if args.serving is not None:
        serving_signals(is_leader)  # in place of start_role's, which end a job's rank at once
    get_logger().info("role_started", method=method.name, backend=backend, world=world, strategy=cfg.pruning.strategy,
                      pid=os.getpid(), host=os.uname().nodename, pipeline=pipeline.index, **_placement(),
                      pipelines=len(layout.pipelines), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    if in_roles:  # signs of life from a thread, by which a peer tells busy from dead (a lone target has no peer)
        ctx.ctrl.start_heartbeat([k for r, k in pipeline.ranks.items() if k != rank], interval_s=min(1.0, timeout_s / 4))
    run_role(ctx, args, out, layout, pipeline, secret if is_leader else None, target_group)
    ctx.ctrl.close()
    dist.destroy_process_group()
    return 0


def as_a_rank() -> None:
    """A rank torchrun started: its agent's death ends it too, and a crash in native code (gloo, ZeroMQ, a kernel),
    otherwise one line of torchrun's ("exitcode -11"), prints every thread's Python stack to the rank's stderr.
    So does `kill -USR1 <pid>` on a rank that seems stalled, which then goes on (README, Faults)."""
    die_with_parent()
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    signal.signal(signal.SIGUSR1, _print_stacks)


def _print_stacks(signum: int, frame: object) -> None:
    """SIGUSR1: every thread's Python stack, dumped from the interpreter, the GIL held, at the main thread's next
    Python step (a rank's waits poll, so a stalled one gets there). Not faulthandler's own SIGUSR1 handler: that
    one walks the other threads' frames while they run, and a draft rank died of it mid-forward (SIGSEGV in the
    dump, in CI)."""
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)


def launch_layout(cfg: RunConfig, in_roles: bool) -> Layout:
    """The launch's pipelines (launch/layout.py) from torchrun's environment. A launch smaller than one pipeline
    runs the target alone where the method needs no other rank (serial methods, a batch drafting in-process)."""
    roles = dict(cfg.roles)
    # Outside torchrun (no world yet: init_distributed says so later), one pipeline, so what is checked first is.
    world = int(os.environ.get("WORLD_SIZE", str(max(roles.values()) + 1)))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    split = cfg.target.tensor_parallel
    if not in_roles and world < max(roles.values()) + split:
        roles = dict(SOLO)
    return plan(world, local, roles, split)


def split_target_group(pipeline: Pipeline, backend: str):
    """The process group of a split target's ranks (models/tensor_parallel.py), made by its members alone.
    Its timeout is long: a follower waits in it for the leader's next forward while the pipeline has no item
    (a dead leader is torchrun's to notice: it stops the job's ranks)."""
    return dist.new_group(pipeline.target_ranks, backend=backend, timeout=timedelta(days=7),
                          use_local_synchronization=True)


def run_follower(cfg: RunConfig, group, leader: int) -> None:
    from vpsd.models.registry import load_adapter
    from vpsd.models.tensor_parallel import follow

    target = load_adapter(cfg.family, cfg.target, group=group)  # this rank's share of the target's layers
    forwards = follow(target, group, leader)
    get_logger().info("follower_done", leader=leader, forwards=forwards)


def on_stop_signals(layout: Layout, rank: int, is_leader: bool, out: Path, serving: bool = False) -> None:
    """Under ./torchrun.sh, whose launcher says once what stopped the job (launch/launcher.py): this rank's record
    for it, and SIGINT, SIGTERM, SIGHUP end the rank at once, silently. Under torchrun started by hand: Ctrl-C
    said by the leader (`interrupted`). A launch that serves HTTP stops as `vpsd serve` does (`serving_signals`)."""
    if serving:
        serving_signals(is_leader)
        return
    if launch_dir() is None:
        signal.signal(signal.SIGINT, lambda signum, frame: interrupted(is_leader, out))
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))
    placed = layout.of_rank(rank)
    record_rank(placed[1] if placed is not None else "spare", rank, placed[0].index if placed is not None else None)


_SERVER = None  # the leader's LaunchedServer (serve/launched.py), once it runs


def serving_signals(is_leader: bool) -> None:
    """A launch that serves: SIGINT, SIGTERM, SIGHUP shut the leader's server down gracefully (the pipelines then
    end as a job's do, and every rank leaves, exit 0); the other ranks ignore them and leave with their pipeline.
    Before the server runs, the leader leaves at once (torchrun then stops the others)."""
    def stop(signum: int, frame: object) -> None:
        if _SERVER is None:
            os._exit(128 + signum)
        _SERVER.stop(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop if is_leader else signal.SIG_IGN)


def serve_http(serving: argparse.Namespace, cfg: RunConfig, layout: Layout, secret: str, startup_timeout_s: float,
               cores: set[int]):
    """The leader's HTTP server and the pipelines' coordinator, started on a thread (serve/launched.py)."""
    global _SERVER
    from vpsd.serve.launched import LaunchedServer

    _SERVER = LaunchedServer(serving, cfg, layout, secret, startup_timeout_s, cores)
    _SERVER.start()
    return _SERVER


def serve_command(argv: list[str]) -> tuple[argparse.Namespace | None, list[str]] | int:
    """`./torchrun.sh serve ...` (argv starting with "serve"): vpsd serve's options, and the job's command line that
    every rank runs for them (serve/launched.py), its targets served (no job coordinator); any other argv is a
    job's, as it is. An int: the exit status of a refusal (said)."""
    if argv[:1] != ["serve"]:
        return None, argv
    from vpsd.serve.launched import job_argv

    made = job_argv(argv[1:], launch_dir())
    if not isinstance(made, int):
        os.environ[SERVED] = "1"
    return made


def interrupted(is_target: bool, out: Path) -> None:
    """Ctrl-C under torchrun started by hand (./torchrun.sh's launcher says it itself): it reaches every rank (the
    terminal's process group, and torchrun forwards it): one line from the target rank, not a KeyboardInterrupt
    traceback from each. Results are whole lines (vpsd/storage.py), so leaving at once keeps every finished
    item, and the same command resumes."""
    if is_target:
        say(f"interrupted: the items finished are kept in {out}; rerun the same command to do the rest")
    os._exit(INTERRUPTED)


def preflight(args: argparse.Namespace, cfg: RunConfig, method: Method, out: Path, is_target: bool,
              layout: Layout) -> str | int:
    """What every rank checks before any of them loads a model: paths, the cores of every pipeline on a node, the
    job's secret, the lock on --out (the leader's), a resume's settings. Returns the
    secret, or the refusal's exit status."""
    slots = max(p.node_slot for p in layout.pipelines) + 1
    if slots > 1 and (pinning := affinity_problems(cfg, slots=slots)):
        return refuse(pinning)
    problems = path_problems(Path(args.manifest), out)
    if problems:
        # Only the target rank reads them; on one node every rank sees the same files and refuses alike.
        if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
            return refuse(problems)
        if is_target:
            return refuse(problems, reporter=True, every_rank=False)
    try:
        secret = job_secret()  # before anything binds a socket: no secret, no control plane
        if is_target:
            lock_out_dir(out)  # the results writer holds --out for its whole life: one job per directory
        check_resume(out, method.name, cfg)  # every rank, before any of them loads a model
    except OutDirBusy as e:
        # Only the target rank tried the lock: it reports, and exits 2 so that torchrun stops the others; the mark
        # tells ./torchrun.sh's launcher that this was a refusal (exit 2, no failure line of its own).
        return refuse_alone(str(e))
    except OSError as e:  # --out could not be made (what path_problems cannot see: a read-only mount, root's /proc)
        return refuse_alone(f"--out {out}: {e.strerror or e}")
    except (JobMismatch, MissingSecret, ValueError) as e:
        return refuse([str(e)])
    return secret


def refuse_alone(problem: str) -> int:
    """A refusal the target rank alone reaches (--out): said, the launcher's mark left (it then exits 2 with no
    line of its own), and exit 2, so that torchrun stops the ranks that wait for this one."""
    if os.environ.get(REFUSAL_MARK):
        Path(os.environ[REFUSAL_MARK]).touch()
    return refuse([problem], reporter=True, every_rank=False)


def _placement() -> dict:
    """The cores and intra-op threads this role's thread runs on (as start_role pinned them)."""
    return {"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def start_role(rank: int, role: str, pipeline: Pipeline, cfg: RunConfig, method: Method, secret: str,
               timeout_s: float, startup_timeout_s: float, out: Path) -> RoleContext:
    """The rank's control channel, affinity and context (its config pinning its pipeline's cores); torchrun's
    SIGTERM said as one line."""
    # The control channel first: its ZeroMQ I/O thread starts with the socket and keeps the affinity it
    # starts with. Pinned to the role's core it must preempt the role's own compute thread to move every
    # message, on a core shared with whatever else runs there: sends took ~0.1 ms (median) to several ms,
    # 10% of the target's busy time. Unpinned it runs wherever there is room.
    ctrl = ControlChannel.from_process_group(role, secret=secret, connect_timeout_s=startup_timeout_s)
    ACTIVITY.own(role)  # this thread's phases are what the heartbeats report (vpsd/activity.py)
    if cfg.cpu_affinity and role in ("target", "draft"):  # the roles that read videos
        from vpsd.video.pool import note_spare_cores

        # Where their video readers run: the cores of this process's mask (before the pin below) that no role of
        # the node's pipelines is pinned to (vpsd/video/pool.py).
        slots = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // pipeline.size)
        note_spare_cores(os.sched_getaffinity(0) - {c for slot in range(slots) for r in cfg.cpu_affinity
                                                    for c in pinned_cores(cfg.cpu_affinity, r, slot) or []})
    if cfg.cpu_affinity:  # this pipeline's cores: the config's layout shifted to its place on the node
        cfg = dataclasses.replace(cfg, cpu_affinity={r: pinned_cores(cfg.cpu_affinity, r, pipeline.node_slot) or []
                                                     for r in cfg.cpu_affinity})
    cpus = (cfg.cpu_affinity or {}).get(role)
    if cpus is not None:  # e.g. pin target and draft to separate cores for a fair CPU benchmark
        os.sched_setaffinity(0, cpus)  # this thread (and threads it starts later) only
        # One intra-op thread a core it was given. torch's default is one a core of the machine (torchrun sets
        # OMP_NUM_THREADS=1 only for more than one rank a node): a lone rank pinned to one core of two ran two
        # OpenMP threads there, each spinning at the other's barriers, and its larger forwards took 40% longer
        # (sd's 6-row verify 49 ms against 34 ms; `ar`'s prefill 0.21 s against 0.17 s).
        torch.set_num_threads(len(cpus))
    ctx = RoleContext(rank, role, dict(pipeline.ranks), ctrl, TensorChannel(ctrl, timeout_s=timeout_s), cfg, method,
                      timeout_s=timeout_s, idle_timeout_s=cfg.idle_timeout_s, startup_timeout_s=startup_timeout_s,
                      job_id=out.name, out=out)

    def on_sigterm(signum, frame):  # torchrun stops the survivors when a rank dies: say so, and where
        msg = f"{role} (rank {rank}) stopped by torchrun while on item {ctx.item_id or '-'}: another rank failed"
        get_logger().error("role_stopped", error=msg)
        say(msg)
        os._exit(1)

    def on_stop(signum, frame):  # under ./torchrun.sh: its launcher names who failed, or says the job was stopped
        note(rank, item=ctx.item_id)  # the launcher's line says what the target was on
        os._exit(128 + signum)

    if launch_dir() is not None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, on_stop)
    else:
        signal.signal(signal.SIGTERM, on_sigterm)
    return ctx


def import_role(role: str) -> None:
    """Import what `role` runs, before the rendezvous: the model stack (torch's and transformers', ~3 s a process
    on a slow core) only in the ranks that load a model, so the pruner and the ranks a method leaves idle start in
    about a second; and an import's seconds pass before the process group exists, never while a peer waits."""
    if role == "target":
        import vpsd.launch.job  # noqa: F401
    elif role == FOLLOWER:
        import vpsd.models.registry  # noqa: F401
    elif role == "draft":
        import vpsd.models.registry  # noqa: F401
        import vpsd.roles.draft  # noqa: F401
    else:
        import vpsd.roles.pruner  # noqa: F401


def run_role(ctx: RoleContext, args: argparse.Namespace, out: Path, layout: Layout, pipeline: Pipeline,
             leader_secret: str | None, target_group=None) -> None:
    """The role's work (and in the leader's process, the job's coordinator); a silent peer, a coordinator that
    failed or a full disk ends the rank with one line."""
    cfg, role, rank = ctx.config, ctx.role, ctx.rank
    try:  # each branch's modules were imported by import_role: these only bind their names
        if role == "target":
            from vpsd.launch.job import CoordinatorLink, run_pipeline

            coordinator = None
            if leader_secret is not None and args.serving is not None:
                coordinator = serve_http(args.serving, cfg, layout, leader_secret, ctx.startup_timeout_s, args.cores)
            elif leader_secret is not None and os.environ.get(SERVED) != "1":
                coordinator = Coordinator(layout, args, cfg, ctx.method.name, out, leader_secret)
                coordinator.start()
            link = CoordinatorLink(ctx, pipeline.index, layout.coordinator, served=os.environ.get(SERVED) == "1")
            run_pipeline(ctx, cfg, link, len(layout.pipelines), target_group)
            if coordinator is not None:
                coordinator.result()
        elif role == "draft":
            from vpsd.models.registry import load_adapter
            from vpsd.roles.draft import run_draft

            with doing(START):  # its peers wait on it for up to the start-up bound
                draft = load_adapter(cfg.family, cfg.draft or cfg.target)
            run_draft(ctx, draft)
        else:
            from vpsd.roles.pruner import run_pruner

            run_pruner(ctx)
    except (RoleFailure, PeerTimeout) as e:
        peer_failed(ctx, e)
    except RuntimeError as e:
        # A peer that died mid-transfer (gloo: "Connection closed by peer"): under ./torchrun.sh its launcher names
        # the dead rank and how it died, so this rank's traceback would only bury that line.
        if launch_dir() is None or not any(words in str(e) for words in PEER_GONE):
            raise
        get_logger().error("role_failed", error=str(e))
        note(rank, item=ctx.item_id, said=f"{role} (rank {rank}): a peer's connection closed while on item "
                                          f"{ctx.item_id or '-'} ({str(e).splitlines()[0][:200]})")
        os._exit(2)
    except OSError as e:
        if e.errno not in FULL:
            raise
        # A full disk: the results and traces end on whole lines (vpsd/storage.py); say so once, plainly.
        msg = str(e) if isinstance(e, DiskFull) else f"no space left on the device of {out}: {e}"
        say(f"{role} (rank {rank}): {msg}")
        os._exit(2)


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # torch.distributed's words (gloo)


def peer_failed(ctx: RoleContext, e: RoleFailure | PeerTimeout) -> None:
    """A peer silent, stuck or gone: said in one line (by ./torchrun.sh's launcher, from this rank's record, unless
    a peer died: then it names that one), the silent peer killed when on this host; the rank ends."""
    role, rank = ctx.role, ctx.rank
    silent = e.silent_rank if isinstance(e, RoleFailure) else e.rank
    msg = str(e) if isinstance(e, RoleFailure) else f"{role} (rank {rank}) {e} while on item {ctx.item_id or '-'}"
    get_logger().error("role_failed", error=msg)
    if launch_dir() is not None:
        note(rank, item=ctx.item_id, said=msg)
    else:
        say(msg)
    if silent is not None:
        try:  # a stopped rank would hold torchrun 30 s past this report
            if end_silent_peer(ctx.ctrl.peer_record(silent)):
                note(silent, ended_by=f"{role} (rank {rank})")
        except Exception:  # noqa: BLE001 - the report above is what matters; never mask it
            pass
    os._exit(2)  # a peer is gone: do not wait for it in a collective or a socket linger


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: everything the rank wrote is whole and flushed by then (results
    and traces are whole lines, vpsd/storage.py; the trace file is closed here), and torch's native teardown
    after a job held each rank ~2 s past its last line (measured on this 2-core machine: the main thread in no
    Python frame, every Python thread gone), which every job and every test of one paid."""
    close_tracing()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())

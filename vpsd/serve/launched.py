"""`vpsd serve` under torchrun: the launch's pipelines answer HTTP, served from the leader's process (rank 0).

    ./torchrun.sh serve --config C --method hippo [vpsd serve's options]      (NPROC ranks a node: its pipelines)

What a multi-GPU (or multi-node) layout needs and `vpsd serve`'s child ranks cannot give: several pipelines, each
on GPUs of its own, and a target split over ranks on more than one node. Every rank runs its role as in a job
(launch/entry.py), its target served (launch/job.py: each round's tokens reported, cancels taken). In the leader's
process, in place of the job's coordinator, a thread of its own (`LaunchedServer`) coordinates the pipelines
(launch/served.py `ServedPipelines`, over the control plane as rank `world`) through the Python API's on-ranks
path (`vpsd.LLM(..., ranks=...)`) and answers HTTP with them, exactly as `vpsd serve` does with child ranks
(serve/cli.py, serve/app.py, serve/on_ranks.py): an item goes to whichever pipeline asks first.

Departures from `vpsd serve` on one machine, because torchrun owns the ranks:
- the ranks' sampling settings (temperature and filters) are the launch's (its config, `--set`): a request with
  others is refused (400), where child ranks would be started again for it;
- a rank that dies ends the launch (torchrun stops every rank), instead of failing its requests and restarting;
  `./torchrun.sh --max-restarts N serve ...` starts it again;
- SIGTERM or Ctrl-C to `./torchrun.sh` stop it as they stop `vpsd serve`: the port closes, the requests in flight
  finish within --shutdown-timeout, the pipelines end as a job's do, exit 0. Every other rank ignores the signal
  and leaves when its pipeline ends;
- paths (a local video, a data: URL's scratch copy, frames in memory) are read by the target of whichever
  pipeline takes the request: on several nodes they must be on a file system every node mounts at the same path
  (`--allowed-media-dir`, and `--trace-dir`, where the scratch copies go).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Callable

from vpsd.config import RunConfig
from vpsd.launch.arguments import refuse
from vpsd.launch.layout import Layout
from vpsd.launch.rank_records import note
from vpsd.launch.say import say
from vpsd.launch.served import ServedPipelines
from vpsd.serve.cli import _refusal, _serve, parse_args
from vpsd.tracing import get_logger
from vpsd.transport.control import ControlChannel
from vpsd.transport.startup import rendezvous_store

SERVED_IDLE_S = 365 * 24 * 3600.0  # a served rank waits for the next request as long as the launch lives


def job_argv(argv: list[str], launch_dir: Path | None) -> tuple[argparse.Namespace, list[str]] | int:
    """`vpsd serve`'s options as the job's command line for every rank (its items come from the server, so an
    empty manifest where the ranks write: `serve_dir`), and the options; or the exit status of a refusal (said)."""
    try:
        args = parse_args(argv)
    except SystemExit as e:  # said by argparse (./torchrun.sh's launcher parses them first, once)
        return int(e.code or 0)
    api_key = args.api_key or os.environ.get("VPSD_API_KEY") or None
    if (problem := _refusal(args, api_key)) is not None:
        return refuse([f"serve: {problem}"])  # said once, by rank 0; ./torchrun.sh exits 2
    args.api_key = api_key
    out = serve_dir(args.trace_dir, launch_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "served.jsonl"
    manifest.touch()
    job = ["--config", args.config, "--manifest", str(manifest), "--out", str(out), "--method", args.method,
           "--batch", str(args.batch), "--quiet", "--set", f"idle_timeout_s={SERVED_IDLE_S}"]
    for flag, value in (("--pruning", args.pruning), ("--ratio", args.ratio), ("--gamma", args.gamma)):
        if value is not None:
            job += [flag, str(value)]
    for setting in args.set:
        job += ["--set", setting]
    return args, job


def serve_dir(trace_dir: Path | None, launch_dir: Path | None) -> Path:
    """Where the launch's ranks write (traces, the empty manifest): --trace-dir, else the launch's own directory,
    else one named by torchrun's run id (the same on every rank of the launch)."""
    if trace_dir is not None:
        return Path(trace_dir)
    if launch_dir is not None:
        return launch_dir / "serve"
    return Path(tempfile.gettempdir()) / f"vpsd-serve-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}"


class LaunchedServer:
    """The HTTP server and the pipelines' coordinator, on a thread of the leader's process (module docstring)."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig, layout: Layout, secret: str, startup_timeout_s: float,
                 cores: set[int]) -> None:
        """cfg: the launch's checked settings (every rank's); cores: where this thread may run (the process's
        cores before the target's own pinned it: HTTP and JSON on the target's core would slow its rounds)."""
        self.args, self.cfg, self.layout, self.secret = args, cfg, layout, secret
        self.startup_timeout_s, self.cores = startup_timeout_s, cores
        self.failure: BaseException | None = None
        self._stop: Callable[[int], None] | None = None
        self._asked_to_stop: int | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="vpsd-serve", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, signum: int) -> None:
        """A stop signal (the main thread's handler): the server shuts down as `vpsd serve` does on it."""
        with self._lock:
            self._asked_to_stop = signum
            stop = self._stop
        if stop is not None:
            stop(signum)

    def _started(self, stop: Callable[[int], None]) -> None:
        with self._lock:
            self._stop = stop
            asked = self._asked_to_stop
        if asked is not None:  # a signal came while the pipelines started
            stop(asked)

    def result(self) -> None:
        """Waits for the server's end (the pipelines have ended by then); a failure is said in one line and ends
        the rank (exit 2: torchrun stops the others)."""
        self._thread.join()
        if self.failure is not None:
            self._fail()

    def _main(self) -> None:
        import vpsd

        args, layout = self.args, self.layout
        os.sched_setaffinity(0, self.cores)  # this thread only
        # A data: URL's copy, frames in memory: read by whichever pipeline's target takes the request.
        scratch = Path(tempfile.mkdtemp(prefix="vpsd-serve-scratch-", dir=args.trace_dir))
        try:
            ctrl = ControlChannel(layout.coordinator, layout.world + 1, "coordinator", rendezvous_store(),
                                  secret=self.secret, connect_timeout_s=self.startup_timeout_s)
            pipelines = ServedPipelines(args.method, len(layout.pipelines))
            try:
                pipelines.attach(ctrl, self.startup_timeout_s)
            except BaseException:
                pipelines.kill()
                raise
            llm = vpsd.LLM(self.cfg, method=args.method, ranks=pipelines)
            try:
                if self._asked_to_stop is None:
                    n = len(layout.pipelines)
                    _serve(args, llm, args.api_key, scratch, started=self._started,
                           how=f"{n} pipeline{'s' if n > 1 else ''} under torchrun, continuous batching")
            finally:
                llm.close()  # the pipelines' end, as a job's: every target reports its run and leaves
        except BaseException as e:  # noqa: BLE001 - the launch cannot serve: said, and the rank ends
            self.failure = e
            get_logger().error("serve_failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            shutil.rmtree(scratch, ignore_errors=True)
            self._fail()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _fail(self) -> None:
        """One line, and the rank ends (exit 2): torchrun stops the others (the pipelines would wait for ever),
        which ./torchrun.sh's launcher is told are not the cause (they ignore its SIGTERM, and are killed)."""
        say(f"serve: {type(self.failure).__name__}: {self.failure}")
        for rank in range(self.layout.world):
            note(rank, ended_by="vpsd serve's failure")
        os._exit(2)

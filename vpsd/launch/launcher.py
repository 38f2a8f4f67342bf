"""./torchrun.sh's own process: torchrun's agent, run in this process, and what the job says as a whole.

    ./torchrun.sh [torchrun options] run --config C --manifest M --out DIR [...]   (it execs this module)
    ./torchrun.sh [torchrun options] serve --config C [--method M] [...]          (vpsd serve on the launch's ranks)

The launcher's pid is the agent's, so whatever a user, a supervisor or a scheduler sends that pid reaches the
process that owns the ranks (a shell script waiting on torchrun defers its traps until torchrun ends, and dies
alone on SIGTERM, leaving the job running).

Contract:
- Stopped: SIGINT, SIGTERM or SIGHUP, to this process alone or to its whole group (Ctrl-C, `kill PID`,
  `Popen.terminate()`, a closed terminal, SLURM's SIGTERM before its SIGKILL), stop the job: the agent forwards the
  signal to every rank, each leaves at once (results are whole lines, vpsd/storage.py), and one still running
  after `SHUTDOWN_S` is killed. Then one line says what is kept, and the launcher exits 128 + the signal (130,
  143, 129), as the shells do. The lock on --out dies with the target rank, so the same command resumes.
  SIGKILL cannot be caught: the ranks then die with their parent (launch/lifetime.py `die_with_parent`).
- Failed: a rank that ends the job is named in one line by role, rank, node and how it ended (its signal or exit
  code), with the item the target was on and the results kept; exit 1. Where no rank died but one found a peer
  silent or stuck, that rank's line is said (from its record) instead; a rank that said why itself (exit 2: a
  full disk, a start-up bound) is not named again.
- Refused: exit 2 with vpsd's lines alone. A busy --out is refused here before any rank starts; a rank that
  refuses leaves the mark `arguments.REFUSAL_MARK` in this launch's directory.
- Otherwise 0, or 3 when the finished job has failed items (its summary's status).

Why the agent runs in this process: it holds each rank's end as data (`ChildFailedError.failures`: global rank ->
exit code, negative for a signal), where wrapping the `torchrun` command would mean parsing its log block, whose
wording changes between torch versions. The roles behind the ranks come from the records the ranks leave in this
launch's directory (launch/rank_records.py), which is removed at the end with torchrun's log directory (after a
SIGKILL, by the next launch): launch/torchrun.py's, the one every torchrun launch of vpsd's gets.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from vpsd.launch.lifetime import out_dir_holder
from vpsd.launch.rank_records import LAUNCH_DIR, RankRecord, read_records
from vpsd.launch.say import say
from vpsd.launch.torchrun import launch_directory, with_log_dir

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SHUTDOWN_S = 5  # a rank that has not left this long after the stop signal is killed (torchrun --shutdown-timeout)
SAID_WHY = 2  # a rank's exit status when it has said why it ends (entry.py): the launcher adds nothing
FAILED = 1


class Stopped(Exception):
    """The launcher got one of STOP_SIGNALS."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def main(argv: list[str]) -> int:
    for sig in STOP_SIGNALS:  # until torchrun's agent installs its own (which forward the signal to the ranks)
        signal.signal(sig, _raise_stopped)
    at = next((i for i, a in enumerate(argv) if a in ("run", "serve")), None)
    if at is None:
        print("usage: ./torchrun.sh [torchrun options] run --config C --manifest M --out DIR [...] (run --help)\n"
              "       ./torchrun.sh [torchrun options] serve --config C [--method M] [...]   (serve --help)",
              file=sys.stderr)
        return 2
    torchrun_opts, job = list(argv[:at]), list(argv[at + 1:])
    serving = argv[at] == "serve"
    shutdown = SHUTDOWN_S
    if serving:
        from vpsd.serve.cli import parse_args as serve_args

        try:  # --help or a bad option said once, here, before any rank starts
            # The ranks get the server's grace to finish the requests in flight, then their pipelines end.
            shutdown = int(serve_args(job).shutdown_timeout) + 30
        except SystemExit as e:
            return int(e.code or 0)
        job = ["serve", *job]
    elif any(a in ("-h", "--help") for a in job):  # answered once, by this process, before any rank starts
        from vpsd.launch.arguments import parse_args

        parse_args(["--help"])
    out = None if serving else out_dir(job)
    single_node = not any("--nnodes" in o or "--rdzv" in o for o in torchrun_opts)
    if single_node and out is not None and (busy := out_dir_holder(out)) is not None:
        say(busy)  # at once: no rank started for a directory another job holds (the rank's lock still decides)
        return 2
    if not serving and ("--method=auto" in job or ["--method", "auto"] in map(list, zip(job, job[1:]))):
        from vpsd.bench.tune import for_job  # --method auto on a config not tuned yet: tuned on its first items first

        job = for_job(job, out)
        if isinstance(job, int):
            return job
    try:
        with launch_directory() as directory:  # removed as the launch ends (after a SIGKILL: by the next launch)
            return launch(torchrun_opts, job, out, single_node, directory, shutdown)
    except Stopped as s:
        if serving:  # the leader's server shut down as `vpsd serve` does, and every rank left with it
            say(f"serve: stopped by {signal.Signals(s.signum).name}")
            return 0
        return stopped(s.signum, out)


def launch(torchrun_opts: list[str], job: list[str], out: Path | None, single_node: bool, directory: Path,
           shutdown_s: int = SHUTDOWN_S) -> int:
    """shutdown_s: how long the ranks get to leave after a stop signal (a job's leave at once)."""
    from vpsd.launch.arguments import REFUSAL_MARK  # with the model stack's imports (seconds): after the lock check

    os.environ[LAUNCH_DIR] = str(directory)
    mark = directory / "refused"
    if single_node:
        torchrun_opts = ["--standalone", *torchrun_opts]
        # One node: a fresh secret for this job alone (ranks inherit it; other users cannot read it).
        os.environ.setdefault("VPSD_JOB_SECRET", os.urandom(32).hex())
        # A rank that refuses to start (bad settings, an --out holding another job) says why and marks this file:
        # the launcher then exits 2. One node only: there every rank reads the same files and refuses alike.
        os.environ[REFUSAL_MARK] = str(mark)
    if not any(o.startswith(("--shutdown-timeout", "--shutdown_timeout")) for o in torchrun_opts):
        torchrun_opts += ["--shutdown-timeout", str(shutdown_s)]
    if os.environ.get("LOG_RANK"):
        torchrun_opts += ["--local-ranks-filter", os.environ["LOG_RANK"]]
    # torchrun keeps a log directory per launch and never removes it: ours goes with this launch's directory.
    failures = run_torchrun(with_log_dir([*torchrun_opts, "--nproc-per-node", os.environ.get("NPROC", "3"),
                                          "-m", "vpsd.launch.entry", *job], directory))
    if mark.exists():
        return 2  # refused: said by the ranks, in vpsd's lines alone
    if failures is not None:
        for line in failure_lines(failures, read_records(directory), out):
            say(line)
        return FAILED
    if out is not None and (out / "summary.json").is_file():
        from vpsd.reports.summary import main as summary

        return summary([str(out), "--status"])  # 3 when some items failed
    return 0


def run_torchrun(args: list[str]) -> dict[int, int] | None:
    """torchrun's agent on `args`, in this process: None when every rank exited 0, else the exit code of each rank
    that failed first (negative: killed by that signal), by global rank. Stopped if a stop signal came."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(args))
    except SignalException as e:  # the agent forwarded it to the ranks and waited for them (SHUTDOWN_S at most)
        raise Stopped(int(e.sigval)) from None
    except ChildFailedError as e:
        return {rank: failure.exitcode for rank, failure in e.failures.items()}
    finally:
        for sig in STOP_SIGNALS:  # torchrun's handlers raise its exception: ours for what is left
            signal.signal(sig, _raise_stopped)
    return None


def stopped(signum: int, out: Path | None) -> int:
    """The one line a stopped job says (the same for Ctrl-C as it always was), and the shells' status for it."""
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    where = f"the items finished are kept in {out}; " if out is not None else ""
    say(f"{what}: {where}rerun the same command to do the rest")
    return 128 + signum


def failure_lines(failures: dict[int, int], records: dict[int, RankRecord], out: Path | None) -> list[str]:
    """What a failed job says, in one line: the rank that died of a signal of its own (SIGKILL, SIGSEGV ...), else
    one that exited with an error of its own; else what a rank that found a peer silent or stuck would have said
    (its record); else nothing (a rank said why itself: exit 2); else the ranks someone stopped one by one.

    torchrun reports every rank that ended non-zero, and when one dies its peers end too: by the agent's stop
    signal (it stops the survivors; their handlers exit 128 + it), or first, on a send that fails. The one that
    died is the cause, and the one named."""
    def ranked(keep) -> dict[int, int]:
        return {r: code for r, code in failures.items() if keep(code)
                and not (r in records and (records[r].said or records[r].ended_by))}

    stop_codes = {128 + s for s in STOP_SIGNALS} | {-s for s in STOP_SIGNALS}
    for cause in (ranked(lambda c: c < 0 and c not in stop_codes),
                  ranked(lambda c: c > 0 and c not in stop_codes and c != SAID_WHY)):
        if cause:
            return [failure_line(cause, records, out)]
    said = [r.said for _, r in sorted(records.items()) if r.said]
    if said or any(code == SAID_WHY for code in failures.values()):
        return said[:1]
    return [failure_line(failures, records, out)]


def failure_line(failures: dict[int, int], records: dict[int, RankRecord], out: Path | None) -> str:
    """`draft (rank 1, node 0) was killed by SIGKILL while the target was on item X; 4 results kept in OUT; ...`"""
    named = " and ".join(f"{who(rank, records.get(rank))} {how(code)}" for rank, code in sorted(failures.items()))
    targets = [r for r in records.values() if r.role == "target" and r.item is not None]
    pipelines = {records[r].pipeline for r in failures if r in records}
    item = next((t.item for t in targets if t.pipeline in pipelines), targets[0].item if targets else None)
    line = named + (f" while the target was on item {item}" if item is not None else "")
    if out is not None:
        line += f"; {kept(out)} results kept in {out}; rerun the same command to do the rest"
    return line


def who(rank: int, record: RankRecord | None) -> str:
    if record is None:  # it died before it knew its role
        return f"rank {rank}"
    return f"{record.role} (rank {rank}, node {record.node})"


def how(code: int) -> str:
    if code < 0:
        return f"was killed by {_signal_name(-code)}"
    if code - 128 in STOP_SIGNALS:  # a rank's own stop handler (entry.py): someone signalled that rank alone
        return f"was stopped by {_signal_name(code - 128)}"
    return f"exited with code {code}"


def kept(out: Path) -> int:
    try:
        with open(out / "results.jsonl", "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def out_dir(job: list[str]) -> Path | None:
    for i, a in enumerate(job):
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1])
        if a == "--out" and i + 1 < len(job):
            return Path(job[i + 1])
    return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

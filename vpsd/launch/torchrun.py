"""torchrun that leaves nothing behind: every launch vpsd makes (./torchrun.sh's launcher, the benches' jobs, the
tests' jobs) goes through here.

    python -m vpsd.launch.torchrun [torchrun's arguments]     (what `torchrun_command(...)` runs)

torchrun's agent writes its ranks' error files (and any redirected output) under a log directory, by default a
fresh `tempfile.mkdtemp(prefix="torchelastic_")` per launch that it never removes: one more /tmp/torchelastic_*
for every job, bench row and test. Here each launch gets a directory of its own in the temporary directory,
`LAUNCH_DIR_PREFIX` + this process's pid + a suffix, torchrun's log directory inside it (`with_log_dir`), and the
directory goes when the launch ends, whatever way: done, a rank failed, a stop signal. A SIGKILLed launch cannot
remove its own: the next launch of this user removes those whose process is gone (`remove_orphaned_launch_dirs`).
A log directory the caller names (`--log-dir`, or torchrun's PET_LOG_DIR) is theirs: used as is, and kept.

`python -m vpsd.launch.torchrun` is `python -m torch.distributed.run` otherwise: the same agent in the same
process (its pid is the agent's: signals to it reach the ranks), the same output and exit status.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

LAUNCH_DIR_PREFIX = "vpsd-launch."  # + the launching process's pid + "." + mkdtemp's suffix, in the temporary directory
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def torchrun_command(*args: str) -> list[str]:
    """The command line of a torchrun launch on `args` (torchrun's options, then the script or `-m MODULE` and its
    arguments) that leaves nothing behind."""
    return [sys.executable, "-m", "vpsd.launch.torchrun", *args]


@contextlib.contextmanager
def launch_directory() -> Iterator[Path]:
    """A directory of this launch's own in the temporary directory, removed when the block ends, however it ends
    (after removing those of launches that were SIGKILLed)."""
    remove_orphaned_launch_dirs()
    # Stop signals wait (pending) from before the directory is made until the `try` that removes it, and while it
    # is removed: one between mkdtemp and the `try`, or a second one cutting the removal short, would leave it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        directory = Path(tempfile.mkdtemp(prefix=f"{LAUNCH_DIR_PREFIX}{os.getpid()}."))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        yield directory
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        shutil.rmtree(directory, ignore_errors=True)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def with_log_dir(args: list[str], directory: Path) -> list[str]:
    """torchrun's arguments `args` with its log directory in `directory` (so that it goes with it), unless they or
    the environment (PET_LOG_DIR) name one."""
    from torch.distributed.run import parse_args

    if parse_args(list(args)).log_dir is not None:
        return list(args)
    return ["--log-dir", str(directory / "torchrun"), *args]


def remove_orphaned_launch_dirs() -> None:
    """A SIGKILLed launch cannot remove its directory: the next launch of this user removes those whose launching
    process is gone, so that jobs leave nothing outside --out."""
    for path in Path(tempfile.gettempdir()).glob(f"{LAUNCH_DIR_PREFIX}*.*"):
        try:
            pid = int(path.name[len(LAUNCH_DIR_PREFIX):].split(".")[0])
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, OSError):
            continue  # not one of ours, or its launch lives (a pid of another user: PermissionError)


class _Signalled(BaseException):
    """SIGTERM or SIGHUP before torchrun's agent handles them itself (as it starts its ranks)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum: int, frame) -> None:
    raise _Signalled(signum)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGTERM, signal.SIGHUP):  # SIGINT raises KeyboardInterrupt already
        if signal.getsignal(sig) is signal.SIG_DFL:  # one the caller ignores (nohup) stays ignored
            signal.signal(sig, _raise_signalled)
    try:
        with launch_directory() as directory:
            from torch.distributed.run import main as torchrun

            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

            try:
                torchrun(with_log_dir(argv, directory))
            except ChildFailedError:
                # torchrun's agent has printed its failure summary (the rank, its exit code, its error file); a
                # traceback of this wrapper on top would read as a fault of vpsd's own.
                raise SystemExit(1) from None
    except _Signalled as s:  # the directory is gone: end as the signal would have ended torchrun
        signal.signal(s.signum, signal.SIG_DFL)
        os.kill(os.getpid(), s.signum)


if __name__ == "__main__":
    main()

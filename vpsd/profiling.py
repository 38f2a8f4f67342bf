"""Where a round's time goes where it really runs: torch's profiler over a job's rounds (`profile_rounds: N`).

`vpsd bench steps --profile` times a forward alone in its own process; in a job the same forward
shares its process with the rank's other threads (video prefetch, the control plane's I/O, heartbeats, the
prefill-ahead thread, a draft thread), and on one GPU with other ranks. `RoundProfile` profiles N consecutive
rounds of a running job (after `skip` rounds: graphs captured, caches warm) and writes, beside the rank's trace:
    traces/profile_rank{r}_{role}.json           the profiler's Chrome trace (ui.perfetto.dev)
    traces/profile_rank{r}_{role}.summary.json   the split below, per round, and the ops that cost most
The split (`split_events`, also step_cost's): `device` the kernels' own time (on a CPU, the aten ops' own CPU
time), `launch` CPU time in the CUDA runtime's launch calls, `host_wait` in synchronisations and blocking copies,
and `other` = wall - device - launch - host_wait where the ops run on the CPU, wall - launch - host_wait on a GPU:
Python, dispatch, and time the round's thread did not hold the GIL. `other` far above the rest on a GPU says
the step is the CPU's (capture it; or find the thread that holds the GIL), `host_wait` says a sync crept in.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from vpsd.tracing import get_logger

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemsetAsync")
WAIT_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cudaStreamWaitEvent")


@dataclass
class Split:
    """Seconds, summed over what was profiled."""

    device_s: float
    launch_s: float
    host_wait_s: float
    aten_ops: int
    top: list[dict[str, Any]]  # the ops that cost most: name, calls, self CPU s, device s


def split_events(events: Any, cuda: bool, top: int = 10) -> Split:
    """The split of the module docstring from a profiler's `key_averages()`."""
    if cuda:
        device = sum(e.self_device_time_total for e in events) / 1e6
    else:  # the ops' own time is the CPU's kernels
        device = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e6
    launch = sum(e.self_cpu_time_total for e in events if e.key in LAUNCH_CALLS) / 1e6
    wait = sum(e.self_cpu_time_total for e in events if e.key in WAIT_CALLS) / 1e6
    aten = [e for e in events if e.key.startswith("aten::")]
    costly = sorted(aten, key=lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total, reverse=True)
    return Split(device, launch, wait, sum(e.count for e in aten),
                 [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
                   "device_s": e.self_device_time_total / 1e6 if cuda else None} for e in costly[:top]])


class RoundProfile:
    """Profiles rounds `skip + 1` to `skip + rounds` of this rank's loop; `step()` after each round."""

    def __init__(self, out: Path, role: str, rank: int, rounds: int, cuda: bool, skip: int = 5) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.out, self.role, self.rank, self.rounds, self.cuda = Path(out), role, rank, rounds, cuda
        self._count, self._t0, self._wall = 0, 0.0, 0.0
        self._skip = skip
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities, schedule=schedule(wait=skip, warmup=1, active=rounds, repeat=1),
                             on_trace_ready=self._write)
        self._prof.start()
        self.done = False

    def step(self) -> None:
        """One round ended."""
        if self.done:
            return
        self._count += 1
        now = time.perf_counter()
        if self._count == self._skip + 1:  # the warm-up round ended: the active rounds start
            self._t0 = now
        elif self._count == self._skip + 1 + self.rounds:
            self._wall = now - self._t0
        self._prof.step()

    def close(self) -> None:
        if not self.done:
            self._prof.stop()
            self.done = True

    def _write(self, prof: Any) -> None:
        self.done = True
        name = f"profile_rank{self.rank}_{self.role}"
        path = self.out / "traces"
        path.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path / f"{name}.json"))
        split = split_events(prof.key_averages(), self.cuda)
        wall = self._wall or float("nan")
        other = wall - split.launch_s - split.host_wait_s - (0.0 if self.cuda else split.device_s)
        summary = {"rounds": self.rounds, "wall_s": wall, "other_s": other, **asdict(split),
                   "per_round_ms": {k: 1e3 * v / self.rounds for k, v in (("wall", wall), ("device", split.device_s),
                                    ("launch", split.launch_s), ("host_wait", split.host_wait_s), ("other", other))},
                   "aten_ops_per_round": split.aten_ops / self.rounds}
        (path / f"{name}.summary.json").write_text(json.dumps(summary, indent=1))
        get_logger().info("profile_done", path=str(path / f"{name}.summary.json"), **summary["per_round_ms"])

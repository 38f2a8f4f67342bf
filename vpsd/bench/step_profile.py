"""Where a step's time goes (`vpsd bench steps --profile`): kernels, launches, host waits, ops.

For one prefilled item (as step_cost prefills it) and each width k (1: a decode step; gamma + 1: a verify), the
model's eager forward of k tokens is run `steps` times and split four ways:
    wall        a forward, timed on its own (the device settled before and after)
    device      the kernels' own time (the profiler's device time; on a CPU the ops' own CPU time)
    launch      CPU time in the CUDA runtime's launch calls (on a CPU: none)
    host wait   CPU time in synchronisations and blocking copies (on a CPU: none)
and counted (models/dispatch.py): aten ops a forward, a decoder layer's share of them, host reads; for k = 1
also transformers' own generate() step on the same model and input, its ops and host reads, the reference
vpsd's eager step should not exceed. wall >> device + launch says the time is the CPU's between launches:
Python, the framework's dispatch, or another thread holding the GIL (the profile runs with the process's other
threads as they are: run it inside a job's rank to see theirs).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from vpsd.models.base import DecodeState, VideoLMAdapter
from vpsd.models.dispatch import audit
from vpsd.models.timing import settled_clock
from vpsd.profiling import split_events

@dataclass
class StepProfile:
    model: str
    width: int
    context: int
    wall_ms: float
    device_ms: float
    launch_ms: float
    host_wait_ms: float
    ops: int  # aten ops a forward
    ops_per_layer: float
    host_reads: int
    hf_ops: float | None = None  # transformers generate()'s decode step, width 1 only
    hf_host_reads: float | None = None
    hf_wall_ms: float | None = None


def profile_steps(name: str, adapter: VideoLMAdapter, state: DecodeState, width: int, steps: int,
                  hf_inputs: dict | None = None) -> StepProfile:
    """The split of the module docstring for `steps` forwards of `width` tokens after `state` (rolled back after)."""
    ids = torch.full((width,), 11, dtype=torch.long)
    start = state.length
    adapter.step(state, ids)  # warm
    adapter.rollback(state, start)
    walls = []  # the median of 3 runs of `steps`, as generate_step's own (the 10% goal compares the two)
    for _ in range(3):
        t0 = settled_clock(adapter.device)
        for _ in range(steps):
            adapter.step(state, ids)
        walls.append((settled_clock(adapter.device) - t0) / steps)
        adapter.rollback(state, start)
    wall = statistics.median(walls)
    with audit() as seen:
        adapter.step(state, ids)
    adapter.rollback(state, start)
    device_s, launch_s, wait_s = _profiled(adapter, state, ids, steps)
    layers = adapter.model.config.get_text_config().num_hidden_layers
    out = StepProfile(name, width, start, 1e3 * wall, 1e3 * device_s, 1e3 * launch_s, 1e3 * wait_s, seen.num_ops,
                      seen.num_ops / layers, len(seen.host_reads))
    if width == 1 and hf_inputs is not None:
        out.hf_ops, out.hf_host_reads, out.hf_wall_ms = generate_step(adapter.model, hf_inputs, adapter.device)
    return out


def _profiled(adapter: VideoLMAdapter, state: DecodeState, ids: torch.Tensor, steps: int) -> tuple[float, float, float]:
    """(device, launch, host wait) seconds a forward, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = adapter.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = state.length
    with profile(activities=activities) as prof:
        for _ in range(steps):
            adapter.step(state, ids)
        settled_clock(adapter.device)
    adapter.rollback(state, start)
    split = split_events(prof.key_averages(), cuda)
    return split.device_s / steps, split.launch_s / steps, split.host_wait_s / steps


def generate_step(model: torch.nn.Module, inputs: dict, device: torch.device, n: int = 8,
                  repeats: int = 3) -> tuple[float, float, float]:
    """transformers generate()'s greedy decode step, eager, from runs n tokens apart: (aten ops, host reads, wall
    ms) a token. The wall time is what vpsd's eager step is held to (within 10% on a GPU, issue 43): each length's
    median of `repeats` runs, interleaved (both runs hold the prefill, whose noise a single pair of runs can make
    larger than the n steps between them: a negative step on a CPU)."""
    kwargs = dict(inputs, do_sample=False)
    counts, walls = [], {2: [], 2 + n: []}
    with torch.inference_mode():
        model.generate(**kwargs, max_new_tokens=2, min_new_tokens=2)
        for _ in range(repeats):
            for new in walls:
                t0 = settled_clock(device)
                model.generate(**kwargs, max_new_tokens=new, min_new_tokens=new)
                walls[new].append(settled_clock(device) - t0)
        for new in walls:
            with audit() as seen:
                model.generate(**kwargs, max_new_tokens=new, min_new_tokens=new)
            counts.append((seen.num_ops, len(seen.host_reads)))
    wall = statistics.median(walls[2 + n]) - statistics.median(walls[2])
    return (counts[1][0] - counts[0][0]) / n, (counts[1][1] - counts[0][1]) / n, 1e3 * wall / n


def format_profiles(rows: list[StepProfile]) -> str:
    lines = ["model   width  context   wall ms  device ms  launch ms  host wait ms   ops  ops/layer  host reads"
             "   transformers generate(): wall ms, ops (reads)"]
    for r in rows:
        hf = "" if r.hf_ops is None else f"{r.hf_wall_ms:>9.2f} {r.hf_ops:>6.0f} ({r.hf_host_reads:.0f})"
        lines.append(f"{r.model:<7} {r.width:>5} {r.context:>8} {r.wall_ms:>9.2f} {r.device_ms:>10.2f} "
                     f"{r.launch_ms:>10.2f} {r.host_wait_ms:>13.2f} {r.ops:>5} {r.ops_per_layer:>10.1f} "
                     f"{r.host_reads:>11}   {hf}")
    return "\n".join(lines)

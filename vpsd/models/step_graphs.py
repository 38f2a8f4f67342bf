"""Recorded steps: a traced language-model step recorded once a shape and cache bucket, then replayed.

Capture mode "cudagraphs" (models/captured.py). Why vpsd records its own graphs rather than use torch.compile's
`backend="cudagraphs"`: with dynamo inlining nn modules (its default since torch 2.5) that backend counts no input
of the graph as static (`torch._inductor.utils.num_fw_fixed_arguments` is 0 then), so torch's CUDA-graph trees
copy every input into graph-owned memory before each replay: every weight and both KV buffers of every layer, a
step, and a second copy of the weights held for good. The cache's in-place writes also leave the graph (the
backend keeps no input mutation): each step wrote whole buffers and copied them back. Seen here on the CPU (torch
2.13), calling that backend with its device check lifted: the tiny target's step recorded 65 inputs, 0 static; a
3B target would copy its 6 GB of weights a step, more than its step reads. Inductor's own modes
("reduce-overhead") count weights and marked buffers as static, but generate code for tens of seconds a graph.

So a step is recorded with `torch.cuda.CUDAGraph` around dynamo's trace of it (`backend="eager"`: one FX graph run
by the eager kernels, with no host read and no CPU tensor in it, which tests/models/test_captured.py checks on the
meta device for every family):
- the weights and the fixed cache's buffers are read and written where they are, in place (the cache's length is
  a tensor the graph reads: a rollback moves it in place, models/captured.py);
- each tensor argument (k token ids, their positions) has a copy the graph reads; a replay copies the call's
  tensors into them;
- the outputs are the graph's own memory, overwritten by the next replay: a replay returns clones, so a caller
  may keep a step's outputs past the next step;
- a shape's first call runs the trace itself (the real step: the warm-up torch asks for before a capture), then
  records it on a stream of the model's own, into one memory pool a model (`record`); recording runs nothing, so
  the cache is untouched. One recording at a time in a process, and no device synchronisation while one runs
  (`timing.RECORDING`): the draft records on its own thread (`draft_on: thread`).
- A recording that fails (an op CUDA refuses in a capture) leaves that shape to run the trace uncaptured, with a
  RuntimeWarning that says why (`CapturedLanguageModel.unrecorded`): a slow step, not a lost job.
- A recorded step's first replay (and its next one after any later recording into the model's pool) is checked
  against the trace it was recorded from, over the same cache entries; one that differs goes the same way
  (models/captured.py, "check"). A target verifies whatever it is given, so a draft graph that replays wrong
  costs only acceptance, silently (issue 60 item 2): the check is what says so.

Mode "trace" runs the same object with the graph replaced by the trace run over the copies: on a CPU, where
there are no CUDA graphs, every test of captured steps takes the path a GPU takes (copies in, clones out, one
recording a shape and bucket).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch._dynamo

from vpsd.models.timing import RECORDING


# Where a step's width k (the tokens it feeds) sits in each argument vpsd's steps pass (models/base.py, batch.py).
WIDTH_DIMS = {"input_ids": -1, "inputs_embeds": 1, "position_ids": -1, "attention_mask": -2}


def as_traced(inputs: dict[str, Any], copy: bool = False) -> dict[str, Any]:
    """The call's tensors as the trace takes them: contiguous (dynamo guards on strides: an expanded position
    tensor and its copy would be two traces; `copy`: always a copy, a recorded step's own), and, for a width
    above 1, that width marked dynamic, so that one trace serves every verify width (a graph is still recorded
    for each: recording is a forward, tracing a 28-layer model takes seconds, and `gamma: auto` verifies at up
    to 16 widths). Width 1 stays a trace of its own (dynamo specialises a size of 1)."""
    out = {name: (v.clone(memory_format=torch.contiguous_format) if copy else v.contiguous())
           if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}
    width = next((out[name].shape[WIDTH_DIMS[name]] for name in ("input_ids", "inputs_embeds")
                  if isinstance(out.get(name), torch.Tensor)), 1)
    if width > 1:
        for name, dim in WIDTH_DIMS.items():
            if isinstance(out.get(name), torch.Tensor):
                torch._dynamo.mark_dynamic(out[name], dim % out[name].dim())
    return out


def cloned(out: Any) -> Any:
    """A step's output with its tensors copied out of the graph's memory (a model output, tuple or tensor)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return type(out)(cloned(v) for v in out)
    if isinstance(out, dict):  # transformers' ModelOutput: an ordered dict of its set fields
        return type(out)(**{name: cloned(v) for name, v in out.items()})
    return out


class RecordedStep:
    """One step shape recorded: `__call__(inputs)` copies the call's tensors in, replays, returns clones."""

    def __init__(self, trace: Callable[..., Any], inputs: dict[str, Any], device: torch.device,
                 pool: Any = None, stream: Any = None) -> None:
        for name, v in inputs.items():
            if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
                raise ValueError(f"a recorded step takes tensors as arguments of their own, not in a list ({name})")
        self.trace = trace
        self.inputs = as_traced(inputs, copy=True)
        self.tensors = [(name, v) for name, v in self.inputs.items() if isinstance(v, torch.Tensor)]
        self.graph: Any = None
        self.outputs: Any = None
        if device.type == "cuda":
            self.graph, self.outputs = record(trace, self.inputs, device, pool, stream)

    def __call__(self, inputs: dict[str, Any]) -> Any:
        for name, static in self.tensors:
            static.copy_(inputs[name])
        if self.graph is not None:
            self.graph.replay()
        else:  # "trace": the recorded ops run by the eager kernels over the same copies, into outputs of fixed
            out = self.trace(**self.inputs)  # addresses as a graph's are (so a caller holding them would see it)
            self.outputs = out if self.outputs is None else overwritten(self.outputs, out)
        return cloned(self.outputs)


def record(trace: Callable[..., Any], inputs: dict[str, Any], device: torch.device, pool: Any,
           stream: Any) -> tuple[Any, Any]:
    """`trace(**inputs)` recorded as a CUDA graph on `stream` into `pool` (nothing runs); (graph, its outputs).

    `torch.cuda.graph` does the same after synchronising the device and emptying the allocator's caches at every
    recording (and in some releases a full `gc.collect()`: tens to hundreds of ms, with dozens of graphs a model,
    a step width and bucket each); here the capture stream waits for the caller's stream instead, which is all
    the recorded work reads, and the rank's other threads keep their cached memory.
    "thread_local": the checks of what may not run during a capture apply to this thread alone, so the rank's
    other threads (the draft's, the prefill's) go on."""
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream(device)
    with RECORDING:
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = trace(**inputs)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is invalid already: its own error says less
                    graph.capture_end()
                raise
            graph.capture_end()
        caller.wait_stream(stream)
    return graph, outputs


def overwritten(held: Any, new: Any) -> Any:
    """`held`'s tensors overwritten in place by `new`'s (what a replay does to a graph's outputs); `held`."""
    if isinstance(held, torch.Tensor):
        held.copy_(new)
    elif isinstance(held, (tuple, dict)):
        for a, b in zip(held.values() if isinstance(held, dict) else held,
                        new.values() if isinstance(new, dict) else new):
            overwritten(a, b)
    return held

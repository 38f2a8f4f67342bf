"""Captured steps: a batch-1 decode step or verify as one compiled graph over a preallocated KV cache.

On a GPU an eager transformers step of a 3B model is mostly Python and kernel launches (measured on an H200,
2026-11-26: 59 ms a step where its weights read in ~1.2 ms; docs/benchmarks.md, "On a GPU"), which inflates
every forward alike and squeezes the cost ratio c = T_p / T_q toward the ratio of layer counts (App. C: the
speedup's ceiling falls with c). Captured, a step is one CUDA-graph replay (`capture: cudagraphs`, recorded by
models/step_graphs.py; or inductor's `reduce-overhead`), so a forward costs what it reads and c returns to the
models' size ratio.

A graph needs fixed shapes and fixed addresses, which vpsd's growing cache (models/kv_cache.py) gives up by
design. So a captured model keeps `FixedCache`s (transformers' StaticCache layout: the whole buffer is attended
to, the entries past the length masked) in a few bucket sizes up to `capture_len` (`FixedCacheLease`), reused by
every item it decodes:

    adopt    a batch-1 prefill's cache is copied into the smallest bucket that holds it (once an item; the
             prefill itself, of any length, stays eager; a row that outgrows its bucket moves up one)
    step     k tokens through the captured language model: a recorded graph a distinct k and bucket, from two
             traces a bucket (a decode step's, and one for every verify width: models/step_graphs.py), none
             traced again as the cache fills or rolls back (its length is a tensor)
    check    a graph's first replay is checked against the trace it was recorded from: the step is cropped
             back and run again uncaptured, and a replay that differs (a CUDA graph fed stale inputs,
             holding stale outputs, or corrupted by what it shares: its pool, its stream's workspaces) is
             dropped, with the difference in the rank's trace, its shape running uncaptured from then on (a
             graph that replays wrong turns a draft's proposals to noise while the target keeps the output
             lossless: issue 60 item 2); a graph is checked again after every later recording into the
             model's shared pool (a shape's first forward, its warm-up, runs the trace itself: the first replay
             is the graph's first run, its inputs copied in)
    crop     a rollback moves the length back in place (the graph reads it from its fixed address)
    release  the entries copied back into a growing cache when a second item joins the batch (a batch of
             several rows steps eagerly, models/batch.py) or the sequence outgrows the largest bucket

The lease (`FixedCacheLease`) makes the buffers one sequence's at a time: a model that is its own draft
(self-speculation) has two batches over one adapter, and the second steps eagerly.

Outputs: the compiled step computes the same sums as the eager one, over the whole buffer with the unused
entries masked out, in another kernel order: logits differ by float noise (bounded in tests/models/test_captured.py,
~1e-6 in float32), and greedy outputs stay `ar`'s (the tests decode with it against eager `ar`), a difference
being possible only at a near-tie (vpsd.decoders.lossless judges it by the margin, as for batched rows).
Departure from transformers' StaticLayer: it cannot crop; `FixedLayer` adds a crop and an adopt that keep the
buffers' addresses (the one internal it relies on, `cumulative_length`, is checked when a cache is built).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer

from vpsd.models.hook_lock import tracing
from vpsd.models.spec import CAPTURE_MODES
from vpsd.models.step_graphs import RecordedStep, as_traced
from vpsd.models.timing import settled_clock
from vpsd.tracing import get_logger

CUDA_GRAPH_MODES = ("cudagraphs", "reduce-overhead", "max-autotune")
RECORDED_MODES = ("cudagraphs", "trace")  # dynamo's trace, recorded by vpsd (models/step_graphs.py)
# A trace a cache bucket and step width under inductor's modes (the recorded ones trace two a bucket: a decode
# step, every verify width), for a target and its draft in one process; torch's default limit (8 a code object)
# would send the rest back to eager without a word.
RECOMPILE_LIMIT = 512
# How far a graph's first replay may stray from the trace it was recorded from, relative to the trace's largest
# output: the same kernels on the same inputs, so float noise at most (cuBLAS may pick another algorithm on the
# recording stream's workspace); a replay that computes something else is off by order one.
REPLAY_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3}
HALF_REPLAY_TOLERANCE = 5e-2  # bfloat16, float16


class FixedLayer(StaticLayer):
    """A StaticLayer that can roll back (crop) and adopt entries, always writing into the same buffers."""

    def __init__(self, max_cache_len: int) -> None:
        super().__init__(max_cache_len=max_cache_len)
        if not isinstance(getattr(self, "cumulative_length", None), torch.Tensor):
            raise RuntimeError("this transformers' StaticLayer keeps no `cumulative_length` tensor: vpsd's captured "
                               "steps do not support it (set the model's capture: null)")

    def length(self) -> int:
        return int(self.cumulative_length) if self.is_initialized else 0

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Holds exactly `keys` / `values` (1, H, n, d): copied into the buffers, the rest masked as unused."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)  # allocates, and marks the buffers' addresses static
        n = keys.shape[-2]
        self.keys[:, :, :n].copy_(keys)
        self.values[:, :, :n].copy_(values)
        self.cumulative_length.fill_(n)  # in place: a captured graph reads it from this address

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count (tokens to remove), got {tokens_to_remove}")
        if self.is_initialized:
            self.cumulative_length.fill_(max(0, self.length() + tokens_to_remove))


class FixedCache(Cache):
    """A language model's cache of `capacity` entries a layer in fixed buffers (see the module docstring)."""

    def __init__(self, config: Any, capacity: int) -> None:
        text = config.get_text_config()
        if getattr(text, "use_sliding_window", False) or any(
                t != "full_attention" for t in (getattr(text, "layer_types", None) or ())):
            raise ValueError("captured steps support full-attention layers only (set the model's capture: null)")
        super().__init__(layers=[FixedLayer(capacity) for _ in range(text.num_hidden_layers)])
        self.capacity = capacity

    def length(self) -> int:
        return self.layers[0].length()

    def entries(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's held (keys, values), (1, H, n, d) views of the buffers."""
        n = self.length()
        return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in self.layers]

    def rewind(self, length: int) -> None:
        """Every layer holds its first `length` entries, in place (a replay's check re-runs a step over them)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(length)


def held_entries(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) that `cache` holds (a fixed cache's without its unused room)."""
    return cache.entries() if isinstance(cache, FixedCache) else [(l.keys, l.values) for l in cache.layers]


class FixedCacheLease:
    """One model's fixed caches, lent to one sequence at a time; each created on first use.

    Attention reads a fixed cache's whole buffer (the unused entries masked), so a step over a buffer much longer
    than its sequence pays for the difference: 8192 entries for a 1.4k context read 6x the keys and values it
    needs. The buffers therefore come in buckets, `capacity` halved down to `MIN_BUCKET`, and a sequence takes
    the smallest that holds it (and moves to the next when it outgrows it): a sequence reads at most twice its
    entries, and the graphs are one set a bucket."""

    MIN_BUCKET = 512

    def __init__(self, config: Any, capacity: int) -> None:
        self.config, self.capacity = config, capacity
        self.buckets = sorted({capacity >> i for i in range(16) if capacity >> i >= self.MIN_BUCKET} | {capacity})
        self._caches: dict[int, FixedCache] = {}
        self._holder: object | None = None
        self._lock = threading.Lock()

    def take(self, holder: object, entries: list[tuple[torch.Tensor, torch.Tensor]], room: int) -> FixedCache | None:
        """A fixed cache holding a copy of `entries` (each layer's keys and values, `held_entries`), now
        `holder`'s; None (the caller keeps its cache) when another holds one or they and `room` more fit none."""
        n = int(entries[0][0].shape[-2])
        size = next((b for b in self.buckets if n + room <= b), None)
        with self._lock:
            if self._holder not in (None, holder) or size is None:
                return None
            self._holder = holder
        fixed = self._caches.get(size)
        if fixed is None:
            fixed = self._caches[size] = FixedCache(self.config, size)
        for layer, (keys, values) in zip(fixed.layers, entries):
            layer.adopt(keys, values)
        return fixed

    def give_back(self, holder: object) -> None:
        with self._lock:
            if self._holder is holder:
                self._holder = None


class CapturedLanguageModel:
    """A language model's steps over a FixedCache, captured (fixed shapes): recorded graphs of dynamo's trace
    ("cudagraphs", and "trace" on a CPU: models/step_graphs.py) or inductor's compiled code (its modes)."""

    def __init__(self, language_model: torch.nn.Module, mode: str, device: torch.device) -> None:
        if mode not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {CAPTURE_MODES} or null, got {mode!r}")
        if mode in CUDA_GRAPH_MODES and torch.device(device).type != "cuda":
            raise ValueError(f"capture {mode!r} records CUDA graphs: the model is on {device}, not a GPU "
                             f"(on a CPU use 'default', or null)")
        import torch._dynamo as dynamo  # here, not at the top: it costs every rank ~1 s of import otherwise

        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.mode = mode
        self.device = torch.device(device)
        self.language_model = language_model
        self.recorded = mode in RECORDED_MODES  # vpsd's own graphs of the trace (models/step_graphs.py)
        if self.recorded:  # not torch's cudagraphs backend: it copies every weight a replay (step_graphs.py)
            # Static shapes (no automatic dynamic: a second model of the class, or another epsilon, would turn its
            # sizes and floats into inputs), but for the widths `as_traced` marks: one trace for every verify width.
            self.compiled = torch.compile(language_model, backend="eager", dynamic=False)
        else:
            self.compiled = torch.compile(language_model, mode=mode, dynamic=False)
        self.steps = 0  # forwards run captured (the rest of a model's steps ran eagerly)
        self.capture_s = 0.0  # the one-time cost: the first forward of each graph (its compilation or recording)
        self._graphs: dict[tuple, RecordedStep | None] = {}
        self.unrecorded: dict[tuple, str] = {}  # shapes whose recording failed (they run the trace), and why
        self.checked = 0  # replays checked against the trace (a graph's first, and after a later recording)
        self._unchecked: set[tuple] = set()  # recorded shapes whose next replay is checked
        cuda = self.recorded and self.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if cuda else None  # one pool for a model's graphs
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        # The graphs share one memory pool (and the recording stream's cuBLAS workspace): a new recording puts
        # every recorded graph back to be checked at its next replay.
        self.shares_pool = cuda

    def __call__(self, **inputs: Any) -> Any:
        self.steps += 1
        key = tuple((name, tuple(v.shape) if isinstance(v, torch.Tensor) else _identity(v))
                    for name, v in sorted(inputs.items()))
        if key in self._graphs:
            step = self._graphs[key]
            if step is not None and key in self._unchecked:
                return self._checked(key, step, inputs)
            return step(inputs) if step is not None else self.compiled(**as_traced(inputs) if self.recorded
                                                                       else inputs)
        t0 = settled_clock(self.device)  # a new graph: timed whole, once (the only synchronisation it adds)
        with tracing(self.language_model):  # its trace sees no other thread's hooks (models/hook_lock.py)
            out = self.compiled(**as_traced(inputs)) if self.recorded else self.compiled(**inputs)
            step = self._graphs[key] = self._record(key, inputs) if self.recorded else None
        if step is not None:
            if self.shares_pool:
                self._unchecked.update(k for k, s in self._graphs.items() if s is not None)
            self._unchecked.add(key)
        self.capture_s += settled_clock(self.device) - t0
        return out

    def _checked(self, key: tuple, step: RecordedStep, inputs: dict[str, Any]) -> Any:
        """The recorded step's replay, checked (module docstring, "check"): the step cropped back and run again by
        the trace, uncaptured; the trace's outputs are returned, and its cache entries kept, either way. A replay
        that differs is dropped for good (`unrecorded`, a RuntimeWarning and `step_unrecorded` in the rank's
        trace, with the difference), its shape running the trace from then on."""
        self._unchecked.discard(key)
        cache = next((v for v in inputs.values() if isinstance(v, FixedCache)), None)
        if cache is None:  # vpsd's steps always pass their fixed cache; nothing to crop back otherwise
            return step(inputs)
        t0 = settled_clock(self.device)
        before = cache.length()
        replayed = step(inputs)
        cache.rewind(before)  # the same step again, over the same entries, by the trace the graph was recorded from
        out = self.compiled(**as_traced(inputs))
        self.checked += 1
        error, tolerance = _replay_error(replayed, out)
        if not error <= tolerance:  # NaN included
            self._graphs[key] = None
            why = (f"its replay differs from the trace it was recorded from by {error:.3g} of the trace's largest "
                   f"output (tolerance {tolerance:g})")
            self.unrecorded[key] = why
            get_logger().warning("step_unrecorded", shapes=repr(key), error=why)  # the rank's trace
            warnings.warn(f"captured steps: a step of shapes {key} runs uncaptured: {why}", RuntimeWarning,
                          stacklevel=3)
        self.capture_s += settled_clock(self.device) - t0
        return out

    def _record(self, key: tuple, inputs: dict[str, Any]) -> RecordedStep | None:
        """The step just run (its warm-up), recorded; None, with a warning, where CUDA refused it."""
        try:
            return RecordedStep(self.compiled, inputs, self.device, self._pool, self._stream)
        except Exception as e:  # on a GPU any failure of the capture: the step still runs, uncaptured
            if self.device.type != "cuda":
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.unrecorded[key] = why
            get_logger().warning("step_unrecorded", shapes=repr(key), error=why)  # the rank's trace
            warnings.warn(f"captured steps: a step of shapes {key} could not be recorded as a CUDA graph and runs "
                          f"uncaptured: {why}", RuntimeWarning, stacklevel=3)
            return None


def _identity(value: Any) -> Any:
    """A non-tensor argument as part of a step's key: a fixed cache by identity (its buffers' addresses are the
    graph's), anything else by value."""
    return ("cache", id(value), value.capacity) if isinstance(value, FixedCache) else value


def _replay_error(replayed: Any, traced: Any) -> tuple[float, float]:
    """(largest |difference| of the two steps' first outputs relative to the trace's largest, the tolerance for
    their dtype). A step's first output is its last hidden state."""
    a, b = _first_tensor(replayed), _first_tensor(traced)
    if a is None or b is None or a.shape != b.shape:
        return float("inf"), 0.0
    scale = float(b.detach().abs().max().float()) if b.numel() else 0.0
    error = float((a.detach().float() - b.detach().float()).abs().max()) if b.numel() else 0.0
    return error / max(scale, 1e-6), REPLAY_TOLERANCE.get(b.dtype, HALF_REPLAY_TOLERANCE)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)

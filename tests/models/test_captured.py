"""Captured steps (models/captured.py): a batch-1 row held in a fixed cache and stepped by a compiled graph scores
as the eager step does, through rollbacks, a second item joining (back to a growing cache) and leaving (back in),
outgrowing the buffers and two batches over one model (self-speculation); the engine decodes `ar`'s tokens with
it, one graph a step width, none recompiled as the cache fills and rolls back.

torch.compile's inductor backend generates code for a graph in ~10 s on this CPU, so one test runs it (a plain
`ar` decode, one graph; with --slow); the others capture with mode "trace", the very same dynamo graphs run by the eager
kernels (the capture, its guards, the fixed cache and its mask). "cudagraphs" and "reduce-overhead" need a GPU
(tests/gpu/test_on_cuda.py)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch._dynamo.utils
from structlog.testing import capture_logs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.conftest import config_path, random_frames, tiny_tokenizer
from tests.engine_harness import PROMPTS, local_engine, requests, run
from vpsd.config import DecodingConfig, PruningConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.launch.job_identity import differences, identity
from vpsd.models.batch import BatchedCache
from vpsd.models.captured import FixedCache
from vpsd.models.hf_compat import cache_kwargs
from vpsd.models.hook_lock import hooks_installed
from vpsd.models.step_graphs import RecordedStep, as_traced
from vpsd.models.kv_cache import GrowingCache
from vpsd.models.registry import load_adapter
from vpsd.models.spec import ModelSpec

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")


def adapters(family: str, capacity: int = 512, mode: str = "trace"):
    """The family's tiny target twice: eager, and with captured steps (fresh adapters: the session's shared ones
    must stay eager)."""
    cfg = load_config(config_path(family))
    tok = tiny_tokenizer()
    eager = load_adapter(family, cfg.target, tok)
    captured = load_adapter(family, cfg.target, tok)
    captured.capture(mode, capacity)
    return eager, captured


def worst_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_captured_row_scores_as_eager_through_rollbacks_joins_leaves(family):
    eager, target = adapters(family)
    embs = [eager.embed(eager.prepare(random_frames(i, t=4 + 2 * i), PROMPTS[i])) for i in range(2)]
    single = [eager.prefill(e).state for e in embs]
    batch = BatchedCache(target)
    batch.join(0, target.prefill(embs[0]).state)
    assert isinstance(batch.cache, FixedCache)  # alone: in the fixed cache
    torch._dynamo.utils.counters.clear()
    worst = 0.0

    def feed(tokens: dict[int, list[int]]) -> None:
        nonlocal worst
        got = batch.step(tokens)
        for key, ids in tokens.items():
            worst = max(worst, worst_diff(eager.step(single[key], torch.tensor(ids)), got[key]))

    for ids in ([5], [6, 7, 8, 9], [10], [1, 2, 3, 4], [11], [2, 3], [4, 5, 6]):  # decode steps and verifies
        feed({0: ids})
        if len(ids) > 1:  # a verify rejected its last two: rolled back in place
            batch.rollback(0, batch.length(0) - 2)
            eager.rollback(single[0], single[0].length - 2)
    assert isinstance(batch.cache, FixedCache)
    # two traces, whatever the length and the rollbacks: a decode step's, and one for every verify width (its
    # width dynamic: models/step_graphs.py `as_traced`); a step recorded for each width (1, 4, 2, 3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert len(target.captured._graphs) == 4
    batch.join(1, target.prefill(embs[1]).state)  # a second item: both rows eager in a growing cache
    assert isinstance(batch.cache, GrowingCache) and target.fixed_cache._holder is None
    feed({0: [3], 1: [4, 5]})
    batch.leave(1)  # alone again: back into the fixed cache
    assert isinstance(batch.cache, FixedCache)
    feed({0: [6, 7, 8, 9]})
    feed({0: [2]})
    assert worst < 1e-5, worst
    keys, values = batch.entries(0, 0)  # what the row holds is its batch-1 cache
    torch.testing.assert_close(keys[None], single[0].cache.layers[0].keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(values[None], single[0].cache.layers[0].values, atol=1e-5, rtol=0)
    batch.leave(0)
    assert batch.cache is None and target.fixed_cache._holder is None  # the buffers are free for the next item


def test_a_row_that_outgrows_the_buffers_goes_on_eagerly_and_a_second_batch_waits_its_turn():
    eager, target = adapters("qwen2_5_vl")
    emb = eager.embed(eager.prepare(random_frames(3), PROMPTS[0]))
    n = eager.prefill(emb).state.length
    eager2, small = adapters("qwen2_5_vl", capacity=n + 70)  # room for the 64 a row needs to move in, and 6 more
    ref = eager.prefill(emb).state
    batch, other = BatchedCache(small), BatchedCache(small)  # two batches over one model: a self-drafting pair
    batch.join("a", small.prefill(emb).state)
    other.join("b", small.prefill(emb).state)
    assert isinstance(batch.cache, FixedCache) and isinstance(other.cache, GrowingCache)  # one holder at a time
    worst = 0.0
    for step in range(18):  # 4 tokens a step: past n + 70 on the 18th
        ids = [7 + step, 3, 4, 5]
        got = batch.step({"a": ids})["a"]
        theirs = other.step({"b": ids})["b"]
        want = eager.step(ref, torch.tensor(ids))
        worst = max(worst, worst_diff(want, got), worst_diff(want, theirs))
    assert isinstance(batch.cache, GrowingCache) and batch.length("a") == ref.length == n + 72
    assert worst < 1e-5, worst
    batch.leave("a")
    other.leave("b")
    other.join("c", small.prefill(emb).state)  # the buffers were given back: the next item takes them
    assert isinstance(other.cache, FixedCache)


def test_a_row_takes_the_smallest_bucket_that_holds_it_and_moves_up_as_it_grows():
    eager, target = adapters("qwen2_5_vl", capacity=2048)
    assert target.fixed_cache.buckets == [512, 1024, 2048]  # attention reads a whole buffer: at most 2x the row
    emb = eager.embed(eager.prepare(random_frames(4), PROMPTS[1]))
    ref = eager.prefill(emb).state
    batch = BatchedCache(target)
    batch.join(0, target.prefill(emb).state)
    assert batch.cache.capacity == 512
    worst, sizes = 0.0, set()
    while batch.length(0) < 1100:  # through the 512 and 1024 buckets
        ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
        worst = max(worst, worst_diff(eager.step(ref, torch.tensor(ids)), batch.step({0: ids})[0]))
        sizes.add(batch.cache.capacity)
    assert sizes == {512, 1024, 2048} and isinstance(batch.cache, FixedCache)
    assert worst < 1e-4, worst
    keys, _ = batch.entries(0, 3)
    torch.testing.assert_close(keys[None], ref.cache.layers[3].keys, atol=1e-5, rtol=0)


def test_a_trace_waits_for_another_threads_hooks_and_never_runs_them():
    """models/hook_lock.py: a prefill on another thread holds signal hooks on the shared model; a captured step's
    first call of a shape (its trace) waits until they are removed, so no trace inlines or guards on a hook (one
    removed mid-trace failed the step); hooks installed later never run in the traced step, nor trace it again."""
    eager, target = adapters("qwen2_5_vl")
    emb = eager.embed(eager.prepare(random_frames(4), PROMPTS[1]))
    batch = BatchedCache(target)
    batch.join(0, target.prefill(emb).state)
    lm, calls, order = target.language_model, [], []
    install = lambda: [lm.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))]  # noqa: E731
    installed, release = threading.Event(), threading.Event()

    def prefill_with_hooks():
        with hooks_installed(lm, install):
            installed.set()
            release.wait(60)

    holder = threading.Thread(target=prefill_with_hooks)
    holder.start()
    installed.wait(60)
    stepper = threading.Thread(target=lambda: (batch.step({0: [5]}), order.append("traced")))
    stepper.start()
    stepper.join(3.0)  # time enough to trace a tiny model's step, were it not waiting
    order.append("hooks removed")
    release.set()
    holder.join(60)
    stepper.join(60)
    assert order == ["hooks removed", "traced"] and calls == []
    graphs = len(target.captured._graphs)
    with hooks_installed(lm, install):  # the same shape again, hooks in place: the trace runs as traced
        batch.step({0: [6]})
    assert calls == [] and len(target.captured._graphs) == graphs


def test_cuda_graph_modes_refuse_a_cpu_model():
    _, target = adapters("qwen2_5_vl")
    with pytest.raises(ValueError, match="records CUDA graphs"):
        target.capture("cudagraphs", 1024)


@pytest.mark.parametrize("size", [1, 2])
def test_the_engine_with_captured_target_and_draft_decodes_ars_tokens(size):
    eager, target = adapters("qwen2_5_vl")
    _, draft = adapters("qwen2_5_vl")  # the target's weights on pruned video (the tiny draft never agrees)
    cfg = DecodingConfig(gamma=3, max_new_tokens=12, temperature=0.0)
    todo = requests(3, max_new=12)
    got = run(local_engine(target, draft, cfg, PruningConfig("uniform", 0.5, seed=3), size)[1], todo)
    assert target.captured.steps > 0 and draft.captured.steps > 0  # a row alone stepped captured
    graphs = len(target.captured._graphs)  # one a step width and bucket; each first forward timed, once
    assert graphs >= 2 and target.captured.capture_s > 0 and target.captured.steps > graphs
    for it in todo:
        ref = decode_ar(eager, it.frames, it.prompt, dataclasses.replace(cfg, max_new_tokens=it.max_new_tokens))
        assert got[it.id].token_ids == ref.token_ids, it.id
        assert sum(got[it.id].stats.accepted_per_round) > 0  # it speculated


# torch's own inductor imports a deprecated torch.jit decorator of torch's (not vpsd's, not transformers').
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow  # inductor's code generation, 10-15 s cold: the graphs themselves are the "trace" tests'
def test_inductor_captured_ar_decodes_ars_tokens():
    """Inductor's generated kernels once, one graph (a decode step)."""
    eager, target = adapters("qwen2_5_vl", mode="default")
    cfg = DecodingConfig(max_new_tokens=10, temperature=0.0)
    todo = requests(2, max_new=10)
    torch._dynamo.utils.counters.clear()
    got = run(local_engine(target, None, cfg, None, 1)[1], todo)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # every step one graph
    for it in todo:
        ref = decode_ar(eager, it.frames, it.prompt, dataclasses.replace(cfg, max_new_tokens=it.max_new_tokens))
        assert got[it.id].token_ids == ref.token_ids, it.id


def test_capture_is_a_checked_setting_outside_the_jobs_identity():
    with pytest.raises(ValueError, match="capture must be one of"):
        ModelSpec(tiny={"seed": 0}, capture="fast")
    with pytest.raises(ValueError, match="capture_len"):
        ModelSpec(tiny={"seed": 0}, capture="default", capture_len=0)
    cfg = load_config(config_path("qwen2_5_vl"))
    captured = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, capture="reduce-overhead",
                                                                   capture_len=4096))
    assert differences(identity(cfg), identity(captured)) == []  # how fast, not what: a resume goes on


def test_captured_target_and_draft_on_threads_decode_ars_tokens():
    """The GPU layout under test in scripts/gpu_check.sh: hippo's draft (the target's weights, captured on its own
    thread) beside the captured target, both models' graphs compiled and replayed on their own threads."""
    from tests.engine_harness import FramesInMemory, Jobs, fresh
    from vpsd.engine.engine import Engine
    from vpsd.engine.scheduler import Scheduler
    from vpsd.launch.in_process import RoleThreads
    from vpsd.pipeline.methods import get_method

    eager, target = adapters("qwen2_5_vl")
    _, draft = adapters("qwen2_5_vl")
    cfg = load_config(config_path("qwen2_5_vl"), {"pruning.strategy": "hippo", "pruning.ratio": 0.5, "decoding.gamma": 3,
                                             "decoding.max_new_tokens": 12})
    todo = requests(3, max_new=12)
    threads = RoleThreads(target, draft, cfg, get_method("hippo"), None, "captured", 30.0, videos=FramesInMemory(todo))
    engine = Engine(target, cfg, 1, threads.drafter)
    threads.drafter.await_peers(30.0)
    jobs = Jobs()
    with capture_logs() as logs:
        Scheduler(engine, None).run(fresh(todo), jobs)
        threads.stop()
    assert target.captured.steps > 0 and draft.captured.steps > 0
    # The draft role says its own one-time cost as it ends (the bench lists it: bench/throughput.py).
    said = [e for e in logs if e["event"] == "captured_steps"]
    assert len(said) == 1 and said[0]["capture_s"] == round(draft.captured.capture_s, 3) > 0
    for it in todo:
        ref = decode_ar(eager, it.frames, it.prompt, dataclasses.replace(cfg.decoding, max_new_tokens=it.max_new_tokens))
        assert jobs.out[it.id].token_ids == ref.token_ids, it.id


def test_a_recorded_step_runs_nothing_when_recorded_reads_its_copies_and_hands_out_clones():
    """models/step_graphs.py's plumbing, the graph's stand-in on a CPU ("trace") taking the GPU's path: recording
    runs nothing (the cache is untouched), each call's tensors are copied into the step's own, what the step holds
    (the cache) is written where it is, and its outputs sit at fixed addresses, each call handed clones of them."""
    held = torch.zeros(3)  # as the fixed cache's buffers: not an argument, read and written in place

    def step(x, scale):
        held.add_(x)
        return (x * scale + held,)

    rec = RecordedStep(step, {"x": torch.ones(3), "scale": 2.0}, torch.device("cpu"))
    assert held.tolist() == [0, 0, 0]
    a = rec({"x": torch.tensor([1.0, 2.0, 3.0]), "scale": 2.0})
    b = rec({"x": torch.tensor([1.0]).expand(3), "scale": 2.0})  # an expanded view, as M-RoPE positions are
    assert held.tolist() == [2, 3, 4]
    assert a[0].tolist() == [3, 6, 9] and b[0].tolist() == [4, 5, 6]  # a still the first call's: a clone
    assert a[0].data_ptr() != rec.outputs[0].data_ptr() != b[0].data_ptr()
    with pytest.raises(ValueError, match="not in a list"):
        RecordedStep(step, {"x": [torch.ones(3)], "scale": 2.0}, torch.device("cpu"))


class _HostOrCpu(TorchDispatchMode):
    """Records each aten op that reads a value to the host or touches a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default or any(t.device.type == "cpu" for t in tensors):
            self.seen.append(str(func))
        return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_captured_step_traces_to_what_a_cuda_graph_records(family):
    """What models/step_graphs.py records on a GPU, checked here on the meta device (shapes, no data): each
    family's traced decode step and verify is one graph, reads nothing to the host (on meta a read raises) and
    makes no tensor on the CPU (on a GPU its value would be frozen into the graph when it records)."""
    cfg = load_config(config_path(family))
    adapter = load_adapter(family, cfg.target, tiny_tokenizer())  # its own: its weights go to the meta device
    lm = adapter.language_model.to("meta")
    text = adapter.model.config.get_text_config()
    heads, dim = text.num_key_value_heads, getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cache = FixedCache(adapter.model.config, 512)
    for layer in cache.layers:
        held = torch.zeros(1, heads, 40, dim, device="meta", dtype=adapter.model.dtype)
        layer.adopt(held, held)
    graphs, watched = [], _HostOrCpu()

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            with watched:
                return gm(*args)
        return run

    traced = torch.compile(lm, backend=backend, dynamic=False)  # as models/captured.py compiles it
    rows = adapter.position_rows
    with torch.inference_mode():
        for k in (1, 4, 1, 3):
            pos = torch.zeros(1, 1, k, dtype=torch.long, device="meta")
            inputs = {"input_ids": torch.zeros(1, k, dtype=torch.long, device="meta"), "use_cache": True,
                      "position_ids": pos.expand(rows, 1, k) if rows > 1 else pos[0], **cache_kwargs(lm, cache)}
            out = traced(**as_traced(inputs))
            assert out.last_hidden_state.shape[1] == k
    # two graphs (a decode step; every verify width, dynamic), no break; nothing read or on the CPU
    assert len(graphs) == 2 and watched.seen == []

"""What torch's own `cudagraphs` backend would copy before each replay of a vpsd step, seen on a CPU.

    python scripts/cudagraphs_backend_inputs.py [FAMILY]

Why vpsd records its own graphs (vpsd/models/step_graphs.py): torch.compile(backend="cudagraphs") hands CUDA-graph
trees the inputs it counts static, and with dynamo inlining nn modules (its default) it counts none, so every input
(the weights, the KV buffers) is copied into graph memory before each replay. This runs that backend on a tiny
target's decode step and verify with its CPU-device check lifted and its recording replaced by a note of what it
was handed (torch internals: a diagnostic, not a test; it may need updating as torch moves).
"""

from __future__ import annotations

import sys

import torch
import torch._inductor.cudagraph_trees as trees
from torch._dynamo.backends import cudagraphs as backend

from tests.conftest import config_path, random_frames, tiny_tokenizer
from tests.engine_harness import PROMPTS
from vpsd.config import load_config
from vpsd.models.batch import BatchedCache
from vpsd.models.registry import load_adapter

handed: list[tuple[int, int, int]] = []  # (inputs, static inputs, bytes of the inputs copied a replay)


def note(model, inputs, static_input_idxs, *args, **kwargs):
    static = set(static_input_idxs)
    copied = sum(t.numel() * t.element_size() for i, t in enumerate(inputs)
                 if isinstance(t, torch.Tensor) and i not in static)
    handed.append((len(inputs), len(static), copied))
    return model


def main(family: str) -> None:
    backend.check_multiple_devices_or_any_cpu_nodes = lambda mapping: None  # as if on a GPU
    backend.get_device_index = lambda gm: 0
    trees.cudagraphify_impl = note
    adapter = load_adapter(family, load_config(config_path(family)).target, tiny_tokenizer())
    adapter.capture("trace", 512)
    adapter.captured.recorded = False  # torch's backend in place of vpsd's recorded steps
    adapter.captured.compiled = torch.compile(adapter.language_model, backend="cudagraphs", dynamic=False)
    batch = BatchedCache(adapter)
    batch.join(0, adapter.prefill(adapter.embed(adapter.prepare(random_frames(0, t=4), PROMPTS[0]))).state)
    for ids in ([5], [6, 7, 8, 9], [10]):
        batch.step({0: ids})
    weights = sum(p.numel() * p.element_size() for p in adapter.language_model.parameters())
    print(f"torch {torch.__version__}, {family}'s tiny target: language-model weights {weights} bytes")
    for n, static, copied in handed:
        print(f"  a graph handed {n} inputs, {static} of them static: {copied} bytes copied before each replay")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2_5_vl")

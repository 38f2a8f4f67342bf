"""Whether more intra-op threads leave a forward's bits as they are, on this machine.

Lending the prefill thread's cores to the decode thread at a job's tail (engine/prefill_ahead.py) gives its forwards
more intra-op threads; that leaves every output as it was only where a forward computes the same bits on n threads
as on one. Whether it does is the CPU's kernels' choice, not vpsd's: on the AMD EPYC (AVX2) vpsd was built on a
prefill and a cached verify of a real language model were bitwise equal on two threads and on one; on an Intel
Xeon the cached verify's attention differed by 5e-7 (2026-11-28). So it is measured, once a process, on a small
real model (the kernels a real model's forwards run, at the shapes that make them split their work) before any
core is lent. It runs on the calling thread, so the intra-op (OpenMP) threads it starts are that thread's, kept for
its later forwards with the affinity the thread had when they started: widen it to the cores its forwards may use
before asking (on the thread's one core, they would all share that core).
"""

from __future__ import annotations

import functools

import torch


def _forwards(model: torch.nn.Module, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batched prefill and a cached 6-token verify on `threads` intra-op threads (the setting restored)."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    prompt, window = torch.randn(8, 40, 256, generator=gen), torch.randn(8, 6, 256, generator=gen)
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            pre = model(inputs_embeds=prompt, use_cache=True)
            ver = model(inputs_embeds=window, past_key_values=pre.past_key_values, use_cache=True)
        return pre.last_hidden_state, ver.last_hidden_state
    finally:
        torch.set_num_threads(before)


def probe_model() -> torch.nn.Module:
    """A 2-layer Qwen2.5-VL language model, wide enough that its GEMMs and attention split over threads."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    config = Qwen2_5_VLTextConfig(vocab_size=64, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, bos_token_id=0, eos_token_id=1,
                                  rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                       mrope_section=[4, 6, 6]))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Qwen2_5_VLTextModel(config).eval()


@functools.cache
def bitwise_across_threads(threads: int) -> bool:
    """Whether the probe model's prefill and cached verify give the same bits on `threads` intra-op threads as on
    one, on this machine (measured once a process, on the calling thread: it starts that thread's intra-op threads,
    with its affinity now)."""
    model = probe_model()
    one, many = _forwards(model, 1), _forwards(model, threads)
    return all(torch.equal(a, b) for a, b in zip(one, many))

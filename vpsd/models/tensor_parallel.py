"""A target across k ranks: its language model's layers sharded (tensor parallelism), every forward mirrored.

Sharding is Megatron's plan over torch's own DTensor API (`parallelize_module` on a device mesh of the target's
ranks, a sub-group of the launch): each layer's q/k/v and gate/up projections split by columns (each rank holds
Hq/k query heads, Hkv/k KV heads, I/k MLP units), o and down by rows, their partial outputs summed by one
all-reduce each. Embeddings, the final norm, lm_head and the vision tower stay whole on every rank: the
leader runs the vision tower alone, and each rank computes the same logits. transformers' attention reshapes
its projections by head_dim (-1 heads), so every family's attention runs on its local heads unchanged, and
the KV cache of each rank holds its own KV heads: 1/k of the cache a rank, like the weights.
(transformers' own `tp_plan="auto"` does the same from a checkpoint, but only over the whole world and through
`from_pretrained`; vpsd builds tiny models from configs and runs several pipelines a launch, so it applies the
plan itself, to a sub-group, with the public torch API.)

The role's code runs on the target's first rank, the leader; the other k - 1, the followers, hold no engine,
no queue, no link: they run what the leader's adapter runs, in the same order. Everything the target's cache
sees goes through two doors of `VideoLMAdapter` (models/base.py), which mirror it when the adapter has a
`Mirror`:
    forward     a language-model forward (prefill, step, a batch's step): its inputs broadcast, then run
    cache op    a cache manipulation (crop; a batch's join, row selection, compaction: `CACHE_OPS`)
naming each cache by an id that the leader gives its caches and the followers keep theirs under; a cache the
leader drops is dropped by the followers with the next message. One lock makes each mirrored operation whole,
so the engine's prefill thread and its decode thread take turns (the forwards of the two would otherwise
interleave their all-reduces). The header is msgpack; tensors follow as broadcasts on the target's group.

A prefill that scores the target's attention for the pruner (HIPPO, SpecVLM, attn: models/signals.py) tells
the followers to score their own heads in the same forward; at the layer where the signals are complete every
rank hands its (L, Hkv/k, N) scores to one all-gather and the leader streams the whole (L, Hkv, N) on. Hidden
states are whole on every rank after each layer's all-reduce, so UV-Prune's signals need nothing more.
Not mirrored, so refused with a tensor-parallel target (launch/preflight.py says so at launch): the draft trees
and Sparse-to-Dense's KV (their own cache surgery) and captured steps (fixed caches).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable

import msgspec
import torch
import torch.distributed as dist

from vpsd.models.cache_ops import CACHE_OPS
from vpsd.models.hf_compat import cache_kwargs
from vpsd.models.hook_lock import hooks_installed

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


# ---- sharding ---------------------------------------------------------------------------------------------

def shard_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def shard_problems(text_config: Any, k: int) -> list[str]:
    """Why the language model of `text_config` cannot be split k ways (heads and MLP units must divide)."""
    sizes = {"num_attention_heads": text_config.num_attention_heads,
             "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads,
             "intermediate_size": text_config.intermediate_size}
    return [f"tensor_parallel {k}: {name} {n} is not a multiple of {k}" for name, n in sizes.items() if n % k]


def shard(adapter: Any, group: dist.ProcessGroup) -> None:
    """Splits every decoder layer of `adapter`'s language model over the ranks of `group` (module docstring):
    a model built whole on every rank (a tiny one) keeps the leader's values, scattered."""
    shard_language_model(adapter.language_model, group, torch.device(adapter.device).type)


def shard_language_model(language_model: torch.nn.Module, group: dist.ProcessGroup, device_type: str,
                         src_data_rank: int | None = 0) -> None:
    """Splits every decoder layer of `language_model` over the ranks of `group`. `src_data_rank`: the rank whose
    values every rank keeps a share of (scattered from it), or None: each keeps its share of its own tensors
    without communication, which is how a model whose parameters are still on the meta device is split before
    each rank reads its share from the checkpoint (models/sharded_load.py)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    k = dist.get_world_size(group)
    problems = shard_problems(language_model.config, k)
    if problems:
        raise ValueError("; ".join(problems))
    mesh = DeviceMesh.from_group(group, device_type)
    plan = shard_plan()
    for layer in language_model.layers:
        parallelize_module(layer, mesh, plan, src_data_rank=src_data_rank)


# ---- the wire ---------------------------------------------------------------------------------------------

class _Wire:
    """Headers and tensors from the leader to the followers of one group (broadcasts, src = the leader)."""

    def __init__(self, group: dist.ProcessGroup, leader: int, device: torch.device) -> None:
        self.group, self.leader, self.device = group, leader, torch.device(device)

    def send(self, header: dict, tensors: list[torch.Tensor]) -> None:
        data = _ENCODER.encode(header)
        self._bytes(torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        self._bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))
        for t in tensors:
            self._bytes(t.contiguous())

    def recv_header(self) -> dict:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bytes(size)
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self._bytes(data)
        return _DECODER.decode(data.cpu().numpy().tobytes())

    def recv_tensor(self, spec: dict) -> torch.Tensor:
        t = torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]], device=self.device)
        self._bytes(t)
        return t

    def _bytes(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=self.leader, group=self.group)


def _pack(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A forward's argument as msgpack-able data, its tensors appended to `tensors` (sent after the header)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"tensor": {"shape": list(value.shape), "dtype": str(value.dtype)}}
    if isinstance(value, (list, tuple)):
        return {"list": [_pack(v, tensors) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"a mirrored forward cannot send a {type(value).__name__}")


def _unpack(data: dict, wire: _Wire) -> Any:
    if "tensor" in data:
        return wire.recv_tensor(data["tensor"])
    if "list" in data:
        return [_unpack(v, wire) for v in data["list"]]
    return data["value"]


# ---- the leader's side ------------------------------------------------------------------------------------

class Mirror:
    """The leader's half: every forward and cache op of its adapter, sent to the followers first."""

    def __init__(self, group: dist.ProcessGroup, leader: int, device: torch.device) -> None:
        self.wire = _Wire(group, leader, device)
        self.ranks = dist.get_world_size(group)  # the target's ranks, this one among them
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self._dropped: list[int] = []  # caches the leader let go of, told with the next message
        self._dropped_lock = threading.Lock()
        self._signals: dict | None = None  # the next forward scores attention on every rank (models/signals.py)
        self.forwards = 0  # sent so far: each follower runs as many (follow's count)

    def cache_id(self, cache: Any) -> int:
        cid = getattr(cache, "_vpsd_mirror_id", None)
        if cid is None:
            cid = cache._vpsd_mirror_id = next(self._ids)
            weakref.finalize(cache, self._drop, cid)
        return cid

    def _drop(self, cid: int) -> None:  # at garbage collection, on any thread: only noted here
        with self._dropped_lock:
            self._dropped.append(cid)

    def _header(self, **fields: Any) -> dict:
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, []
        return {"dropped": dropped, **fields}

    def forward(self, run: Callable[..., Any], cache: Any, inputs: dict[str, Any]) -> Any:
        """Sends the forward to the followers, then runs it here (`run(**inputs)`), all under the lock."""
        with self.lock:
            tensors: list[torch.Tensor] = []
            args = {name: _pack(value, tensors) for name, value in inputs.items()}
            signals, self._signals = self._signals, None
            self.wire.send(self._header(op="forward", cache=self.cache_id(cache), inputs=args, signals=signals),
                           tensors)
            self.forwards += 1
            return run(**inputs)

    def score_next_forward(self, spec: dict) -> None:
        """The next forward (a prefill with signals, under this lock) runs the followers' attention hooks too."""
        self._signals = spec

    def gather_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """(L, Hkv/k, N) of this rank -> (L, Hkv, N) of all of them, in head order (the leader's shard first)."""
        return gather_heads(scores, self.wire.group)

    def cache_op(self, name: str, cache: Any, *args: Any) -> None:
        fn, cache_args = CACHE_OPS[name]
        with self.lock:
            sent = [self.cache_id(a) if i in cache_args else a for i, a in enumerate(args)]
            self.wire.send(self._header(op=name, cache=self.cache_id(cache), args=sent), [])
            fn(cache, *args)

    def stop(self) -> None:
        with self.lock:
            self.wire.send(self._header(op="stop"), [])


def gather_heads(scores: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(scores) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, scores.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# ---- the followers' side ----------------------------------------------------------------------------------

def follow(adapter: Any, group: dist.ProcessGroup, leader: int) -> int:
    """A follower's whole life: runs the leader's forwards and cache ops on its shard until told to stop;
    returns how many forwards it ran."""
    wire = _Wire(group, leader, adapter.device)
    caches: dict[int, Any] = {}
    lm = adapter.language_model
    forwards = 0
    with torch.inference_mode():
        while True:
            header = wire.recv_header()
            for cid in header["dropped"]:
                caches.pop(cid, None)
            op = header["op"]
            if op == "stop":
                return forwards
            cache = caches.get(header["cache"])
            if cache is None:
                cache = caches[header["cache"]] = adapter.new_cache()
            if op == "forward":
                inputs = {name: _unpack(v, wire) for name, v in header["inputs"].items()}
                install = list  # no hook
                if header.get("signals"):  # the leader scores attention in this prefill: score our heads too
                    from vpsd.models.signals import follower_hooks

                    hooks = follower_hooks(header["signals"], cache, adapter.device,
                                           lambda t: gather_heads(t, group))
                    install = lambda hooks=hooks: hooks.install(lm)  # noqa: E731
                with hooks_installed(lm, install):  # models/hook_lock.py
                    lm(**inputs, **cache_kwargs(lm, cache))
                forwards += 1
            else:
                fn, cache_args = CACHE_OPS[op]
                fn(cache, *(caches[a] if i in cache_args else a for i, a in enumerate(header["args"])))

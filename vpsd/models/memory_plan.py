"""What each rank of a layout needs of its device's memory, from the models' shapes alone (no weights, no torch).

A rank holds models (`Held`: a shape, its dtype, the share k of the split layers it keeps) and needs
    weights       its share of every split projection (1/k) plus the parts it keeps whole (models/shapes.py)
    activations   the peak of one prefill of the whole context (the largest forward vpsd runs: prompt and video
                  in one pass), the vision tower's over the video's patches where the rank embeds (the
                  leader), and the logits of a batch's verify rows
    runtime       the process itself: Python, torch and transformers on a CPU (measured: ~0.35 GiB), a CUDA
                  context and the communicators' buffers on a GPU
    reuse         the target's prefix cache, at most `reuse.budget_mib` (engine/prefix_cache.py): an unsplit
                  target's leader only (a split target reuses nothing)
    frames        the decoded frames kept for a video's next question, at most `reuse.frames_mib`
                  (video/frame_cache.py), on the ranks that read videos, and as much again a model there that
                  embeds it, for the last such video's prepared pixels (models/pixel_memo.py): host memory, so
                  counted where the rank's memory is the host's (a GPU rank's host memory is not planned)
    KV            bytes per token (2 x layers x KV heads / k x head_dim x dtype), times the tokens in flight,
                  times CACHE_SPARE: a cache layer's buffer grows by half when full (models/kv_cache.py)
`fits(need, has, context)`: the rank's fixed needs plus one item's cache at the full context fit in what it has
(an item is admitted only while its cache fits beside the others', so a batch needs no more than one item's
room to run; `kv_budget` is the room left, the default of `batching.kv_budget_mib`). `smallest_k` is the
fewest target ranks that would fit, each with as much memory as this one. The activation estimate counts the
tensors a decoder layer holds at once (residual, normed input, q/k/v and their rotary copies, or the MLP's
gate, up and product) and is checked against measured peaks in docs/design.md ("A target across ranks").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vpsd.models.shapes import ModelShape

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CACHE_SPARE = 1.5  # 1 + models/kv_cache.SPARE (tests/unit/test_memory_plan.py holds them together)
RUNTIME_BYTES = {"cpu": int(0.4 * GIB), "cuda": int(1.5 * GIB)}
SPLIT_EXTRA = 19  # measured over gloo on a CPU (16-20 on two shapes): docs/design.md, "A target across ranks"


@dataclass(frozen=True)
class Held:
    """A model as one rank holds it."""

    shape: ModelShape
    dtype_bytes: int
    k: int = 1  # the target's ranks: this one keeps 1/k of every split projection and KV head
    embeds: bool = True  # runs the vision tower and holds the sequence's embeddings (not a follower)
    cache_only: bool = False  # a second use of weights counted already (draft: self): its KV cache only


@dataclass(frozen=True)
class RankNeed:
    rank: int
    role: str
    weights: int
    kv_per_token: int  # every model this rank holds
    activations: int
    runtime: int
    reuse: int = 0  # the target's kept prefixes and vision features: `reuse.budget_mib` (engine/prefix_cache.py)
    frames: int = 0  # decoded frames kept on a host rank that reads videos: `reuse.frames_mib` (video/frame_cache.py)

    @property
    def fixed(self) -> int:
        return self.weights + self.activations + self.runtime + self.reuse + self.frames

    def with_tokens(self, tokens: int) -> int:
        """Everything, with `tokens` of KV cache in flight."""
        return self.fixed + int(tokens * self.kv_per_token * CACHE_SPARE)


def weight_bytes(held: Held) -> int:
    if held.cache_only:
        return 0
    s = held.shape
    return (s.split_params // held.k + s.whole_params) * held.dtype_bytes


def prefill_bytes(held: Held, tokens: int) -> int:
    """Peak activations of one prefill of `tokens` on this rank (module docstring)."""
    s, k, b = held.shape, held.k, held.dtype_bytes
    q, kv = s.heads * s.head_dim // k, s.kv_heads * s.head_dim // k
    attention = 2 * (q + 2 * kv) + q + s.hidden
    mlp = 3 * s.intermediate // k + s.hidden
    # A split layer's outputs are all-reduced (DTensor, over the target's group): the measured peaks of split
    # prefills held SPLIT_EXTRA hidden-sized rows a token more than the same prefill unsplit.
    split = SPLIT_EXTRA * s.hidden if k > 1 else 0
    layer = tokens * b * (2 * s.hidden + max(attention, mlp) + split)
    if not held.embeds:
        return layer
    patches = tokens * s.patches_per_token
    vision = patches * b * (4 * s.vision_hidden + 3 * s.vision_intermediate)
    return tokens * b * s.hidden + max(layer, vision)


def rank_need(rank: int, role: str, held: list[Held], context: int, rows: int, device: str) -> RankNeed:
    """A rank holding `held`: its weights, KV per token, and the larger of a context-long prefill and a batch
    verify's `rows` logit rows (float32) of each model."""
    activations = max((prefill_bytes(h, context) for h in held), default=0)
    activations += sum(rows * h.shape.vocab * 4 for h in held)
    return RankNeed(rank, role, sum(weight_bytes(h) for h in held),
                    sum(h.shape.kv_bytes_per_token(h.dtype_bytes, h.k) for h in held), activations,
                    RUNTIME_BYTES["cuda" if device.startswith("cuda") else "cpu"])


def fits(need: RankNeed, has: int, context: int) -> bool:
    return need.with_tokens(context) <= has


def kv_budget(need: RankNeed, has: int) -> int:
    """Bytes of KV entries (as the scheduler counts them: tokens x bytes per token) that fit beside the rank's
    fixed needs, the cache's spare room counted."""
    return max(0, int((has - need.fixed) / CACHE_SPARE))


def smallest_k(need_at: Callable[[int], list[RankNeed]], has: int, context: int, candidates: list[int]) -> int | None:
    """The fewest target ranks, among `candidates`, at which every rank's `need_at(k)` fits `has`."""
    for k in candidates:
        if all(fits(n, has, context) for n in need_at(k)):
            return k
    return None


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def describe(need: RankNeed, context: int) -> str:
    """'weights X + KV Y (N tokens) + activations Z + runtime W = T'"""
    kv = int(context * need.kv_per_token * CACHE_SPARE)
    reuse = f" + reuse cache {gib(need.reuse)}" if need.reuse else ""
    reuse += f" + frames cache {gib(need.frames)}" if need.frames else ""
    return (f"weights {gib(need.weights)} + KV {gib(kv)} ({context} tokens) + activations {gib(need.activations)} "
            f"+ runtime {gib(need.runtime)}{reuse} = {gib(need.with_tokens(context))}")

"""The one interface every video-LLM family implements, and the family-independent decoding logic.

An adapter owns an architecture's quirks (video preprocessing, rotary positions, deepstack features,
pooled video tokens) and exposes four operations that the decoders and roles use:

    inputs  = adapter.prepare(frames, prompt, times)   # tokens + pixel tensors + video token layout
    embeds  = adapter.embed(inputs)                    # vision tower: sequence embeddings + positions
    result  = adapter.prefill(embeds, keep=None)       # full or pruned prefill -> logits + DecodeState
    logits  = adapter.step(state, token_ids)           # decode / verify k tokens, appending to the cache
    logits  = adapter.step_tree(state, ids, seq_index, visible)  # the same for tree nodes (tree mask)
    adapter.rollback(state, length)                    # drop cache entries past `length`
    adapter.compact(state, start, keep)                # keep only an accepted tree path's entries

A pruned prefill feeds only the text tokens and the kept video tokens, each at its ORIGINAL position,
so a kept token sees exactly the rotary phase it has in the full sequence. Decoded tokens then continue
from the full sequence's positions: position of the next token = cache length + `position_offset`.
The adapter never decides what to prune; it takes kept video-token indices (see pipeline/layout.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from vpsd.models.attention import additive_mask
from vpsd.models.cache_ops import CACHE_OPS
from vpsd.models.captured import CapturedLanguageModel, FixedCache, FixedCacheLease
from vpsd.models.hf_compat import cache_kwargs
from vpsd.models.kv_cache import GrowingCache
from vpsd.models.pixel_memo import PixelMemo
from vpsd.models.prompt import Turn, render_template, tokenizer_lock
from vpsd.pipeline.layout import VideoTokenLayout


@dataclass
class VideoInputs:
    """Model inputs for one (video, prompt) pair, before the vision tower runs."""

    input_ids: torch.Tensor  # (1, L) int64
    pixel_inputs: dict[str, torch.Tensor]  # family-specific tensors for the vision tower / positions
    layout: VideoTokenLayout
    # models/pixel_memo.py: digests of pixel tensors already hashed (tensor_digest), by name; and whether the
    # tensors were the ones kept from the video's last question
    digests: dict[str, bytes] = field(default_factory=dict)
    pixels_kept: bool = False

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass
class SequenceEmbeddings:
    """What the language model consumes: the full sequence with video features scattered in."""

    embeds: torch.Tensor  # (1, L, D) token embeddings, video positions holding visual features
    positions: torch.Tensor  # (P, 1, L) rotary positions: P=3 for Qwen's M-RoPE, P=1 for 1-D
    next_position: int  # rotary position of the first generated token
    layout: VideoTokenLayout
    # Extra per-video-token features injected inside the language model (Qwen3-VL deepstack):
    # each (N_video, D), pruned together with the video tokens.
    deepstack: list[torch.Tensor] = field(default_factory=list)
    # The engine's plan to reuse a cached prefix of this sequence (engine/prefix_cache.py `Reuse`), when it has
    # one: the target's prefill then runs through it (engine/pair_prefill.py prefill_for_strategy). None: a
    # plain prefill. Without vision features (`embed_with(inputs, None)`) the video rows hold placeholder
    # embeddings, which only a prefill that takes every video row from the cache may be given.
    reuse: Any = None

    @property
    def seq_len(self) -> int:
        return int(self.embeds.shape[1])

    @property
    def visual_embeds(self) -> torch.Tensor:
        """(N_video, D) the visual features as they enter the language model."""
        return self.embeds[0, self.layout.seq_positions]


@dataclass
class VisionFeatures:
    """The vision tower's output for one video, as it enters the language model (`embed_with`): what the engine's
    prefix cache keeps per video (engine/prefix_cache.py), so a second question about it skips the tower."""

    video: torch.Tensor  # (N_video, D) features of the video tokens, in layout order
    deepstack: list[torch.Tensor] = field(default_factory=list)  # Qwen3-VL: (N_video, D) per deepstack layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.video, *self.deepstack])


@dataclass
class DecodeState:
    """A sequence's KV cache and where its rotary positions stand."""

    cache: DynamicCache
    position_offset: int  # rotary position of the next token = length + position_offset
    prefill_len: int  # cache entries written by the prefill (text + kept video tokens)

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())


@dataclass
class PrefillResult:
    logits: torch.Tensor  # (V,) float32 logits for the first generated token
    state: DecodeState
    hidden_states: tuple[torch.Tensor, ...] | None = None  # (1, L_kept, D) per layer, when asked
    signals: Any = None  # pruning signals captured during the prefill (models/signals.py), when asked


def sibling_columns(start: int, row: int, length: int) -> torch.Tensor:
    """The cache columns of one request in a packed prefill of siblings (`VideoLMAdapter.prefill_siblings`): the
    shared prefix [0, start), then its own suffix, fed from the packed forward's row `row`, `length` long."""
    return torch.cat([torch.arange(start), torch.arange(start + row, start + row + length)])


class VideoLMAdapter(ABC):
    """Base class of the per-family adapters. Subclasses implement the four abstract hooks."""

    family: str = ""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pixel_memo = PixelMemo()  # the last read-only video's pixel tensors (models/pixel_memo.py)
        # Captured steps (models/captured.py), when `capture` turned them on: the compiled language model and
        # the one fixed cache it steps over, lent to one sequence at a time (models/batch.py takes it).
        self.captured: CapturedLanguageModel | None = None
        self.fixed_cache: FixedCacheLease | None = None
        # A tensor-parallel target's leader (models/tensor_parallel.py): its forwards and cache ops, mirrored.
        self.mirror: Any = None

    def capture(self, mode: str, capacity: int) -> None:
        """Steps over a `FixedCache` run captured (`mode`: models/spec.CAPTURE_MODES); the prefill stays eager."""
        self.captured = CapturedLanguageModel(self.language_model, mode, self.device)
        self.fixed_cache = FixedCacheLease(self.model.config, capacity)

    # ---- family hooks -------------------------------------------------------------------------

    @abstractmethod
    def prepare(self, frames: np.ndarray, prompt: str, frame_times: np.ndarray | None = None) -> VideoInputs:
        """frames: (T, H, W, 3) uint8 RGB. Builds tokens, pixel tensors and the video token layout.

        frame_times: (T,) seconds at which each frame was taken in the source video (what
        `vpsd.video.item.load_frames` returns beside the frames). A family that tells its model
        the time (Qwen2.5-VL in the rotary phase, Qwen3-VL in the prompt) takes it from there; None
        means the frames were sampled at the family's default rate from time 0."""

    @abstractmethod
    def count_tokens(self, num_frames: int, height: int, width: int, prompt: str,
                     frame_times: np.ndarray | None = None) -> int:
        """`prepare(frames, prompt, frame_times).seq_len` for `num_frames` frames of height x width, from the sizes
        alone: whether a video fits the context is known before any frame of it is decoded."""

    @abstractmethod
    def embed(self, inputs: VideoInputs) -> SequenceEmbeddings:
        """Runs the vision tower, scatters its features into the token embeddings, computes positions."""

    def _language_kwargs(self, emb: SequenceEmbeddings, kept_video: torch.Tensor) -> dict[str, Any]:
        """Extra keyword arguments for the language model's prefill (deepstack for Qwen3-VL)."""
        return {}

    # ---- embed split in two, for reuse (engine/prefix_cache.py) ---------------------------------

    def vision_features(self, inputs: VideoInputs) -> VisionFeatures:
        """The vision tower alone: `embed(inputs)` is `embed_with(inputs, vision_features(inputs))`."""
        raise NotImplementedError(f"{type(self).__name__} does not split its embed")

    def embed_with(self, inputs: VideoInputs, features: VisionFeatures | None) -> SequenceEmbeddings:
        """Token embeddings with `features` scattered into the video rows, and the rotary positions, which need no
        vision tower (Qwen's need the grid only). features None: the video rows keep their placeholder tokens'
        embeddings, for a prefill that takes every video row from a cached prefix (`SequenceEmbeddings.reuse`)."""
        raise NotImplementedError(f"{type(self).__name__} does not split its embed")

    def _span_kwargs(self, emb: SequenceEmbeddings, start: int, end: int) -> dict[str, Any]:
        """Extra keyword arguments for a forward of sequence positions [start, end) (`prefill_span`)."""
        return {}

    @torch.inference_mode()
    def prefill_span(self, emb: SequenceEmbeddings, cache: DynamicCache, start: int, end: int,
                     logits: bool = False) -> torch.Tensor | None:
        """Feeds the full sequence's positions [start, end) (every token, each at its own rotary position) after a
        cache holding exactly positions [0, start): a prefill in pieces, for a prefix whose cache was kept
        (engine/prefix_cache.py). Returns the (V,) float32 logits of the span's last row when `logits`."""
        if cache.get_seq_length() != start or not start < end <= emb.seq_len:
            raise ValueError(f"cannot feed [{start}, {end}) of {emb.seq_len} after a cache of {cache.get_seq_length()}")
        positions = emb.positions[:, :, start:end]
        out = self.run_language_model(
            cache,
            inputs_embeds=emb.embeds[:, start:end],
            position_ids=positions if self.position_rows > 1 else positions[0],  # 1-D rotary: (1, n), as `prefill`
            **self._span_kwargs(emb, start, end),
        )
        return self.model.lm_head(out.last_hidden_state[:, -1]).float()[0] if logits else None

    def prefill_after(self, emb: SequenceEmbeddings, cache: DynamicCache, start: int) -> PrefillResult:
        """The full prefill's result when `cache` already holds positions [0, start) of `emb`: only the suffix is
        fed (`prefill_span`), and the state is what `prefill(emb)` returns (every token in the cache)."""
        logits = self.prefill_span(emb, cache, start, emb.seq_len, logits=True)
        n = emb.seq_len
        return PrefillResult(logits=logits, state=DecodeState(cache=cache, position_offset=emb.next_position - n,
                                                              prefill_len=n))

    def packs_suffixes(self, embs: Sequence[SequenceEmbeddings], start: int) -> bool:
        """Whether `prefill_siblings` can feed these requests' suffixes [start, L) in one forward: a model on one
        rank that takes a 4-D mask, whose span forward needs nothing but embeddings and positions (no video in
        the suffix)."""
        impl = getattr(self.model.config.get_text_config(), "_attn_implementation", None) or ""
        return (self.mirror is None and not impl.startswith("flash")
                and all(not self._span_kwargs(e, start, e.seq_len) for e in embs))

    @torch.inference_mode()
    def prefill_siblings(self, embs: Sequence[SequenceEmbeddings], cache: DynamicCache, start: int
                         ) -> list[PrefillResult]:
        """`prefill_after` of several requests that share positions [0, start) (one video's questions), in ONE
        forward: `cache` holds that prefix once, and the suffixes [start, L_i) are packed one after another in a
        single row, each at its own positions, under a mask that shows each suffix the prefix and its own
        earlier tokens only (a tree prefill whose branches are the questions; no padding, so the forward costs
        the rows it feeds). Returns what `prefill_after` returns for each, each with a cache of its own (the
        prefix, then its own suffix's entries); `cache` is left holding the packed rows. The rows agree with
        `prefill_after`'s up to the float order of a wider forward (as a batched verify's do)."""
        lengths = [e.seq_len - start for e in embs]
        offsets = [sum(lengths[:i]) for i in range(len(embs))]
        total = sum(lengths)
        allowed = torch.zeros(total, start + total, dtype=torch.bool)
        allowed[:, :start] = True
        for o, k in zip(offsets, lengths):
            allowed[o : o + k, start + o : start + o + k] = torch.ones(k, k, dtype=torch.bool).tril()
        pos = torch.cat([e.positions[:, :, start:] for e in embs], dim=2)
        out = self.run_language_model(
            cache,
            inputs_embeds=torch.cat([e.embeds[:, start:] for e in embs], dim=1),
            attention_mask=additive_mask(allowed[None], self.model.dtype).to(self.device),
            position_ids=pos if self.position_rows > 1 else pos[0],
        )
        last = torch.tensor([o + k - 1 for o, k in zip(offsets, lengths)], device=self.device)
        logits = self.model.lm_head(out.last_hidden_state[0, last]).float()
        results = []
        for i, (e, o, k) in enumerate(zip(embs, offsets, lengths)):
            cols = sibling_columns(start, o, k).to(self.device)
            own = GrowingCache.holding(self.model.config.get_text_config(), [
                (layer.keys[:, :, cols], layer.values[:, :, cols]) for layer in cache.layers])
            results.append(PrefillResult(logits=logits[i], state=DecodeState(
                cache=own, position_offset=e.next_position - e.seq_len, prefill_len=e.seq_len)))
        return results

    # ---- shared machinery ---------------------------------------------------------------------

    def text(self, token_ids: Sequence[int]) -> str:
        """What generated tokens read as: a result's text, and what stop strings are looked for in."""
        with tokenizer_lock(self.tokenizer):
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def render_chat(self, turns: Sequence[Turn], video_block: str) -> str | None:
        """The tokenizer's own chat template over a conversation's turns (models/prompt.py render_template: their
        texts are slots, the video in its turn before its text), or None when the tokenizer has none (the tiny
        offline models: the family's hand-written form is used). The render must hold `video_block`, the
        placeholder the family expands, exactly once."""
        return render_template(self.tokenizer, turns, video_block)

    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for this model's language model, growing in place (models/kv_cache.py)."""
        return GrowingCache(self.model.config.get_text_config())

    def run_language_model(self, cache: DynamicCache, **inputs: Any):
        """One language-model forward that appends to `cache` (the keyword it goes under: models/hf_compat.py);
        compiled when the cache is the captured path's fixed one, mirrored to a tensor-parallel target's ranks."""
        inputs["use_cache"] = True
        if self.mirror is not None:
            return self.mirror.forward(lambda **kw: self._forward(cache, kw), cache, inputs)
        return self._forward(cache, inputs)

    def _forward(self, cache: DynamicCache, inputs: dict[str, Any]):
        forward = self.captured if self.captured is not None and isinstance(cache, FixedCache) else self.language_model
        return forward(**inputs, **cache_kwargs(self.language_model, cache))

    def cache_op(self, name: str, cache: DynamicCache, *args: Any) -> None:
        """A cache operation of models/cache_ops.py by name (mirrored to a tensor-parallel target's ranks)."""
        if self.mirror is not None:
            self.mirror.cache_op(name, cache, *args)
        else:
            CACHE_OPS[name][0](cache, *args)

    def kept_sequence_positions(self, layout: VideoTokenLayout, seq_len: int, keep: torch.Tensor | None) -> torch.Tensor:
        """Sorted sequence positions that a prefill feeds: every non-video token plus the kept video tokens."""
        if keep is None:
            return torch.arange(seq_len)
        keep = keep.long()
        # Non-prunable video tokens (e.g. newlines) are never dropped, whatever the caller sent.
        forced = torch.nonzero(~layout.prunable).squeeze(1)
        kept_video = torch.unique(torch.cat([keep, forced]))
        is_video = torch.zeros(seq_len, dtype=torch.bool)
        is_video[layout.seq_positions] = True
        selected = ~is_video
        selected[layout.seq_positions[kept_video]] = True
        return torch.nonzero(selected).squeeze(1)

    @torch.inference_mode()
    def prefill(
        self,
        emb: SequenceEmbeddings,
        keep: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        cache: DynamicCache | None = None,
    ) -> PrefillResult:
        """Prefills the text and the kept video tokens (all of them when keep is None).

        cache: an empty cache from `new_cache()` to fill, for a caller that reads it while the prefill runs
        (models/signals.py); a new one when None."""
        sel = self.kept_sequence_positions(emb.layout, emb.seq_len, keep).to(emb.embeds.device)
        kept_video = torch.nonzero(torch.isin(emb.layout.seq_positions.to(sel.device), sel)).squeeze(1)
        cache = self.new_cache() if cache is None else cache
        positions = emb.positions[:, :, sel]
        out = self.run_language_model(
            cache,
            inputs_embeds=emb.embeds[:, sel],
            # A 1-D rotary model takes (1, n): given (1, 1, n) a Qwen2 LM runs without error but wrong logits.
            position_ids=positions if self.position_rows > 1 else positions[0],
            output_hidden_states=output_hidden_states,
            **self._language_kwargs(emb, kept_video),
        )
        logits = self.model.lm_head(out.last_hidden_state[:, -1]).float()[0]
        n = int(sel.numel())
        state = DecodeState(cache=cache, position_offset=emb.next_position - n, prefill_len=n)
        return PrefillResult(logits=logits, state=state, hidden_states=out.hidden_states if output_hidden_states else None)

    @torch.inference_mode()
    def step(self, state: DecodeState, token_ids: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        """Feeds k tokens after the cache; returns (k, V) float32 logits, the i-th predicting token i+1.

        rowwise: k one-token forwards instead of one k-token forward. They are the forwards `ar` runs, so
        every row and every cache entry is bit-identical to `ar`'s (same kernels, same shapes), where a
        k-row forward differs by float noise (up to 0.016 in bf16 on the world pair), enough to flip a
        greedy choice whose top-2 logits are that close. Costs k forwards per verify.
        """
        token_ids = token_ids.reshape(1, -1).to(self.device)
        k = token_ids.shape[1]
        if rowwise and k > 1:
            return torch.cat([self.step(state, token_ids[:, i : i + 1]) for i in range(k)])
        start = state.length + state.position_offset
        pos = torch.arange(start, start + k, device=self.device).view(1, 1, k)
        num_rows = self.position_rows
        out = self.run_language_model(
            state.cache,
            input_ids=token_ids,
            position_ids=pos.expand(num_rows, 1, k) if num_rows > 1 else pos[0],
        )
        return self.model.lm_head(out.last_hidden_state).float()[0]

    @torch.inference_mode()
    def step_tree(
        self, state: DecodeState, token_ids: torch.Tensor, seq_index: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Feeds k tokens of a draft tree after the cache; returns (k, V) float32 logits, row i for token i's successor.

        seq_index (k,): the index each token would have in a plain chain (a tree node: its root's index + its
        depth), so its rotary position is seq_index + position_offset, every M-RoPE row alike, as `step` does.
        visible (k, m + k) bool: what each token attends to among the last m cache entries (tree nodes fed
        before) and the k fed now; every earlier cache entry is visible to all. The mask goes to the language
        model as a 4-D additive float mask, which eager and sdpa attention both take as it is.
        """
        impl = getattr(self.model.config.get_text_config(), "_attn_implementation", None) or ""
        if impl.startswith("flash"):
            raise ValueError(f"tree attention needs a 4-D mask; attn_implementation {impl!r} takes none: use sdpa")
        token_ids = token_ids.reshape(1, -1).to(self.device)
        k = token_ids.shape[1]
        length = state.length
        m = visible.shape[1] - k
        if visible.shape[0] != k or not 0 <= m <= length or seq_index.numel() != k:
            raise ValueError(f"tree step of {k} tokens got visible {tuple(visible.shape)} on a cache of {length}")
        allowed = torch.ones(k, length + k, dtype=torch.bool)
        allowed[:, length - m :] = visible
        mask = additive_mask(allowed[None], self.model.dtype)
        pos = (seq_index.long() + state.position_offset).view(1, 1, k).to(self.device)
        num_rows = self.position_rows
        out = self.run_language_model(
            state.cache,
            input_ids=token_ids,
            attention_mask=mask.to(self.device),
            position_ids=pos.expand(num_rows, 1, k) if num_rows > 1 else pos[0],
        )
        return self.model.lm_head(out.last_hidden_state).float()[0]

    def compact(self, state: DecodeState, start: int, keep: list[int]) -> None:
        """Keeps the cache entries before `start` and, moved right after them in this order, the entries
        start + keep[i]; drops the rest. After a tree round `keep` is the accepted path's nodes: their keys
        already carry the rotary phase of consecutive positions, so the cache equals a chain's."""
        current = state.length
        if not state.prefill_len <= start <= current or any(not 0 <= i < current - start for i in keep):
            raise ValueError(f"cannot keep {keep} after {start} in a cache of {current} (prefill {state.prefill_len})")
        if keep == list(range(len(keep))):  # already in place: a crop does it
            self.rollback(state, start + len(keep))
            return
        if self.mirror is not None:  # refused at launch (launch/preflight.py); this is the backstop
            raise RuntimeError("a draft tree's cache compaction is not mirrored to a tensor-parallel target's ranks")
        idx = torch.tensor(keep, dtype=torch.long)
        for layer in state.cache.layers:
            tail = idx.to(layer.keys.device) + start
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, tail]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, tail]], dim=2)

    def rollback(self, state: DecodeState, length: int) -> None:
        """Drops every cache entry past `length` (Cache.crop is the one rollback mechanism)."""
        current = state.length
        if length > current or length < state.prefill_len:
            raise ValueError(f"cannot roll back a cache of length {current} to {length} (prefill {state.prefill_len})")
        if length < current:
            self.cache_op("crop", state.cache, current - length)

    @property
    def position_rows(self) -> int:
        """Rows of rotary positions the language model takes (3 for M-RoPE, 1 for 1-D)."""
        return 1

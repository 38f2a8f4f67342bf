"""Pruning signals captured during the target's full prefill, without any attention matrix, streamed mid-prefill.

`prefill_with_signals` runs the adapter's ordinary full prefill with hooks on the first L decoder layers
(L: `PruningConfig.signal_layers`, all layers by default as HIPPO Eq. 2 and SpecVLM Eq. 5 define the
attention score; a parallel run streams after an earlier layer, ParallelVLM's variant).

Attention is scored on the target, layer by layer as the prefill runs. Every hook reads a module's OUTPUT or
an object vpsd itself owns, never a keyword argument that transformers passes between its own modules (those
get renamed: 5.24 renamed `past_key_values` to `cache`). A forward hook on the language model's rotary module
keeps the (cos, sin) it computes for the sequence; the multimodal rotary (Qwen's M-RoPE, interleaved for
Qwen3-VL) is already folded into them there, so every family applies them with the plain
`apply_rotary_pos_emb` of its modeling file. A forward hook on each layer's `q_proj` takes the projected
queries of the TEXT rows and finishes them exactly as the attention module does: q_norm where the layer has
one (Qwen3-VL), split into heads, rotary. A forward hook on the attention module itself, which has by then
written its keys to the cache that `prefill_with_signals` created and handed to the adapter (rotary applied,
key j at sequence position j), rebuilds that layer's text-to-video attention
(pipeline/pruning/attention.py) and drops the queries. Only the (L, Hkv, N) float32 mass is kept and sent:
no queries stacked over layers, no keys on the wire (for Qwen2.5-VL-7B and 24k video tokens, 7.5 MiB at 20
layers where the keys were 483 MiB), and the pruner has nothing to rebuild. The cost moves to the target:
Hq x Nt x S x d multiply-adds a layer, Nt text rows against the layer's own prefill of S rows (about 0.1% at
7B width and 24k tokens, by that count); measured, 1-2% of the CPU scale default's small prefill
(`vpsd bench signals`).

Hidden-state rows (UV-Prune) are read only at the two layers UV-Prune's score uses (its sum telescopes:
pipeline/pruning/uv.py), so no per-layer stack of them exists: the input of layer 0 is the embeddings the
prefill feeds (no family here scales them), the output of layer L comes from a forward hook on that layer.

As soon as layer L-1 has run, every signal is complete: a hook there hands them to `on_ready` while the
layers after L are still to run (the target starts the send to the pruner in it).
`vpsd bench signal_memory` measures all of it at a real target's depth and 24k tokens.

Text tokens are the non-video tokens after the last video token (the question and the assistant header):
the queries whose attention HIPPO, SpecVLM and Sparse-to-Dense read.

With prefix reuse (engine/prefix_cache.py, `emb.reuse` set by the engine) the prefill is two forwards cut at
P = the last video token + 1: [0, P) (system + video; from the cache on a hit, else computed and kept) and
[P, S), which is exactly the text rows (a conversation's prefix is cut at its turns too, a forward a segment;
its text rows are then the last segment's: the final user turn and the assistant header, the question being
answered, where a prefill without reuse reads every text row after the video). So the signals come from those
forwards, the same tensors by definition: the query and row hooks run during the SUFFIX forward (they see
exactly the text rows, indexed relative to P), the attention hook reads the video keys from the cache, which
then holds prefix + suffix at their positions, and `on_ready` fires after layer L-1 of the suffix forward. UV-Prune's video rows at layer L come from the
PREFIX forward: computed there on a miss and kept with the prefix's KV, so a hit has them (layer 0's are the
embeddings, as here). A hit computes exactly what a miss computes, signals included, bit for bit; against the
one-forward prefill they differ by float noise only (another split of the same matmuls).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter, sibling_columns
from vpsd.models.hook_lock import hooks_installed
from vpsd.pipeline.pruning.attention import layer_video_attention
from vpsd.pipeline.pruning.strategies import PruningSignals
from vpsd.pipeline.pruning.uv import UV_DEFAULT_LAYERS


@dataclass
class PrefillSignals:
    """What the target's prefill measured for the pruner; fields not asked for stay None."""

    video_attention: torch.Tensor | None = None  # (L, Hkv, N) float32 text-to-video attention (attention.py)
    video_hidden: torch.Tensor | None = None  # (2, N, D) hidden states of the video tokens at layers 0 and L
    text_hidden: torch.Tensor | None = None  # (2, Nt, D) hidden states of the text tokens at layers 0 and L

    def merged_into(self, signals: PruningSignals) -> PruningSignals:
        """A copy of `signals` with this object's non-None fields set."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(signals, **{k: v for k, v in fields.items() if v is not None})

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """The non-None fields, named as PruningSignals' fields (what the wire sends)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def text_positions(emb: SequenceEmbeddings) -> torch.Tensor:
    """(Nt,) sequence positions of the non-video tokens after the last video token."""
    after = torch.arange(int(emb.layout.seq_positions.max()) + 1, emb.seq_len)
    return after[~torch.isin(after, emb.layout.seq_positions)]


def _text_queries(attn: torch.nn.Module, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """projected (1, Nt, Hq*d) q_proj output rows, cos / sin (1, Nt, d) -> (Hq, Nt, d) queries, as `attn` builds them."""
    q = projected.view(*projected.shape[:-1], -1, attn.head_dim)  # (1, Nt, Hq, d)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = q.transpose(1, 2)  # (1, Hq, Nt, d)
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # the function the module's forward calls
    q, _ = rotary(q, q, cos, sin)
    return q[0]


SignalsReady = Callable[[PrefillSignals], None]


def this_thread_only(hook: Callable) -> Callable:
    """The hook, run only for forwards on the thread that registered it: the model is shared, and a batch may
    decode on another thread while this prefill runs (engine/prefill_ahead.py prefills on a spare core)."""
    owner = threading.get_ident()

    @functools.wraps(hook)
    def guarded(*args):
        if threading.get_ident() == owner:
            return hook(*args)
        return None

    return guarded


def layer_output(out) -> torch.Tensor:
    """A decoder layer's output hidden states (transformers 5 layers return a tensor; older ones a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def hooked_layers(adapter: VideoLMAdapter, num_layers: int | None, attention: bool, hidden: bool) -> tuple[int, int]:
    """(attention layers, UV-Prune layer) that `prefill_with_signals` hooks for these arguments; 0 for one not
    asked for."""
    layers = len(adapter.language_model.layers)
    attn_layers = layers if num_layers is None else min(num_layers, layers)
    uv_layers = min(UV_DEFAULT_LAYERS if num_layers is None else num_layers, layers)
    return attn_layers if attention else 0, uv_layers if hidden else 0


def prefill_with_signals(
    adapter: VideoLMAdapter,
    emb: SequenceEmbeddings,
    num_layers: int | None,
    attention: bool,
    hidden: bool,
    on_ready: SignalsReady | None = None,
) -> PrefillResult:
    """A full prefill (as `adapter.prefill(emb)`) whose result carries `PrefillSignals` of the first L layers.

    attention: the text-to-video attention of layers 0..L-1 per KV head, L = num_layers, or every layer when
    None or the model has fewer. hidden: video / text rows of the input of layer 0 and the
    output of layer L-1 (hidden states 0 and L; a layer's raw output, so before the final norm even when L
    is every layer), L = num_layers or UV-Prune's 20 when None, at most every layer.

    Streaming: the signals are complete as soon as layer L-1 has run (its keys are in the cache, every
    query and row was captured on the way), so a forward hook on layer L-1 builds them there and calls
    `on_ready(signals)` while the remaining layers have yet to run. The caller starts a non-blocking send
    in it and the prefill goes on. Hooks, not a forward split at layer L: the model's own forward runs
    unchanged (masks, rotary, Qwen3-VL deepstack injection), so the logits and cache are bit-identical to
    a plain prefill and nothing here re-implements a family's decoder loop.

    With `emb.reuse` (the engine's prefix reuse) the prefill is the reuse's two forwards, the signals taken from
    them (module docstring, `_prefill_reusing`): the result is what `emb.reuse.prefill` returns, with signals.
    """
    attn_layers, uv_layers = hooked_layers(adapter, num_layers, attention, hidden)
    if emb.reuse is not None:
        return _prefill_reusing(adapter, emb, attn_layers, uv_layers, on_ready)
    cache = adapter.new_cache()  # ours: the attention hooks read each layer's keys from it
    device = emb.embeds.device
    hooks = _SignalHooks(text_positions(emb).to(device), emb.layout.seq_positions.to(device), emb.embeds, cache,
                         attn_layers, uv_layers, on_ready)
    mirror = adapter.mirror  # a split target: its other ranks score their heads in the same forward

    def prefill() -> PrefillResult:
        if mirror is not None and hooks.attn_layers:
            with mirror.lock:
                mirror.score_next_forward(hooks.spec())
                hooks.gather = mirror.gather_heads
                return adapter.prefill(emb, cache=cache)
        return adapter.prefill(emb, cache=cache)

    return _hooked(hooks, adapter, prefill)


def _hooked(hooks: "_SignalHooks", adapter: VideoLMAdapter, forward: Callable[[], PrefillResult]) -> PrefillResult:
    """`forward()` with the signal hooks installed on the language model, its result carrying what they measured
    (layer L-1 must have run exactly once)."""
    lm = adapter.language_model
    with hooks_installed(lm, lambda: hooks.install(lm)):  # no trace of the model meanwhile (models/hook_lock.py)
        result = forward()
    if len(hooks.ready) != 1:
        raise RuntimeError(f"layer {hooks.last - 1} ran {len(hooks.ready)} times in one forward; expected once")
    result.signals = hooks.ready[0]
    return result


def _prefill_reusing(adapter: VideoLMAdapter, emb: SequenceEmbeddings, attn_layers: int, uv_layers: int,
                     on_ready: SignalsReady | None) -> PrefillResult:
    """`prefill_with_signals` through the engine's prefix reuse: the prefix [0, P) restored or computed (with the
    video rows of layer `uv_layers` when UV-Prune reads them, kept with its KV), then the suffix [P, S), the text
    rows (a conversation's final user turn and the assistant header: its earlier turns are segments of the
    prefix), with the signal hooks installed, indexed relative to P. A request prefilled with its siblings
    (`prefill_siblings_with_signals`) has its result, signals included, waiting on its plan already."""
    if adapter.mirror is not None:  # the engine never reuses over a split target (its followers hold the shards)
        raise RuntimeError("prefix reuse over a target split over ranks")
    reuse = emb.reuse
    if (ready := reuse.take_ready(emb, (attn_layers, uv_layers))) is not None:
        if on_ready is not None:
            on_ready(ready.signals)
        return ready
    cache, start, layer_rows = reuse.prefix(adapter, emb, uv_layers)
    hooks = _suffix_hooks(emb, cache, start, attn_layers, uv_layers, layer_rows, on_ready)
    return _hooked(hooks, adapter, lambda: reuse.suffix(adapter, emb, cache, start))


def _suffix_hooks(emb: SequenceEmbeddings, cache, start: int, attn_layers: int, uv_layers: int,
                  layer_rows: torch.Tensor | None, on_ready: SignalsReady | None, first_row: int = 0,
                  key_columns: torch.Tensor | None = None) -> "_SignalHooks":
    """The hooks of a suffix forward [start, S) whose first row is the forward's row `first_row` (a packed
    prefill of siblings: where its suffix begins among theirs)."""
    device = emb.embeds.device
    video_pos = emb.layout.seq_positions
    # Only the last segment's rows are fed now: a conversation's earlier turns came from the cache (or were
    # computed as it is kept), so the text rows read are those of the turn being answered, hit or miss alike.
    text_pos = text_positions(emb)
    text_pos = text_pos[text_pos >= start]
    if text_pos.numel() == 0 or int(video_pos.max()) >= start:
        raise RuntimeError(f"the suffix from {start} does not hold exactly the text rows")
    video_rows = None
    if uv_layers:  # layer 0: the embeddings the prefix fed (as a full prefill's); layer L: its forward's, kept
        video_rows = torch.stack([emb.embeds[0, video_pos.to(device)], layer_rows])
    return _SignalHooks(text_pos.to(device), video_pos.to(device), emb.embeds, cache, attn_layers, uv_layers,
                        on_ready, offset=start - first_row, video_rows=video_rows, key_columns=key_columns)


def prefill_siblings_with_signals(adapter: VideoLMAdapter, embs: list[SequenceEmbeddings], cache, start: int,
                                  wanted: list[tuple[int, int]], layer_rows: torch.Tensor | None
                                  ) -> list[PrefillResult]:
    """`VideoLMAdapter.prefill_siblings` with each request's signals measured in the same forward: wanted[i] =
    (attention layers, UV-Prune layer) of request i, (0, 0) for none; `layer_rows`: the video rows at the UV
    layer from the prefix's forward (one video: the same for all). Each request's hooks read its own rows of
    the packed forward and its own keys (the prefix's, then its suffix's), so it measures what its own suffix
    forward would, up to the float order of the wider forward."""
    hooks: list[_SignalHooks | None] = []
    row = 0
    for emb, (attn_layers, uv_layers) in zip(embs, wanted):
        n = emb.seq_len - start
        columns = sibling_columns(start, row, n).to(emb.embeds.device)
        hooks.append(_suffix_hooks(emb, cache, start, attn_layers, uv_layers, layer_rows, None, row, columns)
                     if attn_layers or uv_layers else None)
        row += n
    active = [h for h in hooks if h is not None]
    lm = adapter.language_model
    with hooks_installed(lm, lambda: [handle for h in active for handle in h.install(lm)]):
        results = adapter.prefill_siblings(embs, cache, start)
    for result, h in zip(results, hooks):
        if h is not None:
            if len(h.ready) != 1:
                raise RuntimeError(f"layer {h.last - 1} ran {len(h.ready)} times in one forward; expected once")
            result.signals = h.ready[0]
    return results


class _SignalHooks:
    """The forward hooks of one prefill with signals (`prefill_with_signals`) and what they collect. Each hook
    runs only on the thread that installed it (`this_thread_only`)."""

    def __init__(self, text_pos: torch.Tensor, video_pos: torch.Tensor, embeds: torch.Tensor | None, cache,
                 attn_layers: int, uv_layers: int, on_ready: SignalsReady | None, last: int | None = None,
                 offset: int = 0, video_rows: torch.Tensor | None = None,
                 key_columns: torch.Tensor | None = None) -> None:
        """text_pos / video_pos: the sequence positions of the text rows and the video tokens (`text_positions`,
        the layout's); embeds: the full sequence's embeddings (UV-Prune's layer-0 rows; None without them).
        offset: the sequence position of the hooked forward's first row (a reuse's suffix: P; else 0); video_rows:
        UV-Prune's (2, N, D) video rows when the hooked forward does not feed them (a reuse's suffix); key_columns:
        the cache columns that hold this prefill's keys, key j at position j (a packed prefill of siblings,
        `VideoLMAdapter.prefill_siblings`: the prefix, then its own suffix; None: every column)."""
        self.embeds, self.cache, self.attn_layers, self.uv_layers, self.on_ready = embeds, cache, attn_layers, uv_layers, on_ready
        self.last = last or max(attn_layers, uv_layers)  # the signals are complete after this layer
        self.text_pos, self.video_pos = text_pos, video_pos
        self.offset, self.given_video_rows, self.key_columns = offset, video_rows, key_columns
        self.text_rows_in = text_pos - offset  # the text rows' indices in the hooked forward's rows
        # A split target's: (L, Hkv/k, N) scored here -> (L, Hkv, N) of all its ranks (models/tensor_parallel.py)
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rotary: list[tuple[torch.Tensor, torch.Tensor]] = []  # the (cos, sin) of this prefill's rows
        self.attention_rows: list[torch.Tensor | None] = [None] * attn_layers
        self.pending: dict[int, torch.Tensor] = {}  # layer -> text queries, between its q_proj and its attention
        self.video_rows: list[torch.Tensor] = []  # hidden state 0 (input of layer 0), then L (output of layer L-1)
        self.text_rows: list[torch.Tensor] = []
        self.ready: list[PrefillSignals] = []

    def install(self, language_model: torch.nn.Module) -> list:
        layers, handles = language_model.layers, []

        def hook(module: torch.nn.Module, fn: Callable) -> None:
            handles.append(module.register_forward_hook(this_thread_only(fn)))

        if self.attn_layers:
            hook(language_model.rotary_emb, lambda module, args, out: self.rotary.append(out))
            for i in range(self.attn_layers):
                attn = layers[i].self_attn
                hook(attn.q_proj, self._capture_queries(i, attn))
                hook(attn, self._score_layer(i))
        if self.uv_layers:
            self._keep_rows(self.embeds, 0)  # layer 0's input: a prefill feeds the embeddings as they are
            hook(layers[self.uv_layers - 1], lambda module, args, out: self._keep_rows(layer_output(out), self.offset))
        hook(layers[self.last - 1], self._signals_done)  # after the row capture registered on the same layer
        return handles

    def _capture_queries(self, i: int, attn: torch.nn.Module) -> Callable:
        def capture(module, args, out):
            cos, sin = (t[:, self.text_rows_in] for t in self.rotary[-1])
            self.pending[i] = _text_queries(attn, out[:, self.text_rows_in], cos, sin)

        return capture

    def _score_layer(self, i: int) -> Callable:
        def score(module, args, out):
            # The module has written this layer's keys to the cache (a reuse's: the prefix's, then the suffix's,
            # key j at position j): score, then drop the queries.
            keys = self.cache.layers[i].keys[0]  # (Hkv, S, d), rotary applied
            if self.key_columns is not None:
                keys = keys[:, self.key_columns]
            self.attention_rows[i] = layer_video_attention(self.pending.pop(i), keys, self.video_pos, self.text_pos,
                                                           module.scaling)

        return score

    def spec(self) -> dict:
        """What a split target's other ranks need to score their heads in the same forward (`follower_hooks`)."""
        return {"attn_layers": self.attn_layers, "last": self.last, "text_pos": self.text_pos.tolist(),
                "video_pos": self.video_pos.tolist()}

    def _keep_rows(self, h: torch.Tensor, offset: int) -> None:
        """h: hidden states of rows [offset, ...) of the sequence."""
        if self.given_video_rows is None:
            self.video_rows.append(h[0, self.video_pos - offset])
        self.text_rows.append(h[0, self.text_pos - offset])

    def _signals_done(self, module, args, out) -> None:
        signals = PrefillSignals()
        if self.attn_layers:
            signals.video_attention = torch.stack(self.attention_rows)
            if self.gather is not None:
                signals.video_attention = self.gather(signals.video_attention)
        if self.uv_layers:
            signals.video_hidden = (torch.stack(self.video_rows) if self.given_video_rows is None
                                    else self.given_video_rows)
            signals.text_hidden = torch.stack(self.text_rows)
        self.ready.append(signals)
        if self.on_ready is not None:
            self.on_ready(signals)


def follower_hooks(spec: dict, cache, device: torch.device, gather: Callable[[torch.Tensor], torch.Tensor]
                   ) -> _SignalHooks:
    """A split target's follower's hooks for the leader's prefill with signals (`_SignalHooks.spec`): its heads
    scored layer by layer, handed to `gather` where the leader gathers them."""
    hooks = _SignalHooks(torch.tensor(spec["text_pos"], device=device), torch.tensor(spec["video_pos"], device=device),
                         None, cache, spec["attn_layers"], 0, None, last=spec["last"])
    hooks.gather = gather
    return hooks

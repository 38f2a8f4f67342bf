"""Pruning signals captured during the target's full prefill, without any attention matrix.

`prefill_with_signals` runs the adapter's ordinary full prefill with pre-hooks on the self-attention of
the first L decoder layers. Each hook reads the attention input (`hidden_states`, already normed) and the
rotary `position_embeddings` the layer is given, and recomputes the queries of the TEXT rows only, exactly
as the attention module does: q_proj, q_norm where the layer has one (Qwen3-VL), split into heads, then
the rotary function of the layer's own modeling file. The multimodal rotary (Qwen's M-RoPE, interleaved
for Qwen3-VL) is already folded into (cos, sin) by the model's rotary module, so every family applies it
with the plain `apply_rotary_pos_emb`. Keys are read from the KV cache afterwards (rotary applied, key j at
sequence position j). Memory: L x (Hq, Nt, d) queries plus a copy of L layers' keys; the text-to-video
attention itself is rebuilt in chunks by pipeline/pruning/attention.py.

Text tokens are the non-video tokens after the last video token (the question and the assistant header):
the queries whose attention HIPPO, SpecVLM and Sparse-to-Dense read.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch

from vpsd.config import PruningConfig
from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.pipeline.pruning.strategies import STRATEGIES, PruningSignals


@dataclass
class PrefillSignals:
    """What the target's prefill measured for the pruner; fields not asked for stay None."""

    text_queries: torch.Tensor | None = None  # (L, Hq, Nt, d) text queries, rotary applied, model dtype
    keys: torch.Tensor | None = None  # (L, Hkv, S, d) cached keys, key j at sequence position j
    query_positions: torch.Tensor | None = None  # (Nt,) int64 sequence positions of the text tokens
    attn_scale: float | None = None  # the attention modules' softmax scale
    video_hidden: torch.Tensor | None = None  # (L+1, N, D) hidden states of the video tokens
    text_hidden: torch.Tensor | None = None  # (L+1, Nt, D) hidden states of the text tokens

    def merged_into(self, signals: PruningSignals) -> PruningSignals:
        """A copy of `signals` with this object's non-None fields set."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(signals, **{k: v for k, v in fields.items() if v is not None})

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """The non-None fields as tensors, named as PruningSignals' fields (attn_scale becomes a 0-d tensor)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
        return out


def text_positions(emb: SequenceEmbeddings) -> torch.Tensor:
    """(Nt,) sequence positions of the non-video tokens after the last video token."""
    after = torch.arange(int(emb.layout.seq_positions.max()) + 1, emb.seq_len)
    return after[~torch.isin(after, emb.layout.seq_positions)]


def _text_queries(attn: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """hidden (1, Nt, D) attention input rows, cos / sin (1, Nt, d) -> (Hq, Nt, d) queries, as `attn` builds them."""
    q = attn.q_proj(hidden).view(*hidden.shape[:-1], -1, attn.head_dim)  # (1, Nt, Hq, d)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = q.transpose(1, 2)  # (1, Hq, Nt, d)
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # the function the module's forward calls
    q, _ = rotary(q, q, cos, sin)
    return q[0]


def prefill_with_signals(
    adapter: VideoLMAdapter,
    emb: SequenceEmbeddings,
    num_layers: int,
    attention: bool,
    hidden: bool,
) -> PrefillResult:
    """A full prefill (as `adapter.prefill(emb)`) whose result carries `PrefillSignals` of the first L layers.

    attention: text queries, keys, query positions and scale; hidden: video / text rows of hidden_states[0..L].
    L = num_layers, or every layer if the model has fewer. The full per-layer hidden states are not kept in the
    result (only their video and text rows, in the signals).
    """
    layers = adapter.language_model.layers
    num_layers = min(num_layers, len(layers))
    text_pos = text_positions(emb).to(emb.embeds.device)
    queries: list[torch.Tensor | None] = [None] * num_layers
    handles = []

    def capture(i: int):
        def hook(module, args, kwargs):
            rows = kwargs["hidden_states"][:, text_pos]
            cos, sin = (t[:, text_pos] for t in kwargs["position_embeddings"])
            queries[i] = _text_queries(module, rows, cos, sin)

        return hook

    try:
        if attention:
            for i in range(num_layers):
                handles.append(layers[i].self_attn.register_forward_pre_hook(capture(i), with_kwargs=True))
        result = adapter.prefill(emb, output_hidden_states=hidden)
    finally:
        for h in handles:
            h.remove()

    signals = PrefillSignals()
    if attention:
        cache_layers = result.state.cache.layers[:num_layers]
        signals.text_queries = torch.stack(queries)
        signals.keys = torch.stack([layer.keys[0] for layer in cache_layers])
        signals.query_positions = text_pos.cpu()
        signals.attn_scale = float(layers[0].self_attn.scaling)
    if hidden:
        states = result.hidden_states[: num_layers + 1]  # L+1 of (1, S, D)
        video_pos = emb.layout.seq_positions.to(text_pos.device)
        signals.video_hidden = torch.stack([h[0, video_pos] for h in states])
        signals.text_hidden = torch.stack([h[0, text_pos] for h in states])
        result.hidden_states = None
    result.signals = signals
    return result


def prefill_for_strategy(adapter: VideoLMAdapter, emb: SequenceEmbeddings, cfg: PruningConfig) -> PrefillResult:
    """The target's full prefill with exactly the signals `cfg.strategy` reads (a plain prefill when none)."""
    strategy = STRATEGIES[cfg.strategy]
    attention, hidden = strategy.needs_attention, strategy.needs_hidden_states
    if cfg.strategy == "none" or cfg.ratio == 0.0 or not (attention or hidden):
        return adapter.prefill(emb)
    return prefill_with_signals(adapter, emb, cfg.layers, attention, hidden)

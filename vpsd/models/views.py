"""TABED's drafting views of one item, batched through one forward of the draft model per step.

Views (TABED Sec. 5-6), each a prefix of the same item for the same model:
  - "multimodal": text + the kept video tokens (the pruner's indices), as every other draft;
  - "text": the text alone (no prunable video token; LLaVA-OneVision's non-prunable newline stays);
  - "pooled": text + the video average-pooled in side x side blocks per frame (pipeline/pooling.py).
  The paper pools before the projector; the adapters hand us features after it, so we pool those:
  the same 4x reduction, one linear map later.

Each view is prefilled on its own (once per item; lengths differ), then the caches are merged into
one batch: row i = view i, left-padded with zero entries to one length, an attention mask hiding the
padding. The views share rotary positions from the first generated token on: every pruned prefill
continues from the full sequence's positions (cache length + position_offset), so one position row
serves all views, M-RoPE included. A step then feeds the same tokens to every row in one forward;
rollback is one crop of the batch (generated entries are the rightmost columns of every row).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vpsd.models.base import DecodeState, SequenceEmbeddings, VideoLMAdapter
from vpsd.pipeline.pooling import average_by_group, pool_groups


@dataclass
class ViewBatch:
    state: DecodeState  # the merged cache: batch rows = views
    pad: torch.Tensor  # (m,) zero entries at the left of each row
    names: tuple[str, ...]

    @property
    def num_views(self) -> int:
        return len(self.names)

    def attention_mask(self, new_tokens: int) -> torch.Tensor:
        """(m, length + new_tokens) 1 for real entries and the new tokens, 0 for the padding."""
        total = self.state.length + new_tokens
        cols = torch.arange(total)
        return (cols[None, :] >= self.pad[:, None]).long()


def pooled_view(emb: SequenceEmbeddings, side: int) -> tuple[SequenceEmbeddings, torch.Tensor]:
    """The embeddings with each block's mean at its first member, and those members as kept indices."""
    reps, group_of = pool_groups(emb.layout, side)
    num = int(reps.numel())
    embeds = emb.embeds.clone()
    pos = emb.layout.seq_positions[reps].to(embeds.device)
    embeds[0, pos] = average_by_group(emb.visual_embeds, group_of, num)

    def pool_rows(rows: torch.Tensor) -> torch.Tensor:  # deepstack rows are per video token too
        out = rows.clone()
        out[reps.to(rows.device)] = average_by_group(rows, group_of, num)
        return out

    return dataclasses.replace(emb, embeds=embeds, deepstack=[pool_rows(d) for d in emb.deepstack]), reps


def view_inputs(name: str, emb: SequenceEmbeddings, keep: torch.Tensor, pool: int) -> tuple[SequenceEmbeddings, torch.Tensor]:
    if name == "multimodal":
        return emb, keep
    if name == "text":
        return emb, torch.empty(0, dtype=torch.long)
    if name == "pooled":
        return pooled_view(emb, pool)
    raise ValueError(f"unknown drafting view {name!r}")


def merge_states(adapter: VideoLMAdapter, states: list[DecodeState]) -> tuple[DecodeState, torch.Tensor]:
    """One batched cache from single-row prefill caches (left padding); returns it and the padding."""
    nexts = {s.length + s.position_offset for s in states}
    if len(nexts) != 1:
        raise ValueError(f"views disagree on the next rotary position: {sorted(nexts)}")
    width = max(s.length for s in states)
    pad = torch.tensor([width - s.length for s in states])
    cache = adapter.new_cache()
    for layer in range(len(states[0].cache.layers)):
        keys, values = [], []
        for s, p in zip(states, pad.tolist()):
            src = s.cache.layers[layer]
            keys.append(torch.nn.functional.pad(src.keys, (0, 0, p, 0)))
            values.append(torch.nn.functional.pad(src.values, (0, 0, p, 0)))
        cache.update(torch.cat(keys), torch.cat(values), layer)
    return DecodeState(cache=cache, position_offset=nexts.pop() - width, prefill_len=width), pad


@torch.inference_mode()
def prefill_views(
    adapter: VideoLMAdapter, emb: SequenceEmbeddings, keep: torch.Tensor, names: tuple[str, ...], pool: int
) -> tuple[ViewBatch, torch.Tensor]:
    """Prefills every view; returns the batch and the (m, V) logits of each view's first token."""
    states, logits = [], []
    for name in names:
        view_emb, view_keep = view_inputs(name, emb, keep, pool)
        pre = adapter.prefill(view_emb, keep=view_keep)
        states.append(pre.state)
        logits.append(pre.logits)
    state, pad = merge_states(adapter, states)
    return ViewBatch(state=state, pad=pad, names=tuple(names)), torch.stack(logits)


@torch.inference_mode()
def step_views(adapter: VideoLMAdapter, batch: ViewBatch, token_ids: torch.Tensor) -> torch.Tensor:
    """Feeds the same k tokens to every view in one forward; (m, k, V) float32 logits."""
    device = adapter.device
    m, k = batch.num_views, int(token_ids.numel())
    ids = token_ids.reshape(1, k).to(device).expand(m, k)
    state = batch.state
    start = state.length + state.position_offset
    pos = torch.arange(start, start + k, device=device).view(1, 1, k)
    rows = adapter.position_rows
    mask = batch.attention_mask(k).to(device)
    out = adapter.run_language_model(
        state.cache,
        input_ids=ids,
        position_ids=pos.expand(rows, m, k) if rows > 1 else pos[0].expand(m, k),
        attention_mask=mask,
    )
    return adapter.model.lm_head(out.last_hidden_state).float()

"""What `vpsd tune` measures in its own process, on the sample's items, before any job runs (one target pass an item).

Per item: the target's vision and prefill (with the signals every strategy asked reads: attention of every layer,
hidden states at each layer a strategy is read at), then its own output token by token (greedy, or keyed samples:
the reference every draft is scored against, and `ar`'s step time T_ar at this context), then its forward of k rows
at the end context (T_p at each verify width). Per draft key (candidates.py): the pruner's selection from those
signals, the draft's prefill on the kept tokens, one teacher-forced pass over the reference (the rank of each
reference token among the draft's scores: agreement.py replays any window from them), and its forward of k rows
(T_q; keys of one ratio share it). std's draft is the target on its sparse cache; TABED's, its batched views.
Over a batch: one forward of B rows of k tokens each (the engine's BatchedCache, the items' caches copied in), for
the target and for the draft at each ratio. And a round's messaging where the draft runs: a ZeroMQ round trip
(a rank) and a queue's (threads). The costs of the forwards are medians of `repeats` calls, each rolled back (fewer
once they add up to ENOUGH_S).
Everything runs pinned as the config pins the target rank, with as many threads as it has cores.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from vpsd.bench.tune.candidates import DraftKey
from vpsd.config import RunConfig
from vpsd.engine.keep import keep_policy_for
from vpsd.launch.manifest import ManifestItem
from vpsd.models.base import DecodeState, VideoLMAdapter
from vpsd.models.batch import BatchedCache
from vpsd.models.registry import load_adapter, load_draft
from vpsd.models.signals import PrefillSignals, prefill_with_signals, text_positions
from vpsd.models.sparse_kv import sparse_state, std_cache_indices
from vpsd.models.timing import settle
from vpsd.models.views import prefill_views, step_views
from vpsd.pipeline.ensemble import weight_grid, weighted_average
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.pipeline.pruning.uv import UV_DEFAULT_LAYERS
from vpsd.pipeline.sampling import gumbel, probs_from_logits
from vpsd.pipeline.seeds import draft_sampler, verify_sampler
from vpsd.pipeline.stopping import done
from vpsd.video.item import load_item_frames

TOKEN = 11  # fed to time a forward: its value changes no cost
RANK_CAP = 64  # ranks past it are stored as it (no tree has that many children)
CHUNK = 64  # reference tokens a teacher-forced forward feeds at once (bounds its logits' memory)
DRAFT_WIDTHS = (1, 2, 4, 8)
ENOUGH_S = 0.2  # a forward's timed calls stop once they add up to this (after one): `_median_s`


@dataclass
class DraftItem:
    """One draft key on one item."""

    kept: int  # video tokens the draft saw (std: entries per head)
    select_s: float  # the pruner's selection (std: building the sparse cache)
    prefill_s: float  # the draft's prefill on them (TABED: every view's)
    step_s: dict[int, float]  # a draft forward of k rows at the end context (TABED: of every view)
    ranks: list[int]  # the draft's rank of the reference token at output positions 1, 2, ...
    view_q: list[list[float]] | None = None  # TABED: each view's probability of the reference token there
    hits: list[list[bool]] | None = None  # TABED: whether each grid candidate's ensemble proposes it


@dataclass
class ItemMeasure:
    id: str
    length: int  # reference tokens
    max_new: int
    video_tokens: int
    context: int  # the target's prefill length
    vision_s: float  # the target's preprocessing and vision tower
    prefill_s: float
    ar_step_s: float  # median of the reference's one-token steps
    verify_s: dict[int, float]  # a target forward of k rows at the end context
    draft_vision_s: float = 0.0
    drafts: dict[str, DraftItem] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)


@dataclass
class Measured:
    items: list[ItemMeasure]
    batched_verify_s: dict[int, dict[int, float]]  # B -> k -> a target forward of B rows of k tokens
    batched_draft_s: dict[int, dict[str, float]]  # B -> "kind@ratio" -> a draft forward of B rows of one token
    overhead_s: dict[str, float]  # draft place -> a round's messaging
    cores: int
    seconds: float = 0.0
    grid: list[list[float]] = field(default_factory=list)  # TABED's weight candidates, in the order of `hits`

    @staticmethod
    def from_json(data: dict) -> "Measured":
        def items(d: dict) -> ItemMeasure:
            drafts = {k: DraftItem(**{**v, "step_s": _int_keys(v["step_s"])}) for k, v in d["drafts"].items()}
            return ItemMeasure(**{**d, "verify_s": _int_keys(d["verify_s"]), "drafts": drafts})

        return Measured([items(d) for d in data["items"]],
                        {int(b): _int_keys(v) for b, v in data["batched_verify_s"].items()},
                        {int(b): v for b, v in data["batched_draft_s"].items()}, data["overhead_s"], data["cores"],
                        data.get("seconds", 0.0), data.get("grid", []))


def _int_keys(d: dict) -> dict[int, float]:
    return {int(k): v for k, v in d.items()}


def cost_key(key: DraftKey) -> str:
    """Draft keys whose forwards cost the same: one kind of draft at one ratio."""
    return f"{key.kind}@{key.ratio:g}"


def measure(cfg: RunConfig, items: list[ManifestItem], keys: list[DraftKey], batches: list[int],
            target_widths: list[int], repeats: int = 3, say: Callable[[str], None] = print,
            placements: bool = True) -> Measured:
    """Everything the predictions need (module docstring), for `keys` on `items` at each batch size;
    `placements`: whether a draft beside the target is among the candidates (its messaging is measured)."""
    t0 = time.perf_counter()
    with _pinned(cfg):
        target = load_adapter(cfg.family, cfg.target)
        draft = load_draft(cfg.family, cfg.draft, target) if any(k.kind != "sparse_kv" for k in keys) else None
        grid = weight_grid(len(cfg.tabed_settings.views), cfg.tabed_settings.grid_steps) \
            if cfg.tabed_settings.policy == "grid" else torch.full((1, len(cfg.tabed_settings.views)),
                                                                   1.0 / len(cfg.tabed_settings.views))
        _warm(target, draft, cfg, items[0])
        out, states, draft_states = [], [], {}
        for n, it in enumerate(items, 1):
            m, state, d_states = measure_item(target, draft, cfg, it, keys, target_widths, repeats, grid)
            out.append(m)
            states.append(state)
            for k, s in d_states.items():
                draft_states.setdefault(k, []).append(s)
            say(f"measured {it.id} ({n}/{len(items)}): {m.length} tokens, {len(m.drafts)} drafts")
        verify_b = {b: _batched(target, states, b, [1, *[w for w in target_widths if w > 1]], repeats)
                    for b in batches if b > 1}
        draft_b = {b: {k: _batched(draft or target, s, b, [1], repeats)[1] for k, s in draft_states.items()}
                   for b in batches if b > 1}
    overhead = placement_overhead() if placements else {}
    return Measured(out, verify_b, draft_b, overhead, len(os.sched_getaffinity(0)), time.perf_counter() - t0,
                    grid.tolist())


def _warm(target: VideoLMAdapter, draft: VideoLMAdapter | None, cfg: RunConfig, it: ManifestItem) -> None:
    """One untimed prefill and a few steps of each model on the first item: a process's first forwards pay for
    its kernels' and allocator's set-up, which a job pays once too, not per item."""
    frames, times = _frames(cfg, it)
    for model in dict.fromkeys(m for m in (target, draft) if m is not None):
        pre = model.prefill(model.embed(model.prepare(frames, it.prompt, times)))
        for k in (1, 1, 4):
            model.step(pre.state, torch.full((k,), TOKEN, dtype=torch.long))
        settle(model.device)


@contextmanager
def _pinned(cfg: RunConfig):
    """This thread where the config pins the target rank, with a torch thread a core there (then as it was)."""
    cores = (cfg.cpu_affinity or {}).get("target")
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    usable = [c for c in cores or () if c in before]
    if usable:
        os.sched_setaffinity(0, usable)
        torch.set_num_threads(len(usable))
    try:
        yield
    finally:
        if usable:
            os.sched_setaffinity(0, before)
            torch.set_num_threads(threads)


def _frames(cfg: RunConfig, it: ManifestItem):
    fps = it.fps or (None if it.num_frames else cfg.video.fps)
    return load_item_frames(it.video, it.num_frames or cfg.video.num_frames, fps, cfg.video.max_side)


def measure_item(target: VideoLMAdapter, draft: VideoLMAdapter | None, cfg: RunConfig, it: ManifestItem,
                 keys: list[DraftKey], widths: list[int], repeats: int, grid: torch.Tensor
                 ) -> tuple[ItemMeasure, DecodeState, dict[str, DecodeState]]:
    """One item: the target's pass, then every key's draft (module docstring). Returns its measure, the target's
    state at the end and, per chain ratio, a draft state (for the batched forwards)."""
    frames, times = _frames(cfg, it)
    seed = it.seed if it.seed is not None else cfg.decoding.seed
    max_new = it.max_new_tokens or cfg.decoding.max_new_tokens
    t0 = time.perf_counter()
    emb = target.embed(target.prepare(frames, it.prompt, times))
    vision = time.perf_counter() - t0
    layers = _hidden_layers(cfg, keys, len(target.language_model.layers))
    attention = any(k.kind == "sparse_kv" or STRATEGIES[k.strategy].needs_attention for k in keys if k.ratio > 0)
    with _hidden_at(target, emb, layers) as extra:
        t0 = time.perf_counter()
        pre = (prefill_with_signals(target, emb, None, attention, bool(layers)) if attention or layers
               else target.prefill(emb))
        settle(target.device)
        prefill = time.perf_counter() - t0
    tokens, steps = _reference(target, pre, cfg, seed, max_new)
    verify = {k: _forward_s(target, pre.state, k, repeats) for k in widths}
    m = ItemMeasure(it.id, len(tokens), max_new, emb.layout.num_tokens, pre.state.prefill_len, vision, prefill,
                    statistics.median(steps) if steps else verify[1], verify, tokens=tokens)
    signals = SimpleNamespace(pre=pre, extra=extra, depth=len(target.language_model.layers))
    d_states = _measure_drafts(m, target, draft, cfg, emb, frames, times, it.prompt, keys, signals, seed, repeats,
                               grid)
    return m, pre.state, d_states


def _hidden_layers(cfg: RunConfig, keys: list[DraftKey], depth: int) -> set[int]:
    """The layers hidden states are read at, over the keys (UV-Prune: layers 0 and L)."""
    out = set()
    for k in keys:
        if k.ratio > 0 and k.kind != "sparse_kv" and STRATEGIES[k.strategy].needs_hidden_states:
            L = cfg.pruning.signal_layers(k.parallel)
            out.add(min(UV_DEFAULT_LAYERS if L is None else L, depth))
    return out


@contextmanager
def _hidden_at(adapter: VideoLMAdapter, emb, layers: set[int]):
    """Hidden-state rows of the video and text tokens at each layer L of `layers` (a forward hook on layer L - 1,
    as models/signals.py reads them), with layer 0's (the embeddings): {L: (video rows (2, N, D), text (2, Nt, D))}."""
    video_pos, text_pos = emb.layout.seq_positions, text_positions(emb)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(L: int):
        def keep(module, args, out):
            h = out[0] if isinstance(out, tuple) else out
            e = emb.embeds
            got[L] = (torch.stack([e[0, video_pos], h[0, video_pos]]), torch.stack([e[0, text_pos], h[0, text_pos]]))
        return keep

    handles = [adapter.language_model.layers[L - 1].register_forward_hook(hook(L)) for L in sorted(layers)]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def _reference(target: VideoLMAdapter, pre, cfg: RunConfig, seed: int, max_new: int) -> tuple[list[int], list[float]]:
    """The target's own output from its prefill (what `ar` decodes) and each step's seconds."""
    sampler = verify_sampler(cfg.decoding.rule, seed)
    tokens, steps = [sampler.token(pre.logits, 0)[0]], []
    eos = target.eos_token_ids
    while not done(tokens, max_new, eos):
        t0 = time.perf_counter()
        logits = target.step(pre.state, torch.tensor([tokens[-1]]))[-1]
        settle(target.device)
        steps.append(time.perf_counter() - t0)
        tokens.append(sampler.token(logits, len(tokens))[0])
    return tokens, steps


def _median_s(call: Callable[[], object], undo: Callable[[], object], device, repeats: int) -> float:
    """Median seconds of `call` over `repeats` timed calls after an untimed first, each followed by `undo`; fewer
    once the timed ones add up to ENOUGH_S: a forward of a few hundred ms varies by a few percent, and at B = 8
    the widest verifies were a quarter of the tune's measuring."""
    times: list[float] = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        call()
        settle(device)
        if i:
            times.append(time.perf_counter() - t0)
        undo()
        if sum(times) >= ENOUGH_S:
            break
    return statistics.median(times)


def _forward_s(model: VideoLMAdapter, state: DecodeState, k: int, repeats: int) -> float:
    """Seconds of a forward of k rows after `state`, rolled back after each (`_median_s`)."""
    length, ids = state.length, torch.full((k,), TOKEN, dtype=torch.long)
    return _median_s(lambda: model.step(state, ids), lambda: model.rollback(state, length), model.device, repeats)


def _signals_for(signals: SimpleNamespace, cfg: RunConfig, parallel: bool) -> PrefillSignals | None:
    """The target's signals as the pruner of a serial or a parallel run reads them: attention of its first L
    layers, hidden states at layer L (PruningConfig.signal_layers; None: the papers' definitions)."""
    got: PrefillSignals | None = signals.pre.signals
    if got is None:
        return None
    L = cfg.pruning.signal_layers(parallel)
    attention = got.video_attention
    if attention is not None and L is not None:
        attention = attention[: min(L, signals.depth)]
    uv = min(UV_DEFAULT_LAYERS if L is None else L, signals.depth)
    video, text = signals.extra.get(uv, (got.video_hidden, got.text_hidden))
    return PrefillSignals(attention, video, text)


def _measure_drafts(m: ItemMeasure, target, draft, cfg: RunConfig, emb, frames, times, prompt, keys: list[DraftKey],
                    signals: SimpleNamespace, seed: int, repeats: int, grid: torch.Tensor) -> dict[str, DecodeState]:
    """Every key's draft on this item (module docstring); the chain drafts' states by cost key."""
    d_emb = None
    if draft is not None:
        t0 = time.perf_counter()
        d_emb = emb if draft is target else draft.embed(draft.prepare(frames, prompt, times))
        m.draft_vision_s = time.perf_counter() - t0
    costs: dict[str, dict[int, float]] = {}
    states: dict[str, DecodeState] = {}
    sampler = draft_sampler(cfg.decoding.rule, seed)
    for key in keys:
        if key.kind == "sparse_kv":
            d, state = _sparse_kv(target, emb, signals.pre, key, m.tokens, sampler)
        else:
            keep, select_s = _keep(cfg, key, emb, d_emb, signals, seed, target.family)
            if key.kind == "views":
                d, state = _views(draft, d_emb, keep, cfg, m.tokens, sampler, grid)
            else:
                d, state = _chain(draft, d_emb, keep, m.tokens, sampler)
            d.select_s = select_s
        ck = cost_key(key)
        if ck not in costs:
            model = target if key.kind == "sparse_kv" else draft
            costs[ck] = _draft_widths(model, state, key.kind, repeats)
            if key.kind == "chain":
                states[ck] = state
        d.step_s = costs[ck]
        m.drafts[key.name] = d
    return states


def _keep(cfg: RunConfig, key: DraftKey, emb, d_emb, signals: SimpleNamespace, seed: int, family: str):
    """The video tokens the pruner keeps for `key` (None: every one), and the seconds the selection took."""
    pruning = dataclasses.replace(cfg.pruning, strategy=key.strategy, ratio=key.ratio)
    policy = keep_policy_for(pruning, family)
    t0 = time.perf_counter()
    keep = policy(emb, SimpleNamespace(signals=_signals_for(signals, cfg, key.parallel)), d_emb, seed)
    return keep, time.perf_counter() - t0


def _ranks(rows: torch.Tensor, tokens: list[int], first: int, sampler) -> list[int]:
    """The rank of each reference token among the draft's scores: rows[i] scores output position first + i."""
    positions = list(range(first, first + rows.shape[0]))
    scores = sampler.scores(rows, positions) if not sampler.rule.greedy else rows
    ref = torch.tensor(tokens[first:first + rows.shape[0]], device=scores.device)
    mine = scores.gather(1, ref.view(-1, 1))
    return (scores > mine).sum(1).clamp_max(RANK_CAP).tolist()


def _teacher_forced(step: Callable[[torch.Tensor], torch.Tensor], tokens: list[int], visit) -> None:
    """Feeds the reference's tokens but its last, CHUNK at a time; visit(rows, first position they score)."""
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = tokens[start:min(start + CHUNK, len(tokens) - 1)]
        visit(step(torch.tensor(chunk)), start + 1)


def _chain(draft: VideoLMAdapter, d_emb, keep, tokens: list[int], sampler) -> tuple[DraftItem, DecodeState]:
    t0 = time.perf_counter()
    pre = draft.prefill(d_emb, keep=keep)
    settle(draft.device)
    prefill = time.perf_counter() - t0
    ranks: list[int] = []
    _teacher_forced(lambda ids: draft.step(pre.state, ids), tokens,
                    lambda rows, first: ranks.extend(_ranks(rows, tokens, first, sampler)))
    kept = int(keep.numel()) if keep is not None else d_emb.layout.num_tokens
    return DraftItem(kept, 0.0, prefill, {}, ranks), pre.state


def _sparse_kv(target: VideoLMAdapter, emb, pre, key: DraftKey, tokens: list[int], sampler
               ) -> tuple[DraftItem, DecodeState]:
    """std: the target on the top-K entries of its prefill's cache, per head (models/sparse_kv.py)."""
    t0 = time.perf_counter()
    indices = std_cache_indices(pre, emb, key.ratio)
    state = sparse_state(target, pre.state, indices, emb.next_position)
    select = time.perf_counter() - t0
    ranks: list[int] = []
    _teacher_forced(lambda ids: target.step(state, ids), tokens,
                    lambda rows, first: ranks.extend(_ranks(rows, tokens, first, sampler)))
    kept = int(indices.shape[-1]) - (emb.seq_len - emb.layout.num_tokens)
    return DraftItem(kept, select, 0.0, {}, ranks), state


def _views(draft: VideoLMAdapter, d_emb, keep, cfg: RunConfig, tokens: list[int], sampler, grid: torch.Tensor
           ) -> tuple[DraftItem, object]:
    """TABED: every view prefilled and fed the reference at once (models/views.py); per position, each view's q of
    the reference token and each weight candidate's proposal (greedy, or keyed with the target's noise)."""
    tabed = cfg.tabed_settings
    keep = keep if keep is not None else torch.arange(d_emb.layout.num_tokens)
    t0 = time.perf_counter()
    batch, _ = prefill_views(draft, d_emb, keep, tabed.views, tabed.pool)
    prefill = time.perf_counter() - t0
    temperature = sampler.rule.temperature
    view_q, hits = [], []

    def visit(rows: torch.Tensor, first: int) -> None:  # rows (m, k, V)
        for i in range(rows.shape[1]):
            pos, y = first + i, tokens[first + i]
            probs = probs_from_logits(rows[:, i], temperature if temperature > 0 else 1.0)
            ens = weighted_average(probs, grid)  # (J, V)
            if temperature > 0:
                ens = ens.double().log() + gumbel(sampler.seed, pos, ens.shape[-1], ens.device)
            view_q.append(probs[:, y].tolist())
            hits.append((ens.argmax(-1) == y).tolist())

    _teacher_forced(lambda ids: step_views(draft, batch, ids), tokens, visit)
    return DraftItem(int(keep.numel()), 0.0, prefill, {}, [0 if h[0] else 1 for h in hits], view_q, hits), batch


def _draft_widths(model: VideoLMAdapter, state, kind: str, repeats: int) -> dict[int, float]:
    if kind != "views":
        return {k: _forward_s(model, state, k, repeats) for k in DRAFT_WIDTHS}
    length = state.state.length
    return {k: _median_s(lambda k=k: step_views(model, state, torch.full((k,), TOKEN, dtype=torch.long)),
                         lambda: model.rollback(state.state, length), model.device, repeats)
            for k in DRAFT_WIDTHS}


def _batched(model: VideoLMAdapter, states: list[DecodeState], batch: int, widths: list[int], repeats: int
             ) -> dict[int, float]:
    """Seconds of one forward of `batch` rows of k tokens each (BatchedCache, the items' caches copied in, in turn)."""
    cache = BatchedCache(model)
    for i in range(batch):
        cache.join(i, copy.deepcopy(states[i % len(states)]))
    lengths = {i: cache.length(i) for i in range(batch)}

    def undo() -> None:
        for i in range(batch):
            cache.rollback(i, lengths[i])

    return {k: _median_s(lambda k=k: cache.step({i: [TOKEN] * k for i in range(batch)}), undo, model.device, repeats)
            for k in widths}


def placement_overhead(rounds: int = 200) -> dict[str, float]:
    """A round's messaging where the draft runs, median of `rounds` round trips of a chunk-sized message: over
    ZeroMQ on loopback TCP for a rank (transport/control.py's socket kind), over a queue for threads."""
    import msgspec
    import zmq

    payload = msgspec.msgpack.encode({"item": "x", "start": 100, "tokens": list(range(8)), "t_q": 0.01})
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        for _ in range(rounds):
            b.send(msgspec.msgpack.encode(msgspec.msgpack.decode(b.recv())))

    rank = _round_trips(lambda: (a.send(payload), msgspec.msgpack.decode(a.recv())), echo, rounds)
    a.close(linger=0)
    b.close(linger=0)
    to, back = queue.Queue(), queue.Queue()
    thread = _round_trips(lambda: (to.put(payload), back.get()), lambda: [back.put(to.get()) for _ in range(rounds)],
                          rounds)
    return {"rank": rank, "thread": thread}


def _round_trips(ping: Callable[[], object], echo: Callable[[], object], rounds: int) -> float:
    peer = threading.Thread(target=echo, daemon=True)
    peer.start()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ping()
        times.append(time.perf_counter() - t0)
    peer.join(timeout=5)
    return statistics.median(times)

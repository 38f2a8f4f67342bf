"""One video, many questions: the target's KV cache of a prompt's shared prefix, and its vision features, kept and
reused (issue 62, items 1, 3 and 5).

Every prompt is system, then the user turn with the video block first, then the question, then the assistant
header (models/qwen2_5_vl.py, qwen3_vl.py, llava_onevision.py). So every question about one video shares the
tokens up to the end of its video block: the prefix whose prefill is nearly all of an item's prefill. With reuse
on (`reuse.enabled`, the default), the engine prefills every request in SEGMENTS cut at fixed places of its own
token sequence (`segment_ends`: the end of the video block), one forward each, each segment's KV kept here:

    [0, P)   system + video block: taken from the cache when a request with the same video and the same tokens
             up to P was prefilled before, else computed (and kept)
    [P, L)   the question and the assistant header: always computed, after the prefix's cache, each token at its
             own position in the full sequence (`VideoLMAdapter.prefill_after`)

A conversation (models/prompt.py: earlier questions and answers, then the user turn being answered) is also cut
where each user turn after the video begins (ChatML's `<|im_start|>user`, a control token no text can encode to:
`user_turn_ids`), i.e. at the end of each completed exchange, one cut a turn:

    [0, P) video | [P, U2) question 1 + answer 1 | [U2, U3) question 2 + answer 2 | ... | [Un, L) question n + header

A follow-up's tokens are the earlier turn's prompt, its answer, then the new turn (models/prompt.py), so turn n
shares every segment but the last two with turn n - 1: turn 3 copies [video] and [question 1 + answer 1], which
turn 2 computed and kept, and prefills question 2 + answer 2 (kept for turn 4) and its own question. The last
segment is always the request's own, never kept: the pruning signals are read from its rows. A single question has
no user turn after its video: one cut, as before.

Lossless by construction: the segments are cut by the request's tokens alone, never by what the cache holds, so a
hit and a miss run the same forwards on the same numbers (a hit copies the very tensors the miss computed). An
item's output is therefore the same whatever was asked before, in which order, on which thread, or what was
evicted; every method's output with reuse equals `ar`'s with reuse, token for token (and `decoding.exact_verify`
stays bit-identical to `ar` with reuse). Against `ar` WITHOUT reuse it may differ only where a full prefill's
one forward and the segments' forwards round differently (another reduction order, as a verify's rows
against `ar`'s): at float near-ties, which `python -m vpsd.launch.lossless` names with their margin. At B > 1 a
run of one video's questions may have its last segments computed in one packed forward (engine/sibling_prefill.py,
`Reuse.prepare_prefix` and `Reuse.ready`): the same segments, within float noise of their own forwards.

Keys. A segment's key is a hash of the video as the model sees it (its pixel tensors, grid and times: every
`pixel_inputs` tensor but the token types, which the ids give) and of the token ids up to the segment's end. A
video that changed on disk decodes to other pixels, so it can never hit; another question about the same video
shares the first segment; a segment's key covers every token before it, so a later segment hits only after the
same earlier ones. The vision features are kept per video key too: an item whose prefix was evicted but whose
features were not skips the vision tower, and one whose prefix hits skips it entirely where nothing else reads
the features (`ar`, plain rows; positions need the grid only, `VideoLMAdapter.embed_with`).

Bounded: every kept tensor counts its bytes against `reuse.budget_mib` (the memory plan counts the budget on the
target's rank, launch/memory.py), least recently used evicted first (a segment with its later segments). An entry
larger than the whole budget is not kept. Evicted work is recomputed, never failed.

Pruning signals (hippo, specvlm, parallelvlm, std and the signal strategies) come from the same forwards
(models/signals.py): the text rows are exactly the last segment [P, L) (a conversation's: its final user turn and
the assistant header, the question being answered, where a prefill without reuse reads every turn after the
video), so the text-to-video attention and the text rows are measured during the suffix forward (the video keys
read from the cache, prefix and suffix at their positions), and the pruner is handed its signals after layer L-1
of it. UV-Prune's video rows at layer L come from the prefix forward: a segment keeps them beside its KV
(`Segment.rows`, counted in the budget), computed with it on a miss; a held segment without the rows a request
needs is recomputed as on a miss (the same forward: the same KV) and kept with them. A conversation's later
segments hold no video token: they keep no rows and need none. So a drafted request reuses as `ar`'s does, and
every method's output with reuse equals `ar`'s with reuse token for token, by construction.

The draft's side. A draft model has a cache of its own here (`reuse_for(draft, ...)`, within a quarter of the
budget: config.draft_reuse_budget). Its vision features do not depend on the question, so they are kept for every
draft (`draft_embed`, in process and on a draft rank alike). A draft shown all of the video (pearl, a
self-draft) also prefills through a `Reuse` plan of its own, so its video prefix's KV is kept and restored as the
target's is; a pruned draft prefills what the pruner keeps for each question (the kept set depends on it), after
its cached features. Whatever the draft reuses moves only its proposals, never an output.

Where it does not apply (traced `prefix_reuse` with `reuse: false` and the reason): a target split over ranks (its
followers hold their shards of the cache: the engine keeps no cache for it), a request with no token after its
video (nothing to cut).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoInputs, VideoLMAdapter, VisionFeatures
from vpsd.models.hook_lock import hooks_installed
from vpsd.models.kv_cache import MIN_SPARE, GrowingLayer
from vpsd.models.pixel_memo import tensor_digest
from vpsd.models.prompt import tokenizer_lock
from vpsd.models.signals import layer_output, this_thread_only
from vpsd.tracing import get_logger

log = get_logger()


def video_key(inputs: VideoInputs) -> bytes:
    """A hash of the video as the model sees it: every pixel tensor's dtype, shape and bytes (Qwen's grid and
    seconds per grid included), not the token types (a function of the ids, which a segment's key holds). A
    tensor hashed for an earlier question of the video (models/pixel_memo.py) is not hashed again."""
    h = hashlib.blake2b(digest_size=20)
    for name in sorted(inputs.pixel_inputs):
        if name == "mm_token_type_ids":
            continue
        digest = inputs.digests.get(name)
        if digest is None:  # kept for the video's later questions where the dict is theirs too (pixel_memo.py)
            digest = inputs.digests[name] = tensor_digest(name, inputs.pixel_inputs[name])
        h.update(digest)
    return h.digest()


CHATML_OPEN = "<|im_start|>"  # every family's template (ChatML) opens each message with this control token
USER_ROLE = "user"


def user_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """The token ids that open a user message as the families' templates render it (`<|im_start|>user`), or ()
    where `<|im_start|>` is not a control token of `tokenizer` (then a text could spell those ids: no turn cuts).
    A control token is what a prompt's text can never encode to (models/prompt.py encode_chat splits special
    tokens in every text), so only the template's own markers match."""
    if tokenizer is None:
        return ()
    with tokenizer_lock(tokenizer):
        control = tokenizer.encode(CHATML_OPEN, add_special_tokens=False)
        as_text = tokenizer.encode(CHATML_OPEN, add_special_tokens=False, split_special_tokens=True)
        role = tokenizer.encode(USER_ROLE, add_special_tokens=False)
    if len(control) != 1 or as_text == control or not role:
        return ()
    return (control[0], *role)


def segment_ends(inputs: VideoInputs, user_turn: Sequence[int] = ()) -> list[int]:
    """Where a request's prefill is cut, from its own token ids alone (never from what the cache holds: module
    docstring): after the last video token (every question about a video shares what comes before), then, in a
    conversation, where each user turn after the video begins (`user_turn`: the ids that open one,
    `user_turn_ids`), i.e. at the end of each completed exchange, so a follow-up finds the earlier turns' KV. The
    last segment, the final user turn and the assistant header, is the request's own. A single question has no
    user turn after its video: one cut, as it always had."""
    video_end = int(inputs.layout.seq_positions.max()) + 1
    if not 0 < video_end < inputs.seq_len:
        return []
    return [video_end, *_turn_starts(inputs.input_ids[0], user_turn, video_end)]


def _turn_starts(ids: torch.Tensor, opener: Sequence[int], after: int) -> list[int]:
    """Positions p > `after` where `opener` begins in `ids` (each is < len(ids): never a cut at the very end)."""
    n = len(opener)
    if n == 0 or ids.numel() < n:
        return []
    windows = ids.to("cpu", torch.int64).unfold(0, n, 1)  # (L - n + 1, n): the n ids from each position
    found = (windows == torch.tensor(list(opener), dtype=torch.int64)).all(dim=1).nonzero().flatten().tolist()
    return [p for p in found if p > after]


def segment_key(vkey: bytes, input_ids: torch.Tensor, end: int) -> bytes:
    h = hashlib.blake2b(vkey, digest_size=20)
    h.update(input_ids[0, :end].to("cpu", torch.int64).contiguous().numpy())
    return h.digest()


@dataclass
class Segment:
    """The KV of sequence positions [start, end) of every prompt that shares the key's video and tokens."""

    key: bytes
    parent: bytes | None  # the segment before it (None: it starts at 0)
    start: int
    end: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, Hkv, end - start, d) keys and values
    # UV-Prune's: l -> (n, D) hidden states (output of decoder layer l-1) of the video tokens in [start, end), in
    # layout order, from the forward that computed `kv` (models/signals.py)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)
        return kv + sum(r.numel() * r.element_size() for r in self.rows.values())


@dataclass
class ReuseStats:
    """Counters for the traces, `vpsd summary` and a server's /metrics (`PrefixCache.stats`)."""

    requests: int = 0  # prefills that went through the cache
    hits: int = 0  # ... whose first segment (the video prefix) was found
    misses: int = 0
    skipped: int = 0  # requests that could not reuse (the reason is traced)
    reused_tokens: int = 0  # prefix tokens taken from the cache instead of prefilled
    prefilled_tokens: int = 0  # tokens prefilled by requests that went through the cache
    vision_hits: int = 0  # vision features taken from the cache
    vision_skipped: int = 0  # vision tower not run at all (a prefix hit nothing else needed the features for)
    vision_misses: int = 0
    pixel_hits: int = 0  # requests whose prepared pixels and their hash were kept from the video's last question
    stored: int = 0  # entries kept
    evicted: int = 0  # entries evicted for room
    evicted_bytes: int = 0
    too_large: int = 0  # entries larger than the whole budget, not kept
    bytes: int = 0  # held now
    peak_bytes: int = 0
    budget_bytes: int = 0


class PrefixCache:
    """Byte-budgeted LRU of prefix segments and vision features, shared by the threads that prefill (module
    docstring). One per target model."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self.lock = threading.Lock()
        # ("kv", key) -> Segment, ("vision", video key) -> VisionFeatures; least recently used first
        self.entries: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
        self.children: dict[bytes, set[bytes]] = {}
        self.counts = ReuseStats(budget_bytes=self.budget)

    # ---- lookups ------------------------------------------------------------------------------------

    def segments(self, keys: list[bytes]) -> list[Segment]:
        """The longest run of `keys`' segments held, from the first, each touched (most recently used)."""
        found = []
        with self.lock:
            for key in keys:
                seg = self.entries.get(("kv", key))
                if seg is None:
                    break
                self.entries.move_to_end(("kv", key))
                found.append(seg)
        return found

    def has_segment(self, key: bytes) -> bool:
        with self.lock:
            return ("kv", key) in self.entries

    def features(self, vkey: bytes) -> VisionFeatures | None:
        with self.lock:
            feats = self.entries.get(("vision", vkey))
            if feats is not None:
                self.entries.move_to_end(("vision", vkey))
            return feats

    # ---- keeping ------------------------------------------------------------------------------------

    def put_segment(self, seg: Segment) -> bool:
        """Keeps `seg`; one held under its key already is kept with the rows of both (the same forward computed
        their KV)."""
        if seg.parent is not None and not self.has_segment(seg.parent):
            return False  # its parent went meanwhile: unreachable
        return self._put(("kv", seg.key), seg, seg.nbytes)

    def put_features(self, vkey: bytes, feats: VisionFeatures) -> bool:
        return self._put(("vision", vkey), feats, feats.nbytes)

    def _put(self, name: tuple[str, bytes], value: Any, nbytes: int) -> bool:
        with self.lock:
            old = self.entries.get(name)
            if old is not None:
                if name[0] != "kv" or set(value.rows) <= set(old.rows):
                    self.entries.move_to_end(name)
                    return True
                # more rows of the same segment (the same forward, the same KV): one entry with both, in the old
                # one's place (what follows it stays reachable); too large, the old one stays as it was
                value = dataclasses.replace(old, rows={**old.rows, **value.rows})
                nbytes = value.nbytes
                if nbytes > self.budget:
                    self.counts.too_large += 1
                    return False
                del self.entries[name]
                self.counts.bytes -= old.nbytes
            if nbytes > self.budget:
                self.counts.too_large += 1
                return False
            while self.counts.bytes + nbytes > self.budget and self.entries:
                self._evict(next(iter(self.entries)))
            if name[0] == "kv" and value.parent is not None and ("kv", value.parent) not in self.entries:
                for child in self.children.pop(value.key, set()):  # its parent went for room: unreachable
                    self._evict(("kv", child))
                return False
            self.entries[name] = value
            if name[0] == "kv" and value.parent is not None:
                self.children.setdefault(value.parent, set()).add(value.key)
            self.counts.bytes += nbytes
            self.counts.peak_bytes = max(self.counts.peak_bytes, self.counts.bytes)
            self.counts.stored += 1
            return True

    def _evict(self, name: tuple[str, bytes]) -> None:
        """Drops one entry (a segment with every segment after it: they could not be reached). Lock held."""
        value = self.entries.pop(name, None)
        if value is None:
            return
        nbytes = value.nbytes
        self.counts.bytes -= nbytes
        self.counts.evicted += 1
        self.counts.evicted_bytes += nbytes
        if name[0] == "kv":
            if value.parent is not None:
                self.children.get(value.parent, set()).discard(value.key)
            for child in self.children.pop(value.key, set()):
                self._evict(("kv", child))

    def resize(self, budget_bytes: int) -> None:
        """Another budget (a later engine over the same target, configured otherwise): evicts down to it."""
        with self.lock:
            self.budget = self.counts.budget_bytes = int(budget_bytes)
            while self.counts.bytes > self.budget and self.entries:
                self._evict(next(iter(self.entries)))

    def reset(self) -> None:
        """Empty, every counter at zero."""
        with self.lock:
            self.entries.clear()
            self.children.clear()
            self.counts = ReuseStats(budget_bytes=self.budget)

    # ---- what it did --------------------------------------------------------------------------------

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, d in deltas.items():
                setattr(self.counts, name, getattr(self.counts, name) + d)

    def stats(self) -> dict[str, int]:
        """Every counter (`ReuseStats`), for summary.json's `run.reuse` and a server's /metrics."""
        with self.lock:
            return dict(vars(self.counts))


def _restore(adapter: VideoLMAdapter, segments: list[Segment], capacity: int):
    """A new cache of `adapter` holding the segments' entries, in buffers with room for `capacity` positions."""
    cache = adapter.new_cache()
    length = segments[-1].end
    for i, layer in enumerate(cache.layers):
        keys = [s.kv[i][0] for s in segments]
        values = [s.kv[i][1] for s in segments]
        layer.lazy_initialization(keys[0], values[0])
        if isinstance(layer, GrowingLayer):
            room = max(capacity, length + MIN_SPARE)
            k = keys[0].new_empty(*keys[0].shape[:2], room, keys[0].shape[-1])
            v = values[0].new_empty(*values[0].shape[:2], room, values[0].shape[-1])
            k[:, :, :length].copy_(torch.cat(keys, dim=2))
            v[:, :, :length].copy_(torch.cat(values, dim=2))
            layer.keys, layer.values = k, v
            layer.crop(-(room - length))
        else:
            layer.keys, layer.values = torch.cat(keys, dim=2).clone(), torch.cat(values, dim=2).clone()
    return cache


def _holds_video(seg: Segment, video_pos: torch.Tensor) -> bool:
    """Whether any video token lies in the segment (a conversation's later turns hold none: no rows to keep)."""
    return bool(((video_pos >= seg.start) & (video_pos < seg.end)).any())


def _video_rows(segments: list[Segment], video_pos: torch.Tensor, layer: int) -> torch.Tensor:
    """(N, D) rows of every video token at `layer`, in layout order, from the segments that hold them."""
    parts, count = [], 0
    for seg in segments:
        inside = (video_pos >= seg.start) & (video_pos < seg.end)
        if not bool(inside.any()):
            continue  # an earlier turn's text: it has no video rows (and keeps none)
        count += int(inside.sum())
        parts.append((inside, seg.rows[layer]))
    if count != video_pos.numel():
        raise RuntimeError(f"{count} of {video_pos.numel()} video tokens lie before the last segment")
    if len(parts) == 1:
        return parts[0][1]
    out = parts[0][1].new_empty(video_pos.numel(), parts[0][1].shape[-1])
    for inside, rows in parts:
        out[inside.to(out.device)] = rows
    return out


def _cut(cache, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys[:, :, start:end].clone(), layer.values[:, :, start:end].clone()) for layer in cache.layers]


@dataclass
class Reuse:
    """One request's plan: its video key, where its prefill is cut, and what of it the cache held when planned."""

    store: PrefixCache
    item: str
    vkey: bytes
    ends: list[int]  # segment ends before the last segment
    keys: list[bytes]  # each segment's key
    held: list[Segment] = field(default_factory=list)  # the segments found, from the first
    vision: str = "computed"  # "skipped", "cached" or "computed"
    # The result of a prefill run with the request's siblings (engine/sibling_prefill.py), with the signal layers it
    # measured, (attention layers, UV layer): taken by the prefill that asks for those signals instead of its forwards
    ready: tuple[PrefillResult, tuple[int, int]] | None = None
    # `prefix`'s answer computed ahead (`prepare_prefix`), with the UV layer it was asked for
    prefixed: tuple[tuple[Any, int, torch.Tensor | None], int] | None = None

    @property
    def hit(self) -> bool:
        return bool(self.held)

    @property
    def reused(self) -> int:
        return self.held[-1].end if self.held else 0

    def embed(self, adapter: VideoLMAdapter, inputs: VideoInputs, need_features: bool) -> SequenceEmbeddings:
        """The request's embeddings: without the vision tower where every video row comes from the cache and
        nothing else reads the features, else with the cached features, else the tower's (then kept)."""
        if self.hit and not need_features:
            self.vision = "skipped"
            emb = adapter.embed_with(inputs, None)
        else:
            feats, self.vision = kept_features(self.store, adapter, inputs, self.vkey)
            emb = adapter.embed_with(inputs, feats)
        emb.reuse = self
        return emb

    @torch.inference_mode()
    def prefill(self, adapter: VideoLMAdapter, emb: SequenceEmbeddings) -> PrefillResult:
        """The full prefill's result, in segments (module docstring): what the cache holds is copied, the rest
        computed and kept. A prefill with pruning signals runs the same two steps, `prefix` then `suffix`, with its
        hooks on the suffix (models/signals.py)."""
        if (ready := self.take_ready(emb, (0, 0))) is not None:
            return ready
        cache, start, _ = self.prefix(adapter, emb)
        return self.suffix(adapter, emb, cache, start)

    def take_ready(self, emb: SequenceEmbeddings, signals: tuple[int, int]) -> PrefillResult | None:
        """The result prefilled with the request's siblings, when it measured these `signals` (counted and traced
        as `suffix` counts its own); else None (and it is dropped: the caller prefills as on its own)."""
        ready, self.ready = self.ready, None
        if ready is None or ready[1] != signals:
            return None
        return self.counted(emb, ready[0])

    @torch.inference_mode()
    def prefix(self, adapter: VideoLMAdapter, emb: SequenceEmbeddings, rows_layer: int = 0
               ) -> tuple[Any, int, torch.Tensor | None]:
        """The cache of every segment before the last (copied where held, else computed and kept), where the last
        starts, and, when `rows_layer` > 0, the (N, D) hidden states of every video token at layer `rows_layer`
        (the output of decoder layer rows_layer - 1) from the forwards that computed that KV, in layout order. A
        held segment without those rows is computed again, as on a miss, and kept with them. Once only when
        `prepare_prefix` ran it ahead."""
        prefixed, self.prefixed = self.prefixed, None
        if prefixed is not None and prefixed[1] == rows_layer:
            return prefixed[0]
        if rows_layer:
            if self.vision == "skipped":  # a request that reads signals always embeds its video (`embed`)
                raise RuntimeError("video rows asked for, but the embeddings hold no video features")
            usable = 0  # a segment without video tokens needs no rows
            while usable < len(self.held) and (rows_layer in self.held[usable].rows
                                               or not _holds_video(self.held[usable], emb.layout.seq_positions)):
                usable += 1
            self.held = self.held[:usable]
        segments = list(self.held)
        cache = _restore(adapter, self.held, emb.seq_len) if self.held else adapter.new_cache()
        start = self.reused
        video_pos = emb.layout.seq_positions
        for i, (end, key) in enumerate(zip(self.ends, self.keys)):
            if end <= start:
                continue  # held: copied above
            rows = {}
            inside = video_pos[(video_pos >= start) & (video_pos < end)]
            install = list  # no hook
            if rows_layer and inside.numel():  # only a segment with video tokens has UV-Prune rows to keep
                where = (inside - start).to(emb.embeds.device)

                def keep_rows(module, args, out, where=where, rows=rows):
                    rows[rows_layer] = layer_output(out)[0, where].clone()

                layer = adapter.language_model.layers[rows_layer - 1]
                install = lambda layer=layer, keep_rows=keep_rows: [  # noqa: E731
                    layer.register_forward_hook(this_thread_only(keep_rows))]
            with hooks_installed(adapter.language_model, install):  # models/hook_lock.py
                adapter.prefill_span(emb, cache, start, end)
            seg = Segment(key, self.keys[i - 1] if i else None, start, end, _cut(cache, start, end), rows)
            self.store.put_segment(seg)
            segments.append(seg)
            start = end
        return cache, start, _video_rows(segments, video_pos, rows_layer) if rows_layer else None

    def prepare_prefix(self, adapter: VideoLMAdapter, emb: SequenceEmbeddings, rows_layer: int = 0) -> None:
        """`prefix` now, kept for the request's prefill: its segments are in the cache from here on, so the plans
        of the requests after it hit (engine/sibling_prefill.py)."""
        self.prefixed = (self.prefix(adapter, emb, rows_layer), rows_layer)

    @torch.inference_mode()
    def suffix(self, adapter: VideoLMAdapter, emb: SequenceEmbeddings, cache, start: int) -> PrefillResult:
        """The last segment [start, L) fed after `prefix`'s cache: the full prefill's result; counted and traced."""
        return self.counted(emb, adapter.prefill_after(emb, cache, start))

    def counted(self, emb: SequenceEmbeddings, pre: PrefillResult) -> PrefillResult:
        """`pre`, this request's prefill, counted in the cache's statistics and traced."""
        c = self.store
        c.count(requests=1, hits=int(self.hit), misses=int(not self.hit), reused_tokens=self.reused,
                prefilled_tokens=emb.seq_len - self.reused, vision_hits=int(self.vision == "cached"),
                vision_skipped=int(self.vision == "skipped"), vision_misses=int(self.vision == "computed"))
        stats = c.stats()
        log.info("prefix_reuse", item=self.item, reuse=True, hit=self.hit, reused_tokens=self.reused,
                 segments=len(self.ends) + 1, reused_segments=len(self.held),
                 prefilled_tokens=emb.seq_len - self.reused, vision=self.vision, cache_bytes=stats["bytes"],
                 hits=stats["hits"], misses=stats["misses"], evicted=stats["evicted"])
        return pre


def kept_features(store: PrefixCache, adapter: VideoLMAdapter, inputs: VideoInputs, vkey: bytes | None = None
                  ) -> tuple[VisionFeatures, str]:
    """The vision tower's output for `inputs` from `store` where kept (keyed by the pixels, `video_key`), else
    computed and kept; and which ("cached" or "computed"). The target's `Reuse.embed` and a draft's side of one
    video, many questions take features this one way (the features do not depend on the question)."""
    vkey = video_key(inputs) if vkey is None else vkey
    feats = store.features(vkey)
    if feats is not None:
        return feats, "cached"
    feats = adapter.vision_features(inputs)
    store.put_features(vkey, feats)
    return feats, "computed"


def draft_embed(draft: VideoLMAdapter, inputs: VideoInputs, reuse: "PrefixReuse | None", item: str
                ) -> SequenceEmbeddings:
    """A draft's embeddings of a request whose video other requests share (`reuse`: the draft model's own prefix
    reuse, None: plain `draft.embed`), through a plan of its own (`emb.reuse`): its vision features kept (they do
    not depend on the question), and its prefix's KV ready for `draft_prefill` where it is shown all of the video."""
    plan = reuse.plan(item, inputs) if reuse is not None else None
    if plan is None:
        return draft.embed(inputs)
    emb = plan.embed(draft, inputs, need_features=True)
    log.info("draft_vision_reuse", item=item, vision=plan.vision, prefix_hit=plan.hit,
             cache_bytes=plan.store.stats()["bytes"])
    return emb


def draft_prefill(draft: VideoLMAdapter, emb: SequenceEmbeddings, keep: torch.Tensor | None,
                  whole_prefix: bool = True) -> PrefillResult | None:
    """The draft's prefill of `draft_embed`'s embeddings: shown all of the video (`keep` None or every video token)
    and `whole_prefix` (the caller prefills a single model row), through its plan (its video prefix kept and
    restored as the target's is, the same forwards hit or miss); else None, the caller prefilling the kept tokens
    (a pruned draft: what it keeps depends on the question), its reused features counted here as the target's
    suffix counts its own."""
    plan = emb.reuse
    if plan is None:
        return None
    if whole_prefix and (keep is None or int(keep.numel()) == emb.layout.num_tokens):
        return plan.prefill(draft, emb)
    plan.store.count(vision_hits=int(plan.vision == "cached"), vision_misses=int(plan.vision == "computed"))
    return None


class PrefixReuse:
    """The engine's side: plans each request's reuse (or says why not) over one `PrefixCache`."""

    def __init__(self, budget_bytes: int, user_turn: Sequence[int] = ()) -> None:
        """user_turn: the ids that open a user turn in the target's prompts (`user_turn_ids`): a conversation is
        cut there too (`segment_ends`); () cuts after the video only."""
        self.cache = PrefixCache(budget_bytes)
        self.user_turn = tuple(user_turn)

    def plan(self, item: str, inputs: VideoInputs) -> Reuse | None:
        ends = segment_ends(inputs, self.user_turn)
        if not ends:
            self.skip(item, "no video prefix")
            return None
        vkey = video_key(inputs)
        if inputs.pixels_kept:
            self.cache.count(pixel_hits=1)
        keys = [segment_key(vkey, inputs.input_ids, end) for end in ends]
        return Reuse(self.cache, item, vkey, ends, keys, self.cache.segments(keys))

    def skip(self, item: str, reason: str) -> None:
        self.cache.count(skipped=1)
        log.info("prefix_reuse", item=item, reuse=False, reason=reason)

    def stats(self) -> dict[str, int]:
        return self.cache.stats()


_BY_TARGET: "weakref.WeakKeyDictionary[VideoLMAdapter, PrefixReuse]" = weakref.WeakKeyDictionary()
_BY_TARGET_LOCK = threading.Lock()


def reuse_for(target: VideoLMAdapter, budget_bytes: int) -> PrefixReuse:
    """The one prefix cache of `target` (a model's): every engine over it shares it, so the Python API's calls, each
    with an engine of its own, and a server's requests reuse what earlier ones kept. At the latest budget."""
    with _BY_TARGET_LOCK:
        reuse = _BY_TARGET.get(target)
        if reuse is None:
            turns = user_turn_ids(getattr(target, "tokenizer", None))  # a conversation is cut at its turns too
            reuse = _BY_TARGET[target] = PrefixReuse(budget_bytes, turns)
        elif reuse.cache.budget != budget_bytes:
            reuse.cache.resize(budget_bytes)
        return reuse

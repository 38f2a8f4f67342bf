"""Many sequences in one forward: one model's KV cache for a batch of items, each row at its own length.

Row r is one item's sequence. Items join and leave at any time (continuous batching), and every row has its
own length, rotary offset and rollback, so the cache is a table with holes rather than a rectangle:

    cache   (B, Hkv, C, d) per layer   C columns; row r's entries are its `valid[r]` columns, in order
    valid   (B, C) bool                which columns hold row r's entries (the attention mask)
    lengths [B]                        entries per row (its DecodeState.length)
    offsets [B]                        rotary position of row r's next token = lengths[r] + offsets[r]

- join: an item's own prefill (batch 1, its exact prefill, pruned or not) becomes a new row, its entries in
  the first columns; the other rows get hole columns on the right when it is the longest.
- step: each row feeds its own tokens (none, one, a ragged window); the batch is padded to the longest with
  columns that are holes from the start, every row at its own rotary positions (M-RoPE's three rows alike
  after the prefill, as `VideoLMAdapter.step` does). One forward; row r's logits are its first len(tokens[r]).
- a tree: a row may feed the nodes of a draft tree instead of a chain (`TreeFeed`: each node at its chain
  position, attending to the prefix and its own ancestors); `keep` then keeps only the accepted path's
  entries after a point (the others become holes), after which the row is the chain a plain decode of the
  committed tokens would hold. Rows of one forward may mix chains, trees and nothing.
- rollback: row r forgets its entries past a length by turning those columns into holes (no copy).
- compact: when holes waste more than a quarter of the width, every row's entries are gathered to the left.
- one row: a batch of one item is kept without holes (a rollback crops, a row left alone is compacted) and is
  stepped by `VideoLMAdapter.step` itself, so one item in flight runs exactly the batch-1 forwards, bit for bit
  (the pipelined roles at `--batch 1` are the batch-1 pipeline, not an approximation of it). A model with
  captured steps (models/captured.py) holds that one row in its fixed cache, stepped by the compiled graph: the
  row moves in when it is alone and back out to a growing cache when a second item joins or it outgrows it.

A hole is masked out of every attention (the 2-D mask the language model turns into its causal mask), so
each row computes what its batch-1 decode computes, up to the float order of a wider reduction and of a
batched GEMM: ~1e-6 in float32 (tests/engine/test_batch_decode.py bounds it), which can flip a greedy choice only
at a near-tie (vpsd.decoders.lossless judges such a difference by the target's margin). Padding with masks
was chosen over a packed layout: transformers' attention takes it as it is on every family and backend
(eager, sdpa), and the holes cost only the columns they occupy until the next compaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from vpsd.models.attention import additive_mask
from vpsd.models.base import DecodeState, VideoLMAdapter
from vpsd.models.captured import FixedCache, held_entries
from vpsd.models.kv_cache import GrowingCache

# Token fed in a padding slot: never attended to (its column is a hole), its logits never read.
PAD_TOKEN = 0
# Room a row must have left in a fixed cache to move in (a few verifies): one that would leave at once stays out.
FIXED_ROOM = 64


@dataclass(frozen=True)
class TreeFeed:
    """How a row's fed tokens sit when they are a draft tree's nodes (`VideoLMAdapter.step_tree`'s arguments):
    seq_index (k,) each token's index in the chain sequence (its rotary position less the row's offset);
    visible (k, m + k) bool, what each attends to among the row's last m entries and the k fed now (every
    earlier entry is visible to all)."""

    seq_index: torch.Tensor
    visible: torch.Tensor


@dataclass
class BatchedCache:
    """One model's batch of sequences (see the module docstring)."""

    adapter: VideoLMAdapter
    cache: object | None = None  # the language model's DynamicCache, batch rows = items; None while empty
    valid: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))
    keys: list[Hashable] = field(default_factory=list)  # row -> item
    lengths: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.keys)

    @property
    def width(self) -> int:
        return int(self.valid.shape[1])

    def row(self, key: Hashable) -> int:
        return self.keys.index(key)

    def length(self, key: Hashable) -> int:
        return self.lengths[self.row(key)]

    # ---- membership ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, key: Hashable, state: DecodeState) -> None:
        """Adds `state` (a batch-1 prefill's cache, taken over: do not use it after) as the row of `key`."""
        if key in self.keys:
            raise ValueError(f"item {key!r} is already in the batch")
        n = state.length
        if self.cache is None:
            self.cache = state.cache
            self.valid = torch.ones(1, n, dtype=torch.bool)
        else:
            self._leave_fixed()
            width = max(self.width, n)
            self.adapter.cache_op("join_rows", self.cache, state.cache, width)
            row = torch.zeros(1, width, dtype=torch.bool)
            row[0, :n] = True
            self.valid = torch.cat([torch.nn.functional.pad(self.valid, (0, width - self.width)), row])
        self.keys.append(key)
        self.lengths.append(n)
        self.offsets.append(state.position_offset)
        self.prefill_lens.append(state.prefill_len)
        self._enter_fixed()

    @torch.inference_mode()
    def leave(self, key: Hashable) -> None:
        """Drops the row of `key`; the others keep their entries."""
        r = self.row(key)
        for name in ("keys", "lengths", "offsets", "prefill_lens"):
            del getattr(self, name)[r]
        if not self.keys:
            if self.adapter.fixed_cache is not None:
                self.adapter.fixed_cache.give_back(self)
            self.cache, self.valid = None, torch.zeros(0, 0, dtype=torch.bool)
            return
        rest = [i for i in range(self.valid.shape[0]) if i != r]
        self.valid = self.valid[torch.tensor(rest)]
        self.adapter.cache_op("select_rows", self.cache, rest)
        if self.size == 1:
            self._compact()  # a row alone has no holes (see `_alone`)
            self._enter_fixed()
        else:
            self.compact_if_wasteful()

    def _alone(self) -> bool:
        """One row and no holes: the cache is exactly that item's batch-1 cache."""
        return self.size == 1 and self.width == self.lengths[0]

    def _enter_fixed(self, room: int = FIXED_ROOM) -> None:
        """A row alone moves into the model's smallest fixed cache with `room` to spare (captured steps), when it
        has one free; a row that outgrew the largest goes on in a growing cache."""
        lease = self.adapter.fixed_cache
        if lease is None or not self._alone():
            return
        if isinstance(self.cache, FixedCache) and self.lengths[0] + room <= self.cache.capacity:
            return
        fixed = lease.take(self, held_entries(self.cache), room)
        if fixed is not None:
            self.cache = fixed
        else:
            self._leave_fixed()

    def _leave_fixed(self) -> None:
        """The fixed cache's entries back in a growing cache of their own (a batch of several steps eagerly)."""
        if isinstance(self.cache, FixedCache):
            self.cache = GrowingCache.holding(self.adapter.model.config.get_text_config(), self.cache.entries())
            self.adapter.fixed_cache.give_back(self)

    def _state(self) -> DecodeState:
        """The one row as a batch-1 DecodeState, sharing this cache (only while `_alone`)."""
        return DecodeState(cache=self.cache, position_offset=self.offsets[0], prefill_len=self.prefill_lens[0])

    # ---- decoding -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, tokens: dict[Hashable, list[int]],
             trees: dict[Hashable, TreeFeed] | None = None) -> dict[Hashable, torch.Tensor]:
        """Feeds each row the tokens `tokens` maps its key to (absent: none) in ONE forward; `trees`: the rows
        whose tokens are draft-tree nodes, and where they sit (`TreeFeed`; the others feed a chain).

        Returns {key: (len(tokens[key]), V) float32 logits} for the rows that were fed, row i of it predicting
        the token after tokens[key][i], as `VideoLMAdapter.step` (a tree's row: `step_tree`) does for one sequence.
        """
        trees = trees or {}
        counts = [len(tokens.get(key, ())) for key in self.keys]
        k = max(counts, default=0)
        if k == 0:
            return {}
        if trees:  # a tree's mask and compaction run eagerly (a captured step takes neither)
            self._leave_fixed()
        if isinstance(self.cache, FixedCache) and self.lengths[0] + k > self.cache.capacity:
            self._enter_fixed(max(FIXED_ROOM, k))  # outgrown: into a larger bucket, or on eagerly
        if self._alone():  # the batch-1 forward itself
            key = self.keys[0]
            ids = torch.tensor(tokens[key], dtype=torch.long)
            tree = trees.get(key)
            logits = (self.adapter.step(self._state(), ids) if tree is None
                      else self.adapter.step_tree(self._state(), ids, tree.seq_index, tree.visible))
            self.valid = torch.ones(1, self.width + k, dtype=torch.bool)
            self.lengths[0] += k
            return {key: logits}
        self.compact_if_wasteful()
        device = self.adapter.device
        ids = torch.full((self.size, k), PAD_TOKEN, dtype=torch.long)
        for r, key in enumerate(self.keys):
            if counts[r]:
                ids[r, : counts[r]] = torch.tensor(tokens[key], dtype=torch.long)
        start = torch.tensor([n + o for n, o in zip(self.lengths, self.offsets)])
        pos = start[:, None] + torch.arange(k)[None, :]  # (B, k): padding continues harmlessly
        fed = torch.arange(k)[None, :] < torch.tensor(counts)[:, None]  # (B, k) real tokens; padding = holes
        before = self.valid
        self.valid = torch.cat([self.valid, fed], dim=1)
        width = self.width
        causal = torch.arange(width)[None, :] <= torch.arange(width - k, width)[:, None]  # (k, W): the new rows' past
        allowed = self.valid[:, None, :] & causal[None]  # (B, k, W)
        for key, tree in trees.items():
            r = self.row(key)
            pos[r, : counts[r]] = tree.seq_index.long() + self.offsets[r]
            self._tree_mask(allowed[r], before[r], tree.visible, counts[r])
        rows = self.adapter.position_rows
        pos = pos.to(device)
        out = self.adapter.run_language_model(
            self.cache,
            input_ids=ids.to(device),
            position_ids=pos[None].expand(rows, -1, -1) if rows > 1 else pos,
            attention_mask=additive_mask(allowed, self.adapter.model.dtype).to(device),
        )
        logits = self.adapter.model.lm_head(out.last_hidden_state).float()
        for r, c in enumerate(counts):
            self.lengths[r] += c
        return {key: logits[r, : counts[r]] for r, key in enumerate(self.keys) if counts[r]}

    @staticmethod
    def _tree_mask(allowed: torch.Tensor, before: torch.Tensor, visible: torch.Tensor, count: int) -> None:
        """A tree row's (k, W) mask in place: its nodes see the row's entries before its last m (`before`: its
        columns before this forward), those m as `visible` says, and of the k fed now what `visible` says."""
        k, old = allowed.shape[0], before.shape[0]
        m = visible.shape[1] - count
        cols = torch.nonzero(before).squeeze(1)
        if visible.shape[0] != count or not 0 <= m <= cols.numel():
            raise ValueError(f"tree feed of {count} tokens got visible {tuple(visible.shape)} on {cols.numel()} entries")
        allowed[:count] = False
        allowed[:count, cols[: cols.numel() - m]] = True
        allowed[:count, cols[cols.numel() - m :]] = visible[:, :m]
        allowed[:count, old : old + count] = visible[:, m:]

    @torch.inference_mode()
    def keep(self, key: Hashable, start: int, keep: list[int]) -> None:
        """Keeps row `key`'s entries before `start` and, after them, its entries start + keep[i] (increasing);
        the rest are dropped (`VideoLMAdapter.compact`; batched, they become holes). After a tree round `keep` is
        the accepted path: its entries already carry consecutive chain positions, so the row is a chain's."""
        r = self.row(key)
        if self._alone():
            self.adapter.compact(self._state(), start, keep)
            self.lengths[r] = start + len(keep)
            self.valid = torch.ones(1, self.lengths[r], dtype=torch.bool)
            return
        if not self.prefill_lens[r] <= start <= self.lengths[r] or any(
                not 0 <= i < self.lengths[r] - start for i in keep) or keep != sorted(set(keep)):
            raise ValueError(f"cannot keep {keep} after {start} in row {key!r} of {self.lengths[r]} entries")
        cols = torch.nonzero(self.valid[r]).squeeze(1)
        kept = set(keep)
        dropped = [start + i for i in range(self.lengths[r] - start) if i not in kept]
        self.valid[r, cols[dropped]] = False
        self.lengths[r] = start + len(keep)

    def step_rowwise(self, tokens: dict[Hashable, list[int]]) -> dict[Hashable, torch.Tensor]:
        """As `step`, one token per row per forward (`decoding.exact_verify`: the shapes `ar` runs)."""
        out: dict[Hashable, list[torch.Tensor]] = {}
        for i in range(max((len(t) for t in tokens.values()), default=0)):
            part = self.step({key: t[i : i + 1] for key, t in tokens.items() if len(t) > i})
            for key, logits in part.items():
                out.setdefault(key, []).append(logits)
        return {key: torch.cat(rows) for key, rows in out.items()}

    @torch.inference_mode()
    def rollback(self, key: Hashable, length: int) -> None:
        """Forgets row `key`'s entries past `length` (they become holes)."""
        r = self.row(key)
        if not self.prefill_lens[r] <= length <= self.lengths[r]:
            raise ValueError(f"cannot roll item {key!r} back from {self.lengths[r]} to {length} "
                             f"(prefill {self.prefill_lens[r]})")
        if length < self.lengths[r] and self._alone():  # the batch-1 rollback: a crop, no hole
            self.adapter.rollback(self._state(), length)
            self.valid = self.valid[:, :length]
            self.lengths[r] = length
        elif length < self.lengths[r]:
            self.valid[r] &= self.valid[r].cumsum(0) <= length  # its entries past the first `length` become holes
            self.lengths[r] = length

    @torch.inference_mode()
    def compact_if_wasteful(self) -> None:
        """Gathers every row's entries to the left once holes take more than a quarter of the width."""
        width = max(self.lengths, default=0)
        if self.cache is None or self.width - width <= max(16, self.width // 4):
            return
        self._compact()

    @torch.inference_mode()
    def _compact(self) -> None:
        """Gathers every row's entries to the left (a copy: each entry keeps its value)."""
        width = max(self.lengths, default=0)
        if self.cache is None or self.width == width and bool(self.valid.all()):
            return
        order = torch.zeros(self.size, width, dtype=torch.long)  # row r's entries first, then any column
        for r in range(self.size):
            cols = torch.nonzero(self.valid[r]).squeeze(1)
            order[r, : cols.numel()] = cols
        self.adapter.cache_op("gather_columns", self.cache, order.tolist())
        self.valid = torch.arange(width)[None, :] < torch.tensor(self.lengths)[:, None]

    def entries(self, key: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `key`'s (keys, values) of one layer, (Hkv, length, d) each, holes removed (for tests, checks)."""
        r = self.row(key)
        cols = torch.nonzero(self.valid[r]).squeeze(1)
        src = self.cache.layers[layer]
        return src.keys[r][:, cols.to(src.keys.device)], src.values[r][:, cols.to(src.values.device)]


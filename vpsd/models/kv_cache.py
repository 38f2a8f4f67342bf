"""A KV cache that grows in place: appending a token writes into spare room instead of copying the cache.

transformers' `DynamicLayer` appends by `torch.cat`, so every forward copies the layer's whole cache: at a
long video's context that copy is the largest part of a decode step (the scaled target at a 2k context spent
12% of a batched verify in `aten::cat`, and at batch 1 a step at 4k copies 150 MB of keys and values to read
them once). `GrowingLayer` keeps each layer's keys and values in buffers with room to spare: an append writes
the new entries after the current length (growing the buffer by half when full, so appends cost O(1)
amortised), a crop only moves the length back, and what attention reads is the view `[:, :, :length]`.

The layer is a `DynamicLayer` to every caller: `keys` / `values` read as the cache's current entries, and
assigning them (vpsd's batched cache joins, compacts and drops rows that way) adopts the new tensor as the
buffer. The values are the same tensors a `DynamicCache` would hold, so every forward computes what it did.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE = 0.5  # a full buffer grows by half its length (at least MIN_SPARE entries)
MIN_SPARE = 64


class GrowingLayer(DynamicLayer):
    """One layer's keys and values, (B, H, length, d), in buffers with spare room (see the module docstring)."""

    def __init__(self, **kwargs) -> None:
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        # Entries held: one length for keys and one for values, so that assigning one of them (callers replace
        # keys, then values, each computed from the old one) leaves the other as it was until it is assigned.
        self._length = self._values_length = 0
        super().__init__(**kwargs)

    # DynamicLayer and its callers read and assign `keys` / `values`: views of the buffers, and adoption.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self._length]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys, self._length = self._adopt(tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self._values_length]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values, self._values_length = self._adopt(tensor)

    @staticmethod
    def _adopt(tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
        # DynamicLayer starts a layer as an empty 1-D tensor; anything but (B, H, L, d) holds no entries.
        if tensor is None or tensor.dim() != 4:
            return None, 0
        return tensor, int(tensor.shape[-2])

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else int(self._keys.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self._keys is None or self._keys.shape[:2] != key_states.shape[:2]:
            self._keys, self._values, self._length = key_states[:, :, :0], value_states[:, :, :0], 0
        if self._values_length != self._length:
            raise RuntimeError(f"a cache layer holds {self._length} keys and {self._values_length} values")
        if self._length + n > self.capacity:
            self._grow(self._length + n)
        end = self._length + n
        self._keys[:, :, self._length : end] = key_states
        self._values[:, :, self._length : end] = value_states
        self._length = self._values_length = end
        return self.keys, self.values

    def _grow(self, need: int) -> None:
        room = max(need, self.capacity + max(MIN_SPARE, int(self.capacity * SPARE)))
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], room, old.shape[-1])
            new[:, :, : self._length] = old[:, :, : self._length]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count (tokens to remove), got {tokens_to_remove}")
        self._length = self._values_length = max(0, self._length + tokens_to_remove)

    def reset(self) -> None:
        self._keys = self._values = None
        self._length = self._values_length = 0
        super().reset()


class GrowingCache(DynamicCache):
    """A `DynamicCache` whose full-attention layers are `GrowingLayer`s (sliding-window layers stay as they are)."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]

    @classmethod
    def holding(cls, config, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> "GrowingCache":
        """A cache whose layer i holds copies of entries[i] = (keys, values), (B, H, n, d) each."""
        return cls._adopting(config, [(keys.clone(), values.clone()) for keys, values in entries])

    @classmethod
    def stacked(cls, config, caches: list[DynamicCache]) -> "GrowingCache":
        """A cache whose row b holds caches[b]'s entries (one cache a row; all of one length)."""
        return cls._adopting(config, [(torch.cat([c.layers[i].keys for c in caches]),
                                       torch.cat([c.layers[i].values for c in caches]))
                                      for i in range(len(caches[0].layers))])

    @classmethod
    def _adopting(cls, config, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> "GrowingCache":
        cache = cls(config)
        for layer, (keys, values) in zip(cache.layers, entries):
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        return cache

"""The operations vpsd performs on a KV cache outside a forward, by name: one definition for every caller.

A batch's join, leave and compaction and every rollback go through `VideoLMAdapter.cache_op(name, cache, ...)`
(models/base.py), which runs `CACHE_OPS[name]`; a tensor-parallel target's followers run the same operation on
their shard of the cache when the leader's adapter sends it (models/tensor_parallel.py), so their caches stay
the leader's, head for head. Arguments are plain ints and lists (and other caches, by position) so that they
travel as msgpack.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, C, d) -> (B, H, width, d): hole columns (zeros) on the right."""
    return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]))


def crop(cache: Any, tokens_to_remove: int) -> None:
    cache.crop(-tokens_to_remove)


def join_rows(cache: Any, other: Any, width: int) -> None:
    """`other`'s rows after `cache`'s, both widened to `width` columns (holes on the right)."""
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([_widen(mine.keys, width), _widen(theirs.keys, width)])
        mine.values = torch.cat([_widen(mine.values, width), _widen(theirs.values, width)])


def select_rows(cache: Any, rows: list[int]) -> None:
    for layer in cache.layers:
        index = torch.tensor(rows, device=layer.keys.device)
        layer.keys, layer.values = layer.keys[index], layer.values[index]


def gather_columns(cache: Any, order: list[list[int]]) -> None:
    """Row r keeps columns order[r] (in that order)."""
    for layer in cache.layers:
        index = torch.tensor(order, device=layer.keys.device)[:, None, :, None]
        index = index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)


# name -> (function, which of its positional arguments after the cache are caches)
CACHE_OPS: dict[str, tuple[Callable[..., None], tuple[int, ...]]] = {
    "crop": (crop, ()),
    "join_rows": (join_rows, (0,)),
    "select_rows": (select_rows, ()),
    "gather_columns": (gather_columns, ()),
}

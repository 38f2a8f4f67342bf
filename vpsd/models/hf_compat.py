"""The one place vpsd meets a transformers rename: the keyword a language model takes its KV cache under.

transformers up to 5.23 names it `past_key_values`; 5.24 renamed it `cache` (the old name still works there,
through `deprecate_kwarg`, with a FutureWarning, until its removal in 5.40). Passing a name the forward does not
know is not an error in either: it lands in `**kwargs` and the model silently runs without a cache. So the name
is read from the forward's own signature (public API: `deprecate_kwarg` keeps `__wrapped__`, so the signature is
the new one), never guessed from a version number. Nothing else in vpsd may name either keyword.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

# Newest name first: a forward that names both (a transition release) gets the new one.
_CACHE_NAMES = ("cache", "past_key_values")


@functools.cache
def _cache_parameter(forward_owner: type) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    for name in _CACHE_NAMES:
        if name in params:
            return name
    raise TypeError(f"{forward_owner.__name__}.forward takes none of {_CACHE_NAMES}: a transformers vpsd does not support")


def cache_kwargs(module: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for `module(**...)`, name the one `type(module).forward` declares."""
    return {_cache_parameter(type(module)): cache}

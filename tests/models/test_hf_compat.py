"""The cache keyword: read from the forward's signature, so a rename upstream never drops the cache silently."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.models.hf_compat import cache_kwargs


class Old(torch.nn.Module):  # transformers <= 5.23
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return past_key_values


def renamed(fn):
    @functools.wraps(fn)  # as transformers' deprecate_kwarg wraps a forward: the signature shows the new name
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        return fn(*args, **kwargs)

    return wrapper


class New(torch.nn.Module):  # transformers >= 5.24
    @renamed
    def forward(self, input_ids=None, cache=None, **kwargs):
        return cache


class Neither(torch.nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return kwargs


@pytest.mark.parametrize("cls,name", [(Old, "past_key_values"), (New, "cache")])
def test_the_cache_goes_under_the_name_the_forward_declares(cls, name):
    module, cache = cls(), object()
    assert cache_kwargs(module, cache) == {name: cache}
    assert module(**cache_kwargs(module, cache)) is cache


def test_a_forward_without_a_cache_parameter_is_refused():
    with pytest.raises(TypeError, match="takes none of"):
        cache_kwargs(Neither(), object())


def test_the_installed_language_models_fill_the_cache_they_are_given(family):
    target, _ = tiny_pair(family)
    emb = target.embed(target.prepare(random_frames(0), "hi"))
    cache = target.new_cache()
    result = target.prefill(emb, cache=cache)
    # A name the forward does not know lands in its **kwargs: no error, and the cache stays empty.
    assert result.state.cache is cache and cache.get_seq_length() == emb.seq_len

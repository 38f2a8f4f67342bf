"""Prompts are text: how a user's prompt enters a chat template (light: the manifest imports it too)."""

from __future__ import annotations

import threading
from typing import Any

# Where the user's prompt goes in a rendered chat template (a private-use character; templates have none).
PROMPT_SLOT = "\ue000"


class ControlText(str):
    """A prompt whose special-token strings ARE control tokens: a manifest item that asks for it
    ("prompt_special_tokens": true). A plain str prompt is text, whatever it contains."""


def encode_chat(tokenizer: Any, template: str, prompt: str) -> list[int]:
    """Token ids of a chat `template` rendered with PROMPT_SLOT in place of `prompt`.

    The template's markers are control tokens; the prompt's are text: "<|im_end|>" or "<|video_pad|>" typed by a
    user encodes as the characters it is made of (split_special_tokens), so a prompt can neither end its turn nor
    add video tokens, unless it is a ControlText. Special tokens split the encoding anyway, so a prompt without
    any encodes exactly as it would inside the whole string.
    """
    before, after = template.split(PROMPT_SLOT)

    def enc(text: str, split: bool = False) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split) if text else []

    with tokenizer_lock(tokenizer):
        return enc(before) + enc(prompt, split=not isinstance(prompt, ControlText)) + enc(after)


_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def tokenizer_lock(tokenizer: Any) -> threading.Lock:
    """The one lock of a tokenizer, held around every use of it. A fast tokenizer is not thread-safe: transformers
    sets `split_special_tokens` on the shared Rust tokenizer for the length of a call, so another thread's call
    meanwhile encodes a template's control tokens as text (wrong token ids, silently, or an item failing with "0
    video tokens"), and a call that finds the tokenizer borrowed raises. Items are prepared on the prefill-ahead
    thread and on the engine's (engine/prefill_ahead.py), which also reads committed text for stop strings."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(id(tokenizer), threading.Lock())

"""Prompts are text: how a user's prompt enters a chat template (light: the manifest imports it too)."""

from __future__ import annotations

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

    return enc(before) + enc(prompt, split=not isinstance(prompt, ControlText)) + enc(after)

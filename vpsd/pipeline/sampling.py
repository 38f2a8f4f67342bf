"""Turning logits into the distributions speculative decoding compares, and drawing from them.

Temperature 0 is greedy: the distribution is one-hot on the argmax (ties go to the lowest id, as
torch.argmax does), which makes greedy decoding the exact temperature-0 case of the sampling rule.

Every draw runs on its generator's device, the host: each item's random streams are CPU generators seeded as
at batch 1, and torch refuses a CPU generator for a draw from a CUDA tensor. So the row a draw reads moves to
the host first (`on_generator`; the speculative-sampling rule moves only that row and the two numbers per
drafted token it compares: pipeline/verification.py), and a seed draws the same tokens from the same
probabilities whichever device computed them.
"""

from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) float32; one-hot on the argmax when temperature == 0."""
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def on_generator(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`probs` on the device `generator` draws on (itself when already there, as always on a CPU run)."""
    return probs if generator is None or probs.device == generator.device else probs.to(generator.device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draws one token id from (V,) probabilities; deterministic given the generator state."""
    return int(torch.multinomial(on_generator(probs, generator), 1, generator=generator))


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The token plain decoding emits from (V,) logits: argmax when greedy, else a seeded draw."""
    if temperature == 0.0:
        return int(logits.argmax())
    return sample(probs_from_logits(logits, temperature), generator)

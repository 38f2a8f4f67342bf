"""TABED's drafter: an ensemble of views of one item, for the draft role (roles/draft.py).

Every other method drafts from a row of the draft's batched cache; a TABED item drafts from its own batch of
views through these five operations (the role owns the protocol):
    propose(pos, temperature, gen) -> (token, q or None)   the token for sequence position `pos`
    feed(tokens)                                            append tokens to the cache(s)
    rollback(length)                                        crop the cache(s)
    observe(start, tokens, target_probs)                    verified positions start.. and their labels
    forget_from(pos)                                        positions >= pos were rejected
q is the distribution the token was drawn from; the target verifies with it when sampling, so
sampling stays exact whatever the ensemble is, and greedy stays lossless (only the token matters).
"""

from __future__ import annotations

import torch

from vpsd.models.base import SequenceEmbeddings, VideoLMAdapter
from vpsd.models.views import prefill_views, step_views
from vpsd.pipeline.ensemble import AdaptiveWeights, TabedConfig, weighted_average
from vpsd.pipeline.sampling import probs_from_logits, sample


class TabedDrafter:
    """TABED (Algorithm 1) in the draft role: views batched through the draft model, weights per block.

    A block is the gamma tokens drafted after the weights were chosen (the paper's drafting block); a
    rollback starts a new one. The views' distributions are kept per drafted position until the target's
    verdict turns them into distances (AdaptiveWeights.observe) or a rollback discards them.
    Greedy: each view's q is its softmax at temperature 1 (a one-hot view could not be weighed), the
    token is the ensemble's argmax. Sampling: views at the run's temperature, the token drawn from q.
    """

    def __init__(self, adapter: VideoLMAdapter, emb: SequenceEmbeddings, keep: torch.Tensor, cfg: TabedConfig, gamma: int):
        self.adapter = adapter
        self.cfg = cfg
        self.gamma = gamma
        self.batch, self.view_logits = prefill_views(adapter, emb, keep, cfg.views, cfg.pool)
        self.adaptive = AdaptiveWeights(cfg, len(cfg.views))
        self.weights = self.adaptive.weights()
        self.block_start: int | None = None
        self.view_probs: dict[int, torch.Tensor] = {}  # position -> (m, V), until verified or rejected
        self.weight_log: list[list[float]] = []  # w* of every block, for traces and tests

    @property
    def length(self) -> int:
        return self.batch.state.length

    def propose(self, pos: int, temperature: float, gen: torch.Generator) -> tuple[int, torch.Tensor | None]:
        if self.block_start is None or pos >= self.block_start + self.gamma:
            self.weights = self.adaptive.weights()  # line 3: w* from the verified window, once per block
            self.block_start = pos
            self.weight_log.append([round(float(w), 4) for w in self.weights])
        views = probs_from_logits(self.view_logits, temperature if temperature > 0 else 1.0)  # line 5
        self.view_probs[pos] = views
        q = weighted_average(views, self.weights)  # line 6
        if temperature == 0.0:
            return int(q.argmax()), None
        return sample(q, gen), q  # line 7

    def feed(self, tokens: list[int]) -> None:
        self.view_logits = step_views(self.adapter, self.batch, torch.tensor(tokens))[:, -1]

    def rollback(self, length: int) -> None:
        self.adapter.rollback(self.batch.state, length)
        self.block_start = None

    def observe(self, start: int, tokens: list[int], target_probs: torch.Tensor | None) -> None:
        for i, token in enumerate(tokens):
            views = self.view_probs.pop(start + i, None)
            if views is not None:  # positions the target filled itself were never drafted
                self.adaptive.observe(views, token, None if target_probs is None else target_probs[i])

    def forget_from(self, pos: int) -> None:
        for p in [p for p in self.view_probs if p >= pos]:
            del self.view_probs[p]

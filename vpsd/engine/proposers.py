"""What drafts, whatever the place it runs in: the draft model fed the kept video, or TABED's ensemble of views.

A proposer holds the draft's side of every item it drafts for, by item id, and answers four questions the
drivers ask (engine/drafters/local.py in the target's process, roles/draft.py on the draft rank):

    admit(item, emb, keep, gamma)       prefill the item's draft (pruned input, or TABED's views)
    ready(item)                         whether it holds logits for the item's next position
    propose(item, pos, sampler)         the next token from them, at output position pos (and its q, when the
                                        rejection rule samples)
    feed({item: tokens})                append tokens to the items' caches: ONE forward for every model row
    rollback(item, length)              crop an item's cache (nothing when it holds no more than that)
    leave(item)

and what the verdicts teach (`observe` the verified positions, `forget_from` the rejected ones, `set_gamma`
the window): TABED weighs its views by them; the model proposer has nothing to learn. Adding a proposer
touches no driver.
"""

from __future__ import annotations


import torch

from vpsd.models.base import PrefillResult, SequenceEmbeddings, VideoLMAdapter
from vpsd.models.batch import BatchedCache, TreeFeed
from vpsd.models.timing import Stopwatch
from vpsd.models.views import prefill_views, step_views
from vpsd.pipeline.ensemble import AdaptiveWeights, TabedConfig, weighted_average
from vpsd.pipeline.sampling import ItemSampler, gumbel, probs_from_logits, sample


class ModelProposer:
    """Each item a row of the draft model's `BatchedCache`, prefilled on its kept video tokens; every row is
    fed in one forward."""

    def __init__(self, draft: VideoLMAdapter) -> None:
        self.draft = draft
        self.batch = BatchedCache(draft)
        self.last: dict[str, torch.Tensor | None] = {}  # item -> logits row for the next position

    def admit(self, item: str, emb: SequenceEmbeddings, keep: torch.Tensor | None, gamma: int) -> int:
        return self.join(item, self.draft.prefill(emb, keep=keep))

    def join(self, item: str, pre: PrefillResult) -> int:
        """An item whose draft prefill ran elsewhere (another thread) becomes a row; returns its cache length."""
        self.batch.join(item, pre.state)
        self.last[item] = pre.logits
        return pre.state.length

    def ready(self, item: str) -> bool:
        return self.last.get(item) is not None

    def propose(self, item: str, pos: int, sampler: ItemSampler) -> tuple[int, torch.Tensor | None]:
        return sampler.token(self.last[item], pos)

    def feed(self, feeds: dict[str, list[int]]) -> tuple[int, Stopwatch]:
        """One forward of every row's tokens; returns (rows, its stopwatch) for the cost model: read its
        `seconds` after a proposal from it (on a GPU, earlier would wait for the forward)."""
        watch = Stopwatch(self.draft.device)
        logits = self.batch.step(feeds)
        for item, rows in logits.items():
            self.last[item] = rows[-1].clone()  # a copy: a view would keep the whole step's (B, k, V) logits
        return len(feeds), watch.stop()

    def feed_tree(self, feeds: dict[str, list[int]], trees: dict[str, TreeFeed]) -> tuple[dict[str, torch.Tensor], Stopwatch]:
        """One forward of every row's next tree nodes (engine/drafters/tree.py); returns each row's logits, one
        per node, and the stopwatch."""
        watch = Stopwatch(self.draft.device)
        logits = self.batch.step(feeds, trees)
        for item in feeds:
            self.last[item] = None  # a tree's rows are read from the return; the next chain feed sets it again
        return logits, watch.stop()

    def keep(self, item: str, start: int, keep: list[int]) -> None:
        """The entries before `start` and, after them, start + keep[i] (a tree's accepted nodes, BatchedCache.keep)."""
        self.batch.keep(item, start, keep)

    def rollback(self, item: str, length: int) -> None:
        if length < self.batch.length(item):
            self.batch.rollback(item, length)
            self.last[item] = None  # the row for what replaces the dropped tokens comes from feeding them

    def observe(self, item: str, start: int, labels: list[int], target_probs: torch.Tensor | None) -> None:
        pass

    def forget_from(self, item: str, pos: int) -> None:
        pass

    def set_gamma(self, item: str, gamma: int) -> None:
        pass

    def leave(self, item: str) -> None:
        if self.last.pop(item, None) is not None or item in self.batch.keys:
            self.batch.leave(item)


class TabedProposer:
    """TABED (Algorithm 1): each item drafts from its own batch of views of the draft model (multimodal,
    text-only, pooled), ensembled with weights chosen once per drafting block from the verified tokens.

    A block is the gamma tokens drafted after the weights were chosen; a rollback starts a new one. Each view's
    distribution is kept per drafted position until the target's verdict turns it into a distance
    (AdaptiveWeights.observe) or a rollback discards it. Greedy: each view's q is its softmax at temperature 1
    (a one-hot view could not be weighed) and the token is the ensemble's argmax; sampling: views at the run's
    temperature and the token drawn from q: position-keyed (the argmax of log q plus the item's noise at its
    position, so a draft that agrees with the target in distribution agrees in tokens), or under the rejection
    rule from the draft's stream, q going to the target to verify with. Either stays exact whatever the ensemble
    is. Departure: the run's top-k / top-p / min-p filters are the target's; the ensemble drafts from its whole q
    (what the draft proposes never changes what is committed)."""

    def __init__(self, draft: VideoLMAdapter, cfg: TabedConfig) -> None:
        self.draft, self.cfg = draft, cfg
        self.items: dict[str, _Views] = {}

    def admit(self, item: str, emb: SequenceEmbeddings, keep: torch.Tensor | None, gamma: int) -> int:
        views = _Views(self.draft, emb, keep, self.cfg, gamma)
        self.items[item] = views
        return views.batch.state.length

    def ready(self, item: str) -> bool:
        return item in self.items

    def propose(self, item: str, pos: int, sampler: ItemSampler) -> tuple[int, torch.Tensor | None]:
        return self.items[item].propose(pos, sampler)

    def feed(self, feeds: dict[str, list[int]]) -> tuple[int, Stopwatch]:
        watch = Stopwatch(self.draft.device)
        for item, tokens in feeds.items():  # each item's own forward, over its views
            views = self.items[item]
            views.logits = step_views(self.draft, views.batch, torch.tensor(tokens))[:, -1]
        return sum(v.batch.num_views for v in (self.items[i] for i in feeds)), watch.stop()

    def rollback(self, item: str, length: int) -> None:
        views = self.items[item]
        if length < views.batch.state.length:
            self.draft.rollback(views.batch.state, length)

    def observe(self, item: str, start: int, labels: list[int], target_probs: torch.Tensor | None) -> None:
        views = self.items[item]
        for i, token in enumerate(labels):
            q = views.probs.pop(start + i, None)
            if q is not None:  # positions the target filled itself were never drafted
                views.adaptive.observe(q, token, None if target_probs is None else target_probs[i])

    def forget_from(self, item: str, pos: int) -> None:
        """Positions >= pos were rejected: their distributions go, and the next proposal starts a new block."""
        views = self.items[item]
        for p in [p for p in views.probs if p >= pos]:
            del views.probs[p]
        views.block_start = None

    def set_gamma(self, item: str, gamma: int) -> None:
        self.items[item].gamma = gamma  # its drafting blocks are windows too

    def leave(self, item: str) -> list[list[float]] | None:
        """Drops the item; returns w* of every block it drafted (how its views were weighed)."""
        views = self.items.pop(item, None)
        return None if views is None else views.weight_log


class _Views:
    """One TABED item: its views' batch, their last logits, the block's weights and the pending distributions."""

    def __init__(self, draft: VideoLMAdapter, emb: SequenceEmbeddings, keep, cfg: TabedConfig, gamma: int) -> None:
        self.cfg, self.gamma = cfg, gamma
        self.batch, self.logits = prefill_views(draft, emb, keep, cfg.views, cfg.pool)
        self.adaptive = AdaptiveWeights(cfg, len(cfg.views))
        self.weights = self.adaptive.weights()
        self.block_start: int | None = None
        self.probs: dict[int, torch.Tensor] = {}  # position -> (m, V), until verified or rejected
        self.weight_log: list[list[float]] = []

    def propose(self, pos: int, sampler: ItemSampler) -> tuple[int, torch.Tensor | None]:
        temperature = sampler.rule.temperature
        if self.block_start is None or pos >= self.block_start + self.gamma:
            self.weights = self.adaptive.weights()  # line 3: w* from the verified window, once per block
            self.block_start = pos
            self.weight_log.append([round(float(w), 4) for w in self.weights])
        views = probs_from_logits(self.logits, temperature if temperature > 0 else 1.0)  # line 5
        self.probs[pos] = views
        q = weighted_average(views, self.weights)  # line 6
        if temperature == 0.0:
            return int(q.argmax()), None
        if sampler.rule.keyed:  # line 7, drawn by Gumbel-max with the target's noise at this position
            return int((q.double().log() + gumbel(sampler.seed, pos, q.shape[-1], q.device)[0]).argmax()), None
        return sample(q, sampler.gen), q  # line 7

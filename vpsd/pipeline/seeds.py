"""One rule for an item's random streams, wherever they run.

An item has one seed, s: its own (a manifest line's `"seed"`, a request's `SamplingParams.seed`), else the run's
`decoding.seed`. Every draw of the item derives from it here, and every place that draws uses these functions.
The position-keyed rule (pipeline/sampling.py, the default) needs no stream: target and draft both hash (s,
position, token), so their noise is the same wherever they run. The rejection rule draws from streams: the
target's verify stream (engine/engine.py and the reference decoders) is seeded s, the draft's stream s + 1
(the drafters, roles/draft.py on its rank or on a thread, the reference decoders). A random pruning selection is
seeded `pruning.seed` + s (roles/pruner.py, engine/keep.py). So where the draft runs, and with whom an item is batched, never changes a seeded output or a
random pruning's kept tokens. (Before this rule the draft role drew from decoding.seed + s + 1 and the local
keep policy from pruning.seed alone: equal only at the default seed 0.)
"""

from __future__ import annotations

from vpsd.pipeline.sampling import ItemSampler, SamplingRule


def verify_seed(item_seed: int) -> int:
    """The target's stream: its first token's draw, the speculative-sampling rule's u and resamples."""
    return int(item_seed)


def draft_seed(item_seed: int) -> int:
    """The draft's stream: its proposals' draws."""
    return int(item_seed) + 1


def pruning_seed(pruning: int, item_seed: int) -> int:
    """A random pruning strategy's selection (`random`, and the strategies that break ties at random)."""
    return int(pruning) + int(item_seed)


def verify_sampler(rule: SamplingRule, item_seed: int) -> ItemSampler:
    """The item's target side: its first token, its plain steps and every verify."""
    return ItemSampler(rule, item_seed, verify_seed(item_seed))


def draft_sampler(rule: SamplingRule, item_seed: int) -> ItemSampler:
    """The item's draft side: its proposals (the keyed rule: the target's own noise, position for position)."""
    return ItemSampler(rule, item_seed, draft_seed(item_seed))

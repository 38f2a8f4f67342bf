"""One rule for an item's random streams, wherever they run.

An item has one seed, s: the run's `decoding.seed` (a job's, or one `generate` call's). Every stream of the item
derives from it here, and every place that draws uses these functions: the target's verify stream (engine/engine.py
and the reference decoders) is seeded s, the draft's stream s + 1 (engine/local_drafter.py, roles/draft.py on its
rank or on a thread, the reference decoders), and a random pruning selection `pruning.seed` + s (roles/pruner.py,
engine/keep.py). So where the draft runs, and with whom an item is batched, never changes a seeded output or a
random pruning's kept tokens. (Before this rule the draft role drew from decoding.seed + s + 1 and the local
keep policy from pruning.seed alone: equal only at the default seed 0.)
"""

from __future__ import annotations


def verify_seed(item_seed: int) -> int:
    """The target's stream: its first token's draw, the speculative-sampling rule's u and resamples."""
    return int(item_seed)


def draft_seed(item_seed: int) -> int:
    """The draft's stream: its proposals' draws."""
    return int(item_seed) + 1


def pruning_seed(pruning: int, item_seed: int) -> int:
    """A random pruning strategy's selection (`random`, and the strategies that break ties at random)."""
    return int(pruning) + int(item_seed)

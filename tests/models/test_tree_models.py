"""Tree speculation on the real model classes of every family (tiny configs).

- one tree forward scores every node exactly as decoding that node's root-to-node path as a chain
  (the tree mask and the per-node positions, 3-D M-RoPE after a pruned prefill included);
- the draft's depth-by-depth expansion does the same;
- compacting the cache to a partially accepted path equals a fresh chain decode of that path;
- greedy sd-tree reproduces `ar` for several tree shapes and pruning ratios.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import random_frames, tiny_pair
from vpsd.config import DecodingConfig, PruningConfig
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.sd import decode_sd
from vpsd.decoders.tree_sd import draft_tree
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.sampling import ItemSampler, SamplingRule
from vpsd.pipeline.tree import parse_tree

TREE = parse_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
PROMPT = "Describe the video."


def _pruned_state(adapter, seed: int = 0):
    """A prefill that kept every other video token: decoded positions continue the FULL sequence's."""
    emb = adapter.embed(adapter.prepare(random_frames(seed), PROMPT))
    keep = torch.arange(0, emb.layout.num_tokens, 2)
    return adapter.prefill(emb, keep=keep).state


def _chain_logits(adapter, state, tokens: list[int]) -> torch.Tensor:
    """Last-row logits of feeding `tokens` as a plain chain; the cache is put back afterwards."""
    base = state.length
    logits = adapter.step(state, torch.tensor(tokens))[-1]
    adapter.rollback(state, base)
    return logits


def _path_tokens(tokens: list[int], node: int) -> list[int]:
    out = []
    while node > 0:
        out.append(tokens[node])
        node = TREE.parents[node]
    return out[::-1]


def test_tree_forward_equals_each_node_decoded_as_a_chain(family):
    target, _ = tiny_pair(family)
    state = _pruned_state(target)
    vocab = target.model.config.get_text_config().vocab_size
    target.step(state, torch.tensor([5, 6]))  # some generated tokens already in the cache
    base = state.length
    pending = [7, 8]  # committed tokens the cache lacks; 8 is the root
    tokens = [8] + torch.randint(10, vocab, (TREE.num_nodes,), generator=torch.Generator().manual_seed(0)).tolist()
    offsets, visible = TREE.verify_inputs(len(pending))
    tree_logits = target.step_tree(state, torch.tensor(pending + tokens[1:]), offsets + base, visible)
    target.rollback(state, base)
    for node in range(TREE.num_nodes + 1):
        ref = _chain_logits(target, state, pending + _path_tokens(tokens, node))
        torch.testing.assert_close(tree_logits[len(pending) - 1 + node], ref, atol=1e-5, rtol=0)


def test_draft_expansion_equals_each_node_decoded_as_a_chain(family):
    _, draft = tiny_pair(family)
    state = _pruned_state(draft)
    cursor = CacheCursor(state.length)
    committed = [5, 6, 7]
    drafted = draft_tree(draft, state, cursor, committed, TREE, ItemSampler(SamplingRule(0.0), 0, 0))
    assert state.length == cursor.length + len(drafted.fed)
    assert sorted(drafted.logits) == [0] + drafted.fed  # every node with children was expanded, leaves never fed
    draft.rollback(state, cursor.length - len(committed))
    for node, logits in drafted.logits.items():
        ref = _chain_logits(draft, state, committed + _path_tokens(drafted.tokens, node))
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    # Greedy candidates are the top-k of their parent's draft logits, in rank order.
    for parent, kids in enumerate(TREE.children):
        if kids:
            assert [drafted.tokens[c] for c in kids] == drafted.logits[parent].topk(len(kids)).indices.tolist()


def test_compaction_equals_a_fresh_decode_of_the_accepted_path(family):
    target, _ = tiny_pair(family)
    state = _pruned_state(target)
    fresh = _pruned_state(target)
    base = state.length
    pending = [7, 8]
    tokens = [8, 11, 12, 13, 14, 15, 16, 17]
    path = [2, 5]  # (1,), (1, 0): a partial path away from the first candidates, node (1, 0) a leaf
    offsets, visible = TREE.verify_inputs(len(pending))
    target.step_tree(state, torch.tensor(pending + tokens[1:]), offsets + base, visible)
    target.compact(state, base + len(pending), [n - 1 for n in path])
    accepted = pending + [tokens[n] for n in path]
    target.step(fresh, torch.tensor(accepted))
    assert state.length == fresh.length == base + len(accepted)
    for got, ref in zip(state.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(got.keys, ref.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values, ref.values, atol=1e-5, rtol=0)
    nxt = torch.tensor([21])
    torch.testing.assert_close(target.step(state, nxt), target.step(fresh, nxt), atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", ["eagle", [2, 2, 1], [[0], [0, 0], [0, 1], [0, 0, 0], [1]]])
@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_greedy_sd_tree_equals_ar(family, spec, ratio):
    # The target drafts for itself on pruned video: random tiny pairs agree on too little for a smaller draft
    # to get any path accepted, this way rounds accept paths of every length, not only the first candidates.
    target, _ = tiny_pair(family)
    frames = random_frames(3)
    cfg = DecodingConfig(max_new_tokens=14, temperature=0.0)
    ref = decode_ar(target, frames, PROMPT, cfg)
    got = decode_sd(target, target, frames, PROMPT, cfg, keep_policy_for(PruningConfig("uniform", ratio, 0)),
                    tree=parse_tree(spec))
    assert got.token_ids == ref.token_ids
    assert sum(got.stats.accepted_per_round) > 0


def test_self_speculation_tree_accepts_the_whole_depth(family):
    """The unpruned target drafting for itself: every round accepts a full root-to-leaf path of depth D."""
    target, _ = tiny_pair(family)
    tree = parse_tree([2, 2, 2])
    cfg = DecodingConfig(max_new_tokens=13, temperature=0.0)  # first token + 3 rounds of (3 + 1)
    got = decode_sd(target, target, random_frames(5), PROMPT, cfg, keep_policy_for(PruningConfig("none", 0.0)),
                    tree=tree)
    assert got.token_ids == decode_ar(target, random_frames(5), PROMPT, cfg).token_ids
    assert got.stats.accepted_per_round == [3, 3, 3]


def test_sampled_self_speculation_accepts_every_first_candidate(family):
    """Sampling with q == p (the unpruned target drafting for itself): min(1, p/q) = 1, so every round accepts
    its first candidate at every depth; proves each node's q reaches the rule with its own p. Seeded: repeatable."""
    target, _ = tiny_pair(family)
    cfg = DecodingConfig(max_new_tokens=13, temperature=0.3, seed=3, sampling="rejection")
    keep = keep_policy_for(PruningConfig("none", 0.0))
    tree = parse_tree([2, 2, 2])
    runs = [decode_sd(target, target, random_frames(6), PROMPT, cfg, keep, tree=tree) for _ in range(2)]
    assert runs[0].stats.accepted_per_round == [3, 3, 3]
    assert runs[0].token_ids == runs[1].token_ids
    # Position-keyed: the draft's first candidate is its keyed sample, the target's own at every depth, so every
    # round accepts a whole path too, and the output is ar's sample at the seed.
    keyed = dataclasses.replace(cfg, sampling="keyed")
    got = decode_sd(target, target, random_frames(6), PROMPT, keyed, keep, tree=tree)
    assert got.token_ids == decode_ar(target, random_frames(6), PROMPT, keyed).token_ids
    assert all(a == 3 for a in got.stats.accepted_per_round[:-1])

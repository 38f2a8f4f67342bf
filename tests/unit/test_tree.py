"""Static draft trees: structure, the verify forward's mask and offsets, and the lossless tree rules."""

from __future__ import annotations

import itertools

import pytest
import torch

import vpsd.pipeline.tree as tree_mod
from vpsd.pipeline.sampling import ItemSampler, SamplingRule, probs_from_logits
from vpsd.pipeline.tree import (
    EAGLE_TREE,
    DraftTree,
    parse_tree,
    verify_tree_greedy,
    verify_tree_sampling,
)


def test_eagle_tree_structure():
    t = parse_tree("eagle")
    assert t.num_nodes == len(EAGLE_TREE) == 25 and t.depth == 5
    assert [len(t.level(d)) for d in range(6)] == [1, 4, 8, 8, 3, 2]
    assert [t.paths[c - 1] for c in t.children[0]] == [(0,), (1,), (2,), (3,)]
    # Node (0, 0, 0, 0) has children (0,0,0,0,0), (0,0,0,0,1); each node's parent is its path's prefix.
    for i, p in enumerate(t.paths, start=1):
        parent = t.parents[i]
        assert (t.paths[parent - 1] if parent else ()) == p[:-1]


def test_tree_settings():
    assert parse_tree(None) is None and parse_tree("chain") is None
    assert parse_tree([2, 1]).paths == ((0,), (1,), (0, 0), (1, 0))
    assert parse_tree([[1], [0], [0, 0]]).paths == ((0,), (1,), (0, 0))
    assert DraftTree.chain(3).paths == ((0,), (0, 0), (0, 0, 0))
    for bad in ["pine", [[0, 0]], [[1]], [[0], [0]], [0, 2], [], [[0], "a"], 3]:
        with pytest.raises(ValueError):
            parse_tree(bad)


def _reference_visibility(t: DraftTree, pending: int) -> torch.Tensor:
    """Built node by node: what each fed token may attend to among the fed tokens."""
    n = pending + t.num_nodes
    vis = torch.zeros(n, n, dtype=torch.bool)
    for a in range(pending):
        vis[a, : a + 1] = True
    for i in range(1, t.num_nodes + 1):
        row = pending - 1 + i
        vis[row, :pending] = True
        j = i
        while j > 0:  # walk up to the root
            vis[row, pending - 1 + j] = True
            j = t.parents[j]
    return vis


@pytest.mark.parametrize("spec", ["eagle", [3, 2, 1], [[0], [0, 0], [0, 1], [1]]])
@pytest.mark.parametrize("pending", [1, 3])
def test_verify_inputs_match_a_node_by_node_reference(spec, pending):
    t = parse_tree(spec)
    offsets, visible = t.verify_inputs(pending)
    assert torch.equal(visible, _reference_visibility(t, pending))
    assert offsets.tolist() == list(range(pending)) + [pending - 1 + len(p) for p in t.paths]


def test_greedy_table():
    t = parse_tree([2, 2])  # nodes: 1=(0) 2=(1) 3=(0,0) 4=(0,1) 5=(1,0) 6=(1,1)
    tokens = [9, 1, 2, 3, 4, 5, 6]
    V = 10

    def logits(best: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(best), V).float() * 5

    # (argmax per node row) -> (path, next token)
    cases = [
        ([2, 0, 5, 0, 0, 0, 0], [2, 5], 0),  # second root candidate, its first child, bonus from node 5's row
        ([1, 4, 0, 0, 0, 0, 0], [1, 4], 0),
        ([7, 0, 0, 0, 0, 0, 0], [], 7),  # no candidate matches: the target's own token
        ([1, 8, 0, 0, 0, 0, 0], [1], 8),
    ]
    for best, path, nxt in cases:
        v = verify_tree_greedy(t, tokens, logits(best))
        assert (v.path, v.next_token) == (path, nxt)
        assert v.emitted(tokens) == [tokens[i] for i in path] + [nxt]


def test_greedy_is_the_temperature_zero_case_of_sampling():
    t = parse_tree([3, 2])
    V = 6
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        target_logits = torch.randn(t.num_nodes + 1, V, generator=g)
        tokens, q = [0] * (t.num_nodes + 1), {}
        for node in range(t.num_nodes + 1):
            kids = t.children[node]
            if kids:
                d = torch.randn(V, generator=g)
                d[int(target_logits[node].argmax())] += float(torch.rand((), generator=g)) * 4  # agree often
                chosen, _ = ItemSampler(SamplingRule(0.0), 0, 0).children(d, len(kids), 0)
                for c, x in zip(kids, chosen):
                    tokens[c] = x
                q[node] = torch.softmax(d, -1)
        p = probs_from_logits(target_logits, 0.0)
        sampled = verify_tree_sampling(t, tokens, q, p, torch.Generator().manual_seed(seed))
        assert sampled == verify_tree_greedy(t, tokens, target_logits)


# ---- the sampled law --------------------------------------------------------------------------------

VOCAB = 4
TREE = parse_tree([3, 2])  # 3 candidates of 4 tokens at the root: the sibling rule does real work


def _markov(seed: int, scale: float) -> torch.Tensor:
    """(V, V) next-token distributions given the previous token."""
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale, -1)


def _two_tokens(P: torch.Tensor, Q: torch.Tensor, s: ItemSampler) -> tuple[int, int]:
    """Runs tree rounds on a Markov 'model' (target P, draft Q) from token 0 until two tokens are out."""
    out: list[int] = []
    while len(out) < 2:
        root = out[-1] if out else 0
        tokens, q = [root] + [0] * TREE.num_nodes, {}
        for node in range(TREE.num_nodes + 1):  # breadth-first: a parent's token is set before its children
            kids = TREE.children[node]
            if kids:
                chosen, q[node] = s.children(torch.log(Q[tokens[node]]), len(kids), len(out))
                for c, x in zip(kids, chosen):
                    tokens[c] = x
        p = P[torch.tensor(tokens)]
        out += verify_tree_sampling(TREE, tokens, q, p, s.gen).emitted(tokens)
    return out[0], out[1]


def _chi2(P: torch.Tensor, Q: torch.Tensor, trials: int, seed: int) -> float:
    s = ItemSampler(SamplingRule(1.0, rule="rejection"), seed, seed)  # one stream for draft and target: the rule's law
    counts: dict[tuple[int, int], int] = {}
    for _ in range(trials):
        key = _two_tokens(P, Q, s)
        counts[key] = counts.get(key, 0) + 1
    chi2 = 0.0
    for a, b in itertools.product(range(VOCAB), repeat=2):
        expected = trials * float(P[0, a] * P[a, b])
        chi2 += (counts.get((a, b), 0) - expected) ** 2 / expected
    return chi2


# 15 degrees of freedom; the 0.999 quantile of chi-square(15) is 37.70.
CHI2_15_999 = 37.70
TRIALS = 1500  # the rarest pair still expects ~10 draws


def test_tree_sampling_follows_the_target_distribution():
    """Joint law of the first two emitted tokens is P(a | 0) P(b | a), whatever the draft is."""
    P, Q = _markov(0, 0.8), _markov(1, 0.8)
    assert _chi2(P, Q, TRIALS, seed=0) < CHI2_15_999


def test_tree_sampling_test_fails_when_the_rule_is_broken(monkeypatch):
    """Skipping the residual update (trying later siblings against the untouched p) biases the law."""
    P, Q = _markov(0, 0.8), _markov(1, 0.8)
    monkeypatch.setattr(tree_mod, "residual", lambda p, q: p)
    assert _chi2(P, Q, TRIALS, seed=0) > CHI2_15_999

"""Serial speculative decoding with a static draft tree (`sd-tree`, and `specvlm` as SpecVLM runs it).

A round (SpecVLM Sec. "Seamless Tree Attention Integration", Appendix B; EAGLE's static tree):
  1. the draft brings its cache in line with the committed tokens, then expands the tree one depth per
     forward: the first forward feeds the pending committed tokens (the last is the root) and scores the
     root's candidates; each later forward feeds every node of one depth that has children, all at once,
     under the tree mask (a node sees the prefix and its ancestors) at rotary position root + depth;
     so a tree of depth D costs D draft forwards, as a chain of D tokens does;
  2. the target verifies the whole tree in ONE forward (pending tokens + every node, tree mask);
  3. the longest accepted root-to-leaf path is committed (pipeline/tree.py: greedy, or recursive rejection
     over siblings when sampling), plus the target's own token;
  4. both caches keep only that path: its entries move right after the prefix, the rest are dropped, so
     each cache equals the one a chain decode of the committed tokens would hold.
The draft's cache is compacted to the accepted nodes it was fed (the path's internal nodes); the cursor
then feeds what it still lacks next round, exactly as in the chain loop (sd.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vpsd.config import DecodingConfig
from vpsd.models.base import DecodeState, VideoLMAdapter
from vpsd.models.timing import settle
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.sampling import ItemSampler
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.stopping import cut, done
from vpsd.pipeline.tree import DraftTree, propose_level, verify_tree
from vpsd.tracing import span
from vpsd.pipeline.seeds import draft_sampler


@dataclass
class DraftedTree:
    tokens: list[int]  # (N+1,) node tokens, node 0 the root (the last committed token)
    fed: list[int]  # nodes whose entries follow the root in the draft's cache, in cache order
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # expanded node -> (V,) draft logits
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # expanded node -> q drawn from (sampling)


def draft_tree(
    draft: VideoLMAdapter,
    state: DecodeState,
    cursor: CacheCursor,
    committed: list[int],
    tree: DraftTree,
    sampler: ItemSampler,  # the item's draft side
) -> DraftedTree:
    """Brings the draft cache in line with `committed`, then expands `tree` in tree.depth forwards."""
    length, pending = cursor.sync(committed)
    draft.rollback(state, length)
    with span("draft_step", tokens=len(pending)):
        root_logits = draft.step(state, torch.tensor(pending))[-1]
        settle(draft.device)  # the span times the forward, not its launch
    cursor.feed(pending)
    root_index = state.length - 1  # the root's index in the sequence
    out = DraftedTree(tokens=[committed[-1]] + [0] * tree.num_nodes, fed=[], logits={0: root_logits})
    for depth in range(1, tree.depth + 1):
        new = propose_level(tree, depth, out.logits, out.tokens, out.probs, sampler, len(committed))
        if not new:
            break
        seq_index = torch.tensor([root_index + depth] * len(new))
        with span("draft_step", tokens=len(new)):
            logits = draft.step_tree(
                state, torch.tensor([out.tokens[n] for n in new]), seq_index, tree.draft_visibility(out.fed, new)
            )
            settle(draft.device)
        out.fed += new
        out.logits.update(zip(new, logits))
    return out


def speculate_tree(
    target: VideoLMAdapter,
    t_state: DecodeState,
    draft: VideoLMAdapter,
    d_state: DecodeState,
    committed: list[int],
    cfg: DecodingConfig,
    tree: DraftTree,
    sampler: ItemSampler,  # the item's target side
) -> tuple[list[int], AcceptanceStats]:
    """The serial tree loop from both prefills and the target's first token, to the end (cut where `ar` stops)."""
    drafting = draft_sampler(cfg.rule, sampler.seed)
    t_cur, d_cur = CacheCursor(t_state.length), CacheCursor(d_state.length)
    stats = AcceptanceStats()
    eos = target.eos_token_ids
    while not done(committed, cfg.max_new_tokens, eos):
        # Never draft past max_new_tokens: the round's own token fills the last slot.
        round_tree = tree.truncated(cfg.max_new_tokens - len(committed) - 1)
        length, pending = t_cur.sync(committed)
        target.rollback(t_state, length)
        if round_tree is None:  # one token left: a plain target step
            with span("verify", tokens=len(pending), drafted=0, accepted=0):
                logits = target.step(t_state, torch.tensor(pending))[-1]
                settle(target.device)
            t_cur.feed(pending)
            committed.append(sampler.token(logits, len(committed))[0])
            stats.record(0, 0)
            continue
        drafted = draft_tree(draft, d_state, d_cur, committed, round_tree, drafting)
        offsets, visible = round_tree.verify_inputs(len(pending))
        fed = pending + drafted.tokens[1:]
        with span("verify", tokens=len(fed), drafted=round_tree.depth, nodes=round_tree.num_nodes) as fields:
            logits = target.step_tree(t_state, torch.tensor(fed), offsets + length, visible)[len(pending) - 1 :]
            v = verify_tree(round_tree, drafted.tokens, drafted.probs, logits, sampler, len(committed))
            fields["accepted"] = v.num_accepted
        # Keep only the accepted path in both caches (node i sits at slot i - 1 after the root).
        target.compact(t_state, length + len(pending), [n - 1 for n in v.path])
        t_cur.feed(pending + [drafted.tokens[n] for n in v.path])
        d_path = [n for n in v.path if n in drafted.fed]  # a prefix of the path: the nodes that have children
        draft.compact(d_state, d_cur.length, [drafted.fed.index(n) for n in d_path])
        d_cur.feed([drafted.tokens[n] for n in d_path])
        stats.record(v.num_accepted, v.num_drafted)
        stats.rollbacks += int(bool(round_tree.children[v.path[-1] if v.path else 0]))  # a candidate was rejected
        committed += v.emitted(drafted.tokens)  # an EOS accepted mid-path ends the output (cut trims the rest)
    return cut(committed, cfg.max_new_tokens, eos), stats

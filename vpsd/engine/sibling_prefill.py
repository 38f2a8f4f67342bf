"""One video's questions prefilled together: their shared prefix once, their suffixes in ONE forward.

With reuse on, a question about a video already prefilled costs its suffix alone (engine/prefix_cache.py): the
question and the assistant header, ~20 rows on the short world. A forward that short is mostly the fixed cost of
reading the weights (the scaled target: ~22 ms of a 16-row forward's ~48 on one core), paid again by every
question. Where a batch prefills ahead (engine/prefill_ahead.py), a video's questions queued one after another are
prepared as one group (`Engine.prefill_group`):

    the first one's prefix [0, P) computed (or restored) and kept at once (`Reuse.prepare_prefix`), so that
        the plans of the questions after it hit, as they would one by one;
    every question's suffix [P, L_i) packed in one row after that prefix, each at its own positions, each
        seeing the prefix and its own earlier tokens (`VideoLMAdapter.prefill_siblings`), the pruning signals a
        drafted question reads measured on its own rows and keys (`prefill_siblings_with_signals`);
    each result kept on its plan (`Reuse.ready`), which its ordinary prefill then takes instead of its forwards.

So the forwards cost the rows they feed: three suffixes of ~20 rows cost one weight read, not three (a video's
three questions: ~48 ms less of ~180 on one core). Not padded side by side in a batch: three suffixes of different
lengths padded to the longest cost about what they save.

Lossless: each question's cache and first-token logits are its own prefill's, up to the float order of a wider
forward (~1e-6 in float32, as a batched verify's rows against a single one's: models/batch.py). Which questions
are packed together depends only on the order of the items (a pipeline's run of consecutive items on one video),
so two methods' jobs over one manifest pack them alike and `ar` and every method prefill the same numbers. A
question alone (a video asked once, a batch of one) prefills as before, its prefix's forwards computed as a
lone request's are.
"""

from __future__ import annotations

from vpsd.models.base import SequenceEmbeddings, VideoLMAdapter
from vpsd.models.signals import prefill_siblings_with_signals
from vpsd.tracing import span


class Siblings:
    """The questions of one prefix joined so far, and their one forward."""

    def __init__(self, target: VideoLMAdapter) -> None:
        self.target = target
        self.members: list[tuple[SequenceEmbeddings, tuple[int, int]]] = []
        self.rows = 0  # suffix rows the forward will feed

    def join(self, emb: SequenceEmbeddings, wanted: tuple[int, int]) -> bool:
        """Adds a planned request (`emb.reuse`) whose prefill will ask for the signal layers `wanted` ((0, 0):
        none); False when it cannot be packed with those before it (no prefix; another prefix; another UV layer,
        whose video rows the prefix's forward keeps). The first one's prefix is computed here."""
        plan = emb.reuse
        if plan is None or not plan.ends:
            return False
        start = plan.ends[-1]
        if not self.target.packs_suffixes([emb], start):
            return False
        if self.members:
            first, first_wanted = self.members[0]
            if plan.keys != first.reuse.keys or wanted[1] != first_wanted[1]:
                return False
        else:
            with span("sibling_prefix", item=plan.item, tokens=start, reused=plan.reused):
                plan.prepare_prefix(self.target, emb, wanted[1])
        self.members.append((emb, wanted))
        self.rows += emb.seq_len - start
        return True

    def prefill(self) -> None:
        """The members' suffixes in one forward, each result kept on its plan. A lone member is left to prefill on
        its own (its prefix already on its plan): there is nothing to share."""
        if len(self.members) < 2:
            return
        first, (_, uv_layer) = self.members[0]
        cache, start, layer_rows = first.reuse.prefix(self.target, first, uv_layer)
        results = prefill_siblings_with_signals(self.target, [emb for emb, _ in self.members], cache, start,
                                                [wanted for _, wanted in self.members], layer_rows)
        for (emb, wanted), result in zip(self.members, results):
            emb.reuse.ready = (result, wanted)

    def emb(self, item: str) -> SequenceEmbeddings:
        return next(emb for emb, _ in self.members if emb.reuse.item == item)

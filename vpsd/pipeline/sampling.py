"""Turning logits into tokens and distributions: the two sampling rules, and the filters both apply.

**Position-keyed sampling** (`rule: keyed`, the default). An item's token at output position t is

    argmax_v  filtered(logits / T)_v + g(seed, t, v)

where g is Gumbel noise computed from a counter-based hash of (the item's seed, t, v): no generator state, no
host read, the same noise on whatever device and whichever side (target or draft) computes it. Gumbel-max draws
exactly from softmax(filtered(logits / T)) (the argmax of log-probabilities plus independent Gumbel noise is a
sample), and since position t's noise is independent of every other position's, a sequence drawn so is drawn
exactly from the target's law. `ar` samples this way; the target verifies a drafted token by computing its own
keyed sample at that position and accepting while the two are equal, which is the greedy rule on perturbed
scores; the draft proposes with the same noise at the same positions (Daliri, Musco and Suresh,
"Drafter-Invariant Speculative Decoding", arXiv 2408.07978). So a seeded output is `ar`'s own, token for token,
whatever drafted it, where and how fast, and with whom it was batched. Greedy is the case g = 0 (T = 0: the
argmax of the logits, ties to the lowest id as torch.argmax breaks them).

**The rejection rule** (`rule: rejection`; Leviathan et al. 2023, Chen et al. 2023): the draft samples from q,
the target accepts with min(1, p/q) and resamples from norm(max(p - q, 0)) (pipeline/verification.py,
pipeline/tree.py). Exact in distribution, but its draws come from per-item host generators (`ItemSampler.gen`),
so a seeded output depends on how many draws each stream made: on the windows, hence on timing. Each row a draw
reads moves to the host first (`on_generator`).

**Filters** (both rules, target and draft alike, applied in the order transformers' `generate` applies its
warpers: temperature, top-k, top-p, min-p): top_k keeps the k largest logits (and any tied with the k-th),
top_p the smallest set of most likely tokens whose mass reaches p, min_p the tokens whose probability is at least
min_p times the most likely one's. The law a sampled output follows is the filtered target's.

The noise of token v at position t is mix(mix(v) XOR key(seed, t)): `mix` a 32-bit integer hash (Chris Wellons'
"lowbias32"), mix(v) computed once per vocabulary and device, key(seed, t) a splitmix64 of the two on the host
(one small copy a round, never a read back). The hash runs in int64 tensors with every product kept below 2^63
(a 32-bit multiply split into 16-bit halves), so it is exact and identical on CPU and CUDA; the Gumbel transform
runs in float64, where the last-ulp differences between two devices' `log` cannot flip an argmax except at a tie
of ~1e-16. Its cost is one hash (about 25 integer ops) and two logs per vocabulary entry of a sampled row: a few
elementwise passes over the logits, on the logits' device; greedy rows compute none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

KEYED = "keyed"
REJECTION = "rejection"
RULES = (KEYED, REJECTION)
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingRule:
    """How a run turns logits into tokens (module docstring). temperature 0: greedy, whatever else is set."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    rule: str = KEYED

    def __post_init__(self) -> None:
        for problem in rule_problems(self.temperature, self.top_k, self.top_p, self.min_p, self.rule):
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def keyed(self) -> bool:
        """Whether tokens are chosen as argmaxes of (perturbed) scores: greedy, or the position-keyed rule."""
        return self.greedy or self.rule == KEYED

    @property
    def needs_draft_probs(self) -> bool:
        """The rejection rule's verify reads the draft's q; a keyed one reads only its tokens."""
        return not self.keyed

    def tempered(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits / T, float32, with the filtered-out tokens at -inf (T > 0)."""
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)
            before = probs.cumsum(-1) - probs  # mass of the more likely tokens: a token stays while it is < top_p
            drop = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, before >= self.top_p)
            x = x.masked_fill(drop, float("-inf"))
        if self.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        return x

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., V) -> the distribution sampled from, float32; one-hot on the argmax when greedy."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.float().argmax(-1), logits.shape[-1]).float()
        return torch.softmax(self.tempered(logits), dim=-1)

    def scores(self, logits: torch.Tensor, seed: int, positions: torch.Tensor | list[int] | int) -> torch.Tensor:
        """What a keyed token is the argmax of: logits (..., V) themselves when greedy, else the tempered,
        filtered logits plus the Gumbel noise of `positions` (one output position a row of `logits`)."""
        if self.greedy:
            return logits
        return self.tempered(logits).double() + gumbel(seed, positions, logits.shape[-1], logits.device).view(
            logits.shape)


def rule_problems(temperature: object, top_k: object, top_p: object, min_p: object, rule: object = KEYED) -> list[str]:
    """What is wrong with these settings, a line each (a config, a request's SamplingParams)."""
    def number(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    out = []
    if not (number(temperature) and temperature >= 0):
        out.append(f"temperature must be a number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        out.append(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
    if not (number(top_p) and 0 < top_p <= 1):
        out.append(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
    if not (number(min_p) and 0 <= min_p < 1):
        out.append(f"min_p must be in [0, 1) (0: off), got {min_p!r}")
    if rule not in RULES:
        out.append(f"sampling rule must be one of {', '.join(RULES)}, got {rule!r}")
    return out


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), without an int64 product past 2^63."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32): every input bit moves about half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def row_keys(seed: int, positions: list[int]) -> list[int]:
    """A 32-bit key per (seed, position), on the host: what the device mixes each vocabulary id's hash with."""
    return [_splitmix64(_splitmix64(int(seed) & 0xFFFFFFFFFFFFFFFF) ^ int(t)) & _MASK32 for t in positions]


@functools.lru_cache(maxsize=8)
def _vocabulary_hash(vocab: int, device: str) -> torch.Tensor:
    """(vocab,) int64: each token id hashed once (it does not depend on the position), kept per device."""
    return _mix32(torch.arange(vocab, dtype=torch.int64, device=device))


def uniforms(seed: int, positions: torch.Tensor | list[int] | int, vocab: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """(n, vocab) float64 in (0, 1): the uniform draw behind every (position, vocabulary id) of an item."""
    if isinstance(positions, int):
        positions = [positions]
    elif isinstance(positions, torch.Tensor):
        positions = positions.reshape(-1).tolist()
    keys = torch.tensor(row_keys(seed, positions), dtype=torch.int64).to(device, non_blocking=True)
    h = _mix32(_vocabulary_hash(vocab, str(torch.device(device)))[None, :] ^ keys[:, None])
    return (h.double() + 0.5) / 2.0**32


def gumbel(seed: int, positions: torch.Tensor | list[int] | int, vocab: int,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """(n, vocab) float64 standard Gumbel noise g(seed, t, v) of each position t."""
    return -torch.log(-torch.log(uniforms(seed, positions, vocab, device)))


class ItemSampler:
    """One item's draws on one side (the target's verify, or its draft): the rule, the item's seed (the keyed
    noise, shared by both sides) and, for the rejection rule only, the side's own host generator seeded
    `stream_seed` (pipeline/seeds.py)."""

    def __init__(self, rule: SamplingRule, seed: int, stream_seed: int) -> None:
        self.rule, self.seed = rule, int(seed)
        self.gen = None if rule.keyed else torch.Generator().manual_seed(int(stream_seed))

    def scores(self, logits: torch.Tensor, positions: torch.Tensor | list[int] | int) -> torch.Tensor:
        return self.rule.scores(logits, self.seed, positions)

    def token(self, logits: torch.Tensor, pos: int) -> tuple[int, torch.Tensor | None]:
        """The token plain decoding emits at output position `pos` from a (V,) logits row, and, under the
        rejection rule, the q it was drawn from (the target verifies a draft's token with it)."""
        if self.rule.keyed:
            return int(self.scores(logits, pos).argmax()), None
        q = self.rule.probs(logits)
        return sample(q, self.gen), q

    def children(self, logits: torch.Tensor, k: int, pos: int) -> tuple[list[int], torch.Tensor | None]:
        """A tree node's k candidates at output position `pos` (pipeline/tree.py): the k best keyed scores (the
        Gumbel-top-k trick: k draws without replacement, the first the keyed token), or, under the rejection
        rule, k draws from q without replacement and the q they were drawn from."""
        if self.rule.keyed:
            return self.scores(logits, pos).topk(k).indices.tolist(), None
        q = on_generator(self.rule.probs(logits), self.gen)
        if int((q > 0).sum()) < k:  # fewer than k tokens of non-zero mass (a filter, or underflow): a tiny floor
            q = q + 1e-12
            q = q / q.sum()
        return torch.multinomial(q, k, replacement=False, generator=self.gen).tolist(), q


def on_generator(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`probs` on the device `generator` draws on (itself when already there, as always on a CPU run)."""
    return probs if generator is None or probs.device == generator.device else probs.to(generator.device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draws one token id from (V,) probabilities; deterministic given the generator state."""
    return int(torch.multinomial(on_generator(probs, generator), 1, generator=generator))


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (..., V) -> softmax(logits / T) float32, one-hot when T == 0: an unfiltered rule's `probs`
    (TABED's views and distances, which weigh whole distributions)."""
    return SamplingRule(temperature).probs(logits)

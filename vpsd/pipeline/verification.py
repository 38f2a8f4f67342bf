"""Verification of a draft chunk by the target (Leviathan et al., 2023; Chen et al., 2023).

For draft tokens x_1..x_k with draft probabilities q_i and target probabilities p_i (p has k+1 rows:
row i is the target's distribution for position i, row k the bonus position):
  - accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), stopping at the first rejection;
  - on rejection at i, emit a token drawn from norm(max(0, p_i - q_i)) (the "recovered" token);
  - when all k are accepted, emit a bonus token drawn from p_k.
Greedy verification is the temperature-0 case (p and q one-hot): accept while x_i == argmax p_i, then
emit argmax p at the first mismatch (or the bonus position). `verify_greedy` implements that case
directly so it needs no probabilities on the wire; tests prove it equals `verify_sampling` on one-hot
inputs. The position-keyed rule (pipeline/sampling.py, the default when sampling) is the same greedy rule on
the rows' keyed scores: accept while x_i is the target's own keyed sample at its position. The target alone
makes this decision; drafts only obey it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vpsd.pipeline.sampling import ItemSampler, on_generator


@dataclass(frozen=True)
class Verification:
    num_accepted: int  # draft tokens accepted, 0..k
    next_token: int  # recovered token (after a rejection) or bonus token (all accepted)
    num_drafted: int  # k

    @property
    def all_accepted(self) -> bool:
        return self.num_accepted == self.num_drafted

    def emitted(self, draft_token_ids: list[int]) -> list[int]:
        """Tokens this round commits: the accepted prefix, then the recovered or bonus token."""
        return list(draft_token_ids[: self.num_accepted]) + [self.next_token]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)), what a rejection resamples from; all-zero only when p == q, where a rejection has
    probability 0 (float noise: p)."""
    r = torch.clamp(p - q, min=0.0)
    total = float(r.sum())
    return r / total if total > 0 else p


def verify_greedy(draft_token_ids: list[int], target_logits: torch.Tensor,
                  target_ids: list[int] | None = None) -> Verification:
    """target_logits (k+1, V): row i scores the token at draft position i (row k: bonus). `target_ids`: their
    argmaxes when the caller read them already (`greedy_ids`, one host transfer for a whole batch)."""
    k = len(draft_token_ids)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need k+1={k + 1} target rows, got {target_logits.shape[0]}")
    if target_ids is None:
        target_ids = target_logits.argmax(-1).tolist()
    n = 0
    while n < k and draft_token_ids[n] == target_ids[n]:
        n += 1
    return Verification(num_accepted=n, next_token=int(target_ids[n]), num_drafted=k)


def verify_sampling(
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,  # (k, V) q; None only when k == 0
    target_probs: torch.Tensor,  # (k+1, V) p
    generator: torch.Generator | None,
) -> Verification:
    """The speculative sampling rule; the emitted sequence is distributed exactly as sampling from p."""
    k = len(draft_token_ids)
    if k == 0 and draft_probs is None:  # nothing drafted (one token left to the budget): a plain draw from p
        draft_probs = target_probs[:0]
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(f"need q of {k} rows and p of {k + 1} rows, got {draft_probs.shape[0]} and {target_probs.shape[0]}")
    # What the rule reads comes to the host (where the item's generator draws, pipeline/sampling.py) in the
    # smallest pieces: p_i(x_i) and q_i(x_i) in one copy, then the one row the draw reads (a residual or the bonus
    # row), not every row of p and q. On a CPU nothing moves.
    rows = torch.arange(k, device=target_probs.device)
    drafted = torch.tensor(draft_token_ids, dtype=torch.long, device=target_probs.device)
    p_drafted = target_probs[rows, drafted].tolist()
    q_drafted = draft_probs[rows, drafted.to(draft_probs.device)].tolist()
    for i in range(k):
        p, q = p_drafted[i], q_drafted[i]
        r = float(torch.rand((), generator=generator))
        # r < p/q, written without the division so q == 0 (a token the draft cannot emit) is safe.
        if r * q < p:
            continue
        dist = residual(target_probs[i], draft_probs[i].to(target_probs.device))
        token = int(torch.multinomial(on_generator(dist, generator), 1, generator=generator))
        return Verification(num_accepted=i, next_token=token, num_drafted=k)
    token = int(torch.multinomial(on_generator(target_probs[k], generator), 1, generator=generator))
    return Verification(num_accepted=k, next_token=token, num_drafted=k)


def window_rows(logits: torch.Tensor, first: int, kept_row: torch.Tensor | None = None) -> torch.Tensor:
    """The k+1 rows that verify a window, from a verify forward's logits (`CacheCursor.verify_feed` gives
    `first`); first == -1 puts `kept_row`, the previous forward's last row, in front."""
    if first >= 0:
        return logits[first:]
    if kept_row is None:
        raise ValueError("the window's first row is the previous forward's, and none was kept")
    return torch.cat([kept_row[None], logits])


def greedy_ids(rows: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Each entry's per-row argmax, read to the host in one transfer for the whole batch: on a GPU each
    `.tolist()` waits for the device, so one a row would stall a batched verify B times a round."""
    keys = list(rows)
    if not keys:
        return {}
    flat = torch.cat([rows[k].argmax(-1).reshape(-1) for k in keys]).tolist()
    out, at = {}, 0
    for k in keys:
        n = rows[k].shape[0]
        out[k], at = flat[at:at + n], at + n
    return out


def verify_chunk(
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,  # (k, V) q; None unless the rejection rule samples
    target_logits: torch.Tensor,  # (k+1, V)
    sampler: ItemSampler,  # the item's target side
    pos: int,  # the output position of the first drafted token (row 0)
    target_ids: list[int] | None = None,  # keyed: the rows' keyed tokens, when already read (greedy_ids)
) -> Verification:
    """The one entry point decoders use: the greedy rule on the rows' keyed scores (greedy, or position-keyed
    sampling), else the speculative-sampling rule on the item's generator."""
    if sampler.rule.keyed:
        if target_ids is None:
            target_ids = sampler.scores(target_logits, list(range(pos, pos + target_logits.shape[0]))).argmax(-1).tolist()
        return verify_greedy(draft_token_ids, target_logits, target_ids)
    return verify_sampling(draft_token_ids, draft_probs, sampler.rule.probs(target_logits), sampler.gen)

"""The parallel decoding state machine: pure decisions, no I/O, no models.

Two machines, one per side, exchange the typed messages of pipeline/messages.py:

TargetMachine (the single source of truth) holds the committed sequence and the epoch. For each draft
chunk it answers Drop (stale epoch: sent before a rollback the draft had not yet seen) or verify it; given
the verification it commits tokens and returns what to tell the draft.
  - all accepted: commit the chunk; the target's row for the next position (the "bonus" row) is KEPT,
    not sampled, and verifies the first token of the next chunk (PEARL's post-verify). Mode: optimistic.
    Serial speculative decoding (`defer_bonus=False`: draft and target take turns, nothing is drafted
    meanwhile) commits the bonus token at once instead, as the papers' serial SD does.
  - rejected at i: commit the accepted prefix and the target's own token, bump the epoch (every chunk
    drafted before this moment is now stale) and tell the draft to roll back. Mode: conservative.

DraftMachine keeps the draft's speculative sequence (committed tokens it knows + its own proposals),
decides how large the next chunk is and how far ahead it may draft, and applies verdicts:
  - optimistic mode (post-verify): chunks of gamma tokens, drafting the next chunk while the current
    one is verified, up to `lookahead` tokens past the last confirmed position (optionally a shorter
    chunk when the target has nothing left to verify: `eager_when_idle`);
  - conservative mode (pre-verify): after a rollback the first token goes out alone, so the target can
    verify it while the draft continues; a rejection aborts the rest at once.
  - synchronous prefill: the draft starts drafting from its own prefill (position 0) before the target
    has finished prefilling; the target verifies that first token with its prefill logits.

Lossless by construction: the target commits only tokens its own verification emitted, in order, and
a chunk is verified only if it begins exactly at the committed length in the current epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from vpsd.pipeline.messages import VerifyResult
from vpsd.pipeline.stopping import cut, done


class Mode(str, Enum):
    OPTIMISTIC = "optimistic"  # post-verify: keep drafting while the target verifies
    CONSERVATIVE = "conservative"  # pre-verify: send the first token alone after a rollback


@dataclass(frozen=True)
class Drop:
    reason: str


PLACEHOLDER = -1  # no token: an all-accepted chunk defers its bonus token to the next chunk's first row


@dataclass
class TargetMachine:
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    item_id: str = ""  # named in every verdict
    defer_bonus: bool = True  # parallel drafting keeps the bonus row; serial drafting commits the bonus token
    committed: list[int] = field(default_factory=list)
    epoch: int = 0
    mode: Mode = Mode.OPTIMISTIC
    # True when the target holds the logits row for position len(committed) (after the prefill and
    # after an all-accepted chunk); False when its last committed token still has to be fed.
    holds_next_row: bool = True

    @property
    def done(self) -> bool:
        return done(self.committed, self.max_new_tokens, self.eos_token_ids)

    def on_chunk(self, epoch: int, start: int, num_tokens: int) -> Drop | None:
        """Drop (with the reason) a chunk that cannot be verified now; None: verify it."""
        if self.done:
            return Drop("item already finished")
        if epoch != self.epoch:
            return Drop(f"stale epoch {epoch} (current {self.epoch})")
        if start != len(self.committed):
            return Drop(f"chunk starts at {start}, committed length is {len(self.committed)}")
        if num_tokens < 1:
            return Drop("empty chunk")
        return None

    def on_verified(self, chunk: list[int], num_accepted: int, next_token: int, pre_verify: bool = True,
                    gamma: int = 0) -> VerifyResult:
        """Commits the outcome of verifying `chunk` (next_token: the target's token at the first
        rejected position; ignored when every token was accepted). `pre_verify`: after a rejection, have the
        draft send its first token alone (conservative mode) rather than a whole window (see
        pipeline/cost.py: worth it only while the draft's window takes longer than that verify). `gamma`: the window
        the draft drafts with from now on (0: unchanged). Returns the verdict as it goes on the wire."""
        start = len(self.committed)
        if num_accepted == len(chunk) and not self.defer_bonus:
            self.committed += chunk + [next_token]
            self.holds_next_row = False
            self.mode = Mode.OPTIMISTIC
            rollback, emitted = False, next_token
        elif num_accepted == len(chunk):
            self.committed += chunk
            self.holds_next_row = True
            self.mode = Mode.OPTIMISTIC
            rollback, emitted = False, PLACEHOLDER
        else:
            self.committed += chunk[:num_accepted] + [next_token]
            self.holds_next_row = False
            self.epoch += 1
            self.mode = Mode.CONSERVATIVE if pre_verify else Mode.OPTIMISTIC
            rollback, emitted = True, next_token
        return VerifyResult(self.item_id, self.epoch, start, num_accepted, emitted, len(self.committed), self.mode.value,
                            rollback, gamma)

    def output(self) -> list[int]:
        """The committed tokens cut where plain decoding stops (max_new_tokens, first EOS inclusive)."""
        return cut(self.committed, self.max_new_tokens, self.eos_token_ids)


@dataclass
class DraftMachine:
    gamma: int
    lookahead: int  # most tokens the draft may run ahead of the last confirmed position
    sequence: list[int] = field(default_factory=list)  # confirmed prefix + own proposals
    confirmed: int = 0  # prefix of `sequence` the target has committed
    sent: int = 0  # prefix of `sequence` already sent in chunks
    epoch: int = 0
    mode: Mode = Mode.OPTIMISTIC
    chunk_sizes: list[int] = field(default_factory=list)  # sizes of the chunks still to send this block
    # Send what is drafted at once when the target has nothing in flight (see ready_chunk). Off by default:
    # it makes more, shorter rounds, and on a CPU the target's forward costs about the same for 1 token as
    # for gamma, so where the target's core is contended (2 cores shared with a training job) the extra
    # forwards cost more than the idle time they save. Config: `decoding.eager_when_idle: true`.
    eager_when_idle: bool = False

    def __post_init__(self) -> None:
        if self.lookahead < self.gamma:
            raise ValueError(f"lookahead {self.lookahead} must be at least gamma {self.gamma}")

    def set_gamma(self, gamma: int, lookahead: int) -> None:
        """A new window from the target (gamma auto): chunks not yet cut take the new size."""
        if not 1 <= gamma <= lookahead:
            raise ValueError(f"need 1 <= gamma {gamma} <= lookahead {lookahead}")
        self.gamma, self.lookahead = gamma, lookahead

    def may_draft(self) -> bool:
        return len(self.sequence) - self.confirmed < self.lookahead

    def record_proposal(self, token: int) -> None:
        self.sequence.append(token)

    def next_chunk_size(self) -> int:
        """Size of the next chunk to send: gamma, or 1 first after a rollback in conservative mode."""
        if self.mode is Mode.CONSERVATIVE and self.sent == self.confirmed:
            return 1
        return self.gamma

    def target_idle(self) -> bool:
        """Every chunk sent in this epoch has its verdict: the target has nothing to verify and waits for us
        (as far as the draft knows; a verdict still on the wire only makes this late, never wrong)."""
        return self.sent == self.confirmed

    def ready_chunk(self, flush: bool = False) -> tuple[int, list[int]] | None:
        """(start, tokens) of a chunk ready to send, or None; marks it sent. `flush` sends a short
        chunk too (the draft stopped: it proposed EOS or reached max_new_tokens).

        A short chunk also goes out when `eager_when_idle` and the target is idle: holding tokens back
        until there are gamma of them would leave the target waiting one or more draft steps for tokens
        it could be verifying now (a verification costs about the same for 1 token as for gamma on a CPU,
        and the draft keeps drafting the next chunk meanwhile, so optimistic mode stays what it is)."""
        want = self.next_chunk_size()
        size = min(want, len(self.sequence) - self.sent)
        if size <= 0 or (size < want and not (flush or (self.eager_when_idle and self.target_idle()))):
            return None
        start = self.sent
        self.sent += size
        return start, self.sequence[start : start + size]

    def on_verdict(self, epoch: int, committed_len: int, next_token: int, rollback: bool, mode: Mode | str) -> bool:
        """Applies a verdict; returns True when the draft must roll its cache back."""
        if epoch < self.epoch:
            return False  # an old verdict overtaken by a rollback already applied
        self.mode = Mode(mode)  # the wire's string or the enum
        if rollback:
            # Everything from the rejected position on is wrong; the target's token replaces it.
            del self.sequence[committed_len - 1 :]
            self.sequence.append(next_token)
            self.confirmed = self.sent = committed_len
            self.epoch = epoch
            return True
        self.confirmed = max(self.confirmed, committed_len)
        return False

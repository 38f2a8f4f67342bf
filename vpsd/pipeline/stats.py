"""Decoding statistics with the papers' definitions.

- mean accepted tokens (MAT, tau): tokens committed per verification round, INCLUDING the recovered
  or bonus token the target adds (HIPPO, ParallelVLM, SpecVLM all report it this way), so plain
  autoregressive decoding has MAT 1. A round commits accepted + 1 tokens in serial decoding; the parallel
  target keeps the bonus row of an all-accepted chunk to verify the next chunk's first token instead of
  emitting it, so its rounds commit accepted (+1 only on a rejection): `record` takes what was committed.
- acceptance rate: accepted draft tokens / drafted tokens.
- per-position acceptance: for draft position i, accepted / proposed at that position.
- tau_hat: the per-token acceptance probability of ParallelVLM's Lemma 1 / Theorem 6, A / (A + R) with A
  accepted draft tokens and R rounds that ended in a rejection (pipeline/theory.py says why it is not the
  acceptance rate). Results carry A and R so runs and items pool exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vpsd.pipeline.theory import tau_hat


@dataclass
class AcceptanceStats:
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    committed_per_round: list[int] = field(default_factory=list)
    rollbacks: int = 0

    def record(self, num_accepted: int, num_drafted: int, num_committed: int | None = None) -> None:
        """num_committed: tokens the round added to the output (default accepted + 1, the serial rule)."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted}")
        committed = num_accepted + 1 if num_committed is None else num_committed
        if not num_accepted <= committed <= num_accepted + 1:
            raise ValueError(f"a round that accepted {num_accepted} cannot commit {committed}")
        self.accepted_per_round.append(num_accepted)
        self.drafted_per_round.append(num_drafted)
        self.committed_per_round.append(committed)

    def extend(self, other: "AcceptanceStats") -> None:
        """Pools another run's rounds into these (e.g. over the items of a benchmark)."""
        self.accepted_per_round += other.accepted_per_round
        self.drafted_per_round += other.drafted_per_round
        self.committed_per_round += other.committed_per_round
        self.rollbacks += other.rollbacks

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def mean_accepted_tokens(self) -> float:
        if not self.rounds:
            return 0.0
        return sum(self.committed_per_round) / self.rounds

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(self.drafted_per_round)
        return sum(self.accepted_per_round) / drafted if drafted else 0.0

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def rejections(self) -> int:
        """Rounds that ended in a rejection (a draft token the target did not accept)."""
        return sum(a < d for a, d in zip(self.accepted_per_round, self.drafted_per_round))

    @property
    def tau_hat(self) -> float:
        return tau_hat(self.accepted_tokens, self.rejections)

    def per_position_acceptance(self) -> list[float]:
        """Share of rounds that accepted draft position i, among rounds that proposed it."""
        width = max(self.drafted_per_round, default=0)
        out = []
        for i in range(width):
            proposed = sum(1 for d in self.drafted_per_round if d > i)
            accepted = sum(1 for a in self.accepted_per_round if a > i)
            out.append(accepted / proposed if proposed else 0.0)
        return out

    def histogram(self) -> dict[int, int]:
        """Rounds by number of accepted draft tokens (gpt-fast prints the same)."""
        hist: dict[int, int] = {}
        for a in self.accepted_per_round:
            hist[a] = hist.get(a, 0) + 1
        return dict(sorted(hist.items()))

    def as_dict(self) -> dict:
        return {
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "rounds": self.rounds,
            "rollbacks": self.rollbacks,
            "accepted_tokens": self.accepted_tokens,
            "rejections": self.rejections,
            "tau_hat": self.tau_hat,
            "per_position_acceptance": self.per_position_acceptance(),
        }

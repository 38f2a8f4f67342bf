"""What the engine did over a job, for summary.json's `run.batching` and the throughput bench's accounting
(ParallelVLM App. C over a batch, bench/throughput.py): rounds, items per round, the window, the target's
verify forward (T_p of the batch), the draft's step (T_q), tau_hat over every verified window."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vpsd.pipeline.theory import tau_hat


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class EngineReport:
    size: int
    pipelined: bool  # the draft ran on its own rank (the bench predicts with Theorem 6, the draft overlapped)
    rounds: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests per round
    gammas: list[int] = field(default_factory=list)  # each round's window (0: a plain round)
    verify_s: list[float] = field(default_factory=list)  # each round's target forward
    accepted: int = 0  # accepted draft tokens over every verified window (tau_hat's A)
    rejections: int = 0  # windows that ended in a rejection (tau_hat's R)
    plain_items: int = 0  # requests of a drafting method decoded plain (drafting did not pay for them)
    t_q_s: float | None = None  # the draft's step, as the window last measured it
    decode_s: float = 0.0  # the engine thread's time in rounds, or the loop's outside admission
    admit_s: float = 0.0  # vision + prefill of requests prefilled on the engine's thread
    drafted_rate: float | None = None  # tokens a drafted request commits per round in flight
    tail_from_s: float | None = None  # when the manifest's last prefill had run (the prefill cores lent)
    tail_threads: int | None = None

    def close(self, elapsed_s: float, rounds_s: float, stolen_s: float) -> None:
        """The job's decode time. In turns (serial), the engine thread's rounds: between them it only admits. In a
        pipeline, the loop's time outside admission and prefills run on its thread: waiting for the draft's
        chunks is part of decoding there (App. C's overheads), and rounds alone would leave it out."""
        self.decode_s = elapsed_s - self.admit_s - stolen_s if self.pipelined else rounds_s

    def observe_round(self, batch: int, gamma: int, verify_s: float) -> None:
        self.rounds += 1
        self.batch_sizes.append(batch)
        self.gammas.append(gamma)
        self.verify_s.append(verify_s)

    def observe_window(self, accepted: int, all_accepted: bool) -> None:
        self.accepted += accepted
        self.rejections += int(not all_accepted)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("batch_sizes", "gammas", "verify_s", "accepted", "rejections")}
        return {**out, "mean_batch": _mean(self.batch_sizes), "mean_gamma": _mean(self.gammas),
                "plain_rounds": sum(g == 0 for g in self.gammas), "t_p_s": _mean(self.verify_s),
                "tau_hat": tau_hat(self.accepted, self.rejections) if self.accepted + self.rejections else None}

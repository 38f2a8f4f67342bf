"""What ParallelVLM Appendix C predicts for a run, from what the run itself measured.

`predict(run_dir, method, ar_step_s, summary)` reads the run's traces and results: T_p (the target's verify forward of a
whole window), T_q (one draft step), the mean window gamma and tau_hat, and returns the decode-only speedup over
`ar` that Theorem 6 (parallel) or the serial window's round (serial, pipeline/theory.py) predicts against `ar`'s own measured per-token time
(pipeline/theory.py says why that baseline, and why tau_hat), plus the target's per-round overhead. The bench and
`vpsd summary --baseline` both report it next to the measured speedup; efficiency = measured / predicted.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from vpsd.pipeline.methods import Method
from vpsd.pipeline.theory import predicted_speedup
from vpsd.reports.timeline import Span, load_spans


@dataclass(frozen=True)
class RunPrediction:
    t_p_ms: float | None  # target verify forward of a whole window
    t_q_ms: float | None  # draft step
    theory: float | None  # predicted decode-only speedup over ar (1.0 for ar itself; None: not measurable)
    overhead_ms: float | None  # per round (parallel runs): target time neither verifying nor waiting for a chunk


def mean_span_ms(spans: list[Span], role: str, name: str) -> float | None:
    durs = [s.dur for s in spans if s.role == role and s.name == name and s.kind == "span"]
    return 1000 * statistics.mean(durs) if durs else None


def full_window_verify_ms(spans: list[Span]) -> float | None:
    """Mean target verify forward over rounds that verified a whole window (drafted == the round's gamma).

    Theorem 6 charges every round T_p at the window gamma; the shorter rounds (the first token alone after a
    rollback, a short last chunk) verify fewer rows, which on a CPU is cheaper, and would pull the mean below
    the T_p the theorem means. Serial runs and runs without a gamma field: every verify span."""
    verify = [s for s in spans if s.role == "target" and s.name == "verify" and s.kind == "span"]
    full = [s.dur for s in verify if s.fields.get("gamma") is not None and s.fields.get("drafted") == s.fields["gamma"]]
    durs = full or [s.dur for s in verify]
    return 1000 * statistics.mean(durs) if durs else None


def target_round_overhead_ms(spans: list[Span], decode_s: float, rounds: int) -> float | None:
    """Target decode time per round spent neither in a verify span nor waiting for a chunk."""
    if not rounds:
        return None
    verify = sum(s.dur for s in spans if s.role == "target" and s.name == "verify" and s.kind == "span")
    waits = sum(s.dur for s in spans if s.role == "target" and s.name == "recv_wait" and s.kind == "span"
                and s.fields.get("what") is None)  # chunk waits (the keep report wait comes after decoding)
    return 1000 * max(decode_s - verify - waits, 0.0) / rounds


def predict(run_dir: Path, method: Method, ar_step_s: float, s: dict) -> RunPrediction:
    """The Appendix C prediction for one run directory (`s`: its summary, reports/summary.py `summarize`)."""
    if not method.uses_draft:
        return RunPrediction(None, None, 1.0, None)
    spans = load_spans(run_dir)
    t_p = full_window_verify_ms(spans)
    t_q = mean_span_ms(spans, "draft", "draft_step") or mean_span_ms(spans, "target", "draft_step")
    theory = None
    if t_p and t_q and s["gamma"] and ar_step_s:
        theory = predicted_speedup(method.parallel, 1000 * ar_step_s, t_q, t_p, s["gamma"], s["tau_hat"])
    overhead = target_round_overhead_ms(spans, s["decode_s"], s["rounds"]) if method.parallel else None
    return RunPrediction(t_p, t_q, theory, overhead)

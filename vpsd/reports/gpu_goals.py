"""The GPU check's goals (issue 52), judged from what it brought back, with the term that holds each one missed.

    python -m vpsd.reports.gpu_goals DIR

DIR: scripts/gpu_check.sh's $OUT (the dry run leaves it unpacked) or its gpu_check.tgz unpacked. It reads
step_cost.json and profile.json (`vpsd bench steps`), b1_captured.json, b1_mps.json, b8.json and b32.json
(`vpsd bench throughput`), and profiles/*_target.summary.json (each B = 1 cell's target profiled in the job,
vpsd/profiling.py). A goal whose file is absent reads "not run". The check writes this table at the top of
report.txt, so that a GPU session reads its verdict first, and the split that says where to work next:

- a step's goal (`ar`'s tokens/s, c) missed: the cell's profile per round, kernels (`device`: the GPU's own time)
  against what the CPU spent beside them (`launch`, `host_wait`, `other`: Python, dispatch, the GIL held by the
  rank's other threads); the largest names the term;
- a speedup missed: ParallelVLM App. C's prediction from the run's own forwards (`theory`), the acceptance
  (tau) and the draft length (gamma): a prediction below the goal says the terms (c, tau) cannot reach it, a
  prediction above it says the pipeline loses the rest (its messages, its waits).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPU_TERMS = {"launch": "kernel launches", "host_wait": "host waits (synchronisations, blocking copies)",
             "other": "the CPU beside the kernels (Python, dispatch, other threads holding the GIL)"}


@dataclass
class Goal:
    name: str
    measured: float | None  # None: not run
    wanted: float
    higher_is_better: bool = True
    unit: str = "x"
    why: str = ""  # the cell it was read from; for a miss, the term that holds it

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.wanted if self.higher_is_better else self.measured <= self.wanted

    def line(self) -> str:
        verdict = {True: "met", False: "MISSED", None: "not run"}[self.met]
        got = "-" if self.measured is None else f"{self.measured:.{2 if self.unit == 'x' else 0}f}"
        wanted = f"{'>=' if self.higher_is_better else '<='} {self.wanted:g}"
        return f"{self.name:<50} {got:>8} {wanted:>7} {self.unit:<6} {verdict:<8} {self.why}".rstrip()


def _json(folder: Path, name: str) -> Any:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def _rows(folder: Path, name: str) -> list[dict]:
    table = _json(folder, name)
    # A cell with no items did not run (a bench cut at its limit lists it at 0): no measure of anything.
    return [dict(r, cell=name.removesuffix(".json")) for r in (table or {}).get("rows", []) if r["items"]]


def _base(method: str) -> str:
    return method.split(":")[0]


def _best(rows: list[dict], batch: int, keep: Any) -> dict | None:
    chosen = [r for r in rows if r["batch"] == batch and keep(r["method"])]
    return max(chosen, key=lambda r: r["items_per_hour"], default=None)


def _cell(row: dict) -> str:
    return f"{row['cell']}: {row['method']} B = {row['batch']}"


def profile_term(folder: Path, row: dict) -> str:
    """The cell's target profile per round, and the term it names (see the module docstring)."""
    stem = f"{row['cell']}_{row['method'].replace(':', '-')}_b{row['batch']}_"
    found = sorted((folder / "profiles").glob(f"{stem}*_target.summary.json"))
    if not found:
        return "no profile of this cell"
    per = json.loads(found[0].read_text())["per_round_ms"]
    cpu = max(CPU_TERMS, key=lambda k: per.get(k) or 0.0)
    held = (f"the kernels themselves ({per['device']:.2f} ms a round)" if per["device"] >= per.get(cpu, 0.0)
            else f"{CPU_TERMS[cpu]}, {per[cpu]:.2f} ms a round")
    split = ", ".join(f"{k} {per.get(k, 0.0):.2f}" for k in ("wall", "device", "launch", "host_wait", "other"))
    return f"held by {held} (per round ms: {split})"


def _speedup_why(row: dict) -> str:
    theory = row.get("theory_decode_x_ar_b")
    extra = "" if theory is None else f", App. C {theory:.2f}x decode"
    return f"{_cell(row)} (decode {row['decode_x_ar_b']:.2f}x{extra}, tau {row.get('tau_hat') or 0:.2f}, " \
           f"gamma {row.get('gamma') or 0:.1f})"


def judge(folder: Path) -> list[Goal]:
    """Issue 52's goals, in its order, from the files in `folder`."""
    goals = []
    b1 = _rows(folder, "b1_captured.json") + _rows(folder, "b1_mps.json")
    ar = _best(_rows(folder, "b1_captured.json"), 1, lambda m: m == "ar")
    goals.append(Goal("captured `ar` at B = 1, tokens/s", ar and ar["decode_tokens_per_s"], 250, unit="tok/s",
                      why="" if ar is None else _cell(ar)))
    profile = {(p["model"], p["width"]): p for p in _json(folder, "profile.json") or []}
    eager = profile.get(("target", 1))
    ratio = eager["wall_ms"] / eager["hf_wall_ms"] if eager and (eager.get("hf_wall_ms") or 0) > 0 else None
    goals.append(Goal("eager `ar` step / transformers generate() step", ratio, 1.10, higher_is_better=False,
                      why="" if ratio is None else f"{eager['wall_ms']:.2f} ms vs {eager['hf_wall_ms']:.2f} ms"))
    cost = {(c["model"], c["width"]): c for c in _json(folder, "step_cost.json") or []}
    tp, tq = cost.get(("target", 1)), cost.get(("draft", 1))
    c = tp["captured_ms"] / tq["captured_ms"] if tp and tq else None
    goals.append(Goal("c = T_p / T_q, captured", c, 4.0, why="" if c is None else
                      f"T_p {tp['captured_ms']:.2f} ms, T_q {tq['captured_ms']:.2f} ms"))
    spec = _best(b1, 1, lambda m: m != "ar")
    goals.append(Goal("best speculative method at B = 1 / captured `ar`", spec and spec["x_ar_b"], 2.0,
                      why="" if spec is None else _speedup_why(spec)))
    hippo, pearl = _best(b1, 1, lambda m: _base(m) == "hippo"), _best(b1, 1, lambda m: _base(m) == "pearl")
    goals.append(Goal("hippo / pearl at B = 1", hippo and pearl and hippo["items_per_hour"] / pearl["items_per_hour"],
                      1.1, why="" if not (hippo and pearl) else f"{_cell(hippo)} vs {_cell(pearl)}"))
    for name, batch, wanted in (("b8.json", 8, 1.3), ("b32.json", 32, 1.1)):
        row = _best(_rows(folder, name), batch, lambda m: _base(m) == "hippo")
        goals.append(Goal(f"hippo at B = {batch} / batched `ar`, items/hour", row and row["x_ar_b"], wanted,
                          why="" if row is None else _speedup_why(row)))
    every = b1 + _rows(folder, "b8.json") + _rows(folder, "b32.json")
    same = [r for r in every if r["identical"] + (r.get("ties") or 0) >= r["items"]]
    goals.append(Goal("cells whose every output is batch-1 `ar`'s or a tie", len(same) if every else None,
                      len(every), unit="cells", why=", ".join(_cell(r) for r in every if r not in same)))
    for goal, row in ((goals[0], ar), (goals[3], spec)):
        if goal.met is False and row is not None:
            goal.why += "; " + profile_term(folder, row)
    return goals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vpsd.reports.gpu_goals", description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="the GPU check's $OUT, or its gpu_check.tgz unpacked")
    a = p.parse_args(argv)
    print(f"{'goal (issue 52)':<50} {'measured':>8} {'wanted':>7} {'':<6} {'verdict':<8} read from")
    for goal in judge(a.folder):
        print(goal.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

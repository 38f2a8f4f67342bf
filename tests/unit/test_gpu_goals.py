"""Issue 52's goals judged from a GPU check's files (vpsd/reports/gpu_goals.py), on a hand-made run: each goal's
measure from its own file, the verdicts, and for a miss the term the cell's profile names."""

from __future__ import annotations

import json
from pathlib import Path

from vpsd.reports.gpu_goals import judge, main


def _row(method: str, batch: int, items_per_hour: float, x_ar_b: float, tokens_per_s: float = 0.0,
         identical: int = 8, ties: int = 0, theory: float | None = None) -> dict:
    return {"method": method, "batch": batch, "items": 8, "identical": identical, "ties": ties,
            "items_per_hour": items_per_hour, "decode_tokens_per_s": tokens_per_s, "x_ar_b": x_ar_b,
            "decode_x_ar_b": x_ar_b * 1.2, "theory_decode_x_ar_b": theory, "tau_hat": 0.9, "gamma": 5.0}


def _write(folder: Path, name: str, data) -> None:
    (folder / name).write_text(json.dumps(data))


def _profile(folder: Path, stem: str, **per_round_ms: float) -> None:
    (folder / "profiles").mkdir(exist_ok=True)
    _write(folder / "profiles", f"{stem}_r1_traces_profile_rank0_target.summary.json", {"per_round_ms": per_round_ms})


def test_each_goal_is_read_from_its_file_and_a_miss_names_its_term(tmp_path):
    _write(tmp_path, "step_cost.json", [{"model": "target", "width": 1, "captured_ms": 1.5},
                                        {"model": "draft", "width": 1, "captured_ms": 0.3},
                                        {"model": "target", "width": 8, "captured_ms": 2.0}])
    _write(tmp_path, "profile.json", [{"model": "target", "width": 1, "wall_ms": 32.4, "hf_wall_ms": 30.0}])
    _write(tmp_path, "b1_captured.json", {"rows": [
        _row("ar", 1, 1000, 1.0, tokens_per_s=200.0), _row("pearl", 1, 1500, 1.5),
        _row("hippo", 1, 1900, 1.9, theory=2.6), _row("hippo:thread", 1, 2100, 2.1, identical=7, ties=1)]})
    _write(tmp_path, "b1_mps.json", {"rows": [_row("ar", 1, 1100, 1.0), _row("pearl", 1, 1800, 1.64)]})
    _write(tmp_path, "b8.json", {"rows": [_row("ar", 8, 4000, 1.0), _row("hippo", 8, 4800, 1.2, identical=6)]})
    _profile(tmp_path, "b1_captured_ar_b1", wall=5.0, device=1.6, launch=0.2, host_wait=2.5, other=0.7)
    goals = {g.name: g for g in judge(tmp_path)}

    ar = goals["captured `ar` at B = 1, tokens/s"]
    assert (ar.measured, ar.met) == (200.0, False)
    assert "host waits" in ar.why and "host_wait 2.50" in ar.why  # the largest of the CPU's terms, over the kernels
    eager = goals["eager `ar` step / transformers generate() step"]
    assert abs(eager.measured - 1.08) < 1e-9 and eager.met  # lower is better: 32.4 ms against 30, 8% over
    assert goals["c = T_p / T_q, captured"].measured == 5.0 and goals["c = T_p / T_q, captured"].met
    best = goals["best speculative method at B = 1 / captured `ar`"]
    assert best.measured == 2.1 and best.met and "hippo:thread" in best.why  # the best of both B = 1 files
    ratio = goals["hippo / pearl at B = 1"]  # the best hippo (2100/h) against the best pearl (mps, 1800/h)
    assert abs(ratio.measured - 2100 / 1800) < 1e-9 and ratio.met
    b8 = goals["hippo at B = 8 / batched `ar`, items/hour"]
    assert (b8.measured, b8.met) == (1.2, False) and "gamma 5.0" in b8.why
    assert goals["hippo at B = 32 / batched `ar`, items/hour"].met is None  # no b32.json: not run
    lossless = goals["cells whose every output is batch-1 `ar`'s or a tie"]
    assert (lossless.measured, lossless.wanted, lossless.met) == (7, 8, False)  # a tie passes; b8's hippo does not
    assert lossless.why == "b8: hippo B = 8"


def test_a_step_held_by_its_kernels_says_so_and_the_table_prints(tmp_path, capsys):
    _write(tmp_path, "b1_captured.json", {"rows": [_row("ar", 1, 1000, 1.0, tokens_per_s=180.0)]})
    # A bench cut at its limit lists its unfinished cells at 0 items (gpu_check.sh's --report-only): not run.
    _write(tmp_path, "b8.json", {"rows": [dict(_row("hippo", 8, 0.0, 0.0, identical=0), items=0)]})
    _profile(tmp_path, "b1_captured_ar_b1", wall=5.6, device=5.2, launch=0.1, host_wait=0.1, other=0.2)
    ar = judge(tmp_path)[0]
    assert ar.met is False and "the kernels themselves (5.20 ms a round)" in ar.why
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "MISSED" in out and out.count("not run") == 6

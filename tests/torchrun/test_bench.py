"""The method benchmark end to end on the tiny pair: real torchrun runs, a table, CSV/JSON and a chart."""

import csv
import json

import pytest

from tests.torchrun_jobs import ROOT, world_manifest
from vpsd.bench.methods import BenchRun, default_runs, main


def test_default_runs_cover_every_method_then_every_other_strategy():
    runs = default_runs("hippo", methods=["ar", "sd", "hippo"], strategies=["hippo", "random", "none"])
    assert runs == [BenchRun("ar", "ar"), BenchRun("sd", "sd"), BenchRun("hippo", "hippo"),
                    BenchRun("hippo+random", "hippo", "random"), BenchRun("hippo+none", "hippo", "none")]


def test_pearl_brings_its_table3_row_and_the_four_rows_read_as_steps():
    """HIPPO Table 3: pearl-video (the draft told after the target's prefill), pearl, hippo+specvlm, hippo.
    Each step names the terms that moved: here the prefill overlap, then MAT, then T_q and gamma."""
    from vpsd.bench.methods import PEARL_VIDEO, BenchRow, format_table3

    runs = default_runs("hippo", methods=["ar", "pearl", "hippo"], strategies=["specvlm"])
    assert [r.label for r in runs] == ["ar", "pearl-video", "pearl", "hippo", "hippo+specvlm"]
    assert PEARL_VIDEO.args() == ["--method", "pearl", "--set=decoding.sync_prefill=false"]

    def row(label, first, t_q, gamma, mat, wall):
        return BenchRow(label, "x", "x", True, 4, 4, mat, 0.5, 0.8, gamma, wall, wall, None, None, 100.0, 50.0, t_q,
                        0.1, first, 1, 0)

    rows = [row("pearl-video", 400, 10.0, 8.0, 3.0, 1.5), row("pearl", 20, 10.0, 8.0, 3.0, 1.8),
            row("hippo+specvlm", 20, 10.0, 8.0, 3.6, 2.0), row("hippo", 20, 5.0, 12.0, 3.6, 2.4)]
    text = format_table3(rows).splitlines()
    assert "1st chunk wait x0.05" in text[3] and "T_q" not in text[3]
    assert text[4].endswith("MAT x1.20")
    assert text[5].endswith("T_q x0.50, gamma x1.50")
    assert format_table3(rows[1:]) == ""  # not all four ran: no decomposition


@pytest.mark.slow  # the method bench end to end: the README's demo runs it; CI runs the throughput bench's (test_gpu_check)
def test_bench_runs_ar_and_a_parallel_baseline_losslessly(tmp_path):
    manifest = world_manifest(str(tmp_path), 2)
    out = tmp_path / "bench"
    # A row left by an earlier bench (other weights, say): a job resuming in that directory would skip the
    # item, and the table would mix that run's output and timing into this one's.
    first = json.loads(manifest.read_text().splitlines()[0])["id"]
    (out / "ar").mkdir(parents=True)
    stale = {"id": first, "method": "ar", "token_ids": [1, 2, 3], "text": "stale", "stats": {}, "wall_s": 99.0}
    (out / "ar" / "results.jsonl").write_text(json.dumps(stale) + "\n")
    code = main(["--config", str(ROOT / "configs" / "tiny_qwen2_5_vl.yaml"), "--manifest", str(manifest),
                 "--out", str(out), "--methods", "ar", "--strategies", "random"])
    assert code == 0
    rows = list(csv.DictReader(open(out / "bench.csv")))
    assert [r["label"] for r in rows] == ["ar", "hippo+random"]
    data = json.loads((out / "bench.json").read_text())
    parallel = data["rows"][1]
    assert parallel["identical"] == parallel["items"] == 2
    assert parallel["t_target_ms"] > 0 and parallel["t_draft_ms"] > 0  # measured from the run's traces
    assert parallel["theory_speedup"] is not None
    assert (out / "bench.png").stat().st_size > 0
    assert "stale" not in (out / "ar" / "results.jsonl").read_text()


def _write_run(path, rows, spans=()):
    path.mkdir(parents=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "traces").mkdir()
    lines = [json.dumps({"event": "span", "role": role, "rank": rank, "name": name, "t0": 1000.0 + t, "dur": dur,
                         "t": 1000.0 + t + dur, **fields}) for role, rank, name, t, dur, fields in spans]
    (path / "traces" / "all.jsonl").write_text("\n".join(lines) + "\n")


def _ar_row(item, tokens, wall, decode):
    return {"id": item, "token_ids": tokens, "error": None,
            "stats": {"rounds": len(tokens), "acceptance_rate": 0.0, "wall_s": wall, "decode_s": decode, "prefill_s": wall - decode}}


def test_accounting_by_hand(tmp_path):
    """Baseline = per-item median of the ar runs; speedups on the same ids; theory = Theorem 6 against ar's
    per-token time with tau_hat and the full-window verify time; efficiency = measured / theory."""
    from vpsd.pipeline.theory import predicted_speedup
    from vpsd.bench.methods import Baseline, measure

    toks = list(range(11))  # 11 tokens: 10 decoded after the prefill's first
    for i, (wall, decode) in enumerate([(3.0, 2.0), (3.4, 2.4), (2.9, 1.9)]):
        _write_run(tmp_path / f"ar{i}", [_ar_row("a", toks, wall, decode)])
    base = Baseline([tmp_path / "ar0", tmp_path / "ar1", tmp_path / "ar2"])
    assert base.items["a"] == {"wall_s": 3.0, "decode_s": 2.0}
    assert base.step_s == 0.2 and base.noise == (3.4 - 2.9) / 3.0 and base.consistent
    stats = {"rounds": 4, "acceptance_rate": 0.6, "wall_s": 2.0, "decode_s": 1.0, "prefill_s": 1.0,
             "accepted_tokens": 9, "rejections": 1, "gamma": 4.0, "first_chunk_wait_s": 0.01}
    spans = [("target", 0, "verify", 0.0, 0.3, {"gamma": 4, "drafted": 4}),
             ("target", 0, "verify", 0.3, 0.1, {"gamma": 4, "drafted": 1}),  # a 1-token round: not T_p
             ("target", 0, "verify", 0.4, 0.5, {"gamma": 4, "drafted": 4}),
             ("draft", 1, "draft_step", 0.0, 0.05, {})]
    _write_run(tmp_path / "hippo", [{"id": "a", "token_ids": toks, "error": None, "stats": stats}], spans)
    row = measure(BenchRun("hippo", "hippo"), [tmp_path / "hippo"], base, 0)
    assert (row.speedup, row.decode_speedup, row.identical, row.items) == (1.5, 2.0, 1, 1)
    assert row.tau_hat == 0.9 and row.t_target_ms == 400.0 and row.t_draft_ms == 50.0
    theory = predicted_speedup(True, 200.0, 50.0, 400.0, 4.0, 0.9)
    assert row.theory_speedup == theory and row.efficiency == 2.0 / theory
    assert row.overhead_ms == pytest.approx(1000 * (1.0 - 0.9) / 4)  # decode time neither verify nor chunk wait
    assert row.first_chunk_ms == 10.0


def test_throughput_accounting_by_hand():
    """vpsd bench --batch: ratios over batched and batch-1 ar, the prefill cap, the spread and App. C's
    prediction, from cells whose numbers are chosen by hand."""
    from vpsd.bench.throughput import Cell, format_table, predicted_tokens_per_s, summarize_cells

    def cell(iph, dts, prefill_s, batching=None, outputs=None):
        return Cell(4, 0, iph, dts, 1.0, 2.0, 800.0, batching, outputs or {"a": [1, 2]}, prefill_s)

    ar1 = [cell(1000, 10, 0.2)]
    ar8 = [cell(3000, 30, 0.2, {"mean_batch": 8, "t_p_s": 0.08, "mean_gamma": 0, "t_q_s": 0, "tau_hat": 0})]
    spec = {"mean_batch": 8, "t_p_s": 0.16, "mean_gamma": 4, "t_q_s": 0.01, "tau_hat": 0.8}
    hippo8 = [cell(4000, 80, 0.25, spec), cell(5000, 90, 0.25, spec), cell(4500, 70, 0.25, spec, {"a": [1, 3]})]
    row = summarize_cells("hippo", 8, hippo8, ar8, ar1, {"a": [1, 2]}, cores=2)
    assert (row.items_per_hour, row.decode_tokens_per_s) == (4500, 80)  # medians over the repeats
    assert row.x_ar_b == pytest.approx(1.5) and row.x_ar_1 == pytest.approx(4.5)
    assert row.decode_x_ar_b == pytest.approx(80 / 30) and row.decode_x_ar_1 == pytest.approx(8.0)
    assert row.cap_items_per_hour == pytest.approx(2 * 3600 / 0.25) and row.prefill_ms == pytest.approx(250)
    assert row.spread == pytest.approx((5000 - 4000) / 4500)
    assert row.identical == 1  # the first repeat's output is what is compared
    # App. C over a batch: B (1 + E[X]) / (gamma T_q + T_p) against B / T_p(B, 1) of batched ar.
    e_x = 0.8 * (1 - 0.8**4) / 0.2
    assert predicted_tokens_per_s(spec) == pytest.approx(8 * (1 + e_x) / (4 * 0.01 + 0.16))
    assert row.theory_decode_x_ar_b == pytest.approx(predicted_tokens_per_s(spec) / (8 / 0.08))
    table = format_table([row], {8: 0.1})
    assert "hippo" in table and "22%" in table and "B=8: 10%" in table and "28800" in table
    assert row.stalled_runs == 0 and "slow prefills (an item's vision + prefill over 3x its row's P: a stall or a cold start): none" in table
    # One repeat whose slowest item took 1 s against a P of 0.25 s: a stall, named under the table.
    hippo8[1].slowest_prefill_s = 1.0
    row = summarize_cells("hippo", 8, hippo8, ar8, ar1, {"a": [1, 2]}, cores=2)
    assert (row.stalled_runs, row.slowest_prefill_ms) == (1, 1000)
    assert "hippo B=8: 1 of 3 runs (slowest 1000 ms, P 250 ms)" in format_table([row], {8: 0.1})


def test_captured_steps_one_time_cost_is_out_of_the_rates_and_shown(tmp_path):
    """A cell's captured-step cost (summary.json's run.capture_s: graphs traced and recorded in its first items)
    comes out of its loop and decode times, and the table names it: 2 items of 11 tokens, 20 s of loop, 9 s of
    decode of which 6 s were captures -> 3600 * 2 / 14 items/hour and 20 / 3 decode tokens/s."""
    import json

    from vpsd.bench.throughput import format_table, read_cell, summarize_cells

    rows = [{"id": i, "token_ids": list(range(11)), "stats": {"decode_s": 4.5, "prefill_s": 0.5, "wall_s": 5.0}}
            for i in ("a", "b")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"run": {"loop_s": 20.0, "capture_s": 6.0}}))
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "rank1_draft.jsonl").write_text(  # the draft role's own (roles/draft.py): listed only
        '{"event": "span", "role": "draft", "name": "recv_wait"}\n'
        '{"event": "captured_steps", "role": "draft", "capture_s": 2.5, "graphs": 3, "unrecorded": 0}\n')
    cell = read_cell(tmp_path)
    assert cell.items_per_hour == pytest.approx(3600 * 2 / 14) and cell.decode_tokens_per_s == pytest.approx(20 / 3)
    assert cell.draft_capture_s == 2.5
    row = summarize_cells("hippo", 1, [cell], [cell], [cell], cell.outputs, cores=2)
    table = format_table([row], {1: 0.0})
    assert row.capture_s == 6.0 and "left out of items/h and dec tok/s: hippo B=1: 6.0 s (its draft's own 2.5 s" in table


def test_report_only_reads_the_runs_the_bench_scheduled(tmp_path, capsys):
    """`vpsd bench --report-only --out DIR` rebuilds the table from the cells DIR/schedule.json lists, whatever
    else is in DIR and whatever flags it is given; without a schedule it refuses instead of guessing."""
    from vpsd.launch.cli import main as vpsd
    from vpsd.bench.throughput import write_schedule

    def job(path, loop_s, tokens, batching=None):
        path.mkdir(parents=True)
        rows = [{"id": f"i{k}", "token_ids": tokens, "error": None,
                 "stats": {"prefill_s": 0.2, "wall_s": 1.0, "decode_s": 0.5}} for k in range(4)]
        (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path / "summary.json").write_text(json.dumps({"run": {"loop_s": loop_s, "batching": batching}}))

    with pytest.raises(SystemExit):
        vpsd(["bench", "--report-only", "--out", str(tmp_path)])
    assert "no " + str(tmp_path / "schedule.json") in capsys.readouterr().err
    write_schedule(tmp_path, "c.yaml", tmp_path / "m.jsonl", [1, 2], ["ar", "hippo"], 1)
    for method, b, loop in (("ar", 1, 8.0), ("hippo", 1, 4.0), ("ar", 2, 5.0), ("hippo", 2, 2.5)):
        job(tmp_path / f"{method}_b{b}" / "r1", loop, [1, 2, 3], None if b == 1 else {"decode_s": 1.0})
    job(tmp_path / "ar_b4" / "r1", 1.0, [9])  # not scheduled: not read (its outputs would differ)
    assert vpsd(["bench", "--report-only", "--out", str(tmp_path), "--batch", "4", "--repeats", "3"]) == 0
    table = (tmp_path / "throughput.txt").read_text()
    lines = [line.split() for line in table.splitlines() if line.startswith(("ar ", "hippo "))]
    assert [(m, b) for m, b, *_ in lines] == [("ar", "1"), ("hippo", "1"), ("ar", "2"), ("hippo", "2")]
    assert lines[3][2] == "5760" and lines[3][7:9] == ["2.00x", "3.20x"]  # 4 items in 2.5 s; over 5 s, 8 s
    assert json.loads((tmp_path / "throughput.json").read_text())["config"] == "c.yaml"


def test_a_bench_with_a_bad_manifest_or_batch_list_refuses_before_any_job(tmp_path, capsys):
    """They ran every cell's job only for each to fail (a missing manifest: 0.7 min for six refusals), or ended in
    a ValueError traceback (`--batch 1,x`)."""
    from vpsd.launch.cli import main as vpsd

    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    for argv, said in (
            (["bench", "--batch", "1,2", "--manifest", str(tmp_path / "nope.jsonl")], "no such file"),
            (["bench", "--manifest", str(tmp_path / "nope.jsonl")], "no such file"),
            (["bench", "--batch", "1,x", "--manifest", str(manifest)], "need batch sizes >= 1"),
            (["bench", "--batch", "0", "--manifest", str(manifest)], "need batch sizes >= 1")):
        with pytest.raises(SystemExit) as e:
            vpsd([*argv, "--out", str(tmp_path / "out")])
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

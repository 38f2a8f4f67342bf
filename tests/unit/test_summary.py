"""Run summaries and the comparison with an `ar` run, on hand-written results files."""

from __future__ import annotations

import json

import pytest

from vpsd.launch.cli import main as cli_main
from vpsd.launch.results import ResultRow, ResultsFile
from vpsd.reports.summary import compare, summarize


def _row(item, tokens, rounds, acc, wall, error=None):
    stats = {"rounds": rounds, "acceptance_rate": acc, "wall_s": wall, "prefill_s": 0.1, "decode_s": wall - 0.1}
    return {"id": item, "method": "m", "token_ids": tokens, "stats": stats, "error": error}


def test_summary_and_comparison(tmp_path):
    ar, run = tmp_path / "ar", tmp_path / "run"
    for d, rows in [
        (ar, [_row("a", [1, 2, 3, 4], 4, 0.0, 2.0), _row("b", [5, 6], 2, 0.0, 1.0)]),
        (run, [_row("a", [1, 2, 3, 4], 2, 0.5, 0.5), _row("b", [5, 7], 1, 1.0, 0.5),
               _row("c", [], 0, 0.0, 0.0, error={"type": "VideoError", "message": "x"})]),
    ]:
        for r in rows:
            ResultsFile(d).append(ResultRow.from_json(r))
    s = summarize(run)
    assert (s["items_done"], s["items_failed"], s["tokens"]) == (2, 1, 6)
    assert s["mean_accepted_tokens"] == 6 / 3
    assert s["acceptance_rate"] == (0.5 * 2 + 1.0 * 1) / 3
    c = compare(ar, run)
    assert c == {"items_compared": 2, "identical_outputs": 1, "speedup_vs_baseline": 3.0 / 1.0,
                 "decode_speedup_vs_baseline": (1.9 + 0.9) / (0.4 + 0.4)}
    assert s["items_plain"] == 0  # method "m" is no method with a draft
    # The CLI reports the mismatch with a failing status.
    assert cli_main(["summary", str(run), "--baseline", str(ar)]) == 1
    assert json.loads((run / "summary.json").read_text())["identical_outputs"] == 1


def test_resume_skips_finished_ids(tmp_path):
    f = ResultsFile(tmp_path)
    f.append(ResultRow.from_json({"id": "a", "method": "hippo", "error": None}))
    f.append(ResultRow.from_json({"id": "b", "method": "hippo", "error": {"type": "VideoError", "message": "corrupt"}}))
    f.append(ResultRow.from_json({"id": "a", "method": "ar", "error": None}))
    with f.path.open("a") as h:
        h.write('{"id": "c", "method": "hip')  # a line cut by a crash
    assert f.finished("hippo") == {"a", "b"}
    assert f.finished("hippo", include_failed=False) == {"a"}


def test_summary_counts_the_items_a_drafting_method_decoded_plain(tmp_path):
    """gamma auto may decode an item plain (no draft, as `ar`): such an item reports no kept set."""
    rows = [_row("a", [1, 2], 1, 0.5, 0.5), _row("b", [3], 1, 0.0, 0.5), _row("c", [4], 1, 0.0, 0.5)]
    for r, kept in zip(rows, (6, None, None)):
        ResultsFile(tmp_path / "hippo").append(ResultRow.from_json({**r, "method": "hippo", "stats": {**r["stats"], "num_kept": kept}}))
        ResultsFile(tmp_path / "ar").append(ResultRow.from_json({**r, "method": "ar", "stats": {**r["stats"], "num_kept": None}}))
    assert summarize(tmp_path / "hippo")["items_plain"] == 2
    assert summarize(tmp_path / "ar")["items_plain"] == 0


def test_summary_of_a_directory_that_is_no_job_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["summary", str(tmp_path / "nodir")])
    assert e.value.code == 2 and "holds no results.jsonl or summary.json" in capsys.readouterr().err


def test_a_shared_out_sums_each_method_apart_and_the_status_reads_the_last_runs_method(tmp_path):
    """Two methods in one --out (a bench's ar beside hippo): the top level and --status are the last run's
    method's, `methods` holds each one's, `runs` each one's last run; one method's failures never count against
    another's. A summary.json from before `methods` existed still reads (its top level: every row)."""
    from vpsd.reports.summary import EXIT_ITEMS_FAILED, job_summary, main

    err = {"type": "VideoError", "message": "corrupt"}
    rows = [{**_row(i, [1, 2], 2, 0.5, 1.0, error=err if (m, i) == ("ar", "b") else None), "method": m}
            for m in ("ar", "hippo") for i in ("a", "b")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps(job_summary(tmp_path, "ar", {"items": 2, "failed": 1})))
    hippo = job_summary(tmp_path, "hippo", {"items": 2, "failed": 0})
    (tmp_path / "summary.json").write_text(json.dumps(hippo))
    assert hippo["method"] == "hippo" and (hippo["items_done"], hippo["items_failed"]) == (2, 0)
    assert {m: s["items_failed"] for m, s in hippo["methods"].items()} == {"ar": 1, "hippo": 0}
    assert set(hippo["runs"]) == {"ar", "hippo"} and hippo["run"] == {"items": 2, "failed": 0}
    assert main([str(tmp_path), "--status"]) == 0  # hippo ran last: ar's failure is not its own
    (tmp_path / "summary.json").write_text(json.dumps(job_summary(tmp_path, "ar", {"items": 1, "failed": 1})))
    assert main([str(tmp_path), "--status"]) == EXIT_ITEMS_FAILED
    (tmp_path / "summary.json").write_text(json.dumps({"items_done": 3, "run": {"items": 4}}))  # an old one
    assert main([str(tmp_path), "--status"]) == EXIT_ITEMS_FAILED  # all rows, as before
    assert main([str(tmp_path)]) == 0


def test_summary_prints_the_prefix_reuse_of_the_run(tmp_path, capsys):
    """summary.json's run.reuse (the targets' prefix caches): hits, misses, hit rate and bytes held, on one line."""
    from vpsd.reports.summary import job_summary

    ResultsFile(tmp_path).append(ResultRow.from_json(_row("a", [1, 2], 2, 0.5, 1.0)))
    reuse = {"requests": 12, "hits": 8, "misses": 4, "skipped": 0, "bytes": 210 * 2**20, "peak_bytes": 300 * 2**20}
    (tmp_path / "summary.json").write_text(json.dumps(job_summary(tmp_path, "m", {"items": 1, "reuse": reuse})))
    assert cli_main(["summary", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(None, 2)[2] for line in lines if line.startswith("prefix reuse")] == [
        "8 hits / 12 prefills (67%), 4 misses, 210 MiB held"]
    assert not any("requests=" in line for line in lines)  # not repeated in the run's line
    (tmp_path / "summary.json").write_text(json.dumps(job_summary(tmp_path, "m", {"items": 1, "reuse": None})))
    assert cli_main(["summary", str(tmp_path)]) == 0
    assert "prefix reuse" not in capsys.readouterr().out  # reuse off: no line

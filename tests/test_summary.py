"""Run summaries and the comparison with an `ar` run, on hand-written results files."""

from __future__ import annotations

import json

import pytest

from vpsd.launch.cli import main as cli_main
from vpsd.launch.results import ResultsFile
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
            ResultsFile(d).append(r)
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
    f.append({"id": "a", "method": "hippo", "error": None})
    f.append({"id": "b", "method": "hippo", "error": {"type": "VideoError", "message": "corrupt"}})
    f.append({"id": "a", "method": "ar", "error": None})
    with f.path.open("a") as h:
        h.write('{"id": "c", "method": "hip')  # a line cut by a crash
    assert f.finished("hippo") == {"a", "b"}
    assert f.finished("hippo", include_failed=False) == {"a"}


def test_summary_counts_the_items_a_drafting_method_decoded_plain(tmp_path):
    """gamma auto may decode an item plain (no draft, as `ar`): such an item reports no kept set."""
    rows = [_row("a", [1, 2], 1, 0.5, 0.5), _row("b", [3], 1, 0.0, 0.5), _row("c", [4], 1, 0.0, 0.5)]
    for r, kept in zip(rows, (6, None, None)):
        ResultsFile(tmp_path / "hippo").append({**r, "method": "hippo", "stats": {**r["stats"], "num_kept": kept}})
        ResultsFile(tmp_path / "ar").append({**r, "method": "ar", "stats": {**r["stats"], "num_kept": None}})
    assert summarize(tmp_path / "hippo")["items_plain"] == 2
    assert summarize(tmp_path / "ar")["items_plain"] == 0


def test_summary_of_a_directory_that_is_no_job_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["summary", str(tmp_path / "nodir")])
    assert e.value.code == 2 and "holds no results.jsonl or summary.json" in capsys.readouterr().err

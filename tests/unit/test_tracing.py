"""Traces as JSON lines (in-process and from two real processes), and the timeline / breakdown read back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from vpsd.reports import timeline, timeline_command
from vpsd.reports import timeline_plot
from vpsd.reports.timeline import Row, breakdown, format_breakdown, load_spans
from vpsd.reports.timeline_plot import plot_timeline
from vpsd.tracing import close_tracing, configure_tracing, get_logger, mark, span, trace_path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_structlog():
    yield
    close_tracing()


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- tracing ---------------------------------------------------------------------------------------

ROLE_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import structlog
    from vpsd.tracing import configure_tracing, mark, span

    out, role, rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    configure_tracing(out, role, rank)
    step = "verify" if role == "target" else "draft_step"
    for r in range(3):
        with span(step, item="clip-1", round=r, epoch=0, tokens=4):
            pass
    mark("rollback", item="clip-1", epoch=1)
    structlog.get_logger("vpsd.some_module").warning("peer_slow", peer=1 - rank)
    try:
        with span("send", item="clip-1", round=3):
            raise ValueError("boom")
    except ValueError:
        pass
    """
)


def test_two_processes_write_their_own_trace(tmp_path):
    procs = {
        (role, rank): subprocess.Popen(
            [sys.executable, "-c", ROLE_SCRIPT, str(tmp_path), role, str(rank)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for role, rank in [("target", 0), ("draft", 1)]
    }
    for (role, rank), proc in procs.items():
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        # Warnings reach stderr as one readable line; spans and marks never do.
        assert err.splitlines() == [f"[{role} {rank}] warning peer_slow peer={1 - rank}"]

        lines = read_lines(trace_path(tmp_path, role, rank))
        assert [(d["event"], d.get("name")) for d in lines] == [
            ("span", "verify" if role == "target" else "draft_step")] * 3 + [
            ("mark", "rollback"), ("peer_slow", None), ("span", "send")]
        for d in lines:
            assert (d["role"], d["rank"]) == (role, rank)
            assert isinstance(d["t"], float)
        spans = [d for d in lines if d["event"] == "span"]
        for r, d in enumerate(spans):
            assert d["dur"] >= 0 and d["t0"] <= d["t"]
            assert (d["item"], d["round"]) == ("clip-1", r)
            assert d["level"] == "debug"
        assert [d["epoch"] for d in spans[:3]] == [0, 0, 0] and spans[0]["tokens"] == 4
        assert "error" not in spans[0]
        assert spans[-1]["error"] == "ValueError: boom"
        assert lines[3]["epoch"] == 1 and lines[3]["t0"] <= lines[3]["t"]
        assert lines[4]["level"] == "warning" and lines[4]["peer"] == 1 - rank

    # And the timeline reads them back in lane order.
    spans = load_spans(tmp_path)
    assert timeline.lanes(spans) == [("target", 0), ("draft", 1)]
    assert sum(s.kind == "mark" for s in spans) == 2
    png = plot_timeline(spans, tmp_path / "t.png")
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_reconfiguring_replaces_the_sink_without_duplicates(tmp_path):
    early = structlog.get_logger("made.before.configure")  # module-level loggers must follow reconfiguration
    configure_tracing(tmp_path, "target", 0)
    early.info("one")
    configure_tracing(tmp_path, "target", 0)
    early.info("two")
    configure_tracing(tmp_path, "draft", 1)
    get_logger().info("three", value=np.int64(3))

    assert [d["event"] for d in read_lines(trace_path(tmp_path, "target", 0))] == ["one", "two"]
    (three,) = read_lines(trace_path(tmp_path, "draft", 1))
    assert (three["event"], three["role"], three["rank"], three["value"]) == ("three", "draft", 1, 3)


def test_span_logs_error_and_reraises(tmp_path):
    configure_tracing(tmp_path, "pruner", 2)
    with pytest.raises(KeyError):
        with span("prune", item="a", round=0):
            raise KeyError("k")
    with span("prune", item="a", round=1):
        pass
    failed, ok = read_lines(trace_path(tmp_path, "pruner", 2))
    assert failed["error"] == "KeyError: 'k'" and failed["round"] == 0 and failed["dur"] >= 0
    assert "error" not in ok


def test_fields_set_inside_a_span_are_logged_with_it(tmp_path):
    configure_tracing(tmp_path, "target", 0)
    with span("verify", item="a", drafted=4) as fields:
        fields["accepted"] = 2  # known only once the block has verified
    (line,) = read_lines(trace_path(tmp_path, "target", 0))
    assert (line["name"], line["item"], line["drafted"], line["accepted"]) == ("verify", "a", 4, 2)


def test_stderr_only_without_out_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    configure_tracing(None, "pruner", 2)
    with span("prune"):
        pass
    get_logger().info("hello", a=1)
    get_logger().debug("quiet")
    try:
        raise RuntimeError("bad")
    except RuntimeError:
        get_logger().exception("failed")
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["[pruner 2] info hello a=1", "[pruner 2] error failed"]
    assert err[-1] == "RuntimeError: bad"  # stderr is the only record: the whole traceback is kept
    assert not any("prune" in line and "span" in line for line in err)
    assert list(tmp_path.iterdir()) == []


# --- timeline and breakdown on a hand-written trace ----------------------------------------------

T = 1000.0  # every time below is exact in binary, so sums compare with ==


def span_line(role, rank, name, start, dur, **fields):
    return json.dumps({"event": "span", "level": "debug", "role": role, "rank": rank, "t": T + start + dur,
                       "name": name, "t0": T + start, "dur": dur, **fields})


def mark_line(role, rank, name, at, **fields):
    return json.dumps({"event": "mark", "level": "debug", "role": role, "rank": rank, "t": T + at,
                       "name": name, "t0": T + at, **fields})


@pytest.fixture
def run_dir(tmp_path) -> Path:
    traces = tmp_path / "traces"
    traces.mkdir()
    target = [
        span_line("target", 0, "video_read", -0.25, 0.25, item="v1"),  # before its item span, in its wall
        span_line("target", 0, "prefill", 0.0, 1.0, item="v1"),
        span_line("target", 0, "verify", 1.0, 0.5, item="v1", round=0),
        span_line("target", 0, "send", 1.25, 0.25),  # nested in verify, no item: shown with v1
        mark_line("target", 0, "rollback", 1.5, item="v1", epoch=1),
        span_line("target", 0, "recv_wait", 1.5, 0.25, item="v1"),
        span_line("target", 0, "verify", 1.75, 0.25, item="v1", round=1),
        json.dumps({"event": "bad_message", "level": "warning", "role": "target", "rank": 0, "t": T}),
        "not json{",
        span_line("target", 0, "item", 0.0, 2.0, item="v1"),  # logged last: at its end
        '{"event": "span", "name": "ver',  # the rank died mid-line
    ]
    draft = [
        span_line("draft", 1, "recv_wait", 0.5, 0.5, item="v1"),
        span_line("draft", 1, "draft_step", 1.0, 0.25, item="v1", round=0),
        mark_line("draft", 1, "mode_switch", 1.25, item="v1"),
        span_line("draft", 1, "draft_step", 1.5, 0.25, item="v1", round=1),
        span_line("draft", 1, "item", 0.5, 1.5, item="v1"),
        span_line("draft", 1, "draft_step", 2.5, 0.25, item="v2", round=0),
        span_line("draft", 1, "item", 2.5, 0.5, item="v2"),
        json.dumps({"event": "span", "role": "draft", "rank": 1, "name": "x", "t0": T}),  # no dur
    ]
    pruner = [  # no item span: its wall time is first-to-last span
        span_line("pruner", 2, "vision", 0.0, 0.5, item="v1"),
        span_line("pruner", 2, "prune", 0.5, 0.25, item="v1"),
        span_line("pruner", 2, "send", 1.0, 0.25, item="v1"),
    ]
    (traces / "rank0_target.jsonl").write_text("\n".join(target))
    (traces / "rank1_draft.jsonl").write_text("\n".join(draft) + "\n")
    (traces / "rank2_pruner.jsonl").write_text("\n".join(pruner) + "\n")
    return tmp_path


def test_load_spans_skips_malformed_lines_and_counts_them(run_dir):
    with capture_logs() as logs:
        spans = load_spans(run_dir)
    assert [(e["event"], e["skipped"]) for e in logs] == [("malformed_trace_lines", 3)]
    assert len(spans) == 18 and sum(s.kind == "mark" for s in spans) == 2
    assert [s.t0 for s in spans] == sorted(s.t0 for s in spans)
    item = spans[1]  # at T+0 the longer span (item) sorts first
    assert (item.role, item.rank, item.name, item.item, item.dur) == ("target", 0, "item", "v1", 2.0)
    rollback = next(s for s in spans if s.kind == "mark" and s.name == "rollback")
    assert (rollback.dur, rollback.fields) == (0.0, {"epoch": 1})
    assert next(s for s in spans if s.name == "verify").round == 0


def test_item_selection(run_dir):
    spans = load_spans(run_dir)
    assert timeline.first_item(spans) == "v1"
    v1 = timeline.item_spans(spans, "v1")
    assert {s.item for s in v1} == {"v1", None}
    assert len(v1) == len(spans) - 2  # the two v2 spans of the draft
    with pytest.raises(ValueError, match="nope"):
        timeline.item_spans(spans, "nope")


def test_breakdown_equals_hand_computed_sums(run_dir):
    rows = breakdown(load_spans(run_dir))
    got = [(r.role, r.rank, r.kind, r.name, r.total_s, r.count, r.mean_ms, r.share) for r in rows]
    # video_read, prefill, verify 1-1.5 (send nested inside), verify 1.75-2
    target_busy = 0.25 + 1.0 + 0.5 + 0.25
    draft_busy = 0.25 * 3
    pruner_busy = 0.5 + 0.25 + 0.25
    assert got == [
        ("target", 0, "span", "item", 2.0, 1, 2000.0, None),
        ("target", 0, "span", "prefill", 1.0, 1, 1000.0, 0.5),
        ("target", 0, "span", "verify", 0.75, 2, 375.0, 0.375),
        ("target", 0, "span", "recv_wait", 0.25, 1, 250.0, None),
        ("target", 0, "span", "send", 0.25, 1, 250.0, 0.125),
        ("target", 0, "span", "video_read", 0.25, 1, 250.0, 0.125),
        ("target", 0, "total", "wall", 2.25, None, None, 1.0),
        ("target", 0, "total", "busy", target_busy, None, None, 2.0 / 2.25),
        ("target", 0, "total", "idle", 0.25, None, None, 0.25 / 2.25),
        ("target", 0, "total", "waiting", 0.25, None, None, 0.25 / 2.25),
        ("draft", 1, "span", "item", 2.0, 2, 1000.0, None),
        ("draft", 1, "span", "draft_step", 0.75, 3, 250.0, 1.0),
        ("draft", 1, "span", "recv_wait", 0.5, 1, 500.0, None),
        ("draft", 1, "total", "wall", 2.0, None, None, 1.0),  # two items: 1.5 s + 0.5 s
        ("draft", 1, "total", "busy", draft_busy, None, None, 0.375),
        ("draft", 1, "total", "idle", 1.25, None, None, 0.625),
        ("draft", 1, "total", "waiting", 0.5, None, None, 0.25),
        ("pruner", 2, "span", "vision", 0.5, 1, 500.0, 0.5),
        ("pruner", 2, "span", "prune", 0.25, 1, 250.0, 0.25),
        ("pruner", 2, "span", "send", 0.25, 1, 250.0, 0.25),
        ("pruner", 2, "total", "wall", 1.25, None, None, 1.0),  # no item span: its v1 spans' extent
        ("pruner", 2, "total", "busy", pruner_busy, None, None, 0.8),
        ("pruner", 2, "total", "idle", 0.25, None, None, 0.2),
        ("pruner", 2, "total", "waiting", 0.0, None, None, 0.0),
    ]


def test_format_breakdown():
    rows = [
        Row("target", 0, "span", "prefill", 1.0, 1, 1000.0, 0.5),
        Row("target", 0, "total", "idle", 0.25, share=0.125),
        Row("draft", 1, "span", "recv_wait", 0.5, 2, 250.0, None),
    ]
    lines = format_breakdown(rows).splitlines()
    assert lines[0].split() == ["role", "span", "total", "s", "count", "mean", "ms", "share"]
    assert lines[2].split() == ["target", "(rank", "0)", "prefill", "1.0000", "1", "1000.00", "50.0%"]
    assert lines[3].split() == ["target", "(rank", "0)", "=", "idle", "0.2500", "12.5%", "wall"]
    assert lines[4] == ""  # a blank line between roles
    assert lines[5].split() == ["draft", "(rank", "1)", "recv_wait", "0.5000", "2", "250.00"]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_timeline_writes_a_png(run_dir):
    spans = load_spans(run_dir)
    out = plot_timeline(spans, run_dir / "v2.png", item="v2", window=(0.0, 300.0))
    width, height = png_size(out)
    assert (width, height) == (1440, int(120 * (1.2 + 0.7 * 1)))  # 12 in wide, one lane (draft)
    assert out.stat().st_size > 5_000
    with pytest.raises(ValueError, match="nope"):
        plot_timeline(spans, run_dir / "x.png", item="nope")


def test_main_writes_timeline_and_breakdown(run_dir, capsys):
    assert timeline_command.main([str(run_dir)]) == 0
    width, height = png_size(run_dir / "timeline.png")
    assert width == 1440 and height == int(120 * (1.2 + 0.7 * 3))  # three lanes
    assert (run_dir / "timeline.png").stat().st_size > 10_000
    table = (run_dir / "breakdown.txt").read_text()
    out, err = capsys.readouterr()
    assert out.startswith(table)
    warning = f"[timeline 0] warning malformed_trace_lines skipped=3 run_dir={str(run_dir)!r}"
    assert err.splitlines() == [warning]
    assert "pruner (rank 2)" in table and "= idle" in table

    assert timeline_command.main([str(run_dir), "--item", "v2", "--out", str(run_dir / "v2.png")]) == 0
    assert png_size(run_dir / "v2.png")[0] == 1440
    assert timeline_command.main([str(run_dir), "--item", "nope"]) == 1
    assert timeline_command.main([str(run_dir / "empty")]) == 1


def test_chrome_trace_has_one_lane_per_role_and_every_span(run_dir):
    assert timeline_command.main([str(run_dir)]) == 0
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "target (rank 0)", 1: "draft (rank 1)", 2: "pruner (rank 2)"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len([s for s in timeline.load_spans(run_dir) if s.kind == "span"])
    # Times in microseconds from the first span (the target's video_read at -0.25 s).
    verify = next(e for e in spans if e["name"] == "verify" and e["args"].get("round") == 1)
    assert (verify["pid"], verify["ts"], verify["dur"]) == (0, 2.0e6, 0.25e6)
    assert verify["args"]["item"] == "v1"
    rollback = next(e for e in events if e["name"] == "rollback")
    assert rollback["ph"] == "i" and rollback["ts"] == 1.75e6 and rollback["args"]["epoch"] == 1


def event_line(role, rank, event, at, **fields):
    """An info event as structlog writes it (no t0: its time is `t`)."""
    return json.dumps({"event": event, "level": "info", "role": role, "rank": rank, "t": T + at, **fields})


@pytest.fixture
def batch_dir(tmp_path) -> Path:
    """A batched run's traces: items a and b in flight together; verify rounds carry [a], [a, b], [b]."""
    traces = tmp_path / "traces"
    traces.mkdir()
    target = [
        span_line("target", 0, "prefill", 0.0, 0.5, item="a"),
        event_line("target", 0, "item_admitted", 0.5, item="a", in_flight=1),
        span_line("target", 0, "verify", 0.5, 0.25, round=0, items=["a"], rows=5),
        span_line("target", 0, "prefill", 0.75, 0.25, item="b"),
        event_line("target", 0, "item_admitted", 1.0, item="b", in_flight=2),
        span_line("target", 0, "verify", 1.0, 0.25, round=1, items=["a", "b"], rows=5),
        event_line("target", 0, "item_done", 1.25, item="a", tokens=8, error=None),
        span_line("target", 0, "verify", 1.25, 0.25, round=2, items=["b"], rows=5),
        span_line("target", 0, "send", 1.5, 0.25),  # of no item, carried by no forward
        event_line("target", 0, "item_done", 1.75, item="b", tokens=8, error=None),
    ]
    draft = [
        span_line("draft", 1, "draft_step", 0.5, 0.125, items=["a"], rows=1),
        span_line("draft", 1, "draft_step", 1.0, 0.125, items=["a", "b"], rows=2),
        mark_line("draft", 1, "rollback", 1.125, item="b", epoch=1),
    ]
    (traces / "rank0_target.jsonl").write_text("\n".join(target) + "\n")
    (traces / "rank1_draft.jsonl").write_text("\n".join(draft) + "\n")
    return tmp_path


def test_item_tracks_show_which_rows_each_batched_forward_carried(batch_dir):
    spans = load_spans(batch_dir)
    lifecycle = [(s.name, s.item, s.t0 - T) for s in spans if s.name in timeline.LIFECYCLE]
    assert lifecycle == [("item_admitted", "a", 0.5), ("item_admitted", "b", 1.0), ("item_done", "a", 1.25),
                         ("item_done", "b", 1.75)]
    assert all(s.kind == "mark" and s.dur == 0.0 for s in spans if s.name in timeline.LIFECYCLE)
    a, b = timeline_plot.item_tracks(spans)
    assert (a.item, a.joined - T, a.left - T) == ("a", 0.5, 1.25)
    assert (b.item, b.joined - T, b.left - T) == ("b", 1.0, 1.75)
    assert [(s.name, s.round) for s in a.carried_by] == [("verify", 0), ("draft_step", None), ("verify", 1),
                                                          ("draft_step", None)]
    assert [(s.name, s.round) for s in b.carried_by] == [("verify", 1), ("draft_step", None), ("verify", 2)]
    assert [s.name for s in a.own] == ["prefill"] and [s.name for s in b.marks] == ["rollback"]
    # One item's view keeps the forwards that carried it and leaves out the ones that did not.
    rounds = [s.round for s in timeline.item_spans(spans, "a") if s.name == "verify"]
    assert rounds == [0, 1]
    assert "send" not in {s.name for s in timeline.item_spans(spans, "a")}  # after a's time
    assert "send" in {s.name for s in timeline.item_spans(spans, "b")}


def test_a_batched_run_is_plotted_whole(batch_dir, capsys):
    spans = load_spans(batch_dir)
    out = timeline_plot.plot_batch_timeline(spans, batch_dir / "b.png")
    # two role lanes and two item lanes
    width, height = png_size(out)
    assert width == 1440 and abs(height - 120 * (1.4 + 0.6 * 2 + 0.22 * 2)) <= 1
    assert timeline_command.main([str(batch_dir)]) == 0  # the default plot of a batched run
    assert png_size(batch_dir / "timeline.png") == png_size(out)
    assert timeline_command.main([str(batch_dir), "--item", "b"]) == 0  # one item's view, on request
    width, height = png_size(batch_dir / "timeline.png")
    assert width == 1440 and abs(height - 120 * (1.2 + 0.7 * 2)) <= 1
    capsys.readouterr()


def test_spans_written_directly_match_structlog_lines_and_follow_reconfiguration(tmp_path):
    """Spans and marks skip structlog's chain when writing to a trace file (vpsd.tracing's fast path):
    the same keys in the same order as the chain writes; captured like any event under capture_logs."""
    configure_tracing(tmp_path, "draft", 1)
    with span("draft_step", item="a", pos=np.int64(3)) as fields:
        fields["accepted"] = np.float32(0.5)
    mark("rollback", item="a", epoch=2)
    get_logger().debug("span", name="draft_step", t0=1.0, dur=0.5, item="a", pos=3)  # through the chain
    with capture_logs() as logs:
        with span("verify", item="a"):
            pass
    direct, marked, chained = read_lines(trace_path(tmp_path, "draft", 1))
    assert list(direct) == list(chained) + ["accepted"]
    assert (direct["pos"], direct["accepted"], direct["level"], direct["role"], direct["rank"]) == (3, 0.5, "debug", "draft", 1)
    assert list(marked) == ["event", "level", "role", "rank", "t", "name", "t0", "item", "epoch"]
    assert [(e["event"], e["name"]) for e in logs] == [("span", "verify")]

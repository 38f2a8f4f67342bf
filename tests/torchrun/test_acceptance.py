"""Acceptance per round read back from traces: hand-made spans, and a real torchrun run whose per-round
counts must add up to the tokens its results report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun_jobs import assert_trace_rounds_add_up, run_job, world_manifest
from vpsd.reports import acceptance
from vpsd.reports.acceptance import Round, rounds_from_spans, summarize
from vpsd.reports.timeline import Span
from vpsd.tracing import close_tracing

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_structlog():
    yield
    close_tracing()


def verify(t0: float, drafted: int, accepted: int | None, item: str | None = "a", rank: int = 0, **fields) -> Span:
    more = {"drafted": drafted, **({} if accepted is None else {"accepted": accepted}), **fields}
    return Span("target", rank, "verify", t0, 0.5, item=item, fields=more)


def test_rounds_from_spans_groups_by_item_and_attributes_serial_spans():
    spans = [
        # parallel: items on the spans, listed out of time order
        verify(2.0, 4, 1, mode="optimistic", start=4),
        verify(1.0, 4, 4, mode="optimistic", start=0),
        verify(3.0, 1, 1, mode="conservative", start=6),
        verify(3.5, 4, None),  # an older trace without `accepted`: skipped
        # serial: no item on verify spans; the enclosing item span on the same rank decides
        Span("target", 5, "item", 10.0, 4.0, item="s"),
        verify(11.0, 3, 2, item=None, rank=5),
        verify(12.0, 3, 3, item=None, rank=5),
        verify(11.0, 3, 0, item=None, rank=6),  # a rank without item spans: nothing to attribute it to
        Span("target", 0, "prefill", 0.0, 1.0, item="a"),  # not a verify span
    ]
    by_item = rounds_from_spans(spans)
    assert by_item == {
        "a": [Round("a", 0, 4, 4, "optimistic", 0), Round("a", 1, 4, 1, "optimistic", 4),
              Round("a", 2, 1, 1, "conservative", 6)],
        "s": [Round("s", 0, 3, 2), Round("s", 1, 3, 3)],
    }
    assert [r.rejected for r in by_item["a"]] == [False, True, False]


def test_summarize_by_hand():
    rounds = [Round("a", 0, 4, 4), Round("a", 1, 4, 1), Round("a", 2, 1, 1, "conservative"), Round("b", 0, 2, 0)]
    s = summarize(rounds)
    assert (s.items, s.rounds, s.rollbacks, s.conservative_rounds) == (2, 4, 2, 1)
    assert s.mean_accepted_tokens == (4 + 1 + 1 + 0 + 4) / 4
    assert s.acceptance_rate == 6 / 11
    assert s.histogram == {0: 1, 1: 2, 4: 1}
    # position 1: drafted by all 4 rounds, accepted by 3; position 2: drafted by 3, accepted by 1;
    # positions 3 and 4: drafted by the two 4-token rounds, accepted by one
    assert s.per_position == [3 / 4, 1 / 3, 1 / 2, 1 / 2]
    assert "rounds 4  MAT 2.50  acceptance 54.5%  rollbacks 2  conservative rounds 1\n" in s.format()
    # The rounds of an item decoded plain (none verified a draft) are counted apart: as accepted-length-0 rounds
    # they would read as rejections at the first position. A drafted item's round without a draft stays in.
    plain = summarize(rounds + [Round("c", 0, 0, 0), Round("c", 1, 0, 0)])
    assert (plain.items, plain.plain_rounds, plain.plain_items) == (3, 2, 1)
    assert {k: v for k, v in vars(plain).items() if not k.startswith("plain") and k != "items"} == \
        {k: v for k, v in vars(s).items() if not k.startswith("plain") and k != "items"}
    assert "conservative rounds 1  (besides: 1 item(s) decoded plain, 2 rounds)" in plain.format()
    assert summarize(rounds + [Round("b", 1, 0, 0)]).rounds == 5  # b's last round, cut at max_new_tokens


def write_trace(run_dir: Path, spans: list[Span]) -> None:
    (run_dir / "traces").mkdir(parents=True)
    lines = [json.dumps({"event": "span", "role": s.role, "rank": s.rank, "name": s.name, "t0": s.t0, "dur": s.dur,
                         **({} if s.item is None else {"item": s.item}), **s.fields}) for s in spans]
    (run_dir / "traces" / "rank0_target.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "config.json").write_text(json.dumps({"args": {}, "config": {"decoding": {"gamma": 4}}}))


def test_main_writes_png_and_prints_summary(tmp_path, capsys):
    write_trace(tmp_path, [verify(1.0, 4, 4, mode="optimistic"), verify(2.0, 4, 2, mode="optimistic"),
                           verify(3.0, 1, 0, mode="conservative"), verify(4.0, 4, 3, item="b")])
    assert acceptance.run_gamma(tmp_path) == 4
    assert acceptance.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "items 2  rounds 4  MAT 3.25  acceptance 69.2%  rollbacks 3  conservative rounds 1" in out
    assert (tmp_path / "acceptance.png").read_bytes().startswith(PNG_SIGNATURE)

    png = tmp_path / "b.png"
    assert acceptance.main([str(tmp_path), "--item", "b", "--out", str(png)]) == 0
    assert "items 1  rounds 1  MAT 4.00" in capsys.readouterr().out
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert acceptance.main([str(tmp_path), "--item", "nope"]) == 1


# --- a real run ----------------------------------------------------------------------------------------


# Self-speculation on pruned video: a draft that accepts some tokens and rejects others, so both paths run.
# A batch's verify spans carry one entry per row (`items`, and lists in its order): the same rounds, read back per
# item. The pipelined batch commits as the parallel target does, the serial batch as batch-1 sd does.
PEARL = ["--gamma", "3", "--pruning", "temporal", "--ratio", "0.9", "--set", "draft=self"]
SD = ["--pruning", "uniform", "--ratio", "0.5", "--set", "draft=self"]


@pytest.mark.torchrun
@pytest.mark.parametrize("method,extra", [
    pytest.param("pearl", PEARL, marks=pytest.mark.slow),  # one commit path serves all four
    pytest.param("sd", SD, marks=pytest.mark.slow),
    # CI: test_batch_torchrun's pipelined batch of pearl is held to the same (assert_trace_rounds_add_up)
    pytest.param("pearl", PEARL + ["--batch", "3", "--set", "batching.pipelined=true"], marks=pytest.mark.slow),
    pytest.param("sd", SD + ["--batch", "3"], marks=pytest.mark.slow),
], ids=["pearl", "sd", "pearl-pipelined-batch", "sd-batch"])
def test_trace_rounds_add_up_to_the_committed_tokens(tmp_path_factory, method, extra):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp(f"acceptance-{method}")
    proc = run_job("tiny_qwen2_5_vl.yaml", manifest, out, method, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trace_rounds_add_up(out, method, max_new=24)  # world_manifest's max_new_tokens
    assert acceptance.main([str(out)]) == 0
    assert (out / "acceptance.png").read_bytes().startswith(PNG_SIGNATURE)

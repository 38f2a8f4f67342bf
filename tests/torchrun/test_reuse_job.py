"""One video, many questions through real torchrun jobs (engine/prefix_cache.py): three questions about one video,
prefilled as one prefix (system + video) and three suffixes. `ar` with reuse equals `ar` without it and hippo
with it, whose signals come from the suffix's forward, so it reuses too, and whose draft rank keeps its vision
features; pearl, whose draft is shown all of the video, whose draft rank keeps its own video prefix too; the traces
and summary.json say what was reused."""

from __future__ import annotations

import json

import pytest

from tests.torchrun_jobs import ROOT, results, run_job

pytestmark = pytest.mark.torchrun

CONFIG = "world_qwen2_5_vl.yaml"  # the small world pair
VIDEO = ROOT / "examples" / "world" / "videos" / "world-001000.mp4"
PROMPTS = ["Describe the video.", "What happens in this video?", "Which objects are there?"]


def reuse_events(out) -> list[dict]:
    lines = (out / "traces" / "rank0_target.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "prefix_reuse"]


def test_three_questions_about_one_video_prefill_it_once_and_decode_as_ar(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"q{i}", "video": str(VIDEO), "prompt": p, "max_new_tokens": 16})
                                + "\n" for i, p in enumerate(PROMPTS)))
    outs = {}
    for name, method, more, nproc in (("ar", "ar", [], 1), ("ar_off", "ar", ["--set", "reuse.enabled=false"], 1),
                                      ("hippo", "hippo", [], 3), ("pearl", "pearl", [], 3)):
        outs[name] = tmp_path / name
        proc = run_job(CONFIG, manifest, outs[name], method, "--quiet", *more, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = {name: {k: r["token_ids"] for k, r in results(out).items()} for name, out in outs.items()}
    assert len(tokens["ar"]) == 3 and all(r.get("error") is None for r in results(outs["hippo"]).values())
    assert tokens["ar"] == tokens["ar_off"]  # float32 here: no near-tie on these items
    assert tokens["hippo"] == tokens["ar"]

    events = reuse_events(outs["ar"])
    assert [e["hit"] for e in events] == [False, True, True]
    assert events[1]["vision"] == "skipped" and events[1]["reused_tokens"] > 64  # the video's tokens and more
    summary = json.loads((outs["ar"] / "summary.json").read_text())
    reuse = summary["run"]["reuse"]
    assert (reuse["hits"], reuse["misses"]) == (2, 1) and 0 < reuse["peak_bytes"] <= reuse["budget_bytes"]
    assert reuse["pixel_hits"] == 2  # the video's pixels prepared and hashed once (models/pixel_memo.py)
    assert json.loads((outs["ar_off"] / "summary.json").read_text())["run"]["reuse"] is None
    # hippo's drafted items read the target's attention from the suffix's forward: they reuse as `ar`'s do
    events = reuse_events(outs["hippo"])
    assert [(e["reuse"], e["hit"]) for e in events] == [(True, False), (True, True), (True, True)]
    assert events[1]["reused_tokens"] == events[2]["reused_tokens"] > 64 and events[1]["vision"] != "skipped"
    reuse = json.loads((outs["hippo"] / "summary.json").read_text())["run"]["reuse"]
    assert (reuse["hits"], reuse["misses"], reuse["skipped"], reuse["pixel_hits"]) == (2, 1, 0, 2)
    # the draft rank runs its vision tower once for the video, not once a question (roles/draft.py)
    lines = (outs["hippo"] / "traces" / "rank1_draft.jsonl").read_text().splitlines()
    draft = [e for e in map(json.loads, lines) if e.get("event") == "draft_vision_reuse"]
    assert [e["vision"] for e in draft] == ["computed", "cached", "cached"], draft
    assert not any(e["prefix_hit"] for e in draft)  # pruned per question: only the features are reused
    # pearl's draft is shown all of the video: its own video prefix is prefilled once and reused
    assert {k: r["token_ids"] for k, r in results(outs["pearl"]).items()} == tokens["ar"]
    lines = (outs["pearl"] / "traces" / "rank1_draft.jsonl").read_text().splitlines()
    draft = [e for e in map(json.loads, lines) if e.get("event") == "prefix_reuse"]
    assert [e["hit"] for e in draft] == [False, True, True] and draft[1]["reused_tokens"] > 64, draft

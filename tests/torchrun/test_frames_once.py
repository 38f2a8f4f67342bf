"""Each video decoded once per pipeline, through real torchrun ranks: the target's process reads the frames (on its
reader pool, vpsd/video/pool.py) and sends the draft rank the very frames it read (`video.share_frames`,
roles/frames_wire.py), so the draft's trace holds no `video_read` and one `frames_received` per item, and the
outputs are `ar`'s. With `video.share_frames: false` the draft reads every video itself, as before, to the same
outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun_jobs import ar_reference, results, run_job, world_manifest

pytestmark = pytest.mark.torchrun


def trace(out: Path, rank_role: str) -> list[dict]:
    return [json.loads(line) for line in (out / "traces" / f"{rank_role}.jsonl").read_text().splitlines()]


def named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e.get("event") == "span" and e.get("name") == name]


@pytest.mark.parametrize("share", [True, False], ids=["frames-sent", "draft-reads"])
def test_the_draft_rank_decodes_no_video_the_target_read(tmp_path_factory, share):
    manifest = world_manifest(str(tmp_path_factory.getbasetemp()), count=3)
    out = tmp_path_factory.mktemp("frames-sent" if share else "draft-reads")
    proc = run_job("tiny_qwen2_5_vl.yaml", manifest, out, "hippo", "--quiet",
                   *([] if share else ["--set", "video.share_frames=false"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results(out)
    assert {k: r["token_ids"] for k, r in got.items()} == ar_reference("qwen2_5_vl", manifest)
    target, draft = trace(out, "rank0_target"), trace(out, "rank1_draft")
    assert {e["item"] for e in named(target, "video_read")} == set(got)  # the target read each video once...
    assert len(named(target, "video_read")) == len(got)
    frames = {e["item"]: e for e in draft if e.get("event") == "draft_frames"}
    assert set(frames) == set(got)
    if share:  # ...and the draft decoded none of them: it took the target's
        assert named(draft, "video_read") == []
        received = {e["item"]: e for e in named(draft, "frames_received")}
        assert set(received) == set(got)
        assert all(received[k]["frames"] == got[k]["stats"]["num_frames"] for k in got)
        assert all(e["source"] == "target" and e["video_read_s"] == 0.0 for e in frames.values())
    else:
        assert {e["item"] for e in named(draft, "video_read")} == set(got)
        assert named(draft, "frames_received") == []
        assert all(e["source"] == "file" and e["video_read_s"] > 0 for e in frames.values())

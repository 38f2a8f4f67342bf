"""A manifest whose lines hold conversations (`messages`) runs as a job: each item's tokens are `ar`'s over the
conversation as the checkpoint's chat template renders it (the embedded world pair carries its template), decoded
here in the test's process; a one-user-turn conversation is the plain prompt's item, token for token."""

from __future__ import annotations

import json

from tests.torchrun_jobs import ROOT, results, run_job
from vpsd.config import DecodingConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.launch.manifest import load_manifest
from vpsd.models.registry import load_adapter
from vpsd.video.item import load_item_frames

CONFIG = "world_qwen2_5_vl.yaml"
VIDEOS = ROOT / "examples" / "world" / "videos"


def test_a_manifest_of_conversations_decodes_as_ar_over_their_rendering(tmp_path):
    video = str(VIDEOS / "world-001001.mp4")
    rows = [{"id": "chat", "video": video, "max_new_tokens": 16, "messages": [
                {"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens in this video?"}]},
                {"role": "assistant", "content": "there is one object."},
                {"role": "user", "content": "What color is it?"}]},
            {"id": "one-turn", "video": video, "max_new_tokens": 16,
             "messages": [{"role": "user", "content": "What happens in this video?"}]},
            {"id": "plain", "video": video, "max_new_tokens": 16, "prompt": "What happens in this video?"}]
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = run_job(CONFIG, manifest, out, "ar", "--quiet", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results(out)
    assert all(r.get("error") is None for r in got.values()), got

    cfg = load_config(ROOT / "configs" / CONFIG)
    target = load_adapter(cfg.family, cfg.target)
    items, problems = load_manifest(manifest)
    assert not problems
    for it in items:
        frames, times = load_item_frames(it.video, cfg.video.num_frames, None, cfg.video.max_side)
        ref = decode_ar(target, frames, it.prompt, DecodingConfig(max_new_tokens=it.max_new_tokens), times)
        assert got[it.id]["token_ids"] == ref.token_ids, it.id
    assert got["one-turn"]["token_ids"] == got["plain"]["token_ids"]
    assert got["chat"]["token_ids"] != got["plain"]["token_ids"]  # the conversation is what it answered

"""Two held-out long-world items (1152 video tokens each: a question and a time-stamped caption) through real
torchrun with the long pair: hippo with both items in flight and pearl with one decode exactly what `ar` decodes.
(Every method at both batch sizes is held to `ar` on the short world; these two check the long pair's path.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.media import long_items
from tests.torchrun_jobs import ROOT
from tests.torchrun_jobs import results, run_job
from vpsd.config import load_config
from vpsd.decoders.ar import decode_ar
from vpsd.models.registry import load_adapter
from vpsd.video.item import load_item_frames

CONFIG = "world_long_qwen2_5_vl.yaml"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return long_items(tmp_path_factory.mktemp("long-items"), max_new_tokens=48)


def _reference(manifest, overrides: dict | None = None) -> dict[str, list[int]]:
    """The reference decoder in this process (decoders/ar.py, greedy as the config says), not another launch."""
    cfg = load_config(ROOT / "configs" / CONFIG, overrides)
    target = load_adapter(cfg.family, cfg.target)
    out = {}
    for item in (json.loads(line) for line in manifest.read_text().splitlines()):
        frames, times = load_item_frames(manifest.parent / item["video"], cfg.video.num_frames, cfg.video.fps,
                                         cfg.video.max_side)
        out[item["id"]] = decode_ar(target, frames, item["prompt"],
                                    replace(cfg.decoding, max_new_tokens=item["max_new_tokens"]), times).token_ids
    return out


@pytest.fixture(scope="module")
def reference(manifest):
    return _reference(manifest)


@pytest.mark.parametrize("method,batch", [("hippo", 2), pytest.param("pearl", 1, marks=pytest.mark.slow)])
def test_long_items_decode_as_ar_does(tmp_path, manifest, reference, method, batch):
    proc = run_job(CONFIG, manifest, tmp_path / "out", method, "--quiet", "--batch", str(batch), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results(tmp_path / "out")
    assert set(got) == set(reference) and len(got) == 2
    for item, row in got.items():
        assert row["error"] is None and row["token_ids"] == reference[item], item
        assert row["stats"]["num_kept"] is not None  # drafted, not decoded plain
    if method == "hippo":  # 10% of the video went to the draft
        assert all(row["stats"]["num_kept"] < 0.2 * 1152 for row in got.values())


def test_long_items_decode_as_ar_does_in_bfloat16(tmp_path, manifest):
    """The pair in bf16 through the 3 ranks (issue 60: its float32 sub-configs once built float32 layers under a
    bf16 lm_head, and every bf16 job died at its first prefill). exact_verify: the target verifies with `ar`'s
    one-token forwards, so the outputs are `ar`'s bit for bit in bf16 too, near-ties included."""
    bf16 = {"target.dtype": "bfloat16", "draft.dtype": "bfloat16", "decoding.exact_verify": True}
    reference = _reference(manifest, bf16)
    sets = [arg for key, value in bf16.items() for arg in ("--set", f"{key}={str(value).lower()}")]
    proc = run_job(CONFIG, manifest, tmp_path / "out", "hippo", "--quiet", *sets, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results(tmp_path / "out")
    assert set(got) == set(reference)
    for item, row in got.items():
        assert row["error"] is None and row["token_ids"] == reference[item], item
        assert row["stats"]["mean_accepted_tokens"] > 1, row["stats"]  # drafted and accepted, not decoded plain

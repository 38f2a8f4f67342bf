"""Streaming prefill signals through real torchrun: the kept indices reach the draft while the target still prefills.

The target's prefill is held for STALL_S seconds at the point right after its signals left (a test hook,
VPSD_TEST_SLOW=target:signals-sent:1:<s>, vpsd/activity.py), with the pruner reading only its first 2 layers.
Pruning, the kept indices' transfer and the start of the draft's pruned prefill must all land inside that window:
they can only if the signals left from inside the prefill, and a window of seconds makes the order a property of
the protocol, not a race (a 96-layer target's real compute, ~1 s, still lost it to a loaded CI machine). The order
is read back from the ranks' traces (vpsd.tracing spans; all ranks run on this host, so their clocks agree).
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun_jobs import ROOT, results, run_job
from vpsd.config import DecodingConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.reports.kept_log import read_kept
from vpsd.launch.manifest import load_manifest
from vpsd.reports.timeline import load_spans
from vpsd.models.registry import load_adapter
from vpsd.video.item import load_item_frames
from vpsd.world.dataset import write_manifest

pytestmark = pytest.mark.torchrun

SETS = {"pruning.layers": 2, "video.num_frames": 16, "video.max_side": 224}
STALL_S = 5.0


def _span(spans, role: str, name: str, item: str, **fields):
    found = [s for s in spans if s.role == role and s.name == name and s.item == item
             and all(s.fields.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, f"{role}/{name} {item} {fields}: {len(found)} spans"
    return found[0]


@pytest.mark.parametrize("method", ["hippo"])  # parallelvlm streams the same way (test_pipeline_torchrun runs it)
def test_keep_reaches_the_draft_before_the_target_prefill_ends(tmp_path, method):
    manifest = write_manifest(tmp_path / "data", seeds=[3], num_frames=16, size=(224, 224), max_new_tokens=8)
    out = tmp_path / "run"
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    proc = run_job("tiny_qwen2_5_vl.yaml", manifest, out, method, *sets, timeout=300,
                   env_extra={"VPSD_TEST_SLOW": f"target:signals-sent:1:{STALL_S}"})
    assert proc.returncode == 0, proc.stderr[-3000:]

    spans = load_spans(out)
    item = next(iter(results(out)))
    prefill = _span(spans, "target", "prefill", item=item)
    prefill_end = prefill.t1
    signals = _span(spans, "target", "send", item=item, what="signals")
    prune = _span(spans, "pruner", "prune", item=item)
    keep = _span(spans, "pruner", "send", item=item, what="keep")
    draft_prefill = _span(spans, "draft", "prefill", item=item)
    # The signals left from inside the target's prefill, not after it, and the prefill was held there ...
    assert prefill.t0 < signals.t0 and signals.t1 < prefill_end
    assert prefill_end - signals.t1 >= STALL_S
    # ... so pruning, the transfer of the kept indices and the start of the draft's pruned prefill all
    # happened while the target was still running its later layers.
    assert prune.t1 < prefill_end
    assert keep.t1 < prefill_end
    assert draft_prefill.t0 < prefill_end

    # Still lossless, and the parallel path reports what it kept.
    row = results(out)[item]
    cfg = load_config(ROOT / "configs" / "tiny_qwen2_5_vl.yaml", SETS)
    target = load_adapter(cfg.family, cfg.target)
    it = load_manifest(manifest)[0][0]
    frames, times = load_item_frames(it.video, cfg.video.num_frames, None, cfg.video.max_side)
    ref = decode_ar(target, frames, it.prompt, DecodingConfig(max_new_tokens=8), times)
    assert row["token_ids"] == ref.token_ids
    assert row["strategy"] == {"parallelvlm": "uv", "hippo": "hippo"}[method]
    (record,) = read_kept(out)
    assert record.strategy == row["strategy"] and record.item_id == item
    assert row["stats"]["num_kept"] == record.kept.numel() == record.layout.budget(0.9)
    assert json.loads((out / "config.json").read_text())["config"]["pruning"]["layers"] == 2

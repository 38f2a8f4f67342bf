"""Two held-out long-world items (1152 video tokens each: a question and a time-stamped caption) through real
torchrun with the long pair: hippo with both items in flight and pearl with one decode exactly what `ar` decodes.
(Every method at both batch sizes is held to `ar` on the short world; these two check the long pair's path.)"""

from __future__ import annotations

import pytest

from tests.test_world_long_pair import long_items
from tests.torchrun_jobs import results, run_job

CONFIG = "world_long_qwen2_5_vl.yaml"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return long_items(tmp_path_factory.mktemp("long-items"), max_new_tokens=48)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, manifest):
    out = tmp_path_factory.mktemp("long-ar")
    proc = run_job(CONFIG, manifest, out, "ar", "--quiet", nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {k: r["token_ids"] for k, r in results(out).items()}


@pytest.mark.parametrize("method,batch", [("hippo", 2), ("pearl", 1)])
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

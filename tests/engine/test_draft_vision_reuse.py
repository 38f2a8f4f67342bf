"""One video, many questions on the draft's side (engine/prefix_cache.py `draft_embed`): a drafted request whose
target reuses its video prefix keeps the draft model's vision features too, in the draft model's own cache, so
the draft's vision tower runs once a video; its pruned prefill still runs per question (what the pruner keeps
depends on the question). Outputs stay `ar`'s with reuse, token for token."""

from __future__ import annotations

from tests.conftest import random_frames, tiny_pair
from tests.engine.test_prefix_reuse import engine, questions, tokens
from tests.engine_harness import run
from vpsd.engine.prefix_cache import reuse_for


def test_a_serial_drafts_vision_runs_once_a_video_and_outputs_stay_ars():
    family = "qwen2_5_vl"
    _, draft = tiny_pair(family)
    todo = questions(random_frames(11, t=4))
    ar_e, ar_s = engine(family)
    want = tokens(run(ar_s, questions(random_frames(11, t=4))))
    e, s = engine(family, "specvlm")
    kept = reuse_for(draft, e.cfg.reuse.draft_budget_bytes).cache
    kept.reset()
    got = tokens(run(s, todo))
    assert got == want
    stats = kept.stats()
    assert (stats["vision_misses"], stats["vision_hits"]) == (1, 2), stats
    assert 0 < stats["bytes"] <= stats["budget_bytes"] == e.cfg.reuse.budget_bytes // 4

"""The long-video pair (checkpoints/world_long_qwen2_5_vl): small, loads through its config, reads held-out long
videos (a time-stamped caption and a question about one moment), and its draft agrees with it with all of the
video and with 10% of it, losslessly. Floors catch a broken checkpoint, loader or preprocessing; the quality
itself is measured on 100 held-out items (docs/worlds.md, python -m training.evaluate --kind long: the target
states 85% of scenes right and 47% word accuracy, a blind one 0% and 1%; MAT 2.5 at worst over 75 captions)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from training.evaluate_long import scores
from vpsd.config import PruningConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.sd import decode_sd
from vpsd.models.registry import load_adapter, load_draft
from vpsd.video.item import load_item_frames
from vpsd.world.dataset import LONG_HELD_OUT_FROM

from tests.media import SHORT_LONG_SEEDS, long_items

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "world_long_qwen2_5_vl.yaml"
@pytest.fixture(scope="module")
def pair():
    cfg = load_config(CONFIG)
    target = load_adapter(cfg.family, cfg.target)
    return cfg, target, load_draft(cfg.family, cfg.draft, target)


def test_every_shipped_checkpoint_fits_in_50_mb_and_the_pair_shares_one_tokenizer(pair):
    _, target, draft = pair
    size = sum(f.stat().st_size for f in (ROOT / "checkpoints").rglob("*") if f.is_file() and ".grown-" not in str(f)
               and "resume" not in f.parts and "distill" not in f.parts)
    assert size <= 50 * 2**20, size
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert min(SHORT_LONG_SEEDS) >= LONG_HELD_OUT_FROM


def test_the_long_pair_reads_held_out_videos_and_its_draft_agrees_pruned_or_not(pair, tmp_path):
    cfg, target, draft = pair
    manifest = long_items(tmp_path)
    for item in (json.loads(line) for line in manifest.read_text().splitlines()):
        frames, times = load_item_frames(tmp_path / item["video"], cfg.video.num_frames, cfg.video.fps, None)
        assert frames.shape[0] == 72
        dec = replace(cfg.decoding, temperature=0.0, max_new_tokens=item["max_new_tokens"])
        ar = decode_ar(target, frames, item["prompt"], dec, times)
        text = target.tokenizer.decode(ar.token_ids, skip_special_tokens=True).strip()
        got = scores(item["kind"], text, item["reference"])
        if item["kind"] == "caption":  # the scene, read from the video (blind: 0% of held-out scenes right)
            assert text.split(".")[0] == item["reference"].split(".")[0], (text, item["reference"])
            assert got["word_accuracy"] >= 0.4, (text, item["reference"])
        for pruning in (PruningConfig(strategy="none", ratio=0.0), cfg.pruning):
            sd = decode_sd(target, draft, frames, item["prompt"], dec, keep_policy_for(pruning, target.family), pruning,
                           times)
            assert sd.token_ids == ar.token_ids
            if item["kind"] == "caption":
                assert sd.stats.mean_accepted_tokens >= 2.0, (pruning.strategy, sd.stats.mean_accepted_tokens)

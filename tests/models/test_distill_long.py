"""The long pair's distillation stage (training/distill_long.py): its teacher is the target decoding as `ar` does,
its towers' shortcut is exact, and a step trains the draft alone, resumably, into a checkpoint that loads."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from training.distill_long import CONFIG, Clip, ClipStream, DistillConfig, distinct_groups_only, main, teacher
from vpsd.config import load_config
from vpsd.decoders.ar import decode_ar
from vpsd.models.registry import load_adapter
from vpsd.video.item import load_item_frames
from vpsd.world.dataset import write_long_manifest

ROOT = Path(__file__).resolve().parents[2]
SEED = 100019  # held out, 18 s: a question (a short answer keeps the test fast)


def test_the_teacher_is_ar_and_the_towers_shortcut_is_exact(tmp_path):
    cfg = load_config(ROOT / CONFIG)
    target = load_adapter(cfg.family, cfg.target)
    item = json.loads(write_long_manifest(tmp_path, [SEED]).read_text().splitlines()[0])
    frames, times = load_item_frames(tmp_path / item["video"], cfg.video.num_frames, cfg.video.fps, None)
    with torch.inference_mode():
        inputs = target.prepare(frames, item["prompt"], times)
        full = target.embed(inputs)
        with distinct_groups_only(target.model):
            shortcut = target.embed(inputs)
    assert torch.equal(full.embeds, shortcut.embeds)  # stills: the tower ran on each distinct group once
    clip = Clip(SEED, shortcut, shortcut, item["max_new_tokens"])
    _, _, tokens, logits = teacher(target, clip, cfg.pruning)
    ar = decode_ar(target, frames, item["prompt"], replace(cfg.decoding, max_new_tokens=item["max_new_tokens"]), times)
    assert tokens == ar.token_ids and logits.shape == (len(tokens), logits.shape[1])
    assert logits.argmax(-1).tolist() == tokens


def test_a_step_trains_the_draft_alone_and_resumes(tmp_path, monkeypatch):
    pair = tmp_path / "pair"
    for name in ("target", "draft"):
        shutil.copytree(ROOT / "checkpoints" / "world_long_qwen2_5_vl" / name, pair / name)
    # One example a step, from a seed with a short answer (the stream's seeds are a function of the step).
    monkeypatch.setattr(ClipStream, "seed", lambda self, step, i: SEED)
    before = {n: (pair / n / "model.safetensors").read_bytes() for n in ("target", "draft")}
    main(["--out", str(pair), "--steps", "1", "--batch-size", "1", "--config", str(ROOT / CONFIG)])
    assert (pair / "target" / "model.safetensors").read_bytes() == before["target"]  # the target is not trained
    assert (pair / "draft" / "model.safetensors").read_bytes() != before["draft"]
    state = torch.load(pair / "distill" / "state.pt", weights_only=False)
    assert state["step"] == 1 and len(state["history"]) == 1 and state["history"][0]["kl"] >= 0
    cfg = load_config(ROOT / CONFIG, {"target.path": str(pair / "target"), "draft.path": str(pair / "draft")})
    assert load_adapter(cfg.family, cfg.draft).model.dtype == torch.float32  # loads like the shipped draft
    main(["--out", str(pair), "--steps", "2", "--batch-size", "1", "--config", str(ROOT / CONFIG)])  # resumes at 1
    assert torch.load(pair / "distill" / "state.pt", weights_only=False)["step"] == 2
    assert DistillConfig().keep_hippo + DistillConfig().keep_random + DistillConfig().keep_uniform < 1

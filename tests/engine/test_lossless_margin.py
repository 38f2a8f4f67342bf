"""Lossless comparisons that fail on real divergence, not on ties; and `exact_verify`,
which makes greedy speculation reproduce `ar` bit for bit (one-token verify forwards)."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from tests.conftest import ROOT, random_frames, tiny_pair
from vpsd.config import DecodingConfig, PruningConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.engine.keep import keep_policy_for
from vpsd.decoders.lossless import TIE_TOLERANCE, first_divergence, judge
from vpsd.decoders.sd import decode_sd
from vpsd.models.registry import load_adapter
from vpsd.video.item import load_item_frames

PROMPT = "What happens in this video?"
GREEDY = DecodingConfig(gamma=3, max_new_tokens=10, temperature=0.0)
WORLD = ROOT / "configs" / "world_qwen2_5_vl.yaml"


def test_a_tie_passes_and_a_real_divergence_fails():
    target = copy.deepcopy(tiny_pair("qwen2_5_vl")[0])
    frames = random_frames(2)
    first = decode_ar(target, frames, PROMPT, GREEDY).token_ids
    # Give a second token the lm_head row of the token ar picks at position 2: an exact top-2 tie there.
    chosen, twin = first[2], (first[2] + 1) % target.model.lm_head.weight.shape[0]
    with torch.no_grad():
        target.model.lm_head.weight[twin] = target.model.lm_head.weight[chosen]
    ar = decode_ar(target, frames, PROMPT, GREEDY).token_ids
    pos = next(i for i, t in enumerate(ar) if t in (chosen, twin))
    tied = ar[:pos] + [twin if ar[pos] == chosen else chosen]
    d = first_divergence(target, frames, PROMPT, ar, tied)
    assert d.position == pos and d.margin == 0.0
    assert judge(d, TIE_TOLERANCE[torch.float32])  # a flip at a tie is float noise's to decide
    # A wrong token where the target is sure fails: that is a real divergence.
    wrong = ar[:1] + [ar[1] + 1] + ar[2:]
    d = first_divergence(target, frames, PROMPT, ar, wrong)
    assert d.position == 1 and d.margin > TIE_TOLERANCE[torch.float32]
    assert not judge(d, TIE_TOLERANCE[torch.float32])
    assert first_divergence(target, frames, PROMPT, ar, list(ar)) is None and judge(None, 0.0)
    shorter = first_divergence(target, frames, PROMPT, ar, ar[:4])
    assert shorter.position == 4 and shorter.other_token is None


def test_exact_verify_reproduces_ar_rows_bit_for_bit_in_bf16():
    """On the world pair in bf16 a 16-token verify forward's rows differ from `ar`'s one-token rows (float noise:
    this CPU's kernels change path with the row count; a GPU's do at any count); with rowwise=True they are `ar`'s
    rows exactly, and exact_verify speculation at gamma 15 is `ar`'s output."""
    cfg = load_config(WORLD, {"target.dtype": "bfloat16", "draft.dtype": "bfloat16"})
    target, draft = load_adapter(cfg.family, cfg.target), load_adapter(cfg.family, cfg.draft)
    frames, times = load_item_frames(ROOT / "examples" / "world" / "videos" / "world-001000.mp4", 8, None, None)
    greedy = DecodingConfig(gamma=15, max_new_tokens=20, temperature=0.0)
    ar = decode_ar(target, frames, PROMPT, greedy, times)
    pre = target.prefill(target.embed(target.prepare(frames, PROMPT, times)))
    state, tokens = pre.state, torch.tensor(ar.token_ids[:16])
    batched = target.step(state, tokens)
    target.rollback(state, state.prefill_len)
    rows = target.step(state, tokens, rowwise=True)
    target.rollback(state, state.prefill_len)
    singles = torch.cat([target.step(state, tokens[i : i + 1]) for i in range(16)])
    assert not torch.equal(batched, singles)  # the noise exists here...
    assert torch.equal(rows, singles)  # ...and rowwise verify rows are ar's rows
    none = PruningConfig("none", 0.0)
    sd = decode_sd(target, draft, frames, PROMPT, replace(greedy, exact_verify=True), keep_policy_for(none), none,
                   times)
    assert sd.token_ids == ar.token_ids


def test_the_throughput_bench_judges_what_differs_by_the_targets_margin(tmp_path):
    """`vpsd bench` (bench/throughput.py) no longer stops at "6/8": each output that differs from batch-1 `ar`'s is
    judged where it first differs (launch/lossless.py judge_runs); a tie would count as "+N ties", a real
    divergence stays a failure and is named under the table. Nothing differs: the target is not even loaded."""
    import argparse

    from vpsd.launch.lossless import judge_runs
    from vpsd.bench.throughput import Cell, judge_differences, summarize_cells
    from pathlib import Path

    manifest = ROOT / "examples" / "world" / "manifest.jsonl"
    cfg = load_config(WORLD)
    target = load_adapter(cfg.family, cfg.target)
    item = __import__("json").loads(manifest.read_text().splitlines()[0])
    frames, times = load_item_frames(ROOT / "examples" / "world" / item["video"], 8, None, None)
    ar = decode_ar(target, frames, item["prompt"], replace(GREEDY, max_new_tokens=8), times).token_ids
    wrong = ar[:2] + [ar[2] + 1] + ar[3:]

    nowhere = load_config(WORLD, {"target.path": str(tmp_path / "absent")})  # would fail to load
    assert judge_runs(nowhere, manifest, {item["id"]: ar}, {"ar B=8": {item["id"]: list(ar)}}) == ({"ar B=8": []}, 0.0)
    found, tolerance = judge_runs(cfg, manifest, {item["id"]: ar}, {"hippo B=8": {item["id"]: wrong}})
    (diff,) = found["hippo B=8"]
    assert (diff.divergence.position, diff.divergence.other_token, diff.tie) == (2, ar[2] + 1, False)
    assert tolerance == TIE_TOLERANCE[torch.float32] and "REAL DIVERGENCE" in diff.describe()

    def job(path: Path, tokens: list[int]) -> Path:  # what a cell's job writes: its results
        path.mkdir(parents=True)
        (path / "results.jsonl").write_text(__import__("json").dumps(
            {"id": item["id"], "token_ids": tokens, "error": None}) + "\n")
        return path

    def cell(outputs):
        return Cell(1, 0, 100.0, 10.0, 1.0, 1.0, None, None, outputs, 0.1)

    ref = {item["id"]: ar}
    cells = {("ar", 1): [cell(ref)], ("hippo", 8): [cell({item["id"]: wrong})]}
    rows = [summarize_cells(m, b, cells[m, b], cells["ar", 1], cells["ar", 1], ref, 2) for m, b in cells]
    dirs = {("ar", 1): job(tmp_path / "ar_b1" / "r1", ar), ("hippo", 8): job(tmp_path / "hippo_b8" / "r1", wrong)}
    bench = argparse.Namespace(config=str(WORLD), set=[], out=tmp_path)
    notes = judge_differences(bench, manifest, rows, dirs["ar", 1], dirs)
    assert [r.ties for r in rows] == [0, 0] and rows[1].same == "0/1"
    assert notes[0].startswith("differences from batch-1 ar") and "hippo B=8 " + diff.describe() in notes[1]

"""The memory plan (models/shapes.py, models/memory_plan.py, launch/memory.py): parameter counts read from configs
alone equal the real models' (built on the meta device: every family's tiny configs, the shipped checkpoints,
grown ones, the 72B-shaped target); a layout too big for its devices is refused with one line before any weight
loads (no scale model is even grown); `vpsd plan` prints the 72B-shaped pair's layouts; the shipped and test
configs fit a small machine; the KV budget defaults from the plan."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig

from tests.conftest import config_path
from tests.torchrun_jobs import ROOT
from vpsd.config import load_config
from vpsd.launch.cli import main as vpsd
from vpsd.launch.memory import Memory, launch_plan, refusal
from vpsd.models import kv_cache
from vpsd.models.grow import grown_config
from vpsd.models.memory_plan import CACHE_SPARE, GIB, Held, weight_bytes
from vpsd.models.families import family
from vpsd.models.registry import tiny_tokenizer
from vpsd.models.shapes import grown_config_dict, model_shape, tiny_config_dict
from vpsd.models.sharded_load import empty_model
from vpsd.pipeline.methods import get_method

SPLIT = re.compile(r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.")
BIG = ROOT / "configs" / "qwen2_5_vl_72b.yaml"


def meta_counts(fam: str, config) -> tuple[int, int]:
    """(split, whole) parameters of the real model, built on meta: split = what tensor_parallel's plan splits."""
    with empty_model(torch.float32):
        model = family(fam).model_class(config)
    split = sum(p.numel() for n, p in model.named_parameters() if SPLIT.match(n))
    return split, sum(p.numel() for p in model.parameters()) - split


@pytest.mark.parametrize("fam", ["qwen2_5_vl", "qwen3_vl", "llava_onevision"])
def test_counts_from_a_tiny_config_equal_the_model(fam):
    cfg, tok = load_config(config_path(fam)), tiny_tokenizer()
    for spec in (cfg.target, cfg.draft):
        config = family(fam).tiny_config(dict(spec.tiny["text"]), dict(spec.tiny["vision"]), tok)
        shape = model_shape(fam, config.to_dict())
        assert (shape.split_params, shape.whole_params) == meta_counts(fam, config)
        bound = model_shape(fam, tiny_config_dict(fam, spec.tiny))  # from the spec alone: vocabulary at most 512
        assert bound.split_params == shape.split_params and 0 <= bound.whole_params - shape.whole_params < 0.05 * shape.params


@pytest.mark.parametrize("path", ["checkpoints/world_long_qwen2_5_vl/target", "configs/shapes/qwen2_5_vl_72b"])
def test_counts_from_a_checkpoints_config_equal_the_model_grown_or_not(path):
    raw = json.loads((ROOT / path / "config.json").read_text())
    config = AutoConfig.from_pretrained(ROOT / path)
    shape = model_shape("qwen2_5_vl", raw)
    assert (shape.split_params, shape.whole_params) == meta_counts("qwen2_5_vl", config)
    if shape.layers < 10:  # a scale model: its config grown as growth writes it
        grown = model_shape("qwen2_5_vl", grown_config_dict(raw, 2, 6))
        assert (grown.split_params, grown.whole_params) == meta_counts("qwen2_5_vl", grown_config(config, 2, 6))


def test_the_72b_shaped_pair_is_qwen2_5_vl_72b_and_7b():
    cfg = load_config(BIG)
    lp = launch_plan(cfg, get_method("hippo"))
    target = model_shape("qwen2_5_vl", json.loads((ROOT / "configs/shapes/qwen2_5_vl_72b/config.json").read_text()))
    assert (target.hidden, target.layers, target.heads, target.kv_heads, target.intermediate) == (8192, 80, 64, 8, 29568)
    assert round(target.params / 1e9, 1) == 73.4  # Qwen2.5-VL-72B's published count
    assert [(n.rank, n.role) for n in lp.needs] == [(0, "target"), (1, "draft"), (2, "pruner"),
                                                    (3, "target_follower"), (4, "target_follower"), (5, "target_follower")]
    # a rank of 4: a quarter of the split layers, the rest whole; KV: 2 of the 8 KV heads
    assert lp.needs[3].weights == weight_bytes(Held(target, 2, 4)) == (target.split_params // 4 + target.whole_params) * 2
    assert lp.needs[3].kv_per_token == 2 * 80 * 2 * 128 * 2
    assert CACHE_SPARE == 1 + kv_cache.SPARE


def test_a_layout_that_cannot_fit_is_refused_with_the_plans_line():
    cfg = load_config(BIG, {"target.tensor_parallel": 1})
    lp = launch_plan(cfg, get_method("hippo"))
    line = refusal(cfg, get_method("hippo"), lp, Memory(gpu=141 * GIB, host=64 * GIB))
    # the 0.5 GiB over weights, KV, activations and runtime: the prefix cache's budget (reuse.budget_mib)
    assert line.startswith("memory: target (rank 0) needs 161.2 GiB (weights 136.7 GiB + KV 15.0 GiB (32768 tokens)")
    assert "+ reuse cache 0.5 GiB = 161.2 GiB" in line
    assert line.endswith("but has 141.0 GiB (its GPU's free memory); target.tensor_parallel 2 would fit ranks of 141.0 GiB")
    assert refusal(load_config(BIG), get_method("hippo"), launch_plan(load_config(BIG), get_method("hippo")),
                   Memory(gpu=141 * GIB, host=64 * GIB)) is None
    assert refusal(cfg, get_method("hippo"), lp, Memory(gpu=40 * GIB, host=64 * GIB)).endswith(
        "target.tensor_parallel 8 would fit ranks of 40.0 GiB")  # 4 would not: 56.3 GiB a rank
    assert refusal(cfg, get_method("hippo"), lp, Memory(gpu=20 * GIB, host=64 * GIB)).endswith(
        "no target.tensor_parallel above 1 fits ranks of 20.0 GiB (a smaller video.context_limit may)")


def test_a_launch_too_big_for_this_host_is_refused_before_any_weight_loads(tmp_path, capsys):
    """A scale model far beyond this machine: one line, exit 2, and the model is never grown."""
    from vpsd.launch.entry import main

    argv = ["--config", str(config_path("qwen2_5_vl")), "--manifest", str(tmp_path / "m.jsonl"), "--out",
            str(tmp_path / "o"), "--method", "ar", "--set", f"target={{path: {ROOT}/checkpoints/world_long_qwen2_5_vl/"
            "target, grow: {width: 64, layers: 80}}"]
    (tmp_path / "m.jsonl").write_text("")
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.match(r"vpsd: memory: target \(rank 0\) needs 6\d\d\.\d GiB \(weights 495\.2 GiB", err[0])
    assert "but the host has" in err[0]
    assert not list((ROOT / "checkpoints/world_long_qwen2_5_vl").glob("target.grown-w64*"))


def test_vpsd_plan_prints_each_rank_and_whether_it_fits(capsys):
    assert vpsd(["plan", "--config", str(BIG), "--gpu-gib", "80", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "context 32768 tokens" in out and re.search(r"\n +3  target_follower cuda +38\.7 GiB +80 KiB", out)
    assert "fits; batching.kv_budget_mib defaults to" in out
    assert vpsd(["plan", "--config", str(BIG), "--set", "target.tensor_parallel=1", "--gpu-gib", "80"]) == 1
    assert "target.tensor_parallel 4 would fit ranks of 80.0 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if p != BIG))
def test_every_shipped_config_fits_a_small_machine(name):
    """The refusal must never fire for the shipped configs and the tests' on a machine of 8 GiB, whatever the
    method: their host ranks together, their GPU ranks each (gpu_long_3b on one shared GPU: 3 ranks of 47 GiB)."""
    cfg = load_config(ROOT / "configs" / name)
    for method in ("ar", "hippo", "sd"):
        lp = launch_plan(cfg, get_method(method))
        assert lp.host_total() < 8 * GIB, (method, lp.needs)
        assert refusal(cfg, get_method(method), lp, Memory(gpu=47 * GIB, host=8 * GIB)) is None


def test_the_kv_budget_defaults_from_the_plan():
    from vpsd.launch.arguments import parse_args
    from vpsd.launch.entry import resolve_config

    base = ["--config", str(config_path("qwen2_5_vl")), "--manifest", "m", "--out", "o", "--method", "hippo"]
    assert resolve_config(parse_args(base)).batching.kv_budget_mib > 100  # GiBs of room for a tiny pair's KV
    assert resolve_config(parse_args(base + ["--set", "batching.kv_budget_mib=5"])).batching.kv_budget_mib == 5

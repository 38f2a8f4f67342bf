"""Scale models (vpsd/models/grow.py, vpsd/launch/grow.py): a grown checkpoint computes its source's function.

Every family grown to width x2 and x4 with appended layers: config sizes as asked, prefill logits within the
stated tolerance, greedy `ar` outputs identical (both checked through vpsd's adapters, from disk). Plus: an
uncovered parameter raises, ensure_grown reuses and rebuilds, the CLI, and the shipped default grown x4 / 12.
"""

from __future__ import annotations

import copy
import json
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tests.conftest import FAMILIES, random_frames, tiny_pair
from tests.official_layout import official_checkpoint
from vpsd.launch.grow import check_growth, compare_adapters, main
from vpsd.models import grown_checkpoint as grow_module
from vpsd.models.grow import GrowthError, grow_model
from vpsd.models.grown_checkpoint import RECORD, ensure_grown, grow_checkpoint
from vpsd.models.registry import load_adapter
from vpsd.models.spec import ModelSpec
from vpsd.video.item import load_item_frames

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_TARGET = ROOT / "checkpoints" / "world_qwen2_5_vl" / "target"
EXAMPLES = ROOT / "examples" / "world" / "manifest.jsonl"
INPUTS = [(random_frames(10), "Describe the video."), (random_frames(11), "What happens in this video?")]


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_ckpt")
    return {f: official_checkpoint(tiny_pair(f)[0], f, root / f) for f in FAMILIES}


@pytest.mark.parametrize("width", [2, 4])
def test_grown_checkpoint_computes_the_same_function(family, width, tiny_checkpoints, tmp_path):
    src = tiny_checkpoints[family]
    dst = grow_checkpoint(src, tmp_path / "grown", width=width, layers=6)

    text, cfg = AutoConfig.from_pretrained(src).get_text_config(), AutoConfig.from_pretrained(dst)
    grown_text = cfg.get_text_config()
    assert grown_text.hidden_size == width * text.hidden_size
    assert grown_text.intermediate_size == width * text.intermediate_size
    assert grown_text.num_attention_heads == width * text.num_attention_heads
    assert grown_text.num_key_value_heads == width * text.num_key_value_heads
    assert grown_text.head_dim == text.hidden_size // text.num_attention_heads
    assert grown_text.num_hidden_layers == 6
    assert len(getattr(grown_text, "layer_types", None) or [None] * 6) == 6
    assert not cfg.tie_word_embeddings and not grown_text.tie_word_embeddings
    if family != "llava_onevision":
        assert cfg.vision_config.out_hidden_size == width * text.hidden_size
    record = json.loads((dst / RECORD).read_text())
    assert (record["width"], record["layers"], record["source_layers"]) == (width, 6, 4)
    assert (dst / "tokenizer.json").is_file() and (dst / "generation_config.json").is_file()

    check = check_growth(src, dst, family, INPUTS, max_new_tokens=8)
    assert check.num_inputs == 2 and check.num_identical == 2
    assert check.relative_diff <= 1e-5 and check.ok, check.describe()


def test_check_fails_on_a_different_model(tiny_checkpoints, tmp_path):
    """The check can fail: the tiny draft is not its target grown."""
    draft = official_checkpoint(tiny_pair("qwen2_5_vl")[1], "qwen2_5_vl", tmp_path / "draft")
    check = check_growth(tiny_checkpoints["qwen2_5_vl"], draft, "qwen2_5_vl", INPUTS[:1], max_new_tokens=4)
    assert not check.ok and check.relative_diff > 1e-2


def test_appended_layers_are_zeroed_copies_of_the_last():
    model = tiny_pair("qwen3_vl")[0].model
    grown = grow_model(model, 2, 6)
    last, extra = grown.model.language_model.layers[3], grown.model.language_model.layers[5]
    assert torch.equal(last.self_attn.q_proj.weight, extra.self_attn.q_proj.weight)
    assert torch.equal(last.self_attn.k_norm.weight, extra.self_attn.k_norm.weight)
    assert not extra.self_attn.o_proj.weight.any() and not extra.mlp.down_proj.weight.any()
    assert last.mlp.down_proj.weight.any()
    assert len(grown.model.visual.deepstack_merger_list) == len(model.model.visual.deepstack_merger_list)


def test_tied_embeddings_are_grown_untied():
    """Real small checkpoints (Qwen2.5-VL-3B, LLaVA-OneVision-0.5B) tie lm_head to the embeddings."""
    source = tiny_pair("llava_onevision")[0]
    cfg = copy.deepcopy(source.model.config)
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tied = type(source)(type(source.model)(cfg).eval(), source.tokenizer)
    assert tied.model.lm_head.weight is tied.model.model.language_model.embed_tokens.weight
    grown = type(source)(grow_model(tied.model, 2, 5), source.tokenizer)
    assert grown.model.lm_head.weight.data_ptr() != grown.model.model.language_model.embed_tokens.weight.data_ptr()
    check = compare_adapters(tied, grown, INPUTS[:1], max_new_tokens=4)
    assert check.ok, check.describe()


def test_uncovered_parameter_and_bad_sizes_raise():
    model = tiny_pair("qwen2_5_vl")[0].model
    layer = model.model.language_model.layers[0]
    layer.register_parameter("new_gate", torch.nn.Parameter(torch.ones(3)))
    try:
        with pytest.raises(GrowthError, match="layers.0.new_gate"):
            grow_model(model, 2, 4)
    finally:
        del layer._parameters["new_gate"]
    with pytest.raises(GrowthError, match="layers must be"):
        grow_model(model, 2, 3)
    with pytest.raises(GrowthError, match="width must be"):
        grow_model(model, 0, 4)


def test_ensure_grown_reuses_and_rebuilds(tiny_checkpoints, tmp_path, monkeypatch):
    src = official_checkpoint(tiny_pair("llava_onevision")[0], "llava_onevision", tmp_path / "src")
    dst = tmp_path / "grown"
    built = []
    in_tmp = set(Path(tempfile.gettempdir()).glob("vpsd-grow-*.lock"))
    real = grow_module.grow_checkpoint
    monkeypatch.setattr(grow_module, "grow_checkpoint", lambda *a, **k: built.append(a[2:4]) or real(*a, **k))

    racers = [threading.Thread(target=ensure_grown, args=(src, dst, 2, 5)) for _ in range(2)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    ensure_grown(src, dst, 2, 5)
    assert built == [(2, 5)]  # built once by the two at once, reused by the third call
    ensure_grown(src, dst, 4, 5)
    assert built == [(2, 5), (4, 5)] and AutoConfig.from_pretrained(dst).get_text_config().hidden_size == 4 * 64

    weights = load_file(src / "model.safetensors")  # the source retrained in place: rebuilt
    head = next(k for k in weights if k.endswith("lm_head.weight"))  # saved under the checkpoint's own key names
    weights[head] = weights[head] * 2
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    ensure_grown(src, dst, 4, 5)
    assert len(built) == 3
    assert not list(tmp_path.glob(".grown.tmp-*")) + list(tmp_path.glob(".grown.old-*"))  # none left behind
    # Three builds, one lock: the file beside the destination, reused; nothing in the temporary directory.
    assert [p.name for p in tmp_path.glob(".*.grow.lock")] == [".grown.grow.lock"]
    assert set(Path(tempfile.gettempdir()).glob("vpsd-grow-*.lock")) == in_tmp

    other = tmp_path / "not_grown"  # a directory ensure_grown did not make is never overwritten
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(GrowthError, match="not a grown checkpoint"):
        ensure_grown(src, other, 2, 5)
    assert (other / "notes.txt").read_text() == "mine"


def test_grow_command(tiny_checkpoints, tmp_path, capsys):
    rc = main([str(tiny_checkpoints["qwen3_vl"]), str(tmp_path / "g"), "--width", "2", "--layers", "5",
               "--items", "1", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "identical 1/1: OK" in out
    assert main([str(tiny_checkpoints["qwen3_vl"]), str(tmp_path / "h"), "--width", "2", "--layers", "2"]) == 2
    assert not (tmp_path / "h").exists()


def test_grow_command_builds_and_checks_every_model_a_config_grows(tiny_checkpoints, tmp_path, capsys):
    """`vpsd grow --config C`: the target and the draft a config grows (the long default grows both)."""
    src = tiny_checkpoints["qwen2_5_vl"]
    config = tmp_path / "c.yaml"
    config.write_text(f"family: qwen2_5_vl\ntarget: {{path: {src}, grow: {{width: 2, layers: 5}}}}\n"
                      f"draft: {{path: {src}, grow: {{width: 2, layers: 6}}}}\n")
    assert main(["--config", str(config), "--items", "1", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical 1/1: OK") == 2 and "width x2, 5 layers" in out and "width x2, 6 layers" in out
    assert main(["--config", str(config), "--no-check"]) == 0 and capsys.readouterr().out.count("reused") == 2


def test_shipped_default_grown_x4_12_layers_decodes_identically():
    """The default target grown as the cost-realistic default is (width x4, 12 layers), kept in memory."""
    source = load_adapter("qwen2_5_vl", ModelSpec(path=str(SHIPPED_TARGET)))
    grown = type(source)(grow_model(source.model, 4, 12), source.tokenizer)
    item = json.loads(EXAMPLES.read_text().splitlines()[0])
    frames, _ = load_item_frames(EXAMPLES.parent / item["video"], 8, None, None)
    check = compare_adapters(source, grown, [(frames, item["prompt"])], max_new_tokens=16)
    assert check.num_identical == 1 and check.relative_diff <= 1e-5, check.describe()


def test_a_config_names_its_scale_model_and_specs_stay_checked():
    from vpsd.config import load_config
    from vpsd.models.spec import ModelSpec

    spec = load_config(ROOT / "configs" / "world_qwen2_5_vl_scaled.yaml").target
    assert spec.grow == {"width": 4, "layers": 12}
    assert spec.grown_path() == str(ROOT / "checkpoints" / "world_qwen2_5_vl" / "target.grown-w4-l12")
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec(path="x", dtype="bogus")
    with pytest.raises(ValueError, match="width and layers"):
        ModelSpec(path="x", grow={"width": 2})
    with pytest.raises(ValueError, match="needs a checkpoint"):
        ModelSpec(tiny={}, grow={"width": 2, "layers": 4})


def test_a_source_that_gains_a_side_file_makes_its_scale_model_stale(tiny_checkpoints, tmp_path):
    import shutil

    from vpsd.models.grown_checkpoint import ensure_grown, is_grown

    src = shutil.copytree(tiny_checkpoints["qwen2_5_vl"], tmp_path / "src")
    dst = ensure_grown(src, tmp_path / "grown", 2, 4)
    (src / "preprocessor_config.json").write_text("{}")
    assert not is_grown(src, dst, 2, 4)
    ensure_grown(src, dst, 2, 4)
    assert (dst / "preprocessor_config.json").read_text() == "{}" and is_grown(src, dst, 2, 4)

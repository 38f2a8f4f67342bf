"""Checkpoints read in place (models/sharded_load.py): over two torchrun ranks each family's tiny target, written
in several safetensors shards with an index, loads as two shares that are exactly the unsplit model's slices and
today's split of a model built whole, hold the bytes the memory plan says, and decode as the unsplit one; in one process a checkpoint loads exactly
as `from_pretrained` loads it (every parameter, buffer and dtype), in the layout before transformers 5 too, with
tied embeddings shared, and a checkpoint short of a parameter is named."""

from __future__ import annotations

import json
import subprocess

import pytest
import safetensors.torch
import torch

from tests.conftest import config_path
from tests.torchrun_jobs import ROOT, job_env, torchrun_cmd
from vpsd.config import load_config
from vpsd.models.families import DTYPES, family
from vpsd.models.registry import tiny_tokenizer
from vpsd.models.sharded_load import LEGACY_KEYS, LoadError, load_model

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "llava_onevision"]


@pytest.mark.torchrun
def test_each_rank_reads_its_share_of_every_family_and_decodes_as_the_whole(tmp_path):
    proc = subprocess.run(torchrun_cmd(2) + [str(ROOT / "tests" / "workers" / "sharded_load_worker.py"), str(tmp_path),
                                             *FAMILIES], capture_output=True, text=True, timeout=240, env=job_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for fam in FAMILIES:
        for rank in ranks:
            got = rank[fam]
            assert got["shards"] > 3 and got["index"], got  # a sharded checkpoint, read through its index
            # 7 split projections a decoder layer (4 layers) plus the q/k/v biases of the families with them
            assert got["split"] == 4 * (7 if fam == "qwen3_vl" else 10)
            assert got["unequal_to_slice"] == [] and got["unequal_to_built"] == []
            assert got["local_bytes"] < 0.8 * got["whole_bytes"]  # half of every layer's projections
            assert got["local_bytes"] == got["plan_bytes"]  # the memory plan's weights for a rank of 2
        assert ranks[0][fam]["split_tokens"] == ranks[0][fam]["whole_tokens"]
        assert ranks[0][fam]["prefill_logit_diff"] < 1e-5  # two partial sums added: float noise only
        assert ranks[1][fam]["forwards"] > 5  # the follower ran the leader's forwards


def _tiny(fam: str, tie: bool = False):
    cfg = load_config(config_path(fam))
    tok = tiny_tokenizer()
    config = family(fam).tiny_config(dict(cfg.target.tiny["text"]), dict(cfg.target.tiny["vision"]), tok)
    if tie:
        config.tie_word_embeddings = config.get_text_config().tie_word_embeddings = True
    torch.manual_seed(0)
    return family(fam).model_class(config)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the parameters and buffers (persistent or not) that differ in value, dtype or presence."""
    ta = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    tb = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    return sorted(set(ta) ^ set(tb)) + [n for n in ta if n in tb and not (
        ta[n].dtype == tb[n].dtype and ta[n].requires_grad == tb[n].requires_grad and torch.equal(ta[n], tb[n]))]


@pytest.mark.parametrize("fam", FAMILIES)
def test_a_checkpoint_loads_in_place_exactly_as_from_pretrained(tmp_path, fam):
    model = _tiny(fam)
    # As a checkpoint trained in float32 records it (the long world pair's config.json): every sub-config says
    # float32, and a bf16 load must still build every layer in bf16, as from_pretrained(dtype=...) does.
    model.config.dtype = torch.float32
    for key in model.config.sub_configs:
        getattr(model.config, key).dtype = torch.float32
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    for dtype in ("float32", "bfloat16"):
        ref = family(fam).model_class.from_pretrained(tmp_path, dtype=DTYPES[dtype])
        got = load_model(family(fam).model_class, fam, tmp_path, DTYPES[dtype], "cpu")
        assert _same(ref, got) == []
        assert got.generation_config.to_dict() == ref.generation_config.to_dict()
        assert got.config.get_text_config()._attn_implementation == ref.config.get_text_config()._attn_implementation


def _legacy(name: str, fam: str) -> str:
    """A transformers-5 parameter name as checkpoints written before it name it (LEGACY_KEYS, inverted)."""
    if fam == "llava_onevision":
        for new, old in (("lm_head.", "language_model.lm_head."), ("model.language_model.", "language_model.model."),
                         ("model.vision_tower.", "vision_tower.vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector."), ("model.image_newline", "image_newline")):
            if name.startswith(new):
                return old + name[len(new):]
        return name
    return name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)


@pytest.mark.parametrize("fam", ["qwen2_5_vl", "llava_onevision"])
def test_a_checkpoint_in_the_layout_before_transformers_5_loads_as_transformers_reads_it(tmp_path, fam):
    model = _tiny(fam)
    model.config.save_pretrained(tmp_path)
    safetensors.torch.save_file({_legacy(n, fam): t.contiguous() for n, t in model.state_dict().items()},
                                str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert fam in LEGACY_KEYS
    got = load_model(family(fam).model_class, fam, tmp_path, torch.float32, "cpu")
    assert _same(model, got) == []
    assert _same(family(fam).model_class.from_pretrained(tmp_path), got) == []  # transformers' renames agree


def test_tied_embeddings_are_read_once_and_shared(tmp_path):
    model = _tiny("qwen2_5_vl", tie=True)
    model.save_pretrained(tmp_path)
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    got = load_model(family("qwen2_5_vl").model_class, "qwen2_5_vl", tmp_path, torch.float32, "cpu")
    assert got.lm_head.weight is got.model.language_model.embed_tokens.weight
    assert _same(model, got) == []


def test_a_checkpoint_short_of_a_parameter_is_named(tmp_path):
    model = _tiny("qwen2_5_vl")
    model.config.save_pretrained(tmp_path)
    state = {n: t for n, t in model.state_dict().items() if n != "model.language_model.norm.weight"}
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match="holds no model.language_model.norm.weight"):
        load_model(family("qwen2_5_vl").model_class, "qwen2_5_vl", tmp_path, torch.float32, "cpu")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="holds no safetensors weights"):
        load_model(family("qwen2_5_vl").model_class, "qwen2_5_vl", tmp_path, torch.float32, "cpu")

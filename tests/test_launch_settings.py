"""Settings that only one method reads are checked when the job is launched, before any model loads."""

import pytest

from tests.torchrun_jobs import ROOT
from vpsd.launch.entry import parse_args, resolve_config
from vpsd.pipeline.methods import get_method

CONFIG = str(ROOT / "configs" / "tiny_qwen2_5_vl.yaml")


def args(method: str, *more: str):
    return parse_args(["--config", CONFIG, "--manifest", "m.jsonl", "--out", "o", "--method", method, *more])


def test_a_bad_tabed_setting_stops_the_launch():
    with pytest.raises(SystemExit, match="method tabed: tabed distance must be one of"):
        resolve_config(args("tabed", "--set", "tabed.distance=cosine"))
    with pytest.raises(SystemExit, match="unknown keys in tabed"):
        resolve_config(args("tabed", "--set", "tabed.windows=3"))
    assert resolve_config(args("tabed", "--set", "tabed.distance=tvd")).extra["tabed"] == {"distance": "tvd"}


def test_std_refuses_an_input_pruning_strategy_at_launch():
    with pytest.raises(SystemExit, match="method std: std picks its own KV entries"):
        resolve_config(args("std", "--pruning", "hippo"))
    assert resolve_config(args("std", "--ratio", "0.5")).pruning.ratio == 0.5


def test_tree_settings_at_launch():
    with pytest.raises(SystemExit, match="unknown tree 'pine'"):
        resolve_config(args("specvlm", "--set", "decoding.tree=pine"))
    with pytest.raises(SystemExit, match="skips rank 0"):
        resolve_config(args("sd-tree", "--set", "decoding.tree=[[1]]"))
    # specvlm drafts SpecVLM's (EAGLE's) tree unless told "chain"; a chain method ignores the setting.
    specvlm = get_method("specvlm")
    assert specvlm.draft_tree(resolve_config(args("specvlm")).decoding.tree).num_nodes == 25
    assert specvlm.draft_tree(resolve_config(args("specvlm", "--set", "decoding.tree=chain")).decoding.tree) is None
    shaped = resolve_config(args("sd-tree", "--set", "decoding.tree=[3,1]")).decoding.tree
    assert get_method("sd-tree").draft_tree(shaped).paths == ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0))
    assert get_method("sd").draft_tree(shaped) is None

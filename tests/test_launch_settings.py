"""Settings that only one method reads are checked when the job is launched, before any model loads."""

import pytest

from tests.torchrun_jobs import ROOT
from vpsd.launch.entry import parse_args, resolve_config

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

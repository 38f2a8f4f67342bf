"""A target split over two ranks (models/tensor_parallel.py), through real torchrun and gloo: each rank holds
half the KV heads, the leader's engine decodes every item as the unsharded target does (`ar` at B = 1 and 2,
the target drafting for itself in a batch: its draft's forwards mirrored too), and the follower ran them."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.torchrun_jobs import ROOT, job_env, torchrun_cmd
from vpsd.models.tensor_parallel import shard_problems

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_a_target_over_two_ranks_decodes_as_its_one_rank_self(tmp_path, family):
    proc = subprocess.run(torchrun_cmd(2) + [str(ROOT / "tests" / "workers" / "tensor_parallel_worker.py"), family,
                                             str(tmp_path)], capture_output=True, text=True, timeout=240,
                          env=job_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    leader = json.loads((tmp_path / "leader.json").read_text())
    assert leader["local_kv_rows"] * 2 == leader["whole_kv_rows"]  # half of the KV projection a rank
    assert leader["prefill_logit_diff"] < 1e-5  # two partial sums added: float noise only
    for case in ("ar_b1", "ar_b2", "self_sd_b2"):
        assert leader[case] == leader["reference"], case
    assert leader["self_sd_b2_accepted"] > 0
    assert json.loads((tmp_path / "follower.json").read_text())["forwards"] > 50


def test_a_split_that_does_not_divide_the_heads_is_named():
    class Text:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 128

    assert shard_problems(Text, 2) == []
    assert shard_problems(Text, 4) == ["tensor_parallel 4: num_key_value_heads 2 is not a multiple of 4"]

"""A target split over two ranks (models/tensor_parallel.py), through real torchrun and gloo: each rank holds
half the KV heads, the leader's engine decodes every item as the unsharded target does (`ar` at B = 1 and 2,
the target drafting for itself in a batch: its draft's forwards mirrored too), the pruning signals of a split
prefill (attention gathered over the ranks' heads, hidden states) are the unsharded target's, and the follower
ran them; a
job whose pipelines carry a follower rank (launch/layout.py) equals `ar`; what it cannot run is refused."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.torchrun_jobs import ROOT, ar_reference, job_env, results, run_job, torchrun_cmd, world_manifest
from vpsd.config import DEFAULT_ROLES, load_config
from vpsd.launch.layout import FOLLOWER, plan
from vpsd.launch.preflight import tensor_parallel_problems
from vpsd.models.tensor_parallel import shard_problems
from vpsd.pipeline.methods import get_method

pytestmark = pytest.mark.torchrun


# --slow (each ~45 CPU-s, most of it DTensor's dispatch of a split step on a CPU): CI holds a split target to ar
# through the job below, its pruner scoring attention gathered over the ranks' heads.
@pytest.mark.parametrize("family", [pytest.param("qwen2_5_vl", marks=pytest.mark.slow),
                                    pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_a_target_over_two_ranks_decodes_as_its_one_rank_self(tmp_path, family):
    proc = subprocess.run(torchrun_cmd(2) + [str(ROOT / "tests" / "workers" / "tensor_parallel_worker.py"), family,
                                             str(tmp_path)], capture_output=True, text=True, timeout=240,
                          env=job_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    leader = json.loads((tmp_path / "leader.json").read_text())
    assert leader["local_kv_rows"] * 2 == leader["whole_kv_rows"]  # half of the KV projection a rank
    assert leader["prefill_logit_diff"] < 1e-5  # two partial sums added: float noise only
    shapes = leader["attention_shape"]  # the pruner's attention signal: every KV head, gathered from both ranks
    assert shapes[0] == shapes[1] and leader["signal_diff"] < 1e-5
    for case in ("ar_b1", "ar_b2", "self_sd_b2"):
        assert leader[case] == leader["reference"], case
    assert leader["self_sd_b2_accepted"] > 0
    # the follower ran every forward the leader sent (its decodes, the prefills above): a wire that lost one hangs
    assert json.loads((tmp_path / "follower.json").read_text())["forwards"] == leader["mirrored_forwards"] > 20


def test_a_split_that_does_not_divide_the_heads_is_named():
    class Text:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 128

    assert shard_problems(Text, 2) == []
    assert shard_problems(Text, 4) == ["tensor_parallel 4: num_key_value_heads 2 is not a multiple of 4"]


@pytest.mark.parametrize("method", ["hippo", pytest.param("pearl", marks=pytest.mark.slow)])
def test_a_job_whose_target_spans_two_ranks_equals_ar(tmp_path, method):
    """A parallel method with its target over ranks 0 and 3 (the follower after the draft's and the pruner's;
    hippo's pruner scoring attention gathered from both): every output equals the unsplit target's `ar`, and the
    follower ran the leader's forwards."""
    manifest = world_manifest(str(tmp_path), count=2)
    split = run_job("tiny_qwen2_5_vl.yaml", manifest, tmp_path / method, method, "--quiet",
                    "--set", "target.tensor_parallel=2", nproc=4)
    assert split.returncode == 0, split.stderr[-3000:]
    got = results(tmp_path / method)
    assert {i: r["token_ids"] for i, r in got.items()} == ar_reference("qwen2_5_vl", manifest)
    follower = [json.loads(line) for f in (tmp_path / method / "traces").iterdir() for line in f.read_text().splitlines()
                if '"follower_done"' in line]
    assert len(follower) == 1 and follower[0]["rank"] == 3 and follower[0]["forwards"] > 10


def test_the_split_targets_ranks_follow_its_roles_in_every_pipeline():
    two = plan(8, 8, DEFAULT_ROLES, target_ranks=2)
    assert [(p.ranks, p.followers) for p in two.pipelines] == [
        ({"target": 0, "draft": 1, "pruner": 2}, (3,)), ({"target": 4, "draft": 5, "pruner": 6}, (7,))]
    assert two.of_rank(7) == (two.pipelines[1], FOLLOWER)
    solo = plan(5, 5, {"target": 0}, target_ranks=2)  # the target alone (ar, serial methods): 2 pipelines of 2
    assert [p.target_ranks for p in solo.pipelines] == [[0, 1], [2, 3]] and solo.spare == [4]
    assert "pipelines of 2 ranks" in solo.spare_line()
    with pytest.raises(ValueError, match="and 1 more for the target's tensor_parallel 2"):
        plan(3, 3, DEFAULT_ROLES, target_ranks=2)


@pytest.mark.parametrize("method,more,expect", [
    ("sd-tree", {}, "drafts a eagle tree"),
    ("std", {}, "Sparse-to-Dense's sparse KV"),
    ("ar", {"target.capture": "default"}, "captured steps"),
    ("ar", {"target.tensor_parallel": 4}, "num_key_value_heads 2 is not a multiple of 4"),
])
def test_what_a_split_target_cannot_run_is_refused_at_launch(method, more, expect):
    cfg = load_config(ROOT / "configs" / "tiny_qwen2_5_vl.yaml", {"target.tensor_parallel": 2, **more,
                                                                  "pruning.strategy": get_method(method).default_strategy})
    problems = tensor_parallel_problems(cfg, get_method(method), gpus=0, local_world=4)
    assert any(expect in p for p in problems), problems
    fine = load_config(ROOT / "configs" / "tiny_qwen2_5_vl.yaml", {"target.tensor_parallel": 2, "pruning.strategy": "uv"})
    assert tensor_parallel_problems(fine, get_method("parallelvlm"), gpus=0, local_world=4) == []

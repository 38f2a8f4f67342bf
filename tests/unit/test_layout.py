"""How a launch's ranks form pipelines (launch/layout.py), by hand: per node, over nodes, spare ranks, cores."""

import pytest

from vpsd.config import DEFAULT_ROLES
from vpsd.launch.layout import SOLO, pinned_cores, plan


def ranks(layout):
    return [(p.ranks["target"], p.ranks["draft"], p.ranks["pruner"], p.node_slot) for p in layout.pipelines]


def test_one_node_holds_as_many_pipelines_as_fit():
    assert ranks(plan(3, 3, DEFAULT_ROLES)) == [(0, 1, 2, 0)]
    six = plan(6, 6, DEFAULT_ROLES)
    assert ranks(six) == [(0, 1, 2, 0), (3, 4, 5, 1)] and six.spare == [] and six.coordinator == 6
    assert six.of_rank(4)[0].index == 1 and six.of_rank(4)[1] == "draft" and six.leader.target == 0


def test_a_pipeline_stays_on_its_node():
    assert ranks(plan(6, 3, DEFAULT_ROLES)) == [(0, 1, 2, 0), (3, 4, 5, 0)]  # two nodes of three
    four_a_node = plan(8, 4, DEFAULT_ROLES)  # two nodes of four: one pipeline each, rank 3 and 7 spare
    assert ranks(four_a_node) == [(0, 1, 2, 0), (4, 5, 6, 0)] and four_a_node.spare == [3, 7]


def test_nodes_smaller_than_a_pipeline_form_pipelines_over_the_world():
    two_by_two = plan(4, 2, DEFAULT_ROLES)
    assert ranks(two_by_two) == [(0, 1, 2, 0)] and two_by_two.spare == [3]
    assert two_by_two.spare_line() == ("1 rank (rank 3) of 4 idle: 1 pipeline of 3 ranks fit; launch a multiple of 3 "
                                       "ranks a node to use them")
    assert plan(3, 3, DEFAULT_ROLES).spare_line() is None


def test_roles_are_laid_out_inside_each_pipeline():
    layout = plan(6, 6, {"target": 2, "draft": 0, "pruner": 1})
    assert ranks(layout) == [(2, 0, 1, 0), (5, 3, 4, 1)] and layout.leader.target == 2
    solo = plan(2, 2, SOLO)
    assert [p.ranks for p in solo.pipelines] == [{"target": 0}, {"target": 1}]


def test_a_launch_smaller_than_a_pipeline_is_refused():
    with pytest.raises(ValueError, match="a pipeline needs 3 ranks .* the launch has 2"):
        plan(2, 2, DEFAULT_ROLES)


def test_each_pipeline_of_a_node_takes_the_config_cores_shifted_past_the_last():
    affinity = {"target": [0], "draft": [1], "pruner": [1]}
    assert pinned_cores(affinity, "target", 0) == [0] and pinned_cores(affinity, "draft", 1) == [3]
    assert pinned_cores(affinity, "pruner", 2) == [5] and pinned_cores(None, "target", 1) is None


def test_cores_a_second_pipeline_would_need_are_named_at_launch():
    from vpsd.config import load_config
    from vpsd.launch.preflight import affinity_problems
    from tests.torchrun_jobs import ROOT

    cfg = load_config(ROOT / "configs" / "tiny_qwen2_5_vl.yaml", {"cpu_affinity": {"target": [0], "draft": [1]}})
    assert affinity_problems(cfg, allowed={0, 1}, slots=1) == []
    assert affinity_problems(cfg, allowed={0, 1}, slots=2) == [
        "cpu_affinity.target: core 2 (pipeline 2 of 2 on this node) not available to this job (it may run on 0-1; "
        "pin to those, or set cpu_affinity: null)",
        "cpu_affinity.draft: core 3 (pipeline 2 of 2 on this node) not available to this job (it may run on 0-1; "
        "pin to those, or set cpu_affinity: null)"]

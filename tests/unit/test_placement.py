"""Where ranks run and which path their tensors take: a function of the placement (transport/placement.py)."""

from __future__ import annotations

import pytest

from vpsd.transport.placement import GLOO_BACKEND, NCCL_BACKEND, Placement


@pytest.mark.parametrize(
    "local_world, gpus, gpu_of_ranks, backend",
    [
        (3, 0, [None, None, None], GLOO_BACKEND),  # CPU: gloo, nothing staged
        (3, 3, [0, 1, 2], NCCL_BACKEND),  # a GPU a rank: NCCL between them
        (6, 8, [0, 1, 2, 3, 4, 5], NCCL_BACKEND),  # more GPUs than ranks: the first ones
        (3, 1, [0, 0, 0], GLOO_BACKEND),  # a whole pipeline on one GPU: NCCL refuses it
        (6, 3, [0, 1, 2, 0, 1, 2], GLOO_BACKEND),  # two pipelines on three GPUs
    ],
)
def test_each_rank_gets_a_gpu_and_every_rank_the_same_backend(local_world, gpus, gpu_of_ranks, backend):
    placements = [Placement(r, local_world, gpus) for r in range(local_world)]
    assert [p.gpu for p in placements] == gpu_of_ranks
    assert {p.backend for p in placements} == {backend}
    assert all(p.stages_cuda == (bool(gpus) and backend == GLOO_BACKEND) for p in placements)


def test_without_nccl_cuda_tensors_are_staged_even_on_a_gpu_each():
    p = Placement(1, 2, 2, nccl=False)
    assert (p.gpu, p.backend, p.stages_cuda) == (1, GLOO_BACKEND, True)


def test_the_placement_says_what_it_chose():
    assert Placement(0, 3, 0).describe() == "no GPU: gloo"
    assert Placement(1, 3, 3).describe() == "GPU 1: NCCL between GPUs"
    assert Placement(2, 3, 1).describe() == "GPU 0, 3 ranks on 1 GPU: gloo, CUDA tensors staged through host memory"


def test_a_rank_outside_its_node_is_refused():
    with pytest.raises(ValueError, match="bad placement"):
        Placement(3, 3, 1)

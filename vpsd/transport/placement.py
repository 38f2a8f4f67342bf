"""Where a rank's tensors live and which path carries them between ranks: a function of the placement.

A node runs `local_world` ranks over `gpus` visible GPUs. Rank `LOCAL_RANK` takes GPU `LOCAL_RANK % gpus`:
one GPU a rank when there are enough, the ranks of a pipeline sharing one when there are not (target, draft
and pruner of a 3-rank pipeline all on a node's single GPU).

The tensor path follows from that:
- every rank on a GPU of its own: "cpu:gloo,cuda:nccl", so CUDA tensors travel GPU to GPU over NCCL;
- ranks sharing a GPU: NCCL refuses two ranks on one device (its communicator init fails with "Duplicate GPU
  detected"), so the group is gloo alone and a CUDA tensor is staged through host memory: copied to the host
  by its sender, sent over gloo, and copied onto the receiver's GPU (transport/tensors.py). That costs two
  host copies a transfer; the tensors the pipeline moves are a chunk's tokens and logits rows and, once an
  item, the pruned draft's kept indices, small next to a forward. CUDA IPC handles would skip the copies
  (same device, same node), at the price of keeping each sent buffer alive until its peer released it; not
  built: the staged path is measured first (scripts/gpu_check.sh) and IPC is worth building only where the
  copies show up in the target's time.
- no GPU: gloo, CPU tensors.

Every node of a torchrun launch has the same `local_world`; this assumes the same GPU count on each too (the
launcher's own `--nproc-per-node gpu` makes the same assumption), so every rank picks the same backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

NCCL_BACKEND = "cpu:gloo,cuda:nccl"  # each tensor on its device's backend
GLOO_BACKEND = "gloo"


@dataclass(frozen=True)
class Placement:
    local_rank: int
    local_world: int
    gpus: int  # GPUs visible on the node
    nccl: bool = True  # whether this torch has NCCL

    def __post_init__(self) -> None:
        if not 0 <= self.local_rank < max(self.local_world, 1) or self.gpus < 0:
            raise ValueError(f"bad placement: local rank {self.local_rank} of {self.local_world}, {self.gpus} GPUs")

    @property
    def gpu(self) -> int | None:
        """This rank's GPU index on its node (None: no GPU)."""
        return self.local_rank % self.gpus if self.gpus else None

    @property
    def shares_gpu(self) -> bool:
        """Whether some GPU of the node serves more than one rank."""
        return 0 < self.gpus < self.local_world

    @property
    def backend(self) -> str:
        if self.gpus and self.nccl and not self.shares_gpu:
            return NCCL_BACKEND
        return GLOO_BACKEND

    @property
    def stages_cuda(self) -> bool:
        """Whether CUDA tensors go through host memory (a GPU is there but NCCL does not carry them)."""
        return bool(self.gpus) and self.backend == GLOO_BACKEND

    def describe(self) -> str:
        if not self.gpus:
            return "no GPU: gloo"
        how = "NCCL between GPUs" if self.backend == NCCL_BACKEND else "gloo, CUDA tensors staged through host memory"
        share = f", {self.local_world} ranks on {self.gpus} GPU{'s' if self.gpus > 1 else ''}" if self.shares_gpu else ""
        return f"GPU {self.gpu}{share}: {how}"


def visible_gpus() -> int:
    """The GPUs torch can use in this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def this_placement(local_rank: int, local_world: int) -> Placement:
    """The placement of this process, from the GPUs torch sees."""
    return Placement(local_rank, local_world, visible_gpus(), nccl=dist.is_nccl_available())

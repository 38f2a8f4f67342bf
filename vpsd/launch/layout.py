"""How a launch's ranks form pipelines, and where each rank runs.

One launch uses the whole allocation: its ranks form as many pipelines as the layout allows, and the job's
coordinator (launch/coordinator.py) hands them items as they free up. A pipeline is the config's `roles:`
layout (target 0, draft 1, pruner 2 by default: P = 3 ranks) where the method runs its draft on a rank of its
own, and one rank (the target alone) where it does not (serial methods, a batch drafting in the target's
process).

- Pipelines stay inside a node: torchrun numbers a node's ranks contiguously (node n holds ranks n L .. n L + L - 1
  for L ranks a node), so node n holds L // P pipelines, the first at its first rank. With fewer ranks a node
  than a pipeline needs (L < P), pipelines are formed over the whole world instead, spanning nodes (three
  nodes of one rank each make one pipeline).
- A target split over k ranks (`target.tensor_parallel: k`, models/tensor_parallel.py) adds k - 1 ranks to each
  pipeline, after its roles': P = 3 + k - 1 (or k, the target alone), the target's ranks contiguous.
- Ranks left over (L not a multiple of P) are spare: they leave at once, and rank 0 says so.
- Cores: a config's `cpu_affinity` is pipeline 0's on its node; the j-th pipeline of a node takes the same
  layout shifted by j x (the highest core named + 1), so two pipelines pinned {target: [0], draft: [1]} run
  on cores 0-1 and 2-3.
- GPUs: rank LOCAL_RANK takes GPU LOCAL_RANK % (the node's GPUs) (a model spec's bare `device: cuda` is that
  one): a GPU a rank where there are enough, NCCL between them; ranks sharing GPUs otherwise (a whole pipeline on
  one GPU), their CUDA tensors staged through host memory over gloo (transport/placement.py).
- The coordinator is not a rank of torch.distributed: it is a thread in pipeline 0's target process with a
  control-plane identity of its own, rank `world` (one past the last torchrun rank).
"""

from __future__ import annotations

from dataclasses import dataclass

SOLO = {"target": 0}  # a pipeline of one rank: the target, its draft (if any) in its own process
FOLLOWER = "target_follower"  # a rank holding a share of a tensor-parallel target (models/tensor_parallel.py)


@dataclass(frozen=True)
class Pipeline:
    index: int
    ranks: dict[str, int]  # role -> global rank
    node_slot: int  # its place among the pipelines of its node (0 for the first): its cores' shift
    followers: tuple[int, ...] = ()  # the ranks after its roles' that hold the rest of a split target

    @property
    def target(self) -> int:
        return self.ranks["target"]

    @property
    def target_ranks(self) -> list[int]:
        """The target's ranks, its leader (the role's rank) first."""
        return [self.target, *self.followers]

    @property
    def size(self) -> int:
        return len(self.ranks) + len(self.followers)


@dataclass(frozen=True)
class Layout:
    pipelines: list[Pipeline]
    spare: list[int]
    world: int

    @property
    def coordinator(self) -> int:
        """The coordinator's control-plane rank: one past the last torchrun rank."""
        return self.world

    @property
    def leader(self) -> Pipeline:
        """Pipeline 0: its target holds --out's lock and runs the coordinator."""
        return self.pipelines[0]

    def of_rank(self, rank: int) -> tuple[Pipeline, str] | None:
        """This rank's pipeline and role; None for a spare rank."""
        for p in self.pipelines:
            for role, r in p.ranks.items():
                if r == rank:
                    return p, role
            if rank in p.followers:
                return p, FOLLOWER
        return None

    def spare_line(self) -> str | None:
        """What rank 0 says of spare ranks, if any."""
        if not self.spare:
            return None
        size = self.pipelines[0].size if self.pipelines else 0
        return (f"{len(self.spare)} rank{'s' if len(self.spare) > 1 else ''} ({_ranges(self.spare)}) of {self.world} "
                f"idle: {len(self.pipelines)} pipeline{'s' if len(self.pipelines) != 1 else ''} of {size} rank"
                f"{'s' if size != 1 else ''} fit; launch a multiple of {size} ranks a node to use them")


def plan(world: int, local_world: int, roles: dict[str, int], target_ranks: int = 1) -> Layout:
    """The pipelines of a launch of `world` ranks, `local_world` a node, each laid out as `roles` (role -> rank
    within the pipeline) and, for a target split over `target_ranks` ranks, that many less one after them.
    ValueError when not even one pipeline fits."""
    roles_size = max(roles.values()) + 1
    size = roles_size + target_ranks - 1
    if world < size:
        split = f", and {target_ranks - 1} more for the target's tensor_parallel {target_ranks}" if target_ranks > 1 else ""
        raise ValueError(f"a pipeline needs {size} ranks ({', '.join(f'{r} {k}' for r, k in roles.items())}{split}), "
                         f"the launch has {world}")
    if 0 < local_world and size <= local_world and world % local_world == 0:
        starts = [(n * local_world + j * size, j) for n in range(world // local_world) for j in range(local_world // size)]
    else:  # a node cannot hold one: pipelines over the whole world
        starts = [(j * size, 0) for j in range(world // size)]
    pipelines = [Pipeline(i, {role: base + k for role, k in roles.items()}, slot,
                          tuple(range(base + roles_size, base + size))) for i, (base, slot) in enumerate(starts)]
    used = {r for p in pipelines for r in [*p.ranks.values(), *p.followers]}
    return Layout(pipelines, [r for r in range(world) if r not in used], world)


def pinned_cores(affinity: dict[str, list[int]] | None, role: str, node_slot: int) -> list[int] | None:
    """The cores `role` of the node's `node_slot`-th pipeline is pinned to (None: not pinned)."""
    if not affinity or role not in affinity:
        return None
    stride = max(c for cores in affinity.values() for c in cores) + 1
    return [c + node_slot * stride for c in affinity[role]]


def _ranges(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"rank {a}" if a == b else f"ranks {a}-{b}" for a, b in runs)

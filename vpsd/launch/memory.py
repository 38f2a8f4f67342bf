"""A launch's memory plan: which of a pipeline's ranks hold which models, what each has, and what follows.

`launch_plan(cfg, method)` lays one pipeline out as the launch would (launch/layout.py: the roles' ranks, then
the split target's followers) and asks models/memory_plan.py what each rank needs, from the checkpoints'
config.json (grown as `grow:` says) or a tiny spec's sizes; no weight is read. `Memory.of_node` is what the
node has: a GPU rank its GPU's free memory (`torch.cuda.mem_get_info`, divided among the ranks that GPU
serves), the ranks on the host together its MemAvailable (one pool: a rank that needs little leaves the rest
to the others).

`refusal(cfg, method, plan, memory)`: the line that refuses a layout that cannot fit (launch/preflight.py says
it at launch on every rank, before any weight loads), naming the rank, what it needs, what it has and the
smallest target split that would fit. `kv_budget_mib(plan, memory)`: what `batching.kv_budget_mib` defaults to
(`with_kv_budget`), the KV room the tightest rank has left, in the leader's accounting (engine/scheduler.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from vpsd.config import RunConfig
from vpsd.launch.layout import FOLLOWER, SOLO, plan
from vpsd.models.memory_plan import (CACHE_SPARE, DTYPE_BYTES, Held, RankNeed, describe, fits, gib, kv_budget,
                                     rank_need, smallest_k)
from vpsd.models.shapes import ModelShape, ShapeError, grown_config_dict, model_shape, tiny_config_dict
from vpsd.models.spec import ModelSpec
from vpsd.pipeline.methods import DraftPlace, Method


@dataclass(frozen=True)
class LaunchPlan:
    needs: list[RankNeed]
    devices: dict[int, str]  # rank -> the device its models live on ("cpu" for a rank without one)
    context: int  # tokens a sequence may hold: video.context_limit, or the target's max_position_embeddings

    def on_host(self) -> list[RankNeed]:
        return [n for n in self.needs if not self.devices[n.rank].startswith("cuda")]

    def host_total(self) -> int:
        return sum(n.with_tokens(self.context) for n in self.on_host())


def spec_shape(family: str, spec: ModelSpec) -> ModelShape:
    """A spec's shape from its config alone: a checkpoint's config.json (grown as `grow:` asks), a tiny's sizes."""
    if spec.tiny is not None:
        return model_shape(family, tiny_config_dict(family, spec.tiny))
    try:
        config = json.loads((Path(spec.path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ShapeError(f"cannot read {Path(spec.path) / 'config.json'}: {e}") from None
    if spec.grow is not None:
        config = grown_config_dict(config, spec.grow["width"], spec.grow["layers"])
    return model_shape(family, config)


def pipeline_models(cfg: RunConfig, method: Method, k: int | None = None) -> dict[tuple[int, str], list[Held]]:
    """(rank, role) -> the models it holds, for one pipeline of `cfg` split over k target ranks."""
    k = k or cfg.target.tensor_parallel
    target = spec_shape(cfg.family, cfg.target)
    draft = spec_shape(cfg.family, cfg.draft) if cfg.draft is not None else None
    place = method.draft_place(cfg.batching.size, cfg.batching.pipelined)
    remote = place is DraftPlace.REMOTE
    pipeline = plan(len(cfg.roles) + k - 1 if remote else k, len(cfg.roles) + k - 1 if remote else k,
                    dict(cfg.roles) if remote else dict(SOLO), k).pipelines[0]
    tb, db = DTYPE_BYTES[cfg.target.dtype], DTYPE_BYTES[(cfg.draft or cfg.target).dtype]
    leader = [Held(target, tb, k)]
    if place is DraftPlace.LOCAL and method.loads_draft_model:
        # in the target's process: its own weights, or (draft: self) a second cache on the target's
        leader.append(Held(draft, db) if draft is not None else Held(target, tb, k, embeds=False, cache_only=True))
    out = {(pipeline.target, "target"): leader}
    out.update({(r, FOLLOWER): [Held(target, tb, k, embeds=False)] for r in pipeline.followers})
    if remote:
        out[(pipeline.ranks["draft"], "draft")] = [Held(draft, db) if draft is not None else Held(target, tb)]
        out[(pipeline.ranks["pruner"], "pruner")] = []
    return out


def k_of(cfg: RunConfig, k: int | None) -> int:
    return k or cfg.target.tensor_parallel


def launch_plan(cfg: RunConfig, method: Method, k: int | None = None) -> LaunchPlan:
    models = pipeline_models(cfg, method, k)
    context = cfg.video.context_limit or spec_shape(cfg.family, cfg.target).max_positions
    rows = cfg.batching.size * (cfg.decoding.gamma_max + 1)  # a batch's verify rows of logits
    needs, devices = [], {}
    for (rank, role), held in sorted(models.items()):
        device = {"target": cfg.target.device, FOLLOWER: cfg.target.device,
                  "draft": (cfg.draft or cfg.target).device}.get(role, "cpu")
        need = rank_need(rank, role, held, context, rows, device)
        # engine/prefix_cache.py: the target's kept prefixes; a draft rank's kept vision features (roles/draft.py)
        if role == "target" and k_of(cfg, k) == 1 and cfg.reuse.budget_bytes:
            need = dataclasses.replace(need, reuse=cfg.reuse.budget_bytes)
        elif role == "draft" and cfg.reuse.draft_budget_bytes:
            need = dataclasses.replace(need, reuse=cfg.reuse.draft_budget_bytes)
        # video/frame_cache.py: decoded frames, kept by the ranks that read videos (the target's leader; a draft
        # rank reading its own, video.share_frames false) in host memory: counted where that is the rank's
        reads = role == "target" or (role == "draft" and not cfg.video.share_frames)
        if cfg.reuse.frames_bytes and reads and not device.startswith("cuda"):
            # and the last kept video's prepared pixels, at most the same budget a model that embeds it
            # (models/pixel_memo.py)
            memo = sum(cfg.reuse.frames_bytes for h in held if h.embeds and not h.cache_only)
            need = dataclasses.replace(need, frames=cfg.reuse.frames_bytes + memo)
        needs.append(need)
        devices[rank] = device
    return LaunchPlan(needs, devices, context)


@dataclass(frozen=True)
class Memory:
    """What the ranks of this node may use: each GPU rank its GPU's free memory over the ranks that GPU serves
    (rank LOCAL_RANK takes GPU LOCAL_RANK % gpus: transport/placement.py), the ranks on the host together its
    MemAvailable (`copies`: the pipelines this node holds)."""

    gpu: int | None  # bytes a GPU rank may use; None: no GPU, or not known
    host: int
    copies: int = 1
    gpu_where: str = "its GPU's free memory"

    @classmethod
    def of_node(cls, local_world: int, gpus: int, pipeline_size: int, device: str) -> "Memory":
        gpu, where = None, "its GPU's free memory"
        if gpus and device.startswith("cuda"):
            import torch

            index = int(device.partition(":")[2] or int(os.environ.get("LOCAL_RANK", "0")) % gpus)
            shared = math.ceil(local_world / gpus)
            gpu = torch.cuda.mem_get_info(index)[0] // shared
            where += f", shared by {shared} ranks" if shared > 1 else ""
        return cls(gpu, host_available(), max(1, local_world // pipeline_size), where)


def host_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def split_candidates(cfg: RunConfig, above: int) -> list[int]:
    """Target splits the heads and MLP allow, above `above`, up to the KV heads (each rank one at least)."""
    s = spec_shape(cfg.family, cfg.target)
    return [k for k in range(above + 1, s.kv_heads + 1)
            if s.heads % k == 0 and s.kv_heads % k == 0 and s.intermediate % k == 0]


def refusal(cfg: RunConfig, method: Method, lp: LaunchPlan, memory: Memory) -> str | None:
    """One line for the first GPU rank that cannot fit, or for the host whose ranks together cannot (None: all
    fit)."""
    for n in lp.needs:
        if lp.devices[n.rank].startswith("cuda") and memory.gpu is not None and not fits(n, memory.gpu, lp.context):
            line = (f"memory: {n.role} (rank {n.rank}) needs {gib(n.with_tokens(lp.context))} "
                    f"({describe(n, lp.context)}) but has {gib(memory.gpu)} ({memory.gpu_where})")
            return line + "; " + _remedy(cfg, method, n, memory.gpu, lp.context)
    total = lp.host_total() * memory.copies
    if lp.on_host() and total > memory.host:
        n = max(lp.on_host(), key=lambda m: m.with_tokens(lp.context))
        others = len(lp.on_host()) * memory.copies - 1
        return (f"memory: {n.role} (rank {n.rank}) needs {gib(n.with_tokens(lp.context))} ({describe(n, lp.context)})"
                + (f", with the {others} other rank{'s' if others > 1 else ''} on this host {gib(total)}," if others
                   else "")
                + f" but the host has {gib(memory.host)} available; on one host a split target needs more, not less "
                f"(each rank holds the unsplit parts): a smaller model, dtype or video.context_limit, or more hosts")
    return None


def _remedy(cfg: RunConfig, method: Method, n: RankNeed, has: int, context: int) -> str:
    if n.role not in ("target", FOLLOWER):
        return f"the {n.role} is not split: a smaller model, dtype or video.context_limit"
    k = cfg.target.tensor_parallel
    best = smallest_k(lambda kk: [m for m in launch_plan(cfg, method, kk).needs if m.role in ("target", FOLLOWER)],
                      has, context, split_candidates(cfg, k))
    if best is None:
        return f"no target.tensor_parallel above {k} fits ranks of {gib(has)} (a smaller video.context_limit may)"
    return f"target.tensor_parallel {best} would fit ranks of {gib(has)}"


def node_plan(cfg: RunConfig, method: Method, local_world: int, gpus: int) -> tuple[LaunchPlan, Memory]:
    """This launch's plan and what this node has for it (at launch, before any model loads)."""
    lp = launch_plan(cfg, method)
    return lp, Memory.of_node(local_world, gpus, len(lp.needs), cfg.target.device)


def with_kv_budget(cfg: RunConfig, lp: LaunchPlan, memory: Memory) -> RunConfig:
    """`cfg` with `batching.kv_budget_mib` from the plan where the config leaves it null."""
    if cfg.batching.kv_budget_mib is not None or (budget := kv_budget_mib(lp, memory)) is None:
        return cfg
    return dataclasses.replace(cfg, batching=dataclasses.replace(cfg.batching, kv_budget_mib=max(budget, 1.0)))


def kv_budget_mib(lp: LaunchPlan, memory: Memory) -> float | None:
    """The KV room the tightest cache-holding rank leaves, as the leader's scheduler counts it (tokens x its bytes
    per token): each GPU rank's own room, the host's shared by its ranks in proportion to their KV per token.
    None where a GPU rank's memory is unknown."""
    leader = next(n for n in lp.needs if n.role == "target")
    tokens = []
    host = [n for n in lp.on_host() if n.kv_per_token]
    if host:
        fixed = sum(n.fixed for n in lp.on_host()) * memory.copies
        per_token = sum(n.kv_per_token for n in host) * memory.copies
        tokens.append(max(0, memory.host - fixed) / CACHE_SPARE / per_token)
    for n in lp.needs:
        if n.kv_per_token and lp.devices[n.rank].startswith("cuda"):
            if memory.gpu is None:
                return None
            tokens.append(kv_budget(n, memory.gpu) / n.kv_per_token)
    return min(tokens) * leader.kv_per_token / 2**20 if tokens else None

"""Checks of a job's settings that need no weights: run at launch, so a bad setting costs seconds, not a model load.

`checkpoint_problems(cfg)`: every checkpoint `path` exists and is a transformers checkpoint (a config.json), and
its `model_type` is the config's `family` (a Qwen3-VL checkpoint under `family: qwen2_5_vl` would otherwise load
its weights into the wrong classes and fail later on an attribute); under `video.sampling: checkpoint`, the target
checkpoint names a frame rule. One line per problem.
`affinity_problems(cfg)`: every core `cpu_affinity` pins a role to is one this job may run on.
`device_problems(cfg, gpus)`: every model's `device` is "cpu", "cuda" (the rank's own GPU) or a "cuda:N" this
node has.
`path_problems(manifest, out)`: the manifest is a readable file, and --out is (or can be made) a directory.
`tensor_parallel_problems(cfg, method, ...)`: what a target split over ranks cannot run with.
`memory_problems(cfg, method, ...)`: a layout whose ranks cannot fit this node's memory (launch/memory.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from vpsd.launch.layout import pinned_cores
from vpsd.launch.memory import node_plan, refusal
from vpsd.config import RunConfig, nearest
from vpsd.models.checkpoint import CheckpointError, read_checkpoint, read_frame_sampling
from vpsd.models.shapes import ShapeError
from vpsd.models.spec import FAMILY_MODULES
from vpsd.models.tensor_parallel import shard_problems
from vpsd.pipeline.methods import CHAINS, DraftPlace, Method


# The weight files vpsd reads, whole or sharded (models/sharded_load.py: safetensors, sliced in place).
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def checkpoint_problems(cfg: RunConfig) -> list[str]:
    if cfg.family not in FAMILY_MODULES:
        return [f"unknown model family {cfg.family!r}{nearest(cfg.family, FAMILY_MODULES)}; known: {sorted(FAMILY_MODULES)}"]
    problems = []
    for role, spec in (("target", cfg.target), ("draft", cfg.draft)):
        if spec is None or spec.path is None:
            continue
        path = Path(spec.path)
        if not path.exists():
            problems.append(f"{role}.path: no such checkpoint directory: {path}")
        elif not (path / "config.json").is_file():
            problems.append(f"{role}.path: {path} has no config.json: not a transformers checkpoint")
        else:
            try:
                model_type = json.loads((path / "config.json").read_text()).get("model_type")
            except (OSError, ValueError) as e:
                problems.append(f"{role}.path: cannot read {path / 'config.json'}: {e}")
                continue
            # The family names are the transformers model_type of their checkpoints.
            if model_type != cfg.family:
                hint = f"; set family: {model_type}" if model_type in FAMILY_MODULES else ""
                problems.append(f"family {cfg.family!r} does not match the {role} checkpoint {path} "
                                f"(its config.json says model_type {model_type!r}){hint}")
                continue
            # What loading it reads before the weights (the processor, tokenizer and generation files), and
            # that there are weights: otherwise a traceback on the rank that loads it, after the others start.
            try:
                read_checkpoint(path, cfg.family)
            except CheckpointError as e:
                problems.append(f"{role}.path: {e}")
                continue
            if not any((path / f).is_file() for f in WEIGHTS):
                problems.append(f"{role}.path: {path} holds no weights ({' or '.join(WEIGHTS)}; vpsd reads safetensors)")
    return problems or sampling_problems(cfg)


def sampling_problems(cfg: RunConfig) -> list[str]:
    """`video.sampling: checkpoint` needs a target checkpoint whose video processor names a count or a rate."""
    if cfg.video.sampling != "checkpoint":
        return []
    if cfg.target.path is None:
        return ["video.sampling: checkpoint needs a target checkpoint `path` (a tiny model has no processor "
                "files); use video.sampling: config"]
    try:
        rule = read_frame_sampling(cfg.target.path, cfg.family)
    except CheckpointError as e:
        return [f"video.sampling: checkpoint: {e}"]
    if rule is None:
        return [f"video.sampling: checkpoint: {cfg.target.path}'s video processor names no num_frames or fps "
                "(LLaVA-OneVision's published checkpoints do not); use video.sampling: config with "
                "video.num_frames (the LLaVA-OneVision paper samples 32)"]
    return []


def device_problems(cfg: RunConfig, gpus: int) -> list[str]:
    """Each model's device must exist on a node with `gpus` GPUs: "cuda:3" on a 1-GPU node, or "cuda" on a machine
    without one, otherwise failed at the first model load, in every rank's traceback. A bare "cuda" is the rank's
    own GPU (transport/placement.py); "cuda:N" pins that model of every pipeline on the node to GPU N."""
    problems = []
    for role, spec in (("target", cfg.target), ("draft", cfg.draft)):
        if spec is None:
            continue
        kind, _, index = spec.device.partition(":")
        if kind == "cpu" and not index:
            continue
        if kind != "cuda" or (index and not index.isdigit()):
            problems.append(f"{role}.device: {spec.device!r} is not a device vpsd runs on (cpu, cuda or cuda:N)")
        elif not gpus:
            problems.append(f"{role}.device: {spec.device!r} but this machine has no CUDA device that torch can use "
                            f"(set {role}.device: cpu, or install a CUDA build of torch)")
        elif index and int(index) >= gpus:
            problems.append(f"{role}.device: {spec.device!r} but this node has {gpus} GPU{'s' if gpus > 1 else ''} "
                            f"(cuda:0{f'-{gpus - 1}' if gpus > 1 else ''}); a bare 'cuda' takes each rank's own")
    return problems


def affinity_problems(cfg: RunConfig, allowed: set[int] | None = None, slots: int = 1) -> list[str]:
    """The cores `cpu_affinity` names must be ones this process may use (`allowed`, default its own affinity): a
    config written for a bigger machine otherwise failed at the first pin with a bare OSError in one rank's
    traceback, or, with some of a role's cores present, ran silently on fewer. Every rank checks every role, so on
    one node they all refuse alike; a job over several nodes whose core numbers differ pins nothing. With
    `slots` pipelines a node, each takes the layout shifted past the last (launch/layout.py: pinned_cores)."""
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    span = _ranges(sorted(allowed))
    problems = []
    for slot in range(slots):
        for role in cfg.cpu_affinity or {}:
            cpus = pinned_cores(cfg.cpu_affinity, role, slot) or []
            if missing := sorted(set(cpus) - allowed):
                where = f" (pipeline {slot + 1} of {slots} on this node)" if slots > 1 else ""
                problems.append(f"cpu_affinity.{role}: core{'s' if len(missing) > 1 else ''} {_ranges(missing)}{where} "
                                f"not available to this job (it may run on {span}; pin to those, or set "
                                f"cpu_affinity: null)")
    return problems


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def path_problems(manifest: Path, out: Path) -> list[str]:
    """What the target rank would otherwise meet as a traceback once models load: a manifest it cannot read, an
    --out that is a file or under one, or in a directory it may not write."""
    problems = []
    if not manifest.exists():
        problems.append(f"--manifest {manifest}: no such file")
    elif not manifest.is_file():
        problems.append(f"--manifest {manifest}: not a file")
    elif not os.access(manifest, os.R_OK):
        problems.append(f"--manifest {manifest}: not readable")
    # The deepest part of --out that exists must be a directory this job may write in (it makes the rest).
    there = out
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        problems.append(f"--out {out}: {there} is a file, not a directory")
    elif not os.access(there, os.W_OK | os.X_OK):
        problems.append(f"--out {out}: no permission to write in {there}")
    return problems


def tensor_parallel_problems(cfg: RunConfig, method: Method, gpus: int, local_world: int) -> list[str]:
    """What a target split over `target.tensor_parallel` ranks (models/tensor_parallel.py) cannot run with, said
    at launch: every operation on the target's cache must be one its followers mirror."""
    k = cfg.target.tensor_parallel
    problems = []
    if cfg.draft is not None and cfg.draft.tensor_parallel != 1:
        problems.append(f"draft.tensor_parallel: {cfg.draft.tensor_parallel}: only the target is split over ranks")
    if k == 1:
        return problems
    where = f"target.tensor_parallel {k}"
    place = method.draft_place(cfg.batching.size, cfg.batching.pipelined, cfg.draft_on)
    tree = method.draft_tree(cfg.decoding.tree) is not None
    if tree or method.draft == "sparse_kv":
        what = f"a {method.tree} tree" if tree else "Sparse-to-Dense's sparse KV"
        problems.append(f"{where}: method {method.name} drafts {what}, whose cache surgery is not mirrored to the "
                        f"target's other ranks; split targets run {', '.join(CHAINS)} (trees as chains: "
                        f"decoding.tree: chain)")
    if method.draft == "views" and place is DraftPlace.LOCAL and cfg.draft is None:
        problems.append(f"{where}: tabed's views of the target itself (draft: self) are not mirrored; give it a draft")
    if cfg.target.capture is not None:
        problems.append(f"{where}: captured steps (target.capture) do not run on a split target yet")
    sizes = _text_sizes(cfg.target)
    if sizes is not None:
        problems += shard_problems(SimpleNamespace(**sizes), k)
    if cfg.target.device.startswith("cuda") and gpus < local_world:
        problems.append(f"{where}: a split target's ranks need a GPU each (NCCL refuses two ranks on one); this "
                        f"node has {gpus} GPU{'s' if gpus != 1 else ''} for {local_world} ranks")
    return problems


def _text_sizes(spec) -> dict | None:
    """The language model's head and MLP sizes from a tiny spec or a checkpoint's config.json (None: unknown)."""
    names = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    if spec.tiny is not None:
        text = spec.tiny.get("text", {})
    else:
        try:
            data = json.loads((Path(spec.path) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        text = data.get("text_config") or data
    if not all(n in text for n in (names[0], names[2])):
        return None
    return {n: text.get(n) or text[names[0]] for n in names}


def memory_problems(cfg: RunConfig, method: Method, local_world: int, gpus: int) -> list[str]:
    """The memory plan's line for a layout whose weights, one context-long item's KV cache and activations cannot
    fit this node (launch/memory.py), said before any weight loads; nothing where a config's sizes are unknown
    (the checks above name a missing config.json)."""
    try:
        lp, memory = node_plan(cfg, method, local_world, gpus)
    except (ShapeError, ValueError):
        return []
    line = refusal(cfg, method, lp, memory)
    return [line] if line else []

"""Point-to-point tensors over torch.distributed, announced on the control channel.

Contract:
- `init_distributed(startup_timeout_s)` waits for every rank of the launch (transport/startup.py: one line naming
  a rank that never arrives, under the start-up bound), then joins the process group torchrun describes
  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE) on the backend its placement picks
  (transport/placement.py): "cpu:gloo,cuda:nccl" when every rank has a GPU of its own (cuda tensors travel on
  NCCL, cpu tensors on gloo); gloo when ranks share a GPU, a cuda tensor then staged through host memory by
  both ends (the receiver still gets it on its GPU); gloo without CUDA.
- `TensorChannel.send(dst, tensors, tag)` first sends a `TensorAnnounce` (shapes, dtype names, device
  types) on the control channel, then starts one `isend` per tensor and returns a `SendHandle`: the
  sender may overlap work and `wait()` later. The handle keeps the tensors alive until then.
- The receiver gets the announce from its control loop and calls `recv_announced(announce)` (or
  `recv(src, shapes, dtypes)`); tensors from one sender must be received in the order announced.
- dtypes travel as names ("float32", "bfloat16", "int64"); unknown names raise ValueError.
- Only tensors: never `send_object_list` and friends, which pickle.
- A transfer the peer does not complete within the channel's `timeout_s` (--timeout: a stopped or dead peer)
  raises `PeerTimeout` naming the peer, not gloo's bare RuntimeError. The process group's own timeout is the
  start-up bound (its connect must wait for ranks that come up late), so every wait here names its limit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from vpsd.pipeline.messages import TensorAnnounce
from vpsd.transport.control import ControlChannel, PeerTimeout
from vpsd.transport.placement import this_placement
from vpsd.transport.startup import await_connected, await_ranks, late_start_hook, make_store

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype ("float32", ...)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the tensor channel") from None


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for a wire name; ValueError for an unknown one."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {sorted(DTYPES)}") from None


def init_distributed(startup_timeout_s: float = 600.0, say: Callable[[str], None] = print,
                     progress: bool = True) -> tuple[int, int, str]:
    """Wait for every rank (RanksMissing naming those that never came, after `startup_timeout_s`, said once through
    `say`; rank 0's progress lines meanwhile unless not `progress`), join torchrun's process group (once) and
    return (rank, world_size, backend)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed needs torchrun's environment; missing {missing}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    placement = this_placement(local_rank, local_world)
    if placement.gpu is not None:  # a bare "cuda" (a model spec's device) is this GPU from now on
        torch.cuda.set_device(placement.gpu)
    late_start_hook(rank)
    store = make_store(startup_timeout_s, say)
    await_ranks(store, rank, world_size, local_world, startup_timeout_s, say, progress)
    # Everyone is here: gloo's mesh connect is quick now. Its timeout stays the start-up bound (it is also the
    # default of every later wait in this group; TensorChannel waits name their own, --timeout).
    dist.init_process_group(placement.backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=startup_timeout_s))
    await_connected(store, rank, world_size, startup_timeout_s, say)  # no rank leaves while a peer still connects
    return rank, world_size, placement.backend


@dataclass
class SendHandle:
    """In-flight sends of one announced batch; `wait()` before reusing or freeing the tensors."""

    works: list[dist.Work]
    tensors: list[torch.Tensor] = field(repr=False)  # the wire tensors, alive until the sends complete
    dst: int = -1
    dst_role: str | None = None
    timeout_s: float = 60.0  # the channel's, when a wait names none

    def wait(self, timeout_s: float | None = None) -> None:
        for work in self.works:
            _wait(work, timeout_s or self.timeout_s, self.dst, self.dst_role, "tensors to be taken by")
        self.works.clear()
        self.tensors.clear()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class TensorChannel:
    """Announced point-to-point tensor transfers for one rank (uses its ControlChannel for announces)."""

    def __init__(self, control: ControlChannel, group: dist.ProcessGroup | None = None,
                 timeout_s: float = 60.0) -> None:
        """`timeout_s`: how long a transfer may wait on its peer (--timeout), unless a wait names its own."""
        self.control = control
        self.group = group
        self.timeout_s = timeout_s
        self._staged: bool | None = None

    @property
    def stages_cuda(self) -> bool:
        """Whether cuda tensors go through host memory: the group has no NCCL (ranks share a GPU)."""
        if self._staged is None:
            self._staged = "nccl" not in str(dist.get_backend(self.group))
        return self._staged

    @property
    def rank(self) -> int:
        return self.control.rank

    def send(self, dst: int, tensors: Sequence[torch.Tensor], tag: str, epoch: int = 0, item_id: str = "",
             names: Sequence[str] = ()) -> SendHandle:
        """Announce `tensors` to `dst` under `tag` (and the item they belong to, their names), then start sending
        them; returns the in-flight handle."""
        wire = [t.detach().contiguous() for t in tensors]
        devices = [_device_type(t.device) for t in wire]
        if self.stages_cuda:  # a host copy travels; `devices` still says cuda, so the receiver puts it back there
            wire = [t.cpu() for t in wire]
        announce = TensorAnnounce(
            tag=tag,
            item_id=item_id,
            names=list(names),
            shapes=[list(t.shape) for t in wire],
            dtypes=[dtype_name(t.dtype) for t in wire],
            src=self.rank,
            epoch=epoch,
            devices=devices,
        )
        # Announce first: the receiver sits in its control loop and can only post the matching recvs
        # once it knows the shapes; a large gloo/nccl send blocks until then.
        self.control.send(dst, announce)
        works = [dist.isend(t, dst, group=self.group) for t in wire if t.numel() > 0]
        return SendHandle([w for w in works if w is not None], wire, dst, self.control.peer_role(dst), self.timeout_s)

    def recv(
        self,
        src: int,
        shapes: Sequence[Sequence[int]],
        dtypes: Sequence[str],
        devices: Sequence[str] = (),
    ) -> list[torch.Tensor]:
        """Receive tensors of the given shapes/dtype names from `src`, allocated on `devices` (default cpu)."""
        if len(shapes) != len(dtypes) or (devices and len(devices) != len(shapes)):
            raise ValueError(f"{len(shapes)} shapes, {len(dtypes)} dtypes, {len(devices)} devices")
        places = [_local_device(devices[i] if devices else "cpu") for i in range(len(shapes))]
        landing = [torch.device("cpu") if self.stages_cuda else d for d in places]
        out = [torch.empty(list(shape), dtype=dtype_from_name(dt), device=d)
               for shape, dt, d in zip(shapes, dtypes, landing)]
        works = [dist.irecv(t, src, group=self.group) for t in out if t.numel() > 0]
        for work in works:
            if work is not None:
                _wait(work, self.timeout_s, src, self.control.peer_role(src), "announced tensors from")
        return [t.to(d) for t, d in zip(out, places)]

    def recv_announced(self, announce: TensorAnnounce) -> list[torch.Tensor]:
        """Receive the tensors that `announce` described, from its sender."""
        return self.recv(announce.src, announce.shapes, announce.dtypes, announce.devices)


def _wait(work: dist.Work, timeout_s: float, peer: int, role: str | None, what: str) -> None:
    """work.wait(timeout), the timeout naming the peer."""
    started = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:  # gloo: "Timed out waiting ...ms for send/recv operation", or the peer's socket closed
        raise PeerTimeout(peer, role, time.monotonic() - started, what) from e


def _device_type(device: torch.device) -> str:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors on {device} cannot travel on the tensor channel")
    return device.type


def _local_device(kind: str) -> torch.device:
    """The receiver's device for a wire device type: cuda means this rank's current GPU."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"unknown wire device {kind!r}")

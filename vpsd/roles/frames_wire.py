"""The frames a draft rank takes from the target instead of decoding the item's video a second time
(`video.share_frames`).

The target's process has read, scaled and fitted the item's frames (launch/items.py); the draft's are exactly
those (the same request, capped alike). So the target's JobStart says they follow (`video["frames"]: "follow"`,
and no `next_video`: nothing is left for the draft to read ahead) and the frames go right after it on the tensor
channel, announced under `TAG` (a (T, H, W, 3) uint8 tensor, and the (T,) float64 times when the item has them),
sent from the same thread back to back, as a verdict and TABED's target rows are: the draft takes the next
message from the target as their announce (`recv_announced`). The send does not wait (the draft posts its receive
when it handles the JobStart); the target keeps the handle until it completes.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from vpsd.pipeline.messages import JobStart

TAG = "frames"
FOLLOW = "follow"


def announce(job: JobStart) -> JobStart:
    """The JobStart that tells the draft the frames follow it."""
    return msgspec.structs.replace(job, video={**job.video, "frames": FOLLOW}, next_video=None)


def follow(job: JobStart) -> bool:
    """Whether the item's frames follow its JobStart on the tensor channel."""
    return job.video.get("frames") == FOLLOW


def pack(frames: np.ndarray, times: np.ndarray | None) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of the frames and their times, sharing their memory where they can."""
    names, arrays = ["frames"], [frames]
    if times is not None:
        names.append("times")
        arrays.append(np.asarray(times, dtype=np.float64))
    tensors = [torch.from_numpy(np.ascontiguousarray(a) if a.flags.writeable else np.array(a)) for a in arrays]
    return names, tensors


def unpack(names: list[str], tensors: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray | None]:
    named = dict(zip(names, tensors))
    if "frames" not in named or len(names) != len(tensors):
        raise ValueError(f"frames tag names {names}, {len(tensors)} tensors arrived")
    times = named.get("times")
    return named["frames"].numpy(), None if times is None else times.numpy()

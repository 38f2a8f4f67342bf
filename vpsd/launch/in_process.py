"""A parallel method's draft and pruner on threads of the target's process (`draft_on: thread`).

The same roles as on their own ranks (roles/draft.py `draft_role`, roles/pruner.py `pruner_role`) and the same
drafter on the target's side (engine/drafters/remote.py `RemoteDrafter`), over an in-process carrier (roles/thread_link.py)
instead of ZeroMQ and torch.distributed: the draft drafts while the target verifies, as between ranks. Why: on one
GPU, ranks of their own are processes whose kernels the GPU time-slices (and NCCL refuses two ranks on one GPU,
so their tensors go through host memory); threads of one process share the GPU through streams, each role's
thread issuing its work on a CUDA stream of its own, and a captured step is one graph launch, so a thread holds
the GIL for little of it. On a CPU, torch releases the GIL inside its ops, so the draft's forwards and the
target's run on separate cores as the ranks' do.

What differs from ranks: one process to fail (a role thread that raises ends the job through the target's
next wait, naming it), and the pruner's signals are handed over as copies instead of sent.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from vpsd.config import RunConfig
from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.pipeline.methods import Method
from vpsd.roles.draft import FrameSource, draft_role
from vpsd.roles.pruner import pruner_role
from vpsd.engine.drafters.remote import RemoteDrafter
from vpsd.roles.thread_link import ThreadHub
from vpsd.tracing import get_logger

ROLES = ("target", "draft", "pruner")


class RoleThreads:
    """The draft and pruner roles running on threads; `drafter` is the target's side of them."""

    def __init__(self, target: VideoLMAdapter, draft: VideoLMAdapter, cfg: RunConfig, method: Method,
                 out: Path | None, job_id: str, timeout_s: float, videos: FrameSource | None = None) -> None:
        """`videos`: where the draft takes an item's frames from (default: it reads the item's file, read ahead)."""
        self.hub = ThreadHub(ROLES, cfg.idle_timeout_s)
        started = time.monotonic()
        bodies = {"draft": lambda: draft_role(self.hub.link("draft"), draft, cfg, method.draft, started, videos),
                  "pruner": lambda: pruner_role(self.hub.link("pruner"), cfg, out, started)}
        self.threads = [threading.Thread(target=self._run, args=(role, body, draft.device), name=f"vpsd-{role}",
                                         daemon=True) for role, body in bodies.items()]
        for thread in self.threads:
            thread.start()
        self.drafter = RemoteDrafter(self.hub.link("target"), target, cfg, job_id=job_id, timeout_s=timeout_s,
                                     target_probs=verdicts_carry_target_probs(method.draft, cfg.tabed_settings,
                                                                              cfg.decoding.temperature))

    def _run(self, role: str, body, device: torch.device) -> None:
        try:
            with _own_stream(device):
                body()
        except BaseException as e:  # noqa: BLE001 - the target's next wait names it; the thread ends here
            get_logger().error("role_thread_failed", role=role, error=f"{type(e).__name__}: {e}")
            self.hub.fail(role, e)

    def stop(self, timeout_s: float = 30.0) -> None:
        """After the last item: the drafter's shutdown (the roles leave their loops), then the threads' end."""
        self.drafter.shutdown()
        for thread in self.threads:
            thread.join(timeout_s)


def _own_stream(device: torch.device):
    """The thread's work on a CUDA stream of its own, so that it overlaps the target's (a no-op on a CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))

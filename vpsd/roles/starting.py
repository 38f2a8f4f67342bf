"""How the target starts an item with its draft on its own rank (engine/drafters/remote.py), on the engine's thread or ahead:
the JobStart the draft and the pruner are told, and the full prefill that streams the pruner its signals."""

from __future__ import annotations

import torch

from vpsd.activity import ACTIVITY
from vpsd.config import PruningConfig
from vpsd.engine.request import Request
from vpsd.models.base import VideoLMAdapter
from vpsd.models.prompt import ControlText
from vpsd.engine.pair_prefill import prefill_for_strategy, signals_needed
from vpsd.pipeline.messages import JobStart
from vpsd.pipeline.pruning.strategies import STRATEGIES
from vpsd.roles.link import Link
from vpsd.roles.signals_wire import TAG, pack
from vpsd.tracing import span


def job_start(job_id: str, item: Request, seed: int, gamma: int, target: VideoLMAdapter) -> JobStart:
    """What the draft and the pruner are told of a new item: how to read its video (and the next one's, to
    read ahead), its prompt, its budget and the target's EOS set, the window to draft with."""
    return JobStart(job_id=job_id, item_id=item.id, seed=seed, max_new_tokens=item.max_new_tokens, gamma=gamma,
                    eos_token_ids=list(target.eos_token_ids), video=item.video, next_video=item.next_video,
                    prompt=str(item.prompt), prompt_special_tokens=isinstance(item.prompt, ControlText),
                    reuse=bool(item.reuse))


def job_prompt(job: JobStart) -> str:
    """The item's prompt as the target read it: control text stays control text."""
    return ControlText(job.prompt) if job.prompt_special_tokens else job.prompt


def prefill_streaming_signals(link: Link, cfg: PruningConfig, target: VideoLMAdapter, emb, item_id: str,
                              timeout_s: float):
    """Full prefill; the pruner's signals leave as early as they exist, so it and the draft's pruned prefill
    overlap the rest of this prefill (HIPPO's synchronous draft-target prefill, ParallelVLM's streaming).

    Signals measured by the prefill (attention, hidden states) leave from inside it, right after layer L-1
    (models/signals.py calls back there; the send is non-blocking and the prefill goes on); a strategy that
    reads none of them gets its signals before the prefill starts. Returns the PrefillResult.
    """
    base = {"visual_embeds": emb.visual_embeds.float()} if STRATEGIES[cfg.strategy].needs_visual_embeds else {}
    in_flight = []

    def send(measured: dict[str, torch.Tensor]) -> None:
        names, tensors = pack({**base, **measured}, emb.layout)
        with span("send", item=item_id, what="signals"):
            in_flight.append(link.send_tensors("pruner", tensors, tag=TAG, item_id=item_id, names=names))
        ACTIVITY.passing("signals-sent")

    attention, hidden = signals_needed(cfg)
    if not (attention or hidden):
        send({})
    with span("prefill", item=item_id, tokens=emb.seq_len):
        pre = prefill_for_strategy(target, emb, cfg, on_ready=lambda signals: send(signals.as_tensors()), parallel=True)
    pre.signals = None  # sent; not needed while decoding
    for handle in in_flight:
        handle.wait(timeout_s)  # a stopped pruner: PeerTimeout naming it, not gloo's bare timeout
    return pre


class HeldSignals:
    """Stands in for the link while an item prefills on a thread of its own (the transport belongs to the role's
    thread): the signals are kept, and `release` sends them from the role's thread once the prefill is done. The
    pruner then starts after the target's whole prefill instead of from inside it; that costs the new item a
    little latency, never the batch a round."""

    def __init__(self) -> None:
        self.held: list[dict] = []

    def send_tensors(self, dst: str, tensors, tag: str, epoch: int = 0, item_id: str = "",
                     names=()) -> "HeldSignals":
        self.held.append({"tensors": list(tensors), "tag": tag, "item_id": item_id, "names": list(names)})
        return self

    def wait(self, timeout_s: float | None = None) -> None:
        pass  # nothing is on the wire yet

    def release(self, link: Link, timeout_s: float) -> None:
        handles = [link.send_tensors("pruner", **held) for held in self.held]
        for handle in handles:
            handle.wait(timeout_s)
        self.held.clear()

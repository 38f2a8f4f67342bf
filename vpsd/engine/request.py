"""A `Request`: one item in flight, from the moment the launcher hands it over to its result.

The launcher fills what it read (prompt, frames, budget, how a draft rank reads the same video); the engine
fills the rest as the item is prefilled, joins the batch, is verified round by round and leaves. The same
object is prefilled (on any thread), joined, stepped and finished: per-item state lives here, never on the
batch, which each round is built from the requests in flight (vLLM v1's `Request`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from vpsd.pipeline.result import DecodeResult
from vpsd.models.base import PrefillResult, VideoInputs
from vpsd.pipeline.kv import CacheCursor
from vpsd.pipeline.layout import VideoTokenLayout
from vpsd.pipeline.sampling import ItemSampler
from vpsd.pipeline.state_machine import TargetMachine
from vpsd.pipeline.stats import AcceptanceStats
from vpsd.pipeline.stopping import stop_length

# A request's error when its client left (a server's): set between rounds, it leaves at the next one, KV freed.
CANCELLED = "cancelled: the client closed the request"


@dataclass
class Request:
    # ---- what the launcher hands over ----
    id: str
    prompt: str
    max_new_tokens: int
    frames: np.ndarray  # (T, H, W, 3) uint8, read, scaled and fitted to the context
    frame_times: np.ndarray | None = None  # (T,) seconds each frame was taken (None: the family's default rate)
    video: dict = field(default_factory=dict)  # how a draft rank reads the same frames (FrameRequest.to_wire)
    next_video: dict | None = None  # the next item's, so a draft rank reads it ahead
    stop: tuple[str, ...] = ()  # stop strings: decoding ends once the committed text holds one (pipeline/stopping.py)
    seed: int | None = None  # its draws' seed (pipeline/seeds.py); None: the run's decoding.seed, set at its prefill
    # Keep and reuse its video prefix (engine/prefix_cache.py) where reuse is on; False: one forward, nothing kept (a
    # job's item that no other item asks about the same video: launch/manifest.py shares_video).
    reuse: bool = True

    # ---- what the engine fills ----
    drafted: bool = True  # False: decoded plain, one token a round (the drafting policy's decision)
    inputs: VideoInputs | None = None  # its tokens and pixel tensors, until its prefill
    prefill: PrefillResult | None = None  # the target's, until the request joins the batch
    draft_handle: Any = None  # what the drafter keeps of its side of the prefill until the join
    machine: TargetMachine | None = None  # committed tokens, epoch, whether the next row is held
    cursor: CacheCursor | None = None  # which committed tokens the target's cache holds
    sampler: ItemSampler | None = None  # the target side's draws, seeded as the item's batch-1 run seeds them
    kept_row: torch.Tensor | None = None  # the target's logits row for position len(committed), when held
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    windows: list[int] = field(default_factory=list)  # the window each verified proposal was drafted under
    kv_bytes: int = 0  # what admission reserved for it
    started: float = 0.0  # time.time() when its prefill started (its trace span starts there)
    prefill_s: float = 0.0
    draft_prefill_s: float | None = None  # what drafting added to it (a local drafter's vision, pruning, prefill)
    decode_start: float = 0.0
    joined_round: int = 0
    num_video_tokens: int = 0
    num_kept: int | None = None  # video tokens the draft saw
    kept: torch.Tensor | None = None  # which ones (a local drafter's pruning; the pruner rank logs its own)
    layout: VideoTokenLayout | None = None
    first_chunk_wait: float | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds it waited, by span name (video_wait)
    error: str | None = None  # why it cannot be decoded (a drafter's report); it fails with this
    hit_stop: bool = False  # a stop string ended it (the engine looks after each commit)
    stop_checked: int = 0  # how many committed tokens were looked at for stop strings

    @property
    def committed(self) -> list[int]:
        return self.machine.committed

    @property
    def done(self) -> bool:
        return self.hit_stop or self.machine.done

    def look_for_stop(self, decode: Callable[[list[int]], str]) -> None:
        """Whether a stop string ended it: the text of a committed prefix not looked at yet holds one, as plain
        decoding would have seen it after that token (pipeline/stopping.py). `decode`: the target's tokenizer's."""
        if self.stop and not self.hit_stop:
            self.hit_stop = stop_length(decode, self.committed, self.stop, self.stop_checked + 1) is not None
            self.stop_checked = len(self.committed)

    def start_decoding(self, machine: TargetMachine, cache_length: int, sampler: ItemSampler, round_: int) -> None:
        """The request joins the batch: its first token is committed, its cache holds `cache_length` entries."""
        self.machine, self.cursor, self.sampler = machine, CacheCursor(cache_length), sampler
        self.decode_start, self.joined_round = time.perf_counter(), round_

    def result(self) -> DecodeResult:
        """What its batch-1 decoder would return."""
        r = DecodeResult(token_ids=self.machine.output(), stats=self.stats, prefill_s=self.prefill_s,
                         decode_s=time.perf_counter() - self.decode_start, num_kept=self.num_kept if self.drafted
                         else None, num_video_tokens=self.num_video_tokens, kept=self.kept, layout=self.layout)
        if self.drafted:
            r.gamma = sum(self.windows) / len(self.windows) if self.windows else 0.0
        if self.first_chunk_wait is not None:
            r.timings["first_chunk_wait"] = self.first_chunk_wait
        r.timings.update(self.timings)
        return r

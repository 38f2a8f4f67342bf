"""A manifest item's video, read for the target: the frames its request asks for, scaled and fitted to the
context, and the request a draft rank reads the same frames by.

Runs on the prefill thread; touches the target only through `prepare` (no model forward). Per item the
timings (`video_read_s`, `preprocess_s`) go into its result's stats; the same spans are in the target's trace.
An item whose prompt + video + max_new_tokens exceeds `video.context_limit` (default the target's
max_position_embeddings) fails as `too_long`, or is subsampled to fit when `video.subsample_to_fit` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vpsd.config import RunConfig
from vpsd.engine.request import Request
from vpsd.launch.manifest import ManifestItem
from vpsd.models.base import VideoLMAdapter
from vpsd.models.checkpoint import read_frame_sampling
from vpsd.tracing import get_logger
from vpsd.video.fit import fit_to_context
from vpsd.video.item import FrameRequest, cap_frames, load_frames, timed


def context_limit(target: VideoLMAdapter, cfg: RunConfig) -> int:
    """Tokens one sequence may hold: the config's limit, else what the target's positions allow."""
    if cfg.video.context_limit is not None:
        return int(cfg.video.context_limit)
    return int(target.model.config.get_text_config().max_position_embeddings)


@dataclass
class LoadedItem:
    frames: np.ndarray  # read, scaled, fitted to the context
    times: np.ndarray  # (T,) seconds at which each of those frames was taken
    video: dict  # the wire-form request the draft reads the same frames by (with max_frames if capped)
    timings: dict[str, float]  # video_read_s, preprocess_s


class ItemReader:
    def __init__(self, target: VideoLMAdapter, cfg: RunConfig) -> None:
        self.target, self.cfg = target, cfg
        self.limit = context_limit(target, cfg)
        # video.sampling: checkpoint: the target processor's rule (checked at launch by preflight).
        self.processor = (read_frame_sampling(cfg.target.path, cfg.family)
                          if cfg.video.sampling == "checkpoint" else None)

    def frame_request(self, item: ManifestItem) -> FrameRequest:
        v = self.cfg.video
        return FrameRequest.resolve(item.video, item.num_frames, item.fps, v.num_frames, v.fps, v.max_side,
                                    self.processor)

    def max_new_tokens(self, item: ManifestItem) -> int:
        return item.max_new_tokens or self.cfg.decoding.max_new_tokens

    def load(self, item: ManifestItem) -> LoadedItem:
        timings: dict[str, float] = {}
        request = self.frame_request(item)
        frames, times = load_frames(request, item.id, timings)
        reserve = self.max_new_tokens(item)
        with timed("preprocess", timings, item=item.id, step="fit"):
            # A capped clip's times are the same cap of the times (Qwen3-VL's prompt counts them).
            frames, max_frames = fit_to_context(
                frames, lambda f: self.target.prepare(f, item.prompt, cap_frames(times, len(f))).seq_len + reserve,
                self.limit, self.cfg.video.subsample_to_fit, item.video,
            )
        if max_frames is not None:
            get_logger().info("video_subsampled", item=item.id, frames=max_frames, limit=self.limit)
        return LoadedItem(frames, cap_frames(times, max_frames), request.to_wire(item.id, max_frames), timings)

    def request(self, item: ManifestItem, loaded: LoadedItem, nxt: ManifestItem | None) -> Request:
        """The item as the engine takes it: its frames, and how a draft rank reads them and the next item's."""
        return Request(item.id, item.prompt, self.max_new_tokens(item), loaded.frames, loaded.times, loaded.video,
                       self.frame_request(nxt).to_wire(nxt.id) if nxt is not None else None)

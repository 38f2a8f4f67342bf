"""Methods whose drafting the engine does not batch: a draft tree (sd-tree, specvlm) and Sparse-to-Dense's
sparse KV (std). Each item is decoded by the method's reference decoder (decoders/serial.py), one at a time,
inside the same scheduler loop as every other method: it joins, is decoded whole, and leaves."""

from __future__ import annotations

import dataclasses
import time

from vpsd.config import RunConfig
from vpsd.decoders.serial import decode_serial
from vpsd.engine.engine import Engine
from vpsd.engine.request import Request
from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.methods import Method
from vpsd.tracing import span


class ReferenceEngine(Engine):
    def __init__(self, target: VideoLMAdapter, cfg: RunConfig, method: Method, draft: VideoLMAdapter | None) -> None:
        super().__init__(target, cfg, 1)
        self.method, self.draft = method, draft

    def prefill(self, request: Request, on_engine_thread: bool) -> Request:
        request.started = time.time()
        return request  # its decoder prefills it

    def join(self, request: Request) -> Request:
        dec = dataclasses.replace(self.cfg.decoding, max_new_tokens=request.max_new_tokens)
        with span("decode", item=request.id, method=self.method.name):
            request.final = decode_serial(self.method, self.target, self.draft, request.frames, request.prompt, dec,
                                          self.cfg.pruning, request.frame_times)
        request.final.gamma = float(dec.serial_gamma())
        self._trace_item(request)
        return request

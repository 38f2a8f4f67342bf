"""The scheduler: which request runs when. One loop for every method, batch size and drafter place.

    run(items): until every item is done
        read (and at batch > 1 prefill) the next items ahead on a thread of their own   (PrefillAhead)
        admit what is ready while there is a free slot and its KV fits the budget        (`_admit`)
        at a thin batch, prefill on this thread too; at the manifest's tail, lend this thread the prefill cores
        with a remote drafter: take its messages; wait for a straggler's chunk while that costs less than
                                leaving it a round behind                                  (`patience_s`)
        one engine round; the requests that left are reported                            (engine/engine.py)

Admission: a request's KV cache (prompt + video + max_new_tokens + one window, the target's and, where the
draft runs in this process, the draft's) is reserved when it joins; one that does not fit beside the requests
in flight waits for a round to free some, and one that could not fit even alone fails with that error.

Whether a request drafts: `DraftingPolicy` (pipeline/drafting_policy.py), decided when its prefill starts,
with the prediction for where its draft runs (serial batch, pipelined batch, batch 1), and one explore
budget shared with the serial window's rounds.

At batch 1 nothing is prefilled ahead: a request is prefilled on the engine's thread when it is admitted, so
a remote drafter streams the pruner its signals from inside the prefill (HIPPO's synchronous prefill), and
every method's batch-1 timing is its batch-1 decoder's; the next items' videos are read ahead.
"""

from __future__ import annotations

import time
from typing import Callable, Generic, Iterable, Protocol, TypeVar

from vpsd.engine.engine import Engine
from vpsd.engine.prefill_ahead import ItemSource, ListSource, PrefillAhead
from vpsd.engine.request import Request
from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.cost import ExploreBudget
from vpsd.pipeline.drafting_policy import DraftingPolicy, predicted_loss
from vpsd.tracing import get_logger, span
from vpsd.video.errors import VideoError

T = TypeVar("T")
log = get_logger()


class JobEvents(Protocol[T]):
    """What the launcher is told, item by item."""

    def request(self, item: T, next_item: T | None) -> Request:
        """The item as a request: its video read, scaled and fitted (any thread; raises VideoError / ValueError)."""

    def started(self, item: T) -> None: ...

    # Optional: `read_ahead(item)`, told on the engine's thread as each item is taken, starts reading its video on
    # readers of the launcher's own (launch/job.py); it must not block.

    def finished(self, item: T, request: Request) -> None:
        """A request left the engine: done, or failed (`request.error`)."""

    def failed(self, item: T, error: Exception) -> None:
        """An item that could not become a request (its video, its size)."""


def kv_bytes_per_token(adapter: VideoLMAdapter) -> int:
    """Bytes one token takes in a model's KV cache on this rank: keys and values, every layer, every KV head it
    holds (1/k of them on each of a split target's k ranks)."""
    text = adapter.model.config.get_text_config()
    heads = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // (
        adapter.mirror.ranks if adapter.mirror is not None else 1)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * adapter.model.dtype.itemsize


class Scheduler(Generic[T]):
    def __init__(self, engine: Engine, kv_budget_bytes: int | None = None, local_draft: VideoLMAdapter | None = None,
                 prefill_cpus: list[int] | None = None, lend_cores: bool = False, shared_items: bool = False) -> None:
        """local_draft: the draft model when it runs in this process (its KV counts against the budget);
        prefill_cpus: where the prefill thread runs; lend_cores: give the decode thread those cores at the
        manifest's tail (only where nothing else uses them: no draft rank); shared_items: other pipelines take
        items from the same queue (launch/coordinator.py), so fewer are read ahead (PrefillAhead)."""
        self.engine, self.kv_budget, self.prefill_cpus, self.lend_cores = engine, kv_budget_bytes, prefill_cpus, lend_cores
        self.shared_items = shared_items
        self.models = [engine.target] + ([local_draft] if local_draft is not None else [])
        dec = engine.cfg.decoding
        budget = getattr(engine.window, "budget", None) or ExploreBudget()  # the serial window's rounds share it
        self.policy = DraftingPolicy(budget, always=dec.temperature > 0 or engine.window.fixed)
        self.round_end = 0.0
        self.rounds_s = 0.0  # the engine thread's time in rounds
        self.on_round: Callable[[], None] | None = None  # told after each round (vpsd/profiling.py steps there)
        self._items: dict[str, T] = {}  # request id -> the launcher's item, while in flight
        self.largest_need = 0  # the largest KV need of a request seen (bytes): what an item prefilled ahead may hold

    # ---- admission -----------------------------------------------------------------------------------

    def kv_need(self, request: Request, prompt_tokens: int) -> int:
        tokens = prompt_tokens + request.max_new_tokens + self.engine.cfg.decoding.gamma_max + 1
        return sum(tokens * kv_bytes_per_token(m) for m in self.models)

    def reserved(self) -> int:
        return sum(r.kv_bytes for r in self.engine.requests.values())

    def fits(self, need: int) -> bool:
        """Whether `need` bytes fit beside the requests in flight (always on an empty batch)."""
        return self.kv_budget is None or not self.engine.requests or self.reserved() + need <= self.kv_budget

    def decide(self, request: Request) -> None:
        """Whether the request drafts (module docstring)."""
        e = self.engine
        if e.drafter is None:
            request.drafted = False
            return
        with e.lock:
            batch = max(1, min(e.size, len(e.requests) + 1))
            request.drafted = self.policy.decide(predicted_loss(e.window, e.size, batch, e.means,
                                                                request.max_new_tokens))

    def room_ahead(self, count: int) -> bool:
        """Whether `count` items prefilled ahead (each bounded by the largest KV need seen) fit the budget beside the
        requests in flight: prefilling further ahead than the free slots stays within `batching.kv_budget_mib`."""
        return self.kv_budget is None or (0 < self.largest_need and
                                          self.reserved() + count * self.largest_need <= self.kv_budget)

    def check_kv(self, request: Request) -> None:
        """Raises ValueError for a request whose KV cache could not fit even alone."""
        e = self.engine
        if self.kv_budget is not None:  # the need is the prompt's tokens: prepared once, kept for the prefill
            request.inputs = e.target.prepare(request.frames, request.prompt, request.frame_times)
            request.kv_bytes = self.kv_need(request, request.inputs.seq_len)
            self.largest_need = max(self.largest_need, request.kv_bytes)
        if self.kv_budget is not None and request.kv_bytes > self.kv_budget:
            raise ValueError(f"item needs {request.kv_bytes / 2**20:.1f} MiB of KV cache, over the budget of "
                             f"{self.kv_budget / 2**20:.1f} MiB (batching.kv_budget_mib)")

    def prepare_run(self, built: list[Request | Exception], at_admission: bool) -> list[Request | Exception]:
        """Checks each request's KV need and, unless they are prefilled at admission, decides and prefills them:
        one on its own, a run of one video's questions together (`Engine.prefill_group`). Each comes back
        prefilled, or with the VideoError / ValueError it failed with."""
        checked: list[Request | Exception] = []
        for request in built:
            try:
                if isinstance(request, Request):
                    self.check_kv(request)
                checked.append(request)
            except (VideoError, ValueError) as err:
                checked.append(err)
        requests = [r for r in checked if isinstance(r, Request)]
        if at_admission or not requests:
            return checked  # decided and prefilled at admission, once it fits
        for request in requests:
            self.decide(request)
        done = iter(self.engine.prefill_group(requests))
        return [next(done) if isinstance(r, Request) else r for r in checked]

    # ---- straggler patience --------------------------------------------------------------------------

    def patience_s(self, ready: int, waiting: int) -> float:
        """How long a round may wait for the requests whose chunk has not come yet (after a rollback the draft
        needs a step or two to answer). Leaving now costs each of them a whole round, T_p; waiting w costs each
        ready request w: waiting pays while w ready < T_p waiting, capped at half a round. Not in the papers: at
        batch 1 the target has nothing else to do but wait."""
        recent = self.engine.report.verify_s[-8:]
        if not recent or ready == 0:
            return 0.0
        return sum(recent) / len(recent) * min(0.5, waiting / ready)

    def _wait_for_stragglers(self) -> bool:
        """Whether a message came while waiting for a straggler (then look again before the round)."""
        e = self.engine
        if e.drafter is None:
            return False
        e.drafter.pump()  # a remote drafter's chunks that arrived during the round
        rows = list(e.requests.values())
        ready = sum(not r.drafted or e.drafter.has_proposal(r) for r in rows)
        if not 0 < ready < len(rows):
            return False
        left = self.patience_s(ready, len(rows) - ready) - (time.perf_counter() - self.round_end)
        return left > 0 and e.drafter.pump(timeout_s=left)

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self, items: ItemSource[T] | Iterable[T], events: JobEvents[T]) -> None:
        """Decodes the items, taken one at a time as there is room for them, until every one is done."""
        e = self.engine
        at_admission = e.size == 1  # batch 1: prefilled on this thread when admitted (module docstring)

        def prepare(items: list[T], nxt: T | None) -> list[Request | Exception]:
            built: list[Request | Exception] = []
            for i, item in enumerate(items):
                try:
                    built.append(events.request(item, items[i + 1] if i + 1 < len(items) else nxt))
                except (VideoError, ValueError) as err:
                    built.append(err)
            return self.prepare_run(built, at_admission)

        source = items if hasattr(items, "take") else ListSource(items)
        # Where the launcher reads items ahead on readers of its own (JobEvents.read_ahead), each item's read starts
        # as it is taken, `video.read_ahead` items ahead.
        read = getattr(events, "read_ahead", None)
        # Where the launcher says which items share a video, a run of them is prefilled together (never at batch 1:
        # each is prefilled at its admission there).
        group_key = getattr(events, "group_key", None)
        ahead: PrefillAhead[T] = PrefillAhead(source, e.size, prepare, self.prefill_cpus, self.shared_items, read,
                                              e.cfg.video.read_ahead if read is not None else 0, group_key,
                                              1 if at_admission or group_key is None else e.size, self.room_ahead)
        started = time.perf_counter()
        try:
            while e.requests or ahead.pending:  # pending asked with nothing in flight: it may take an item
                ahead.top_up(len(e.requests))
                self._lend_at_tail(ahead, started)
                self._admit(ahead, events, at_admission)
                if ahead.steal_if_thin(len(e.requests)):
                    continue  # a thin batch: prefilling here beats decoding it
                if self._wait_for_stragglers():
                    continue
                t0 = time.perf_counter()
                ran, left = e.round()
                self.round_end = time.perf_counter()
                self.rounds_s += self.round_end - t0
                if self.on_round is not None:
                    self.on_round()
                for r in left:
                    events.finished(self._item(r), r)
                if not ran and e.requests:
                    e.drafter.wait()  # nothing to verify: the draft's next chunk (only a remote drafter's rounds)
        finally:
            ahead.close()
        e.report.close(time.perf_counter() - started, self.rounds_s, ahead.stolen_s)

    def _lend_at_tail(self, ahead: PrefillAhead, started: float) -> None:
        if self.lend_cores and (threads := ahead.lend_cores_when_drained()) is not None:
            self.engine.report.tail_from_s, self.engine.report.tail_threads = time.perf_counter() - started, threads
            log.info("prefill_cores_lent", in_flight=len(self.engine.requests), tail_from_s=self.engine.report.tail_from_s,
                     tail_threads=threads)

    def _admit(self, ahead: PrefillAhead[T], events: JobEvents[T], at_admission: bool) -> None:
        """Joins what is ready, in order; blocks on a prefill only when nothing is decoding."""
        e = self.engine
        while not e.full:
            t0 = time.perf_counter()
            if e.requests:
                nxt = ahead.next_ready(block=False)
            else:  # nothing is decoding: wait for it (what reading and prefilling ahead did not hide)
                with span("video_wait") as waited:
                    nxt = ahead.next_ready(block=True)
                    waited["item"] = None if nxt is None else getattr(nxt[0], "id", None)
            if nxt is None:
                return
            item, request = nxt
            events.started(item)
            if isinstance(request, Exception):
                events.failed(item, request)
                continue
            request.timings.setdefault("video_wait", time.perf_counter() - t0)
            if not self.fits(request.kv_bytes):
                log.info("item_deferred", item=request.id, need_mib=request.kv_bytes / 2**20,
                         reserved_mib=self.reserved() / 2**20, budget_mib=self.kv_budget / 2**20)
                return  # after a round frees some (never on an empty batch)
            ahead.pop()
            if at_admission:
                t0 = time.perf_counter()
                try:
                    self.decide(request)
                    e.prefill(request, on_engine_thread=True)
                except (VideoError, ValueError) as err:
                    events.failed(item, err)
                    continue
                finally:
                    e.report.admit_s += time.perf_counter() - t0
            self._items[request.id] = item
            if (done := e.join(request)) is not None:
                events.finished(self._items.pop(done.id), done)

    def _item(self, request: Request) -> T:
        return self._items.pop(request.id)

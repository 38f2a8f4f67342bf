"""Driving the engine in one process: requests from frames in memory, the scheduler's loop or a seeded
interleaving of the engine and the draft and pruner workers over an in-memory link (the real protocol, msgpack
and all; only the carrier differs from the ranks')."""

from __future__ import annotations

import dataclasses
import itertools
import random

from tests.conftest import config_path, random_frames, tiny_pair
from vpsd.config import BatchingConfig, DecodingConfig, PruningConfig, RunConfig, load_config
from vpsd.decoders.ar import decode_ar
from vpsd.decoders.sd import decode_sd
from vpsd.engine.engine import Engine
from vpsd.engine.keep import keep_policy_for
from vpsd.engine.drafters.local import LocalDrafter
from vpsd.engine.request import Request
from vpsd.engine.scheduler import Scheduler
from vpsd.models.base import VideoLMAdapter
from vpsd.pipeline.ensemble import verdicts_carry_target_probs
from vpsd.pipeline.methods import get_method
from vpsd.pipeline.result import DecodeResult
from vpsd.roles.draft import DraftWorker
from vpsd.roles.link import Idle, MemoryHub
from vpsd.roles.pruner import PrunerWorker
from vpsd.engine.drafters.remote import RemoteDrafter

PROMPTS = ["Describe the video.", "What happens in this video? Answer in detail.", "Which colours?"]

_BATCH1: dict[tuple, DecodeResult] = {}


def _once(key: tuple, item: Request, decode) -> DecodeResult:
    """`decode()`'s result for `key` and the item's content, decoded once a test worker (a file's cases run on one
    worker, on session models): the engine is held to the same batch-1 output at every batch size, method and
    interleaving."""
    key = (*key, item.id, item.prompt, item.frames.shape, int(item.frames.sum()))
    if key not in _BATCH1:
        _BATCH1[key] = decode()
    return _BATCH1[key]


def batch1_ar(target: VideoLMAdapter, item: Request, decoding: DecodingConfig) -> DecodeResult:
    """The reference decoder's `ar` of `item`."""
    return _once(("ar", id(target), repr(decoding)), item,
                 lambda: decode_ar(target, item.frames, item.prompt, decoding))


def batch1_sd(target: VideoLMAdapter, draft: VideoLMAdapter, item: Request, decoding: DecodingConfig,
              pruning: PruningConfig) -> DecodeResult:
    """The reference decoder's serial sd of `item` (the same rounds a batch must make)."""
    return _once(("sd", id(target), id(draft), repr(decoding), repr(pruning)), item,
                 lambda: decode_sd(target, draft, item.frames, item.prompt, decoding,
                                   keep_policy_for(pruning, target.family), pruning))


def requests(n: int, max_new: int = 14) -> list[Request]:
    """n items of different lengths: frame counts, prompts and answer budgets differ."""
    return [Request(f"item-{i}", PROMPTS[i % 3], max_new - 2 * (i % 3), random_frames(10 + i, t=4 + 2 * (i % 2)),
                    video={"item": f"item-{i}"}) for i in range(n)]


def fresh(todo: list[Request]) -> list[Request]:
    """The same items, never decoded (a Request is the engine's state for its item: one per run)."""
    return [Request(r.id, r.prompt, r.max_new_tokens, r.frames, r.frame_times, dict(r.video), stop=r.stop, seed=r.seed)
            for r in todo]


class Jobs:
    """The scheduler's events (engine/scheduler.py JobEvents) over requests already in memory."""

    def __init__(self) -> None:
        self.out: dict[str, object] = {}

    def request(self, item: Request, nxt: Request | None) -> Request:
        return item

    def started(self, item: Request) -> None:
        pass

    def finished(self, item: Request, r: Request) -> None:
        self.out[item.id] = r.result() if r.error is None else ValueError(r.error)

    def failed(self, item: Request, error: Exception) -> None:
        self.out[item.id] = error


def run_config(target: VideoLMAdapter, decoding: DecodingConfig, pruning: PruningConfig | None, size: int,
               kv_budget_mib: float | None = None) -> RunConfig:
    base = load_config(config_path(target.family))
    return dataclasses.replace(base, decoding=decoding, pruning=pruning or PruningConfig("none", 0.0),
                               batching=BatchingConfig(size=size, kv_budget_mib=kv_budget_mib))


def local_engine(target: VideoLMAdapter, draft: VideoLMAdapter | None, decoding: DecodingConfig,
                 pruning: PruningConfig | None, size: int, kv_budget_bytes: int | None = None,
                 parallel_signals: bool = False) -> tuple[Engine, Scheduler]:
    """The engine with the draft in this process (or none: `ar`), as the launcher wires a serial batch."""
    cfg = run_config(target, decoding, pruning, size)
    drafter = LocalDrafter(target, draft, decoding, cfg.pruning, parallel_signals) if draft is not None else None
    engine = Engine(target, cfg, size, drafter)
    return engine, Scheduler(engine, kv_budget_bytes, draft)


def run(scheduler: Scheduler, todo: list[Request], grouped: bool = False) -> dict:
    jobs = Grouped() if grouped else Jobs()
    scheduler.run(fresh(todo), jobs)
    return jobs.out


class FramesInMemory:
    """The draft's frame source for items that never were files: the same frames the target got."""

    def __init__(self, items: list[Request]) -> None:
        self.frames = {it.id: it.frames for it in items}

    def take(self, wire):
        return self.frames[wire["item"]], None, {}

    def ahead(self, wire) -> None:
        pass


def video_of(request: Request) -> str:
    """Which video a harness request asks about: its id before the question's ("v-q1": "v")."""
    return request.id.rsplit("-", 1)[0]


class Grouped(Jobs):
    """`Jobs` that say which items share a video (JobEvents.group_key), as a job's do: their runs are prefilled
    together."""

    def group_key(self, item: Request) -> str:
        return video_of(item)


class Pipeline:
    """The engine with a remote drafter, the draft and pruner workers on one in-memory hub, and a scheduler that
    interleaves them at random: messages delayed, verdicts arriving while the draft is several chunks ahead,
    items joining mid-batch, on the engine's thread (signals streamed from inside the prefill) or prefilled as
    on the prefill thread (signals held, then sent)."""

    def __init__(self, family: str, method: str, size: int, todo: list[Request], overrides: dict,
                 draft_is_target: bool, grouped: bool = False) -> None:
        """grouped: a request prefilled off the engine's thread takes the requests after it on its video (`video_of`)
        with it, as the prefill thread does (engine/sibling_prefill.py); they wait prefilled for their turn."""
        m = get_method(method)
        strategy = m.default_strategy
        self.cfg = load_config(config_path(family), {"pruning.strategy": strategy, "pruning.ratio":
                                                     0.0 if strategy == "none" else 0.5, **overrides})
        target, smaller = tiny_pair(family)
        self.target = target
        self.rng = random.Random(0)
        self.hub = MemoryHub(["target", "draft", "pruner"], shuffle=self.rng)
        probs = verdicts_carry_target_probs(m.draft, self.cfg.tabed_settings, self.cfg.decoding.temperature)
        self.drafter = RemoteDrafter(self.hub.link("target"), target, self.cfg, target_probs=probs)
        self.engine = Engine(target, self.cfg, size, self.drafter)
        self.scheduler = Scheduler(self.engine, self.cfg.batching.kv_budget_bytes)
        self.dw = DraftWorker(self.hub.link("draft"), target if draft_is_target else smaller, self.cfg,
                              FramesInMemory(todo), drafts_from=m.draft)
        self.pw = PrunerWorker(self.hub.link("pruner"), self.cfg)
        self.queue = fresh(todo)
        self.deferred: dict[str, Request] = {}  # prefilled items waiting for KV room (or, grouped, for their turn)
        self.grouped = grouped
        self.peak_kv = 0
        self.results: dict[str, object] = {}

    def draft_idle(self) -> bool:
        """Every row left the draft worker."""
        proposer = self.dw.proposer
        held = getattr(proposer, "items", None) or getattr(getattr(proposer, "batch", None), "keys", None)
        return not self.dw.rows and not self.dw.waiting and not held

    def _deliver(self, role: str, handle) -> bool:
        link = self.hub.link(role)
        if not link.poll():
            return False
        handle(*link.recv())
        return True

    def admit(self, request: Request, on_engine_thread: bool) -> bool:
        """Prefills and joins one request as the scheduler does; False (nothing announced) while its KV does not
        fit beside the requests in flight."""
        s, e = self.scheduler, self.engine
        if request.id in self.deferred:
            request = self.deferred[request.id]
        elif on_engine_thread:
            s.check_kv(request)
            if not s.fits(request.kv_bytes):
                return False
            s.decide(request)
            e.prefill(request, on_engine_thread=True)
        else:
            siblings = list(itertools.takewhile(
                lambda r: video_of(r) == video_of(request) and r.id not in self.deferred,
                self.queue[1:])) if self.grouped else []
            first, *rest = s.prepare_run([request, *siblings], at_admission=False)
            for sibling, got in zip(siblings, rest):
                if isinstance(got, Exception):
                    raise got
                self.deferred[sibling.id] = got
            if isinstance(first, Exception):
                raise first
        if not s.fits(request.kv_bytes):
            self.deferred[request.id] = request
            return False
        self.deferred.pop(request.id, None)
        if (done := e.join(request)) is not None:
            self.results[done.id] = done.result()
        self.peak_kv = max(self.peak_kv, s.reserved())
        return True

    def _admit(self, rng: random.Random) -> bool:
        if self.admit(self.queue[0], rng.random() < 0.5):
            self.queue.pop(0)
            return True
        return False

    def target_step(self) -> bool:
        ran, left = self.engine.round()
        for r in left:
            self.results[r.id] = r.result() if r.error is None else ValueError(r.error)
        return ran or bool(left)

    def run(self, seed: int, max_turns: int = 50_000) -> dict:
        rng = self.rng
        rng.seed(seed)
        actions = {
            "admit": lambda: bool(self.queue) and not self.engine.full and self._admit(rng),
            "target_msg": lambda: self._deliver("target", self.drafter.handle),
            "target_step": self.target_step,
            "draft_msg": lambda: self._deliver("draft", self.dw.handle),
            "draft_step": self.dw.step,
            "pruner_msg": lambda: self._deliver("pruner", self.pw.handle),
        }
        names = list(actions)
        idle = 0
        for _ in range(max_turns):
            if not self.queue and not self.engine.requests:
                while self._deliver("draft", self.dw.handle) or self._deliver("pruner", self.pw.handle):
                    pass  # the ItemDone tails
                return self.results
            name = rng.choice(names)
            try:
                moved = actions[name]()
            except Idle:
                moved = False
            idle = 0 if moved else idle + 1
            assert idle < 200, f"no worker can move: a deadlock ({name})"
        raise AssertionError("the pipeline did not finish")

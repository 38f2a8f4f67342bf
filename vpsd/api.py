"""vpsd from Python: load a model pair once, decode videos with any method, get texts and speculation stats back.

    import vpsd

    with vpsd.LLM(config="configs/world_qwen2_5_vl_scaled.yaml", method="hippo") as llm:
        outs = llm.generate([vpsd.VideoRequest("clip.mp4", "Describe the video.")],
                            vpsd.SamplingParams(max_new_tokens=64))
    print(outs[0].text, outs[0].stats["mean_accepted_tokens"])

Below the I/O this is the job's own path: the same config resolution and checks (launch/settings.py), the same
engine, scheduler, drafters and roles. Where the method runs:
- serial and batched methods (`ar`, sd, the trees, a batch that drafts in-process): in the caller's process, as in
  a one-rank job (launch/wiring.py);
- a parallel method (pearl, hippo, ...), by default: its target, draft and pruner ranks as child processes of the
  caller (`draft_on: rank`, launch/served.py), started by the `LLM` over a local rendezvous of its own with the
  job's entry, roles, transport and control plane, and stopped by `close()`, at interpreter exit, when the caller
  dies, and on a KeyboardInterrupt in `generate` (the next call starts them again). The caller plays the job's
  coordinator: each call's requests go to the pipeline as it has room, and each result comes back as the job's
  result line. Their traces go to `trace_dir`. A server feeds them one request at a time instead (`submit`, then
  `results` as they finish; `joins` says whether a request's sampling settings fit the ranks in flight);
- with `draft_on="thread"`: the draft and pruner roles on threads of the caller's process (launch/in_process.py;
  on a GPU each on its own CUDA stream), no child process at all.
A list of requests runs through the engine's continuous batching when `batch > 1`.

Bad input: a setting that cannot run (or a config file that is not there) raises `ConfigError` (one line a
problem, the job's lines) when the `LLM` is made; a request whose video is missing, corrupt or too long, or that
is malformed (a prompt or video of the wrong type, an empty prompt, chat messages vpsd cannot answer: no user
turn or not one video, a video outside a user turn, an unknown role; kind `bad_request`, the items a job's
manifest refuses), does not stop the others: its `Output` carries the error
(`error`, `error_kind`), as a job's result row does. `VideoError` is the
same typed exception the job writes rows from; a child rank that dies is `RanksFailed`, with what it said.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import reprlib
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import structlog

from vpsd.config import ConfigError, RunConfig
from vpsd.engine.request import Request
from vpsd.launch.items import ItemReader, checked_frames
from vpsd.launch.manifest import ManifestItem
from vpsd.launch.results import ResultRow, output_of
from vpsd.launch.served import RanksFailed, ServedPipelines, ServedRanks
from vpsd.launch.settings import auto_method, run_config
from vpsd.launch.wiring import SharedFrames, build_engine
from vpsd.models.prompt import chat_prompt, is_chat, parse_messages, turns_of
from vpsd.models.registry import load_adapter, load_tokenizer
from vpsd.pipeline.sampling import rule_problems
from vpsd.pipeline.methods import DraftPlace, get_method
from vpsd.tracing import configure_tracing
from vpsd.video.decode import write_frames_file
from vpsd.video.errors import VideoError

__all__ = ["LLM", "SamplingParams", "VideoRequest", "Output", "ConfigError", "VideoError", "RanksFailed"]
SERVED_IDLE_S = 365 * 24 * 3600.0  # a child rank waits for the caller's next call as long as the caller lives


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one `generate` call's requests. None: the config's value."""

    max_new_tokens: int | None = None
    temperature: float = 0.0  # 0: greedy; > 0: sampled (the config's decoding.sampling rule: keyed by default)
    top_k: int = 0  # the filters, applied to target and draft alike (0 / 1.0 / 0.0: off; pipeline/sampling.py)
    top_p: float = 1.0
    min_p: float = 0.0
    stop: tuple[str, ...] | str = ()  # decoding stops at the first of these, and the text is cut before it
    # Every request's seed (its draws, its random pruning: pipeline/seeds.py); None: the config's decoding.seed.
    # Position-keyed sampling makes a seeded output `ar`'s own sample at that seed, whatever the method.
    seed: int | None = None

    def __post_init__(self) -> None:  # one stop string may be given as itself, as vLLM's SamplingParams takes it
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    def check(self) -> list[str]:
        problems = []
        if not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            problems.append(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        problems += rule_problems(self.temperature, self.top_k, self.top_p, self.min_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed must be an int >= 0, got {self.seed!r}")
        return problems


@dataclass(frozen=True)
class VideoRequest:
    """One video and what to ask about it.

    video: a video file, a folder of frame images (read at `video.fps`, else 1 frame a second), or the frames
    themselves, a (T, H, W, 3) uint8 array (with `frame_times` in seconds; default one a second).
    prompt: the question, or chat messages, rendered as the checkpoint's chat template renders them: [{"role":
    "system" | "user" | "assistant", "content": "..." or [{"type": "text", "text": ...}, {"type": "video"}]}, ...],
    an optional system message first, the last message a user's, `video` in the user turn that holds the one
    {"type": "video"} part (without one, in the first user turn), as a manifest line's `messages`."""

    video: str | Path | np.ndarray
    prompt: str | list[dict[str, Any]]
    frame_times: np.ndarray | None = None
    id: str | None = None
    seed: int | None = None  # this request's seed, before SamplingParams.seed and the config's decoding.seed


@dataclass
class Output:
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens), "error"
    num_video_tokens: int | None = None
    num_generated_tokens: int = 0  # what plain decoding generated: past token_ids up to a stop string's end
    # What a job's result row carries: mean_accepted_tokens (MAT), acceptance_rate, rounds, prefill_s, decode_s,
    # wall_s, tokens_per_s, num_kept, ...
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # A VideoError's kind ("missing", "corrupt", "too_long", ...), or "bad_request" for a malformed request.
    error_kind: str | None = None


def _auto(config: str | Path | RunConfig, batch: int, overrides: dict[str, Any]):
    """`method="auto"`: the tuned config's choice at `batch`, or its winner's when batch is the default 1 and it was
    not tuned at 1 (launch/tuned.py); ConfigError when the config holds none."""
    try:
        return auto_method(config, batch, overrides)
    except ConfigError:
        if batch != 1:
            raise
        return auto_method(config, None, overrides)
    except FileNotFoundError as e:
        raise ConfigError([f"no such config file: {e.filename}"]) from None


class LLM:
    """A target (and draft) loaded once; `generate` as often as needed; `close()` (or a with block) at the end.

    config: a YAML of configs/ (or any path); method: any of vpsd's (`ar` is the baseline), or "auto": the choice of
    a config `vpsd tune` wrote, at `batch` if it was tuned there (`tuned_choice` says which); pruning, ratio, gamma,
    batch: as the job's --pruning, --ratio, --gamma, --batch; draft_on: where a parallel method's draft and
    pruner run, "rank" (child processes, the default) or "thread" (module docstring); settings: more KEY: VALUE
    overrides, as --set; trace_dir: where the structlog JSON traces go (DIR/traces/, one file a role, readable by
    `vpsd timeline`); without one, vpsd prints its warnings alone (unless the program configured structlog);
    ranks: pipelines a launch started (vpsd serve under torchrun), used instead of child ranks of its own."""

    def __init__(self, config: str | Path | RunConfig, method: str = "hippo", *, pruning: str | None = None,
                 ratio: float | None = None, gamma: int | str | None = None, batch: int = 1,
                 draft_on: str | None = None, settings: dict[str, Any] | None = None,
                 trace_dir: str | Path | None = None, ranks: ServedPipelines | None = None) -> None:
        overrides = {**({} if draft_on is None else {"draft_on": draft_on}), **(settings or {})}
        self.tuned_choice = None  # method="auto": what the config's tuned: block chose (launch/tuned.py)
        if method == "auto":
            self.tuned_choice = choice = _auto(config, batch, overrides)
            method, batch = choice.method, batch if batch != 1 else choice.batch
            pruning, ratio, gamma = (v if v is not None else choice.option(k) for k, v in
                                     (("pruning", pruning), ("ratio", ratio), ("gamma", gamma)))
            overrides = {**{k: v for k, v in choice.settings.items() if k in ("draft_on", "batching.pipelined")},
                         **overrides}
        try:
            self.method = get_method(method)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        try:  # a RunConfig is one a launch checked already (its ranks run it: vpsd serve under torchrun)
            self.config: RunConfig = config if isinstance(config, RunConfig) else run_config(
                config, method, pruning=pruning, ratio=ratio, gamma=gamma, batch=batch, overrides=overrides,
                local_world=1)
        except FileNotFoundError as e:  # the job's refusal of it, word for word (launch/entry.py)
            raise ConfigError([f"no such config file: {e.filename}"]) from None
        if trace_dir is not None:
            configure_tracing(Path(trace_dir), "api", 0)
        elif not structlog.is_configured():
            configure_tracing(None, "api", 0, stderr_level=logging.WARNING)
        cfg = self.config
        # `ranks`: pipelines started by a launch (`vpsd serve` under torchrun, serve/launched.py), whatever the
        # method; their sampling settings are the launch's, and they are never started again here.
        self._launched = ranks is not None
        self.served = self._launched or self.method.draft_place(
            cfg.batching.size, cfg.batching.pipelined, cfg.draft_on) is DraftPlace.REMOTE
        self._count = 0
        self._calls = 0
        self._closed = False
        self._draft = None  # loaded with the first engine that needs it, then kept
        self._ranks: ServedRanks | None = None
        self._ranks_for: tuple | None = None  # the sampling settings they run (_sampling_key)
        self._submitted: dict[str, tuple[str, Path | None]] = {}  # in flight on the ranks: wire id -> (id, frames)
        self._ready: list[Output] = []  # submitted requests answered without the ranks (malformed, unreadable)
        self._scratch = Path(trace_dir) if trace_dir is not None else Path(tempfile.mkdtemp(prefix="vpsd-llm-"))
        self._own_scratch = trace_dir is None
        _open.add(self)
        if self.served:  # the ranks start now: an LLM made is one ready to decode
            self.target = None
            self.tokenizer = load_tokenizer(cfg.target)
            if ranks is not None:
                self._ranks, self._ranks_for = ranks, _sampling_key(cfg)
            else:
                self._start_ranks(cfg)
        else:
            self.target = load_adapter(cfg.family, cfg.target)
            self.tokenizer = self.target.tokenizer

    # ---- decoding -----------------------------------------------------------------------------------

    def generate(self, requests: VideoRequest | Sequence[VideoRequest],
                 params: SamplingParams | None = None) -> list[Output]:
        """One Output per request, in order (a failed request's carries its error)."""
        if self._closed:
            raise RuntimeError("this LLM is closed")
        params = params or SamplingParams()
        problems = params.check()
        if problems:
            raise ConfigError(problems)
        items = [self._item(r) for r in ([requests] if isinstance(requests, VideoRequest) else list(requests))]
        if len({item.id for item in items}) != len(items):
            raise ValueError("two requests of one generate call have the same id")
        # A malformed request is its own Output (bad_request), as a bad manifest line is that item's problem: the
        # good requests beside it still decode.
        outputs = {item.id: _bad_request(item.id, item.problem) for item in items if item.problem is not None}
        todo = [item for item in items if item.problem is None]
        if todo:
            cfg = self._decoding_config(params)
            outputs.update(self._on_ranks(todo, cfg, params) if self.served else self._in_process(todo, cfg, params))
        return [outputs[item.id] for item in items]

    def _in_process(self, todo: list[_Item], cfg: RunConfig, params: SamplingParams) -> dict[str, Output]:
        frames = SharedFrames()
        events = _Events(self.target, cfg, frames, params, lambda item: self._seed(params, item))
        wired = build_engine(cfg, self.method, self.target, draft=self._load_draft(cfg), videos=frames,
                             timeout_s=cfg.timeout_s, job_id="api")
        try:
            wired.ready(cfg.startup_timeout_s)
            wired.scheduler.run(todo, events)
        finally:
            wired.stop()
            frames.close()
        return events.outputs

    def _on_ranks(self, todo: list[_Item], cfg: RunConfig, params: SamplingParams) -> dict[str, Output]:
        """The requests through the child ranks (launch/served.py). Their config holds the decoding's temperature
        and filters, so a call with others starts them again; max_new_tokens and the seed go with each item."""
        self._ranks_for_call(cfg)
        outputs: dict[str, Output] = {}
        items, ids = [], {}
        self._calls += 1
        for n, item in enumerate(todo):
            # On the wire an item's id is new to the ranks: a request's id may repeat across calls, and the roles
            # tell one item's messages from another's by it. The traces show it as ID#CALL.
            wire_id = f"{item.id}#{self._calls}"
            ids[wire_id] = item.id
            try:
                items.append(self._manifest_item(item, wire_id, params, n))
            except (VideoError, ValueError) as e:
                outputs[item.id] = _failed(item.id, e)
        assert self._ranks is not None
        try:
            rows = self._ranks.run(items)
        except BaseException:
            self._lose_ranks()  # stopped by run (interrupted, or a rank died): the next call starts them again
            raise
        finally:
            for item in items:  # the call's frames files (a submitted request's go with its result)
                if item.video.parent == self._scratch / "frames":
                    item.video.unlink(missing_ok=True)
        for wire_id, row in rows.items():
            outputs[ids[wire_id]] = self._row_output(ids[wire_id], row)
        return outputs

    def _ranks_for_call(self, cfg: RunConfig) -> None:
        """Ranks that run `cfg`'s sampling settings: started again for others, once no request is in flight."""
        if self._ranks is not None and self._ranks_for == _sampling_key(cfg):
            return
        if self._launched and self._ranks is None:
            raise RanksFailed("the launch's ranks are gone (torchrun stops the launch when one dies)")
        if self._launched:
            raise ConfigError([f"this server's ranks sample as the launch set them (temperature, top_k, top_p, "
                               f"min_p = {', '.join(map(str, self._ranks_for))}): a request cannot change them"])
        if self._submitted:
            raise RuntimeError("requests with other sampling settings (temperature, top_k, top_p, min_p) are in "
                               "flight on the ranks: take their results first (LLM.joins says when)")
        self._stop_ranks()
        self._start_ranks(cfg)

    # ---- one request at a time on child ranks (vpsd serve's runner) ----------------------------------

    def joins(self, params: SamplingParams) -> bool:
        """Whether a request with `params` can be submitted now, beside those in flight: the ranks run one
        temperature and filters (their config), so another setting waits until the requests in flight leave."""
        return not self._submitted or self._launched or self._ranks_for == _sampling_key(self._decoding_config(params))

    @property
    def pipelines(self) -> int:
        """How many pipelines decode the submitted requests side by side (a launch's, under torchrun; else 1)."""
        return getattr(self._ranks, "pipelines", 1) if self._launched else 1

    @property
    def in_flight(self) -> int:
        """Submitted requests whose Output `results` has not returned yet."""
        return len(self._submitted) + len(self._ready)

    def submit(self, request: VideoRequest, params: SamplingParams | None = None) -> str:
        """Queues one request on the child ranks (`served` methods), beside those decoding there: it joins the
        ranks' batch as a slot frees; its Output comes from `results` when it finishes. Returns its id (new among
        those in flight: ValueError otherwise). Settings that `joins` refuses raise RuntimeError; with nothing
        in flight they start the ranks again for them."""
        if not self.served or self._closed:
            raise RuntimeError("submit needs an open LLM whose method runs on child ranks (LLM.served)")
        params = params or SamplingParams()
        if problems := params.check():
            raise ConfigError(problems)
        item = self._item(request)
        if any(item.id == known for known, _ in self._submitted.values()):
            raise ValueError(f"a request with id {item.id!r} is in flight")
        if item.problem is not None:
            self._ready.append(_bad_request(item.id, item.problem))
            return item.id
        self._ranks_for_call(self._decoding_config(params))
        self._calls += 1
        wire_id = f"{item.id}#{self._calls}"
        try:
            manifest = self._manifest_item(item, wire_id, params, f"s{self._calls}")
        except (VideoError, ValueError) as e:
            self._ready.append(_failed(item.id, e))
            return item.id
        self._submitted[wire_id] = (item.id, manifest.video if isinstance(item.video, np.ndarray) else None)
        try:
            self._ranks.submit(manifest)
        except BaseException:
            self._lose_ranks()
            raise
        return item.id

    def results(self, timeout_s: float | None = None) -> list[Output]:
        """The Outputs of submitted requests that have finished, waiting up to `timeout_s` (None: until one does,
        or a request's tokens grow: `progress`) while the ranks decode; [] when none did. RanksFailed when a child rank died: the requests in flight are
        lost with it, and the next submit starts the ranks again."""
        ready, self._ready = self._ready, []
        if ready or self._ranks is None or not self._submitted:
            return ready
        try:
            rows = self._ranks.poll(timeout_s)
        except BaseException:
            self._lose_ranks()
            raise
        outputs = []
        for row in rows:
            item_id, frames = self._submitted.pop(row.id)
            if frames is not None:
                frames.unlink(missing_ok=True)
            outputs.append(self._row_output(item_id, row))
        return outputs

    def progress(self) -> dict[str, list[int]]:
        """The submitted requests whose committed tokens grew since the last call, each with every token it has
        committed so far (the ranks report each round's; `results` takes the reports as it waits, and returns
        early when one comes). Tokens past a stop string are included: the Output's text is cut, these are not."""
        if self._ranks is None:
            return {}
        return {self._submitted[w][0]: list(self._ranks.committed(w)) for w in self._ranks.fresh()
                if w in self._submitted}

    def reuse_stats(self) -> dict[str, int] | None:
        """On ranks (`served`): their targets' prefix-cache counters (engine/prefix_cache.py ReuseStats: hits,
        misses, reused tokens, bytes...), as the latest results carried them, summed over the pipelines; None before
        any result, with reuse off, with the ranks stopped, and in process (there the cache is the target model's,
        shared by every call's engine: `Engine.reuse_stats`). Safe from any thread (a server's /metrics)."""
        ranks = self._ranks
        return None if ranks is None else ranks.reuse_stats()

    def cancel(self, request_id: str) -> None:
        """Stops a submitted request (its client left): dropped before it starts, or at the ranks' next round,
        its KV freed; its Output from `results` is an error. One that has finished keeps its Output."""
        wire = next((w for w, (rid, _) in self._submitted.items() if rid == request_id), None)
        if wire is not None and self._ranks is not None:
            self._ranks.cancel(wire)

    def text(self, token_ids: Sequence[int]) -> str:
        """What tokens read as, as an Output's text is read (the target's tokenizer, special tokens skipped)."""
        if self.target is not None:
            return self.target.text(token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _lose_ranks(self) -> None:
        """The ranks stopped under their requests (a rank died, an interrupt): those are gone."""
        self._ranks = None
        for _, frames in self._submitted.values():
            if frames is not None:
                frames.unlink(missing_ok=True)
        self._submitted = {}

    def _manifest_item(self, item: _Item, wire_id: str, params: SamplingParams, n: int | str) -> ManifestItem:
        """A request as a job's item: a file or folder by its path; frames in memory written as a frames file
        (video/decode.py) that the ranks read back whole."""
        prompt = _prompt(item.prompt)
        max_new_tokens, stop, seed = params.max_new_tokens, params.stop, self._seed(params, item)
        if not isinstance(item.video, np.ndarray):
            return ManifestItem(wire_id, Path(item.video).absolute(), prompt, max_new_tokens, None, None, {}, 0, stop,
                                seed)
        frames, times = checked_frames(item.id, item.video, item.frame_times)
        path = self._scratch / "frames" / f"{n}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_frames_file(path, frames, times)
        return ManifestItem(wire_id, path, prompt, max_new_tokens, len(frames), None, {}, 0, stop, seed)

    def _row_output(self, item_id: str, row: ResultRow) -> Output:
        """A job's result row as an Output: the job cut it at the request's stop strings already."""
        if row.error is not None:
            return Output(item_id, "", [], "error", error=f"{row.error.type}: {row.error.message}",
                          error_kind=row.error.kind)
        return Output(item_id, row.text, list(row.token_ids), str(row.stats.get("finish_reason")),
                      row.stats.get("num_video_tokens"), int(row.stats.get("generated_tokens", len(row.token_ids))),
                      dict(row.stats))

    def _item(self, r: Any) -> _Item:
        """A request as the call's item; what makes it malformed in `problem` (then it is not decoded)."""
        self._count += 1
        fallback = f"request-{self._count}"
        if not isinstance(r, VideoRequest):
            return _Item(fallback, None, "", None, problem=f"a request must be a vpsd.VideoRequest, got {_kind(r)}")
        item_id, problem = fallback, None
        if isinstance(r.id, int) and not isinstance(r.id, bool):
            item_id = str(r.id)  # as a manifest's integer id
        elif isinstance(r.id, str) and r.id.strip():
            item_id = r.id
        elif r.id is not None:
            problem = f"id must be a non-empty string, got {r.id!r}"
        return _Item(item_id, r.video, r.prompt, r.frame_times, r.seed, problem or _request_problem(r))

    def _decoding_config(self, params: SamplingParams) -> RunConfig:
        dec = dataclasses.replace(self.config.decoding, temperature=float(params.temperature), top_k=params.top_k,
                                  top_p=float(params.top_p), min_p=float(params.min_p))
        if params.max_new_tokens is not None:
            dec = dataclasses.replace(dec, max_new_tokens=params.max_new_tokens)
        return dataclasses.replace(self.config, decoding=dec)

    def _seed(self, params: SamplingParams, item: _Item) -> int:
        """A request's seed (its own, else the call's, else the config's): every item carries it (Request.seed, a
        manifest item's seed), so requests with other seeds share one batch and one set of child ranks."""
        for seed in (item.seed, params.seed):
            if seed is not None:
                return int(seed)
        return int(self.config.decoding.seed)

    def _load_draft(self, cfg: RunConfig):
        if self.method.loads_draft_model and self._draft is None:
            from vpsd.models.registry import load_draft

            self._draft = load_draft(cfg.family, cfg.draft, self.target)
        return self._draft

    # ---- lifetime -----------------------------------------------------------------------------------

    def _start_ranks(self, cfg: RunConfig) -> None:
        # The ranks wait for the next call as long as this process lives (they die with it).
        served = dataclasses.replace(cfg, idle_timeout_s=max(cfg.idle_timeout_s, SERVED_IDLE_S))
        self._ranks = ServedRanks(served, self.method.name, self._scratch, cfg.startup_timeout_s)
        self._ranks_for = _sampling_key(cfg)

    def _stop_ranks(self) -> None:
        if self._ranks is not None:
            ranks, self._ranks = self._ranks, None
            ranks.close()

    def close(self) -> None:
        """Stops the child ranks (if any) and frees the models."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_ranks()
        finally:
            self.target = self._draft = None
            if self._own_scratch:
                shutil.rmtree(self._scratch, ignore_errors=True)
            _open.discard(self)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_open: "weakref.WeakSet[LLM]" = weakref.WeakSet()
atexit.register(lambda: [llm.close() for llm in list(_open)])


@dataclass
class _Item:
    id: str
    video: Any
    prompt: str | list[dict[str, Any]]
    frame_times: np.ndarray | None
    seed: int | None = None
    problem: str | None = None  # why the request is malformed (its Output says it, kind bad_request)


def _request_problem(r: VideoRequest) -> str | None:
    """What makes a request malformed, in the words of a manifest's checks: the job and the API take the same
    items (launch/manifest.py: a video path, a non-empty prompt, a seed >= 0)."""
    video = r.video
    if isinstance(video, str) and not video.strip():
        return "video is empty: give a video file, a folder of frames, or the frames as an array"
    if not isinstance(video, (str, Path, np.ndarray)):
        return f"video must be a path (str or Path) or a (T, H, W, 3) uint8 array, got {_kind(video)}"
    try:
        prompt = _prompt(r.prompt)
    except ValueError as e:
        return str(e)
    if not any(t.text.strip() for t in turns_of(prompt) if t.role == "user"):
        return "prompt is empty (a job refuses such an item too: vpsd check)"
    if r.seed is not None and (isinstance(r.seed, bool) or not isinstance(r.seed, int) or r.seed < 0):
        return f"seed must be an int >= 0, got {r.seed!r}"
    return None


def _prompt(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt, or chat messages as a conversation prompt (models/prompt.py: one user turn is its text alone);
    ValueError for what a video prompt cannot hold."""
    if isinstance(prompt, str):
        if is_chat(prompt):  # a conversation already (chat_prompt's: the server's requests), checked again
            turns_of(prompt)
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt must be a string or chat messages (a list of {{'role': ..., 'content': ...}} "
                         f"dicts), got {_kind(prompt)}")
    try:
        return chat_prompt(parse_messages(prompt))
    except ValueError as e:
        raise ValueError(f"chat messages: {e}") from None


def _kind(value: Any) -> str:
    return "None" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"


class _Events:
    """The scheduler's events (engine/scheduler.py JobEvents) over a generate call's requests."""

    def __init__(self, target, cfg: RunConfig, frames: SharedFrames, params: SamplingParams,
                 seed: Callable[[_Item], int]) -> None:
        self.target, self.cfg, self.frames, self.params, self.seed = target, cfg, frames, params, seed
        self.reader = ItemReader(target, cfg)
        self.outputs: dict[str, Output] = {}

    def request(self, item: _Item, nxt: _Item | None) -> Request:
        """The request's frames read and fitted (VideoError, ValueError: its Output carries them)."""
        budget = self.cfg.decoding.max_new_tokens
        prompt = _prompt(item.prompt)
        if isinstance(item.video, np.ndarray):
            loaded = self.reader.load_array(item.id, prompt, item.video, item.frame_times, budget)
        else:
            loaded = self.reader.load(ManifestItem(item.id, Path(item.video), prompt, budget, None, None, {}, 0))
        self.frames.put(item.id, loaded.frames, loaded.times)  # a draft thread takes them from here
        return Request(item.id, prompt, budget, loaded.frames, loaded.times, loaded.video, None, self.params.stop,
                       seed=self.seed(item))

    def group_key(self, item: _Item) -> Hashable:
        """Items on one video (a file, or one array): a run of them is prefilled together (engine/sibling_prefill.py)."""
        return ("array", id(item.video)) if isinstance(item.video, np.ndarray) else ("file", str(item.video))

    def started(self, item: _Item) -> None:
        pass

    def finished(self, item: _Item, request: Request) -> None:
        self.frames.drop(item.id)
        if request.error is not None:
            self.failed(item, ValueError(request.error))
            return
        res = request.result()
        out, reason = output_of(self.target.text, res.token_ids, self.params.stop, self.target.eos_token_ids)
        stats = res.stats_dict()
        self.outputs[item.id] = Output(item.id, out.text, out.tokens, reason, stats.get("num_video_tokens"),
                                       out.generated, dict(stats))

    def failed(self, item: _Item, error: Exception) -> None:
        self.frames.drop(item.id)
        self.outputs[item.id] = _failed(item.id, error)


def _sampling_key(cfg: RunConfig) -> tuple:
    """What child ranks hold of a call's sampling settings in their config: other values start them again."""
    dec = cfg.decoding
    return dec.temperature, dec.top_k, dec.top_p, dec.min_p


def _bad_request(item_id: str, problem: str) -> Output:
    return Output(item_id, "", [], "error", error=f"bad request: {problem}", error_kind="bad_request")


def _failed(item_id: str, error: Exception) -> Output:
    kind = error.kind if isinstance(error, VideoError) else None
    return Output(item_id, "", [], "error", error=f"{type(error).__name__}: {error}", error_kind=kind)

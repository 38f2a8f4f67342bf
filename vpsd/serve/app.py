"""The HTTP surface of `vpsd serve` (FastAPI): OpenAI's chat completions over vpsd's Python API.

    POST /v1/chat/completions   a chat (system, user and assistant turns) about one video (video_url, or frames as
                                image_url parts, in a user turn), answered as the checkpoint's chat template asks
    GET  /v1/models             the one model served
    GET  /health                200 while the engine takes requests, 503 while shutting down
    GET  /metrics               Prometheus text (serve/metrics.py)

Every refusal is OpenAI's error object with a status the client can act on: 401 a wrong or missing key (when
the server has one), 400 a request vpsd cannot run (unsupported fields named; a video missing, unreadable or
too long for the context, with the job's error kind as `code`), 403 a local path outside --allowed-media-dir,
404 another model's name, 413 a body or video over the limits, 429 a full queue (Retry-After), 503 shutting
down or the engine failing. One request's failure is its own: the server goes on.

A streamed request (`stream: true`) gets server-sent events in OpenAI's chunk format: the role, the text as it
commits (each round's new text, where the engine runs in this process, serve/online.py, and where a parallel
method's ranks decode it and report their rounds, serve/on_ranks.py), never past a stop string's cut, the
finish reason (and the usage, with `stream_options.include_usage`), then `data: [DONE]`. A client that
disconnects has its request dropped from the queue, or stopped in the engine at its next round.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from vpsd.api import Output, SamplingParams, VideoRequest
from vpsd.models.prompt import prompt_texts, tokenizer_lock
from vpsd.serve.jobs import Done, Job, QueueFull, Runner, ServerClosing
from vpsd.serve.media import MediaError, MediaLimits, ParsedRequest, parse_messages
from vpsd.serve.metrics import Metrics
from vpsd.serve.schema import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChunkChoice, Delta,
                               ModelCard, ModelList, ResponseMessage, Usage, VpsdStats, error_body, unsupported)
from vpsd.tracing import get_logger

DISCONNECT_POLL_S = 0.25
log = get_logger()


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    method: str
    api_key: str | None = None
    max_body_bytes: int = 96 * 2**20
    limits: MediaLimits = MediaLimits()
    scratch: Path = Path("/tmp")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param, self.headers = status, type_, code, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, self.code, self.param), self.status, headers=self.headers)


def create_app(llm: Any, runner: Runner, settings: ServeSettings, metrics: Metrics) -> FastAPI:
    """llm: what the runner decodes with (its tokenizer counts prompt tokens)."""
    service = ChatService(llm, runner, settings, metrics)
    metrics.watch_reuse(getattr(runner, "reuse_stats", None))  # the prefix cache's counters, where the runner has them
    app = FastAPI(title="vpsd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        metrics.requests.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:  # still OpenAI's shape, and the server goes on
        metrics.requests.labels("500").inc()
        log.error("serve_internal_error", error=f"{type(exc).__name__}: {exc}")
        return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    app.get("/health")(service.health)
    app.get("/metrics")(service.prometheus)
    app.get("/v1/models")(service.models)
    app.post("/v1/chat/completions")(service.chat_completions)
    return app


class ChatService:
    """The routes' work over the server's state: the queue, the settings, the metrics."""

    def __init__(self, llm: Any, runner: Runner, settings: ServeSettings, metrics: Metrics) -> None:
        self.llm, self.queue, self.settings, self.metrics = llm, runner.queue, settings, metrics
        self.samples_per_request = runner.samples_per_request
        self.closing = False  # set on SIGTERM: /health says 503, new requests get 503
        self.created = int(time.time())

    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise HTTPError(401, "a wrong or missing API key (Authorization: Bearer KEY)", "authentication_error",
                            "invalid_api_key")

    async def health(self) -> Response:
        if self.closing:
            return JSONResponse({"status": "shutting down"}, 503)
        return JSONResponse({"status": "ok", "queue": self.queue.depth, "running": self.queue.running})

    async def prometheus(self) -> Response:
        return Response(self.metrics.text(), media_type=self.metrics.content_type)

    async def models(self, request: Request) -> JSONResponse:
        self.check_key(request)
        cards = [ModelCard(id=self.settings.model_name, created=self.created)]
        return JSONResponse(ModelList(data=cards).model_dump())

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self.check_key(request)
        if self.closing:
            raise HTTPError(503, "the server is shutting down", "server_error", "shutting_down")
        body = await _read_body(request, self.settings.max_body_bytes)
        req = await asyncio.to_thread(_parse, body)  # a body of many MiB of base64 parses off the event loop
        if req.model not in (None, self.settings.model_name):
            raise HTTPError(404, f"model {req.model!r} is not served here; this server serves "
                                 f"{self.settings.model_name!r} (GET /v1/models)", "invalid_request_error",
                            "model_not_found", "model")
        params = _sampling_params(req)
        try:
            parsed = await asyncio.to_thread(parse_messages, req, self.settings.limits, self.settings.scratch)
        except MediaError as e:
            raise HTTPError(e.status, str(e), "invalid_request_error", e.code, "messages") from None
        job = Job(VideoRequest(parsed.video, parsed.prompt, id=f"chatcmpl-{uuid.uuid4().hex}"), params)
        job.num_frames, job.fps = self._sampling(req)
        deltas: asyncio.Queue[str] = asyncio.Queue()
        if req.stream:
            loop = asyncio.get_running_loop()
            job.on_text = lambda text: loop.call_soon_threadsafe(deltas.put_nowait, text)
        self._submit(job, parsed)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(job, deltas, parsed, include_usage, arrived),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            done = await _wait(job, request)
        finally:
            parsed.cleanup()
        out = _checked(done)
        usage = self._usage(out, parsed.prompt, done)
        answer = ChatCompletion(id=str(job.request.id), model=self.settings.model_name, usage=usage,
                                choices=[Choice(message=ResponseMessage(content=out.text),
                                                finish_reason=out.finish_reason)])
        self._answered(job, out, usage, done, arrived)
        return JSONResponse(answer.model_dump())

    def _sampling(self, req: ChatCompletionRequest) -> tuple[int | None, float | None]:
        """A video_url's frame sampling (media_io_kwargs.video), where the runner honours it per request."""
        video = req.media_io_kwargs.video if req.media_io_kwargs is not None else None
        if video is None or (video.num_frames is None and video.fps is None):
            return None, None
        cfg = self.llm.config.video
        if not self.samples_per_request and (video.num_frames, video.fps) != (cfg.num_frames, cfg.fps):
            raise HTTPError(400, f"media_io_kwargs.video {video.model_dump(exclude_none=True)}: a method on child "
                                 f"ranks samples every video by the config (num_frames {cfg.num_frames}, fps "
                                 f"{cfg.fps}); serve it with --batch > 1 or --draft-on thread to choose per request",
                            code="unsupported_parameter", param="media_io_kwargs")
        return video.num_frames, video.fps

    def _submit(self, job: Job, parsed: ParsedRequest) -> None:
        try:
            self.queue.submit(job)
        except QueueFull as e:
            parsed.cleanup()
            raise HTTPError(429, str(e), "rate_limit_error", "queue_full",
                            headers={"Retry-After": str(e.retry_after_s)}) from None
        except ServerClosing as e:
            parsed.cleanup()
            raise HTTPError(503, str(e), "server_error", "shutting_down") from None

    def _usage(self, out: Output, prompt: str, done: Done) -> Usage:
        tokenizer = self.llm.tokenizer
        with tokenizer_lock(tokenizer):  # every message's text (the chat template's own tokens are not counted)
            text_tokens = sum(len(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
                              for text in prompt_texts(prompt))
        prompt_tokens = text_tokens + int(out.num_video_tokens or 0)
        s = out.stats
        stats = VpsdStats(method=self.settings.method, mean_accepted_tokens=s.get("mean_accepted_tokens"),
                          acceptance_rate=s.get("acceptance_rate"), rounds=s.get("rounds"),
                          num_video_tokens=out.num_video_tokens, num_kept=s.get("num_kept"),
                          prefill_s=s.get("prefill_s"), decode_s=s.get("decode_s"), queue_s=done.queue_s,
                          batch_size=done.batch_size, pipeline=s.get("pipeline"))
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=len(out.token_ids),
                     total_tokens=prompt_tokens + len(out.token_ids), vpsd=stats)

    def _answered(self, job: Job, out: Output, usage: Usage, done: Done, arrived: float) -> None:
        m = self.metrics
        m.requests.labels("200").inc()
        if job.first_token is not None:  # the engine's first committed token (reported by the ranks on child ranks)
            m.ttft.observe(job.first_token - job.enqueued)
        m.latency.observe(time.perf_counter() - arrived)
        m.queue_wait.observe(done.queue_s)
        m.answered(usage.prompt_tokens, usage.completion_tokens, out.stats, done.batch_size)

    def _chunk(self, job: Job, made: int, delta: Delta, finish: str | None = None, usage: Usage | None = None,
               choices: bool = True) -> str:
        c = ChatCompletionChunk(id=str(job.request.id), created=made, model=self.settings.model_name,
                                usage=usage, choices=[ChunkChoice(delta=delta, finish_reason=finish)] if choices else [])
        body = c.model_dump()
        for choice in body["choices"]:  # as OpenAI's chunks: a delta holds only what it carries
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def _stream(self, job: Job, deltas: "asyncio.Queue[str]", parsed: ParsedRequest, include_usage: bool,
                      arrived: float) -> AsyncIterator[str]:
        sent, made = "", int(time.time())
        try:
            yield self._chunk(job, made, Delta(role="assistant", content=""))
            waiting = asyncio.wrap_future(job.future)
            while not waiting.done() or not deltas.empty():
                getting = asyncio.ensure_future(deltas.get())
                await asyncio.wait({getting, waiting}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():
                    getting.cancel()
                    continue
                sent += getting.result()
                yield self._chunk(job, made, Delta(content=getting.result()))
            try:
                done = _resolved(waiting)
                out = _checked(done)
            except HTTPError as e:  # the status line is sent already: the error goes as an event, as OpenAI's does
                yield f"data: {json.dumps(error_body(str(e), e.type, e.code))}\n\n"
                yield "data: [DONE]\n\n"
                self.metrics.requests.labels(str(e.status)).inc()
                return
            if out.text.startswith(sent) and len(out.text) > len(sent):  # what was not streamed as it committed
                yield self._chunk(job, made, Delta(content=out.text[len(sent):]))
            usage = self._usage(out, parsed.prompt, done)
            yield self._chunk(job, made, Delta(), out.finish_reason)
            if include_usage:
                yield self._chunk(job, made, Delta(), usage=usage, choices=False)
            yield "data: [DONE]\n\n"
            self._answered(job, out, usage, done, arrived)
        except asyncio.CancelledError:  # the client went away: dropped from the queue, or stopped in the engine
            job.abandon()
            self.metrics.requests.labels("499").inc()
            raise
        finally:
            parsed.cleanup()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"the request body is {declared} bytes, over the server's limit of {limit} "
                             "(--max-body-mib)", "invalid_request_error", "body_too_large")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise HTTPError(413, f"the request body is over the server's limit of {limit} bytes (--max-body-mib)",
                            "invalid_request_error", "body_too_large")
        chunks.append(part)
    return b"".join(chunks)


def _parse(body: bytes) -> ChatCompletionRequest:
    try:
        req = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise HTTPError(400, f"invalid request: {where}: {first.get('msg')} ({e.error_count()} error(s))",
                        code="invalid_request", param=where or None) from None
    bad = unsupported(req)
    if bad:
        raise HTTPError(400, f"not supported by vpsd: {', '.join(bad)}", code="unsupported_parameter",
                        param=bad[0].split("=")[0].split(" ")[0])
    return req


def _sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    """The request's decoding settings as the API's SamplingParams; its own checks answer 400 (a top_p of 0...)."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "stop": stop, "seed": req.seed}
    if req.temperature is not None:
        kwargs["temperature"] = float(req.temperature)
    if req.top_p is not None:
        kwargs["top_p"] = float(req.top_p)
    if req.top_k is not None:
        kwargs["top_k"] = int(req.top_k)
    if req.min_p is not None:
        kwargs["min_p"] = float(req.min_p)
    params = SamplingParams(**kwargs)
    problems = params.check()
    if problems:
        raise HTTPError(400, "; ".join(problems), code="unsupported_parameter")
    return params


async def _wait(job: Job, request: Request) -> Done:
    """The job's result; a 499 (its future cancelled, if still queued) when the client disconnects first."""
    waiting = asyncio.wrap_future(job.future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if done:
            return _resolved(waiting)
        if await request.is_disconnected():
            job.abandon()  # dropped from the queue, or stopped in the engine where the runner can
            raise HTTPError(499, "the client closed the request", code="client_closed")


def _resolved(waiting: "asyncio.Future[Done]") -> Done:
    """A finished job's Done, or why it has none as an HTTPError."""
    try:
        return waiting.result()
    except asyncio.CancelledError:
        raise HTTPError(499, "the client closed the request", code="client_closed") from None
    except ServerClosing as e:
        raise HTTPError(503, str(e), "server_error", "shutting_down") from None
    except ValueError as e:  # the request's own settings, refused where it was submitted (ConfigError is one)
        raise HTTPError(400, str(e), "invalid_request_error", "bad_request") from None
    except Exception as e:  # noqa: BLE001 - the engine call failed (a rank died): this request's answer
        raise HTTPError(503, f"the engine failed: {type(e).__name__}: {e}", "server_error", "engine_failed") from None


def _checked(done: Done) -> Output:
    """The output, or its error as the job reports it: 400 with the error's kind (missing, corrupt, too_long)."""
    out = done.output
    if out.finish_reason == "error":
        raise HTTPError(400, out.error or "the request failed", "invalid_request_error", out.error_kind or "bad_request",
                        "messages")
    return out

"""OpenAI's chat-completions schema, the part `vpsd serve` speaks: the request as clients send it (the `openai`
package, lmms-eval's `openai_compatible` backend, curl), the response, the streamed chunks and the error body.

Fields vpsd cannot honour are not dropped silently: `unsupported(request)` names each one a client set to
something other than its neutral value (n > 1, tools, logprobs, penalties, ...), and the server answers 400
naming them. Fields that change nothing (user, metadata, store, a neutral value) are accepted.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Fields of OpenAI's request that vpsd does not implement, with the value(s) that mean "not used": a request that
# sets one of them to anything else is refused (400), naming it.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
}
IGNORED = {"user", "metadata", "store", "stream_options", "safety_identifier", "prompt_cache_key"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ImageURL(_Open):
    url: str
    detail: str | None = None


class VideoURL(_Open):
    url: str


class ContentPart(_Open):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None


class Message(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(_Open):
    include_usage: bool = False


class VideoIOKwargs(_Open):
    """How to sample a video_url's frames (vLLM's `media_io_kwargs.video`, which lmms-eval's openai backend sends
    with pass_video_url): None, the config's video.num_frames / fps."""

    num_frames: int | None = Field(default=None, ge=1)
    fps: float | None = Field(default=None, gt=0)


class MediaIOKwargs(_Open):
    video: VideoIOKwargs | None = None


class ChatCompletionRequest(_Open):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extensions (the openai client's extra_body), as vpsd's SamplingParams
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    media_io_kwargs: MediaIOKwargs | None = None


def unsupported(request: ChatCompletionRequest) -> list[str]:
    """The fields the request sets that vpsd does not implement, as `name=value` (empty: none)."""
    extra = request.model_extra or {}
    named = [f"{k}={v!r}" for k, v in extra.items() if k in NEUTRAL and v not in NEUTRAL[k]]
    unknown = [k for k in extra if k not in NEUTRAL and k not in IGNORED]
    return named + [f"{k} (unknown field)" for k in unknown]


# ---- responses ------------------------------------------------------------------------------------------


class VpsdStats(BaseModel):
    """vpsd's own numbers for one request (an extension of `usage`): speculation and timing."""

    method: str
    mean_accepted_tokens: float | None = None  # MAT: tokens committed per target verification round
    acceptance_rate: float | None = None
    rounds: int | None = None
    num_video_tokens: int | None = None
    num_kept: int | None = None  # video tokens the draft saw after pruning
    prefill_s: float | None = None
    decode_s: float | None = None
    queue_s: float = 0.0  # waiting in the server's queue
    batch_size: int = 1  # requests decoded in the same engine call
    pipeline: int | None = None  # which of a launch's pipelines decoded it (ranks; None in the server's process)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    vpsd: VpsdStats | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vpsd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: what its client raises as an APIStatusError with this message."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

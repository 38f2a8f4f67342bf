"""lmms-eval's chat requests in vpsd's terms: a task document's messages as a VideoRequest, a task's generation
kwargs as SamplingParams.

Pure (no lmms_eval import): the messages are the plain dicts a task's `doc_to_messages` returns
(`[{"role": "user", "content": [{"type": "video", "url": PATH}, {"type": "text", "text": ...}]}]`), so vpsd's
own suite tests this without lmms-eval.

What vpsd takes: one user turn holding one video (a file or a folder of frames) and text, after an optional system
message (its text parts): the user's text parts joined by newlines are the prompt, as `vpsd.LLM` joins a chat
turn's; with a system message the prompt is that conversation (models/prompt.py `chat_prompt`), rendered by the
checkpoint's chat template. Anything else (images, audio, several videos, a clip's start/end times, assistant
turns) is a `BadRequest` for that request alone: the backend answers it with an empty string and a warning, as it
does a request whose video fails to read.

One video, many questions: `video_order` puts the requests about one video next to each other (videos in the order
of their first request), so a task's questions about a video decode one after another (in one engine batch, or
adjacent ones) and the target reads and prefills the video once for all of them (engine/prefix_cache.py);
`generate_by_video` decodes in that order and answers in the requests' own.

Generation kwargs follow transformers' `generate`: greedy unless `do_sample` is not false and `temperature > 0`;
`until` (a string or a list) are stop strings; `top_k`, `top_p` and `min_p` filter the target's distribution (and
the draft's) as transformers' warpers do, and a seeded output is `ar`'s own (pipeline/sampling.py). What would
decode another distribution than the one vpsd samples losslessly (beam search, repetition penalties) is a
`ConfigError` for the whole group: a score from settings silently ignored would not be the score the task asks
for.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, Callable, Mapping, Sequence, TypeVar

from vpsd.api import SamplingParams, VideoRequest
from vpsd.config import ConfigError
from vpsd.models.prompt import Turn, chat_prompt

T = TypeVar("T")

# Keys that only shape how transformers runs (not what it samples), or that greedy decoding ignores anyway.
NEUTRAL_KEYS = frozenset({"max_new_tokens", "temperature", "do_sample", "until", "top_p", "top_k", "min_p",
                          "num_beams", "use_cache", "image_aspect_ratio"})
# Keys whose non-default values change the distribution (or the search) in a way vpsd does not reproduce.
UNSUPPORTED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "length_penalty": 1.0, "min_new_tokens": 0,
               "typical_p": 1.0}


class BadRequest(ValueError):
    """A request vpsd cannot decode (its answer is empty; the others go on)."""


def video_request(messages: Sequence[Mapping[str, Any]], request_id: str) -> VideoRequest:
    """The video and the user's text (after the system message, if any) of one task document's chat messages."""
    roles = [m.get("role") for m in messages]
    if roles not in (["user"], ["system", "user"]):
        raise BadRequest(f"vpsd takes one user turn (the video goes in it), after an optional system message; got "
                         f"roles {roles}")
    system = [Turn("system", _system_text(messages[0].get("content")))] if roles[0] == "system" else []
    content = messages[-1].get("content")
    if isinstance(content, str):
        raise BadRequest("the user turn holds no video (its content is text only)")
    videos, texts, others = [], [], []
    for part in content or []:
        kind = part.get("type")
        if kind == "video":
            videos.append(part.get("url"))
        elif kind == "text":
            texts.append(part.get("text") or "")
        else:
            others.append(kind)
    if others:
        raise BadRequest(f"vpsd decodes one video and text; this request also holds {', '.join(map(str, others))}")
    if len(videos) != 1:
        raise BadRequest(f"vpsd decodes one video a request, this one holds {len(videos)}")
    video = videos[0]
    if isinstance(video, dict):  # lmms-eval's form of a clip: {"video": path, "video_start": s, "video_end": s}
        raise BadRequest("a clip of a video (video_start / video_end) is not supported: vpsd reads the whole file")
    if not isinstance(video, str):
        raise BadRequest(f"the video must be a path (a file or a folder of frames), got {type(video).__name__}")
    return VideoRequest(video, chat_prompt([*system, Turn("user", "\n".join(texts), True)]), id=request_id)


def _system_text(content: Any) -> str:
    """A system message's text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    parts = content or []
    others = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in parts
              if not (isinstance(p, dict) and p.get("type") == "text")]
    if others:
        raise BadRequest(f"a system message holds text only; this one also holds {', '.join(map(str, others))}")
    return "\n".join(p.get("text") or "" for p in parts)


def video_order(requests: Sequence[VideoRequest]) -> list[int]:
    """The requests' indices with each video's together: videos in the order of their first request, a video's
    requests in theirs (module docstring)."""
    groups: dict[Any, list[int]] = {}
    for i, r in enumerate(requests):
        key = str(r.video) if isinstance(r.video, (str, os.PathLike)) else ("array", id(r.video))
        groups.setdefault(key, []).append(i)
    return [i for group in groups.values() for i in group]


def generate_by_video(generate: Callable[[list[VideoRequest]], Sequence[T]],
                      requests: Sequence[VideoRequest]) -> list[T]:
    """`generate`'s outputs of `requests`, decoded in `video_order`, returned in the requests' own order."""
    order = video_order(requests)
    outputs = generate([requests[i] for i in order])
    answers: list[Any] = [None] * len(requests)
    for i, out in zip(order, outputs, strict=True):
        answers[i] = out
    return answers


def sampling_params(gen_kwargs: Mapping[str, Any]) -> tuple[SamplingParams, list[str]]:
    """SamplingParams for one group of requests, and the keys it ignored (neither known nor refused)."""
    problems = []
    if int(gen_kwargs.get("num_beams") or 1) != 1:
        problems.append(f"num_beams {gen_kwargs['num_beams']}: beam search is not what vpsd decodes (greedy or "
                        "sampled); set num_beams 1")
    for key, neutral in UNSUPPORTED.items():
        if gen_kwargs.get(key) not in (None, neutral):
            problems.append(f"{key} {gen_kwargs[key]}: vpsd samples from the model's own distribution; only "
                            f"{key} {neutral} runs")
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    sampled = temperature > 0 and gen_kwargs.get("do_sample") is not False
    until = gen_kwargs.get("until") or ()
    stop = (until,) if isinstance(until, str) else tuple(s for s in until if s)
    max_new = gen_kwargs.get("max_new_tokens")
    params = SamplingParams(max_new_tokens=int(max_new) if max_new is not None else None,
                            temperature=temperature if sampled else 0.0,
                            top_k=int(gen_kwargs.get("top_k") or 0) if sampled else 0,
                            top_p=float(gen_kwargs.get("top_p") or 1.0) if sampled else 1.0,
                            min_p=float(gen_kwargs.get("min_p") or 0.0) if sampled else 0.0, stop=stop)
    problems += params.check()
    if problems:
        raise ConfigError(problems)
    ignored = sorted(k for k in gen_kwargs if k not in NEUTRAL_KEYS and k not in UNSUPPORTED)
    return params, ignored


def request_seed(base: int, request_id: str) -> int:
    """A request's seed: the run's decoding.seed moved by a hash of its id (task, split, document, repeat), so
    two documents, or two repeats of one, sample apart, and every method samples a document alike."""
    return int(base) + zlib.crc32(request_id.encode())


def group_key(gen_kwargs: Mapping[str, Any]) -> str:
    """Requests with equal generation kwargs decode in one `generate` call (one batch for the engine)."""
    return json.dumps(dict(gen_kwargs), sort_keys=True, default=repr)

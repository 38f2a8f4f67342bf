"""A chat request's messages as vpsd's one video and its prompt (a `VideoRequest`), within the server's limits.

The video comes in one of the forms OpenAI-compatible clients send:
- one `video_url` part: a `data:video/...;base64,` URL (written to a temporary file the caller deletes, keyed by
  its bytes for the frames kept of a video asked about again: vpsd/video/identity.py), or a
  local path / `file://` URL, read only when it lies under the server's `--allowed-media-dir` (vLLM's rule for
  `--allowed-local-media-path`); remote http(s) URLs are not fetched;
- `image_url` parts, one per frame, as data URLs (what lmms-eval's `openai_compatible` backend sends for a
  video task: the frames as base64 PNGs after the question), decoded to a (T, H, W, 3) uint8 array, one frame a
  second.
The prompt is the conversation (vpsd/models/prompt.py): an optional system message (or OpenAI's `developer`)
first, then user and assistant turns, the last a user's; each message's text parts joined by newlines; the video
in the user turn that holds its part(s), before that turn's text. One user turn is the plain prompt it always was.
What does not fit is a `MediaError` with the HTTP status to answer (400 bad input: a role other than those, a
video part outside a user turn, two videos, none; 403 a path outside the allowed folder, 413 over a size limit).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

from vpsd.models.prompt import ROLES, Turn, chat_prompt, check_turns
from vpsd.serve.schema import ChatCompletionRequest, ContentPart
from vpsd.video.identity import forget_content, note_content


ROLE_NAMES = {"developer": "system"}  # OpenAI's newer name of the system message (its o-series clients send it)


class MediaError(ValueError):
    def __init__(self, status: int, message: str, code: str = "invalid_video") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class MediaLimits:
    max_video_bytes: int = 64 * 2**20  # one video's decoded bytes (a data URL's payload, or a local file)
    max_frames: int = 512  # image parts of one request
    allowed_media_dir: Path | None = None  # local paths are read only under it; None: none are


@dataclass
class ParsedRequest:
    prompt: str
    video: str | np.ndarray  # a file path, or frames
    temp_files: list[Path] = field(default_factory=list)  # the caller deletes them when the request is done

    def cleanup(self) -> None:
        for path in self.temp_files:
            forget_content(path)
            path.unlink(missing_ok=True)


def parse_messages(request: ChatCompletionRequest, limits: MediaLimits, scratch: Path) -> ParsedRequest:
    """The request's conversation and video (MediaError for what does not fit; module docstring)."""
    turns, videos, images = [], [], []  # videos, images: (message index, url)
    for n, message in enumerate(request.messages):
        role = ROLE_NAMES.get(message.role, message.role)
        if role not in ROLES:
            raise MediaError(400, f"messages[{n}]: role {message.role!r} is not supported (system, user, assistant)",
                             "unsupported_messages")
        content = message.content
        if (message.model_extra or {}).get("tool_calls") or (message.model_extra or {}).get("function_call"):
            raise MediaError(400, f"messages[{n}] ({message.role}): tool calls are not supported",
                             "unsupported_messages")
        if content is None:
            raise MediaError(400, f"messages[{n}] ({message.role}) has no content (tool calls are not supported)",
                             "unsupported_messages")
        parts = [ContentPart(type="text", text=content)] if isinstance(content, str) else list(content)
        texts = []
        for part in parts:
            if part.type == "text":
                texts.append(part.text or "")
            elif part.type in ("video_url", "image_url") and role != "user":
                raise MediaError(400, f"messages[{n}] ({message.role}): a {part.type} part goes in a user turn",
                                 "unsupported_content")
            elif part.type == "video_url" and part.video_url is not None:
                videos.append((n, part.video_url.url))
            elif part.type == "image_url" and part.image_url is not None:
                images.append((n, part.image_url.url))
            else:
                raise MediaError(400, f"messages[{n}]: content part of type {part.type!r} is not supported (text, "
                                      "video_url, image_url)", "unsupported_content")
        turns.append(Turn(role, "\n".join(texts)))
    try:
        check_turns(turns, one_video=False)  # the conversation's shape, before its video
    except ValueError as e:
        raise MediaError(400, str(e), "unsupported_messages") from None
    if videos and images or len(videos) > 1:
        raise MediaError(400, "one video a request: one video_url part, or image_url parts as its frames, not both "
                              f"(got {len(videos)} video_url, {len(images)} image_url)", "unsupported_content")
    if not videos and not images:
        raise MediaError(400, "no video: give a video_url part, or the frames as image_url parts", "missing_video")
    holders = sorted({n for n, _ in videos + images})
    if len(holders) > 1:
        raise MediaError(400, f"one video a request: the frames (image_url parts) are in messages {holders}; send "
                              "them in one user turn", "unsupported_content")
    turns[holders[0]] = Turn(turns[holders[0]].role, turns[holders[0]].text, video=True)
    try:
        prompt = chat_prompt(turns)
    except ValueError as e:
        raise MediaError(400, str(e), "unsupported_messages") from None
    if videos:
        return _video(videos[0][1], prompt, limits, scratch)
    return ParsedRequest(prompt, _frames([url for _, url in images], limits))


def _video(url: str, prompt: str, limits: MediaLimits, scratch: Path) -> ParsedRequest:
    if url.startswith("data:"):
        mime, payload = _data_url(url, limits)
        if not mime.startswith("video/") and mime != "application/octet-stream":
            raise MediaError(400, f"a video_url data URL must be video/*, got {mime!r}")
        scratch.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(suffix=_suffix(mime), dir=scratch)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        # Keyed by its bytes, not its temporary file: the next request sending the same video finds its frames kept
        # (video/frame_cache.py), though written to a file of its own
        note_content(name, payload)
        return ParsedRequest(prompt, name, [Path(name)])
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise MediaError(400, "remote video URLs are not fetched: send the video as a data: URL, or as a local path "
                              "under the server's --allowed-media-dir", "unsupported_url")
    if parsed.scheme not in ("", "file"):
        raise MediaError(400, f"video_url scheme {parsed.scheme!r} is not supported (data:, file://, a local path)",
                         "unsupported_url")
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else url)
    if limits.allowed_media_dir is None:
        raise MediaError(403, "local video paths are refused: the server was started without --allowed-media-dir",
                         "path_not_allowed")
    root = limits.allowed_media_dir.resolve()
    real = path.resolve()
    if not real.is_relative_to(root):
        raise MediaError(403, f"{path} is outside the server's --allowed-media-dir", "path_not_allowed")
    if real.is_file() and real.stat().st_size > limits.max_video_bytes:
        raise MediaError(413, f"{path}: {real.stat().st_size} bytes, over the server's limit of "
                              f"{limits.max_video_bytes} (--max-video-mib)", "video_too_large")
    return ParsedRequest(prompt, str(real))  # missing or unreadable: the job's own error, from the engine


def _frames(urls: list[str], limits: MediaLimits) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if len(urls) > limits.max_frames:
        raise MediaError(413, f"{len(urls)} frames, over the server's limit of {limits.max_frames} (--max-frames)",
                         "video_too_large")
    frames, total = [], 0
    for n, url in enumerate(urls):
        if not url.startswith("data:"):
            raise MediaError(400, f"frame {n}: image_url must be a data: URL (remote and local images are not read)",
                             "unsupported_url")
        _, payload = _data_url(url, limits)
        total += len(payload)
        if total > limits.max_video_bytes:
            raise MediaError(413, f"the frames are over the server's limit of {limits.max_video_bytes} bytes "
                                  "(--max-video-mib)", "video_too_large")
        try:
            with Image.open(io.BytesIO(payload)) as image:
                frames.append(np.asarray(image.convert("RGB"), dtype=np.uint8))
        except Image.DecompressionBombError as e:
            raise MediaError(413, f"frame {n}: {e}", "video_too_large") from None
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise MediaError(400, f"frame {n}: not a readable image ({e})", "corrupt") from None
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise MediaError(400, f"the frames differ in size: {sorted(shapes)}", "bad_request")
    return np.stack(frames)


def _data_url(url: str, limits: MediaLimits) -> tuple[str, bytes]:
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise MediaError(400, "a data URL must be data:<mime>;base64,<payload>", "bad_request")
    if len(data) * 3 // 4 > limits.max_video_bytes + 3:  # refused before decoding it
        raise MediaError(413, f"the video is over the server's limit of {limits.max_video_bytes} bytes "
                              "(--max-video-mib)", "video_too_large")
    try:
        payload = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(400, "the data URL's payload is not valid base64", "bad_request") from None
    return head[len("data:"):-len(";base64")].lower(), payload


def _suffix(mime: str) -> str:
    return {"video/webm": ".webm", "video/quicktime": ".mov", "video/x-matroska": ".mkv",
            "video/x-msvideo": ".avi"}.get(mime, ".mp4")

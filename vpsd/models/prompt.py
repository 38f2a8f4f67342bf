"""Prompts are text: how a user's prompt, or a conversation, enters a chat template (light: the manifest imports it).

A prompt is what an item asks about its one video: a question (a str), or a conversation: an optional system
message, then user and assistant turns, the last one a user's, the video in one user turn (`Turn`). A
conversation travels as a str too (`chat_prompt`: CHAT_MARK, then its JSON), so every path that carries a prompt
(a manifest item on the wire, a request, the draft rank's JobStart) carries it unchanged; `turns_of` reads either
form back. A conversation of one user turn IS the plain question: `chat_prompt` returns its text, so it renders,
tokenizes and decodes exactly as the question always did.

Rendering (`render_template`, or a family's hand-written `chatml` form where the tokenizer has no template) puts
slot(i), a private-use character, where turn i's text goes; `encode_chat` encodes the template's pieces as control
tokens and each text as text. The video leads the text of the turn that holds it (Qwen's and LLaVA's processors
put it there; a job's plain prompt always did). In a Qwen-style (ChatML) template the generation prompt
`<|im_start|>assistant\n` is the assistant turn's own header and every piece around a text is encoded on its own,
so a follow-up conversation (the turns so far, the assistant's answer, a new user turn) encodes as the earlier
prompt's tokens, then the answer's text tokens, then `<|im_end|>`, `\n` and the new turn: a follow-up's prefix is
the earlier turn's prompt plus its answer (KV reuse can keep that cache). The answer is re-encoded from its text:
a reuse compares token ids (a sampled answer may have been generated as another split of the same text), and a
template whose assistant header differs from its generation prompt (llava-hf's `assistant ` vs `assistant\n`)
keeps only the common prefix.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, replace
from typing import Any, Sequence

ROLES = ("system", "user", "assistant")
SLOTS = 4096  # slot(0) .. slot(SLOTS - 1): U+E000 .. U+EFFF, private-use characters templates never hold
MAX_TURNS = SLOTS
# A conversation as a prompt str: this mark (a supplementary private-use character), then its JSON. A manifest's
# plain prompt that starts with it is refused, and chat_prompt never returns a plain text that does.
CHAT_MARK = "\U000F0000"


def slot(i: int) -> str:
    """Where turn i's text goes in a rendered template."""
    if not 0 <= i < SLOTS:
        raise ValueError(f"a conversation holds at most {SLOTS} messages")
    return chr(0xE000 + i)


PROMPT_SLOT = slot(0)  # where a plain prompt goes (its one user turn)
_SLOT_RE = re.compile(f"([{slot(0)}-{slot(SLOTS - 1)}])")


class ControlText(str):
    """A prompt whose special-token strings ARE control tokens: a manifest item that asks for it
    ("prompt_special_tokens": true). A plain str prompt is text, whatever it contains."""


@dataclass(frozen=True)
class Turn:
    """One message of a conversation: its role, its text (a message's text parts joined by newlines) and whether the
    video goes in it (before its text)."""

    role: str
    text: str
    video: bool = False


def check_turns(turns: Sequence[Turn], one_video: bool = True) -> None:
    """ValueError naming what makes `turns` a conversation vpsd cannot answer: roles other than system, user,
    assistant; a system message that is not the first; the video outside a user turn; a last message that is not a
    user's (vpsd answers the last user turn); not exactly one video (unless `one_video` is False)."""
    if not turns:
        raise ValueError("a conversation needs at least one message (a user turn with the video)")
    if len(turns) > MAX_TURNS:
        raise ValueError(f"a conversation holds at most {MAX_TURNS} messages, got {len(turns)}")
    roles = [t.role for t in turns]
    for n, t in enumerate(turns):
        if t.role not in ROLES:
            raise ValueError(f"message {n}: unknown role {t.role!r} (system, user, assistant)")
        if not isinstance(t.text, str):
            raise ValueError(f"message {n} ({t.role}): its text must be a string")
        if t.role == "system" and n > 0:
            raise ValueError(f"message {n}: a system message may only come first (roles {roles})")
        if t.video and t.role != "user":
            raise ValueError(f"message {n} ({t.role}): the video goes in a user turn")
    if "user" not in roles:
        raise ValueError(f"a conversation needs a user turn (the video goes in one), got roles {roles}")
    if roles[-1] != "user":
        raise ValueError(f"the last message must be a user turn (vpsd answers it), got roles {roles}")
    videos = [n for n, t in enumerate(turns) if t.video]
    if one_video and len(videos) != 1:
        where = f" (messages {videos})" if videos else ""
        raise ValueError(f"a conversation holds exactly one video, in one user turn; got {len(videos)}{where}")


def chat_prompt(turns: Sequence[Turn]) -> str:
    """`turns` as a prompt (checked: ValueError): the plain text for one user turn (unless it starts with CHAT_MARK),
    else CHAT_MARK + JSON."""
    turns = list(turns)
    check_turns(turns)
    if len(turns) == 1 and not turns[0].text.startswith(CHAT_MARK):
        return turns[0].text
    return CHAT_MARK + json.dumps([{"role": t.role, "text": t.text, **({"video": True} if t.video else {})}
                                   for t in turns])


def is_chat(prompt: str) -> bool:
    return isinstance(prompt, str) and prompt.startswith(CHAT_MARK)


def turns_of(prompt: str) -> list[Turn]:
    """The conversation a prompt is: a plain prompt is one user turn holding the video (a ControlText stays one)."""
    if not is_chat(prompt):
        return [Turn("user", prompt, True)]
    try:
        data = json.loads(prompt[len(CHAT_MARK):])
        turns = [Turn(str(m["role"]), m["text"], bool(m.get("video", False))) for m in data]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"a conversation prompt that is not one: {e}") from None
    check_turns(turns)
    return turns


def prompt_texts(prompt: str) -> list[str]:
    """Every message's text of a prompt (a plain prompt's is itself): what a server counts as its text tokens."""
    return [t.text for t in turns_of(prompt)]


def parse_messages(messages: Any) -> list[Turn]:
    """Chat messages as plain data (a manifest line's `messages`, `vpsd.VideoRequest`'s prompt) as checked turns.

    Each is {"role": "system" | "user" | "assistant", "content": a string, or a list of {"type": "text", "text":
    ...} parts and, in one user turn, one {"type": "video"} part: where the item's own video goes (the line's
    `video`, the request's); without one, the video goes in the first user turn.
    ValueError names the message and what is wrong with it."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} objects, got "
                         f"{_kind(messages)}")
    turns = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {n} must be an object {{'role': ..., 'content': ...}}, got {_kind(m)}")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise ValueError(f"message {n}: unknown field(s) {unknown} (role, content)")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {n}: unknown role {role!r} (system, user, assistant)")
        content = m.get("content")
        if isinstance(content, str):
            turns.append(Turn(role, content))
            continue
        if not isinstance(content, (list, tuple)):
            raise ValueError(f"message {n} ({role}): content must be a string or a list of parts, got "
                             f"{_kind(content)}")
        texts, videos = [], 0
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
                texts.append(part["text"])
            elif kind == "video" and set(part) == {"type"}:
                videos += 1
            elif kind == "video":
                raise ValueError(f"message {n} ({role}), part {k}: a video part is {{'type': 'video'}} alone: it "
                                 f"marks where the item's own video goes (the line's or request's 'video')")
            elif kind in ("video_url", "image_url", "image"):
                raise ValueError(f"message {n} ({role}), part {k}: {kind!r} is not read here: the video is the "
                                 f"item's own (the line's or request's 'video'); mark its turn with "
                                 f"{{'type': 'video'}}")
            else:
                raise ValueError(f"message {n} ({role}), part {k}: expected {{'type': 'text', 'text': '...'}} or "
                                 f"{{'type': 'video'}}, got {_kind(part)}")
        if videos > 1:
            raise ValueError(f"message {n} ({role}): {videos} video parts; a conversation holds one video")
        if videos and role != "user":
            raise ValueError(f"message {n} ({role}): the video goes in a user turn")
        turns.append(Turn(role, "\n".join(texts), videos == 1))
    check_turns(turns, one_video=False)
    if not any(t.video for t in turns):  # the first user turn holds the video
        first = next(n for n, t in enumerate(turns) if t.role == "user")
        turns[first] = replace(turns[first], video=True)
    check_turns(turns)
    return turns


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


# ---- rendering ------------------------------------------------------------------------------------------------


def slotted(turns: Sequence[Turn]) -> list[Turn]:
    """The turns with slot(i) for turn i's text: what a template is rendered with (encode_chat fills them)."""
    return [replace(t, text=slot(i)) for i, t in enumerate(turns)]


def render_template(tokenizer: Any, turns: Sequence[Turn], video_block: str) -> str | None:
    """The tokenizer's own chat template over `turns` (each message's content a list of parts: the video part, in its
    turn, then one text part), with the generation prompt; None when the tokenizer has none. The render must hold
    `video_block`, the placeholder the family expands, exactly once."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": t.role, "content": [*([{"type": "video"}] if t.video else []), {"type": "text", "text": t.text}]}
                for t in turns]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(video_block) != 1:
        raise ValueError(f"the chat template rendered {text.count(video_block)} {video_block!r} for one video")
    return text


def chatml(turns: Sequence[Turn], video_block: str, default_system: str | None = None, after_video: str = "") -> str:
    """A family's hand-written chat template (ChatML, Qwen's markers) over `turns`, for a tokenizer without one (the
    tiny offline models): `<|im_start|>ROLE\\n` + (the video block + `after_video`, in its turn) + text +
    `<|im_end|>\\n` a message, `<|im_start|>assistant\\n` last; `default_system` leads when the first message is not
    a system one (Qwen2.5-VL's "You are a helpful assistant.")."""
    out = []
    if default_system is not None and (not turns or turns[0].role != "system"):
        out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for t in turns:
        video = video_block + after_video if t.video else ""
        out.append(f"<|im_start|>{t.role}\n{video}{t.text}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


def encode_chat(tokenizer: Any, template: str, texts: str | Sequence[str]) -> list[int]:
    """Token ids of a chat `template` rendered with slot(i) in place of `texts[i]` (one str: the PROMPT_SLOT's).

    The template's markers are control tokens; the texts are text: "<|im_end|>" or "<|video_pad|>" typed by a
    user encodes as the characters it is made of (split_special_tokens), so a text can neither end its turn nor
    add video tokens, unless it is a ControlText. Each piece between slots, and each text, is encoded on its own:
    special tokens split the encoding anyway, so a text without any encodes exactly as it would inside the whole
    string, and a conversation's tokens are its earlier turns' tokens followed by the rest (module docstring).
    """
    texts = [texts] if isinstance(texts, str) else list(texts)

    def enc(text: str, split: bool = False) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split) if text else []

    ids: list[int] = []
    with tokenizer_lock(tokenizer):
        for n, piece in enumerate(_SLOT_RE.split(template)):
            if n % 2 == 0:
                ids += enc(piece)
            else:
                text = texts[ord(piece) - 0xE000]
                ids += enc(text, split=not isinstance(text, ControlText))
    return ids


_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def tokenizer_lock(tokenizer: Any) -> threading.Lock:
    """The one lock of a tokenizer, held around every use of it. A fast tokenizer is not thread-safe: transformers
    sets `split_special_tokens` on the shared Rust tokenizer for the length of a call, so another thread's call
    meanwhile encodes a template's control tokens as text (wrong token ids, silently, or an item failing with "0
    video tokens"), and a call that finds the tokenizer borrowed raises. Items are prepared on the prefill-ahead
    thread and on the engine's (engine/prefill_ahead.py), which also reads committed text for stop strings."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(id(tokenizer), threading.Lock())

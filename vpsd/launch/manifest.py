"""JSONL manifests: the list of (video, prompt) items a run decodes, and a checker for people.

Format, one JSON object per line (blank lines and lines starting with `#` are skipped):
    {"id": "clip-1", "video": "videos/a.mp4", "prompt": "Describe the video.",
     "max_new_tokens": 64, "num_frames": 16, "reference": "..."}
- `id`: non-empty string or integer, unique in the file; always handed on as a string.
- `video`: a file or a folder of frame images; relative paths are relative to the manifest's folder.
- `prompt`: non-empty string; text, even where it spells a special token such as `<|im_end|>` (encoded as
  the characters, vpsd/models/prompt.py), unless the item sets `"prompt_special_tokens": true`.
- or `messages` instead of `prompt`: a conversation, rendered as the checkpoint's chat template renders it:
  [{"role": "system" | "user" | "assistant", "content": "..." or [{"type": "text", "text": "..."},
  {"type": "video"}]}, ...]: an optional system message first, the last message a user's, and the line's `video`
  in the user turn holding the one `{"type": "video"}` part (without one, in the first user turn).
  Its texts are text; `ManifestItem.prompt` holds it as a conversation prompt (models/prompt.py chat_prompt).
- optional `max_new_tokens` (int > 0), and `num_frames` (int > 0) or `fps` (number > 0), not both;
  null means absent.
- optional `stop`: a string or a list of strings; the output ends before the first of them (decoding stops
  there too: pipeline/stopping.py).
- any other field is carried untouched in `ManifestItem.extra` (references, metadata).

`load_manifest` never raises for a bad line: each line either becomes an item or yields problems,
all of them, with the line number, so one pass over a large manifest shows everything to fix. It
raises `ManifestError` only when the manifest itself cannot be read. `check_manifest` prints those
problems as `path:line: message` and returns an exit code (`vpsd check FILE`): it also opens every video as a
job's reader starts it (container, video stream, first frame) and lists those that fail with the job's error kind;
`--fast` only checks that the files exist and are non-empty. Decoding a whole video is the reader's job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpsd.launch.video_queue import groups_of
from vpsd.models.prompt import CHAT_MARK, ControlText, chat_prompt, parse_messages, turns_of

KNOWN_FIELDS = ("id", "video", "prompt", "messages", "max_new_tokens", "num_frames", "fps", "stop", "seed")

# Exit codes of check_manifest.
OK, HAS_PROBLEMS, UNREADABLE = 0, 1, 2


class ManifestError(Exception):
    """The manifest file itself cannot be read."""


@dataclass(frozen=True)
class ManifestItem:
    id: str
    video: Path  # absolute, resolved
    prompt: str
    max_new_tokens: int | None
    num_frames: int | None
    fps: float | None
    extra: dict[str, Any] = field(hash=False)  # every field not listed in KNOWN_FIELDS, as parsed
    line: int  # 1-based line in the manifest
    stop: tuple[str, ...] = ()  # stop strings
    seed: int | None = None  # its sampling seed (pipeline/seeds.py); None: the run's decoding.seed
    # Another item of the job reads the same frames (the coordinator sets it, launch/video_queue.py): only then is
    # its video prefix kept for reuse (engine/prefix_cache.py). An item asked alone prefills in one forward, as
    # before reuse, so a parallel method's pruner gets the signals mid-prefill (HIPPO's synchronous prefill).
    shares_video: bool = True

    def to_wire(self) -> dict[str, Any]:
        """Plain data for a control message (the coordinator hands items to pipelines with it)."""
        return {"id": self.id, "video": str(self.video), "prompt": str(self.prompt),
                "prompt_special_tokens": isinstance(self.prompt, ControlText), "max_new_tokens": self.max_new_tokens,
                "num_frames": self.num_frames, "fps": self.fps, "extra": self.extra, "line": self.line,
                "stop": list(self.stop), "seed": self.seed, "shares_video": self.shares_video}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "ManifestItem":
        prompt = ControlText(data["prompt"]) if data["prompt_special_tokens"] else data["prompt"]
        return cls(data["id"], Path(data["video"]), prompt, data["max_new_tokens"], data["num_frames"], data["fps"],
                   dict(data["extra"]), data["line"], tuple(data["stop"]), data["seed"], data.get("shares_video", True))


@dataclass(frozen=True)
class ManifestProblem:
    line: int  # 1-based line in the manifest
    message: str


class _DuplicateKey(Exception):
    pass


def _object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys silently; a manifest author meant one of them.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(obj: dict, name: str, problems: list[str]) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if not _is_int(value) or value <= 0:
        problems.append(f"field '{name}' must be a positive integer, got {_json_type(value)}")
        return None
    return value


def _positive_number(obj: dict, name: str, problems: list[str]) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        problems.append(f"field '{name}' must be a positive number, got {_json_type(value)}")
        return None
    return float(value)


def _stop_strings(obj: dict, problems: list[str]) -> tuple[str, ...]:
    value = obj.get("stop")
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        problems.append(f"field 'stop' must be a non-empty string or a list of them, got {_json_type(value)}")
        return ()
    return tuple(strings)


def _seed(obj: dict, problems: list[str]) -> int | None:
    value = obj.get("seed")
    if value is not None and (not _is_int(value) or value < 0):
        problems.append(f"field 'seed' must be an integer >= 0, got {_json_type(value)}")
        return None
    return value


def _required_text(obj: dict, name: str, problems: list[str]) -> str | None:
    if name not in obj:
        problems.append(f"missing field '{name}'")
        return None
    value = obj[name]
    if not isinstance(value, str):
        problems.append(f"field '{name}' must be a string, got {_json_type(value)}")
        return None
    if not value.strip():
        problems.append(f"field '{name}' is empty")
        return None
    return value


def _prompt(obj: dict, problems: list[str]) -> str | None:
    """The line's `prompt`, or its `messages` as a conversation prompt (models/prompt.py)."""
    if "messages" not in obj:
        prompt = _required_text(obj, "prompt", problems)
        if prompt is not None and prompt.startswith(CHAT_MARK):
            problems.append("field 'prompt' starts with U+F0000, vpsd's conversation mark: give 'messages' instead")
            return None
        return prompt
    if "prompt" in obj:
        problems.append("give 'prompt' or 'messages', not both")
        return None
    try:
        prompt = chat_prompt(parse_messages(obj["messages"]))
    except ValueError as e:
        problems.append(f"field 'messages': {e}")
        return None
    if not any(t.text.strip() for t in turns_of(prompt) if t.role == "user"):
        problems.append("field 'messages': the user turns hold no text")
        return None
    return prompt


def _item_id(obj: dict, problems: list[str]) -> str | None:
    if "id" not in obj:
        problems.append("missing field 'id'")
        return None
    value = obj["id"]
    if _is_int(value):
        return str(value)
    if not isinstance(value, str):
        problems.append(f"field 'id' must be a string or an integer, got {_json_type(value)}")
        return None
    if not value.strip():
        problems.append("field 'id' is empty")
        return None
    return value


def _video_path(video: str, base_dir: Path, check_files: bool, problems: list[str]) -> Path:
    path = Path(video).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    if check_files:
        if not path.exists():
            problems.append(f"video not found: {path}")
        elif path.is_file() and path.stat().st_size == 0:
            problems.append(f"video file is empty: {path}")
    return path


def _parse_object(
    obj: dict, line: int, base_dir: Path, check_files: bool
) -> tuple[str | None, ManifestItem | None, list[str]]:
    """(id if valid, the item if the line has no problem, the line's problems)."""
    problems: list[str] = []
    item_id = _item_id(obj, problems)
    video = _required_text(obj, "video", problems)
    prompt = _prompt(obj, problems)
    max_new_tokens = _positive_int(obj, "max_new_tokens", problems)
    num_frames = _positive_int(obj, "num_frames", problems)
    fps = _positive_number(obj, "fps", problems)
    stop = _stop_strings(obj, problems)
    seed = _seed(obj, problems)
    if obj.get("num_frames") is not None and obj.get("fps") is not None:
        problems.append("give 'num_frames' or 'fps', not both")
    video_path = _video_path(video, base_dir, check_files, problems) if video is not None else None
    special = obj.get("prompt_special_tokens", False)
    if not isinstance(special, bool):
        problems.append(f"'prompt_special_tokens' must be true or false, got {special!r}")
    elif special and "messages" in obj:
        problems.append("'prompt_special_tokens' applies to 'prompt'; a conversation's texts are text")
    if problems:
        return item_id, None, problems
    if special:  # the item asks for its prompt's special-token strings to act as control tokens
        prompt = ControlText(prompt)
    extra = {key: value for key, value in obj.items() if key not in KNOWN_FIELDS}
    item = ManifestItem(item_id, video_path, prompt, max_new_tokens, num_frames, fps, extra, line, stop, seed)
    return item_id, item, problems


def _read_lines(path: Path) -> list[bytes]:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ManifestError(f"cannot read manifest {path}: {err.strerror or err}") from None
    return data.split(b"\n")


def load_manifest(
    path: str | os.PathLike[str], *, check_files: bool = True
) -> tuple[list[ManifestItem], list[ManifestProblem]]:
    """Every valid item and every problem of the manifest at `path`, both in line order."""
    path = Path(path)
    base_dir = path.resolve().parent
    items: list[ManifestItem] = []
    problems: list[ManifestProblem] = []
    first_line_of_id: dict[str, int] = {}
    for line_no, raw in enumerate(_read_lines(path), start=1):
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as err:
            problems.append(ManifestProblem(line_no, f"not valid UTF-8 (byte {err.start + 1})"))
            continue
        if line_no == 1:
            text = text.removeprefix("\ufeff")  # editors on Windows add a byte-order mark
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(text, object_pairs_hook=_object_without_duplicate_keys)
        except json.JSONDecodeError as err:
            problems.append(ManifestProblem(line_no, f"not valid JSON: {err.msg} (column {err.colno})"))
            continue
        except _DuplicateKey as err:
            problems.append(ManifestProblem(line_no, f"field '{err.args[0]}' appears twice"))
            continue
        if not isinstance(obj, dict):
            problems.append(ManifestProblem(line_no, f"expected a JSON object, got {_json_type(obj)}"))
            continue
        item_id, item, messages = _parse_object(obj, line_no, base_dir, check_files)
        if item_id is not None:
            if item_id in first_line_of_id:
                messages.insert(0, f"duplicate id '{item_id}' (first on line {first_line_of_id[item_id]})")
                item = None
            else:
                first_line_of_id[item_id] = line_no
        problems.extend(ManifestProblem(line_no, message) for message in messages)
        if item is not None:
            items.append(item)
    return items, problems


@dataclass(frozen=True)
class Shard:
    """Part `index` (0-based) of `count`, for independent jobs that split one manifest (`--shard I/N`).

    A video stays in one shard: the manifest's entries are its video groups (the items that read the same frames,
    launch/video_queue.py `groups_of`, so the shard's pipeline prefills the video once for all its questions) and
    its problem lines (each a unit of its own, all of a line's problems together), in the order of their first
    line, dealt round-robin: entry j belongs to shard j % count. Every item and every bad line lands in exactly
    one shard, so a bad line is reported by the one shard that holds it. Shards differ by at most one entry (one
    video group or one bad line), so their item counts differ by up to the size of a group."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: need 0 <= I < N")

    @staticmethod
    def parse(text: str) -> "Shard":
        try:
            index, count = (int(v) for v in text.split("/"))
        except ValueError:
            raise ValueError(f"shard {text!r}: expected I/N, e.g. 0/4") from None
        return Shard(index, count)

    def select(
        self, items: list[ManifestItem], problems: list[ManifestProblem]
    ) -> tuple[list[ManifestItem], list[ManifestProblem]]:
        bad_lines = sorted({p.line for p in problems})
        entries = sorted([(g[0].line, g) for g in groups_of(items)] + [(line, None) for line in bad_lines],
                         key=lambda e: e[0])
        mine = [e for j, e in enumerate(entries) if j % self.count == self.index]
        my_lines = {line for line, group in mine if group is None}
        my_items = {item.line for _, group in mine if group is not None for item in group}
        return [i for i in items if i.line in my_items], [p for p in problems if p.line in my_lines]


def check_manifest(path: str | os.PathLike[str], *, check_files: bool = True, open_videos: bool = True) -> int:
    """Print every problem as `path:line: message` and a summary; 0 if the manifest is usable,
    1 if it has problems or no items, 2 if it cannot be read. `open_videos`: each item's video is opened as a
    job's reader starts it (vpsd.video.decode.open_video), and one that fails is a problem of its line, with the
    kind a job's result row would carry; without it (`--fast`) files are only checked to exist and be non-empty."""
    try:
        items, problems = load_manifest(path, check_files=check_files)
    except ManifestError as err:
        print(f"error: {err}", file=sys.stderr)
        return UNREADABLE
    if check_files and open_videos:
        failed = video_problems(items)
        items = [item for item in items if item.line not in {p.line for p in failed}]
        problems = sorted([*problems, *failed], key=lambda p: p.line)
    for problem in problems:
        print(f"{path}:{problem.line}: {problem.message}")
    if not items and not problems:
        print(f"{path}: no items (only blank or comment lines)")
    print(f"{len(items)} items ok, {len(problems)} problems")
    return OK if items and not problems else HAS_PROBLEMS


def video_problems(items: list[ManifestItem], threads: int = 8) -> list[ManifestProblem]:
    """The items whose video does not open, as problems `[kind] message` (kind: missing, empty, corrupt,
    no_video_stream, as a job's results carry it). A few threads: opening is mostly waiting on the disk, and
    PyAV decodes without the GIL."""
    from concurrent.futures import ThreadPoolExecutor

    from vpsd.video.decode import open_video
    from vpsd.video.errors import VideoError

    def problem(item: ManifestItem) -> ManifestProblem | None:
        try:
            open_video(item.video)
        except VideoError as e:
            return ManifestProblem(item.line, f"{e} [{e.kind}]")
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(items)))) as pool:
        return [p for p in pool.map(problem, items) if p is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a vpsd JSONL manifest and list its problems: every line, and "
                                                 "every video opened as a job starts reading it (its first frame).")
    parser.add_argument("manifest", type=Path, help="the JSONL manifest")
    parser.add_argument("--fast", action="store_true",
                        help="only check that the videos exist and are not empty; do not open them")
    parser.add_argument("--no-check-files", action="store_true", help="do not check that the videos exist")
    args = parser.parse_args(argv)
    return check_manifest(args.manifest, check_files=not args.no_check_files, open_videos=not args.fast)


if __name__ == "__main__":
    sys.exit(main())

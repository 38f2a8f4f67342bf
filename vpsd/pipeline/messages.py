"""Typed, versioned control messages and their msgpack wire format.

Contract:
- Every control message is a frozen dataclass registered with `@message`; its wire form is one
  msgpack map `{"type": <class name>, "v": <VERSION>, <field>: <value>, ...}`.
- `encode(msg)` validates the fields against the dataclass annotations before anything reaches the
  wire, so a sender bug fails on the sender, with its own traceback.
- `decode(data)` returns a message or raises `MessageError`; it never returns a half-checked object.
  Rejected: not msgpack, trailing bytes, not a map, unknown type, wrong version, missing or extra
  fields, field values that do not match the annotations.
- No pickle anywhere: a peer's bytes are data, never code. msgpack extension types are rejected.

Supported field annotations: int, float, str, bool, dict (str keys, msgpack-native values),
list[X] of a supported X, and Optional[X] (`X | None`). int is int64; bool is never accepted as an
int; an int is accepted for a float and widened (msgpack packs 1.0 and 1 differently, senders mix them).

Adding a message: write a frozen dataclass, decorate it with `@message`, bump `VERSION` when its
fields change. Pure module: no I/O beyond msgpack.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar

import msgpack

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Free-form `dict` fields (JobStart.video) may nest, but not without bound: a hostile peer must not
# be able to exhaust the validator's recursion.
_MAX_DEPTH = 32
_RESERVED = frozenset({"type", "v"})


class MessageError(ValueError):
    """A control message could not be encoded or decoded; the text says why."""


class Message:
    """Base of every control message. Subclasses are frozen dataclasses registered with `@message`."""

    TYPE: ClassVar[str] = ""  # set by @message to the class name
    VERSION: ClassVar[int] = 1


M = TypeVar("M", bound=type[Message])
_REGISTRY: dict[str, type[Message]] = {}
_FIELDS: dict[type[Message], dict[str, Any]] = {}  # resolved annotations per class


def message(cls: M) -> M:
    """Class decorator: register a frozen dataclass as a wire message type (named by its class)."""
    if not (isinstance(cls, type) and issubclass(cls, Message)):
        raise TypeError(f"{cls!r} must subclass Message")
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} must be a @dataclass(frozen=True)")
    name = cls.__name__
    if name in _REGISTRY:
        raise TypeError(f"message type {name!r} is already registered")
    if type(cls.VERSION) is not int or cls.VERSION < 1:
        raise TypeError(f"{name}.VERSION must be a positive int")
    hints = typing.get_type_hints(cls)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    for fname, tp in fields.items():
        if fname in _RESERVED:
            raise TypeError(f"{name}.{fname}: field names {sorted(_RESERVED)} are reserved for the envelope")
        _check_supported(tp, f"{name}.{fname}")
    cls.TYPE = name
    _REGISTRY[name] = cls
    _FIELDS[cls] = fields
    return cls


def registered_types() -> Mapping[str, type[Message]]:
    """Read-only view of the registry: wire type name -> message class."""
    return types.MappingProxyType(_REGISTRY)


def encode(msg: Message) -> bytes:
    """Validate `msg` against its annotations and pack it as one msgpack map."""
    cls = type(msg)
    if _REGISTRY.get(getattr(cls, "TYPE", "")) is not cls:
        raise MessageError(f"{cls.__name__} is not a registered message type")
    payload: dict[str, Any] = {"type": cls.TYPE, "v": cls.VERSION}
    for fname, tp in _FIELDS[cls].items():
        payload[fname] = _check(getattr(msg, fname), tp, f"{cls.TYPE}.{fname}", 0)
    return msgpack.packb(payload, use_bin_type=True)


def decode(data: bytes) -> Message:
    """Parse and validate one wire message; raise MessageError for anything malformed."""
    try:
        # strict_map_key: only str/bytes keys; raw=False: str must be valid UTF-8. Extension types come
        # back as ExtType/Timestamp objects, which the field checks below reject.
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises ExtraData, FormatError, StackError, ValueError, ...
        raise MessageError(f"not a msgpack message: {type(e).__name__} {e}".rstrip()) from None
    if not isinstance(obj, dict):
        raise MessageError(f"a message must be a msgpack map, got {type(obj).__name__}")
    name = obj.get("type")
    if not isinstance(name, str):
        raise MessageError("message has no str 'type'")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise MessageError(f"unknown message type {name!r}")
    v = obj.get("v")
    if type(v) is not int:
        raise MessageError(f"{name}: message has no int 'v'")
    if v != cls.VERSION:
        raise MessageError(f"{name}: version {v} is not the supported version {cls.VERSION}")
    fields = _FIELDS[cls]
    extra = set(obj) - _RESERVED - set(fields)
    if extra:
        raise MessageError(f"{name}: unexpected fields {sorted(map(str, extra))}")
    missing = set(fields) - set(obj)
    if missing:
        raise MessageError(f"{name}: missing fields {sorted(missing)}")
    values = {f: _check(obj[f], tp, f"{name}.{f}", 0) for f, tp in fields.items()}
    return cls(**values)


# --- annotation checks ------------------------------------------------------------------------------


def _optional_arm(tp: Any) -> Any | None:
    """X for Optional[X] / X | None, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if len(args) == 2 and type(None) in args:
            return args[0] if args[1] is type(None) else args[1]
    return None


def _check_supported(tp: Any, path: str) -> None:
    if tp in (int, float, str, bool, dict):
        return
    if typing.get_origin(tp) is list and len(typing.get_args(tp)) == 1:
        return _check_supported(typing.get_args(tp)[0], path)
    if typing.get_origin(tp) is dict:
        args = typing.get_args(tp)
        if args and args[0] is str and args[1] is Any:
            return
    arm = _optional_arm(tp)
    if arm is not None:
        return _check_supported(arm, path)
    raise TypeError(f"{path}: annotation {tp!r} is not supported on the wire")


def _check(value: Any, tp: Any, path: str, depth: int) -> Any:
    """Return `value` (floats widened) if it matches annotation `tp`, else raise MessageError."""
    if tp is bool:
        if type(value) is not bool:
            raise MessageError(f"{path}: expected bool, got {_tname(value)}")
        return value
    if tp is int:
        if type(value) is not int or not _INT64_MIN <= value <= _INT64_MAX:
            raise MessageError(f"{path}: expected int64, got {_tname(value)}")
        return value
    if tp is float:
        if type(value) is float:
            return value
        if type(value) is int:
            return float(value)
        raise MessageError(f"{path}: expected float, got {_tname(value)}")
    if tp is str:
        if type(value) is not str:
            raise MessageError(f"{path}: expected str, got {_tname(value)}")
        return value
    if tp is dict or typing.get_origin(tp) is dict:
        if type(value) is not dict:
            raise MessageError(f"{path}: expected map, got {_tname(value)}")
        _check_native(value, path, depth)
        return value
    if typing.get_origin(tp) is list:
        if type(value) is not list:
            raise MessageError(f"{path}: expected list, got {_tname(value)}")
        if depth >= _MAX_DEPTH:
            raise MessageError(f"{path}: nested deeper than {_MAX_DEPTH}")
        (item_tp,) = typing.get_args(tp)
        return [_check(x, item_tp, f"{path}[{i}]", depth + 1) for i, x in enumerate(value)]
    arm = _optional_arm(tp)
    if arm is not None:
        return None if value is None else _check(value, arm, path, depth)
    raise MessageError(f"{path}: unsupported annotation {tp!r}")  # unreachable: @message checked it


def _check_native(value: Any, path: str, depth: int) -> None:
    """Free-form data (dict fields): plain msgpack types only, str map keys, bounded nesting."""
    if depth > _MAX_DEPTH:
        raise MessageError(f"{path}: nested deeper than {_MAX_DEPTH}")
    if value is None or type(value) in (bool, float, str, bytes):
        return
    if type(value) is int:
        if not _INT64_MIN <= value <= 2**64 - 1:
            raise MessageError(f"{path}: int out of msgpack range")
        return
    if type(value) is list:
        for i, x in enumerate(value):
            _check_native(x, f"{path}[{i}]", depth + 1)
        return
    if type(value) is dict:
        for k, x in value.items():
            if type(k) is not str:
                raise MessageError(f"{path}: map keys must be str, got {_tname(k)}")
            _check_native(x, f"{path}.{k}", depth + 1)
        return
    raise MessageError(f"{path}: {_tname(value)} is not plain msgpack data")


def _tname(value: Any) -> str:
    return type(value).__name__


# --- the messages -------------------------------------------------------------------------------------
# Names used everywhere in vpsd: `epoch` rises on every rollback so stale messages can be dropped;
# `committed_len` is the number of tokens the target has committed; `start` is the committed length at
# which a chunk of draft tokens begins.


@message
@dataclass(frozen=True)
class JobStart(Message):
    """Launcher -> roles: decode one item.

    v2: `eos_token_ids`, the target's: the draft stops drafting on these, not on its own checkpoint's
    set (a draft whose generation config names other ids would otherwise draft past the target's end).
    v3: no `mode` (every item starts optimistic; the verdicts carry the mode from then on).
    v4: typed fields for what travelled in a free-form `extra` dict (the video requests and the prompt)."""

    VERSION: ClassVar[int] = 4

    job_id: str
    item_id: str
    seed: int
    max_new_tokens: int
    gamma: int  # draft tokens per chunk
    eos_token_ids: list[int]
    # How to read the item's video exactly as the target did (vpsd.video.item.FrameRequest.to_wire), and the
    # next item's, so that a role can read it ahead (vpsd.video.prefetch); None after the last item.
    video: dict
    next_video: dict | None
    prompt: str
    prompt_special_tokens: bool  # the prompt is control text: its special tokens are tokens (models/prompt.py)


@message
@dataclass(frozen=True)
class TensorAnnounce(Message):
    """Tensors with these shapes/dtypes follow from `src` on torch.distributed, in this order."""

    tag: str
    shapes: list[list[int]]
    dtypes: list[str]  # torch dtype names without the "torch." prefix: "float32", "bfloat16", "int64"
    src: int
    epoch: int
    # Per tensor "cpu" or "cuda": the receiver allocates on the same device type, which picks the same
    # backend (gloo or nccl) on both ends. Empty means all "cpu".
    devices: list[str] = field(default_factory=list)


@message
@dataclass(frozen=True)
class DraftChunk(Message):
    """Draft -> target: `token_ids` proposed after the first `start` committed tokens."""

    VERSION = 2  # v2: draft_step_s

    item_id: str
    epoch: int
    start: int
    token_ids: list[int]
    has_probs: bool  # draft_probs follow as tensors (announced separately)
    # The draft's recent forward time (T_q, seconds, a running mean; 0: not measured yet): the target
    # matches gamma to T_p / T_q with it (pipeline/window.py).
    draft_step_s: float = 0.0


@message
@dataclass(frozen=True)
class VerifyResult(Message):
    """Target -> draft: the verdict on the chunk that began at `start`."""

    VERSION = 2  # v2: gamma

    item_id: str
    epoch: int
    start: int
    num_accepted: int
    next_token: int  # the target's token after the accepted prefix (recovered or bonus)
    committed_len: int
    mode: str
    rollback: bool
    gamma: int = 0  # the window for the chunks drafted from now on (0: unchanged); see pipeline/window.py


@message
@dataclass(frozen=True)
class KeepIndices(Message):
    """Pruner -> target: the draft was sent `num_kept` kept video token indices (tag "keep:<item>": an int64
    tensor, then the target's (3,) token grid, which the draft checks its own against)."""

    item_id: str
    num_kept: int


@message
@dataclass(frozen=True)
class ItemDone(Message):
    """Target -> launcher: the item's final tokens, or the error that stopped it."""

    item_id: str
    token_ids: list[int]
    error: dict | None


@message
@dataclass(frozen=True)
class Heartbeat(Message):
    """Any role -> any role: I am alive at time `t` (time.time() of the sender)."""

    role: str
    rank: int
    t: float


@message
@dataclass(frozen=True)
class Shutdown(Message):
    """Stop the receiving role's loop."""

    reason: str


@message
@dataclass(frozen=True)
class Error(Message):
    """A role failed on an item (item_id may be empty when not item-specific). The draft sends the target
    one when it cannot draft an item (its video grid is not the target's): the target fails that item."""

    role: str
    rank: int
    item_id: str
    message: str

"""Typed, versioned control messages: msgspec Structs, msgpack on the wire.

Contract:
- Every control message is a frozen `Message` struct. Its wire form is one msgpack map, `{"type": <tag>,
  <field>: <value>, ...}`, the tag naming the type and its version ("VerifyResult/2"): a peer on another
  version is rejected by name, never half-read.
- `decode(data)` returns a message or raises `MessageError`: typed decoding (msgspec) rejects what is not
  msgpack, trailing bytes, not a map, an unknown type or version, missing or extra fields, and field values
  of the wrong type (no bool for an int, no int beyond int64, no bytes for a str; an int is widened for a
  float); free-form dict fields must hold plain data only (str keys, no extension types), nested at most 32
  deep. It never returns a half-checked object.
- `encode(msg)` checks the message as `decode` would before anything reaches the wire, so a sender's bug
  fails on the sender, with its own traceback.
- No pickle anywhere: a peer's bytes are data, never code.

Adding a message: subclass `Message` with `tag="Name/1"`; bump the number when its fields change. Pure module.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, ClassVar, Union

import msgspec

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
Int = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]
# Free-form data (a video request, an error) may nest, but not without bound: a hostile peer must not be able
# to exhaust the checker's recursion.
_MAX_DEPTH = 32


class MessageError(ValueError):
    """A control message could not be encoded or decoded; the text says why."""


_REGISTRY: dict[str, type["Message"]] = {}


def registered_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


@functools.lru_cache(maxsize=1)
def _decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Union[tuple(_REGISTRY.values())])  # type: ignore[misc]


class _Registering(msgspec.StructMeta):
    """Registers every Message subclass under the name in its tag, and reads its version from the tag."""

    def __new__(mcls, name: str, bases: tuple, namespace: dict, **kwargs: Any):
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        if not any(isinstance(b, _Registering) for b in bases):
            return cls  # Message itself
        tag = cls.__struct_config__.tag
        type_name, _, version = tag.partition("/") if isinstance(tag, str) else ("", "", "")
        if type_name != name or not version.isdigit():
            raise TypeError(f"{name} needs the tag '{name}/<version>' (Name/version), got {tag!r}")
        if name in _REGISTRY:
            raise TypeError(f"message type {name!r} is already registered")
        cls.TYPE, cls.VERSION = name, int(version)
        _REGISTRY[name] = cls
        _decoder.cache_clear()
        return cls


class Message(msgspec.Struct, metaclass=_Registering, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of every control message (module docstring)."""

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 0


def encode(msg: Message) -> bytes:
    """The wire form of `msg`, checked first (module docstring)."""
    if not isinstance(msg, Message) or _REGISTRY.get(type(msg).TYPE) is not type(msg):
        raise MessageError(f"{type(msg).__name__} is not a registered message type")
    try:
        data = msgspec.msgpack.encode(msg)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageError(f"{type(msg).TYPE}: {e}") from None
    if decode(data) != msg:  # a tuple where a list belongs, a bool where an int does, ...
        raise MessageError(f"{type(msg).TYPE}: a field does not hold the type it is declared with")
    return data


def decode(data: bytes) -> Message:
    """Parse and check one wire message; MessageError for anything malformed."""
    try:
        msg = _decoder().decode(data)
    except msgspec.ValidationError as e:
        raise MessageError(_explain(data, str(e))) from None
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MessageError(f"not a msgpack message: {type(e).__name__} {e}") from None
    for name, tp in typing.get_type_hints(type(msg)).items():
        if _is_free_form(tp):
            _check_plain(getattr(msg, name), f"{msg.TYPE}.{name}", 0)
    return msg


def _explain(data: bytes, error: str) -> str:
    """msgspec's reason, with the message type named; a known type at another version is said as such."""
    try:
        head = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, RecursionError):
        head = None
    if not isinstance(head, dict):
        return f"a message must be a msgpack map: {error}"
    name, _, version = str(head.get("type", "")).partition("/")
    cls = _REGISTRY.get(name)
    if cls is not None and version != str(cls.VERSION):
        return f"{name}: version {version or '?'} is not the supported version {cls.VERSION}"
    return f"{name or 'message'}: {error}" if cls is not None else f"unknown message type {head.get('type')!r}"


def _is_free_form(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict or any(_is_free_form(a) for a in typing.get_args(tp))


def _check_plain(value: Any, path: str, depth: int) -> None:
    """Free-form data: plain msgpack types only (no extension types, no timestamps), bounded nesting."""
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
            _check_plain(x, f"{path}[{i}]", depth + 1)
        return
    if type(value) is dict:
        for k, x in value.items():
            if type(k) is not str:
                raise MessageError(f"{path}: map keys must be str, got {type(k).__name__}")
            _check_plain(x, f"{path}.{k}", depth + 1)
        return
    raise MessageError(f"{path}: {type(value).__name__} is not plain msgpack data")


# --- the messages -------------------------------------------------------------------------------------
# Names used everywhere in vpsd: `epoch` rises on every rollback so stale messages can be dropped;
# `committed_len` is the number of tokens the target has committed; `start` is the committed length at
# which a chunk of draft tokens begins.


class JobStart(Message, tag="JobStart/5"):
    """Target -> draft and pruner: decode one item.
    v4: typed fields for the video requests and the prompt. v5: `reuse`."""

    job_id: str
    item_id: str
    seed: Int
    max_new_tokens: Int
    gamma: Int  # draft tokens per chunk
    eos_token_ids: list[Int]  # the target's: the draft stops drafting on these, not on its own checkpoint's
    # How to read the item's video exactly as the target did (vpsd.video.item.FrameRequest.to_wire), and the
    # next item's, so that a role can read it ahead (vpsd.video.prefetch); None after the last item.
    video: dict[str, Any]
    next_video: dict[str, Any] | None
    prompt: str
    prompt_special_tokens: bool  # the prompt is control text: its special tokens are tokens (models/prompt.py)
    # Another item asks about the same video (the target keeps its prefix): the draft keeps its vision features
    # too (engine/prefix_cache.py draft_embed), since they do not depend on the question.
    reuse: bool = False


class TensorAnnounce(Message, tag="TensorAnnounce/2"):
    """Tensors with these shapes/dtypes follow from `src` on torch.distributed, in this order.
    v2: the item they belong to and the names of the tensors are fields, not parts of a tag string."""

    tag: str  # what they are: "signals", "keep", "draft_probs", "target_probs"
    shapes: list[list[Int]]
    dtypes: list[str]  # torch dtype names without the "torch." prefix: "float32", "bfloat16", "int64"
    src: Int
    epoch: Int
    # Per tensor "cpu" or "cuda": the receiver allocates on the same device type, which picks the same
    # backend (gloo or nccl) on both ends. Empty means all "cpu".
    devices: list[str] = []
    item_id: str = ""  # the item they belong to, when one does
    names: list[str] = []  # what each tensor is, when the tag says several things (the pruning signals)


class DraftChunk(Message, tag="DraftChunk/2"):
    """Draft -> target: `token_ids` proposed after the first `start` committed tokens."""

    item_id: str
    epoch: Int
    start: Int
    token_ids: list[Int]
    has_probs: bool  # draft_probs follow as tensors (announced separately)
    # The draft's recent forward time (T_q, seconds, a running mean; 0: not measured yet): the target
    # matches gamma to T_p / T_q with it (pipeline/cost.py).
    draft_step_s: float = 0.0


class VerifyResult(Message, tag="VerifyResult/2"):
    """Target -> draft: the verdict on the chunk that began at `start`."""

    item_id: str
    epoch: Int
    start: Int
    num_accepted: Int
    next_token: Int  # the target's token after the accepted prefix (recovered or bonus)
    committed_len: Int
    mode: str
    rollback: bool
    gamma: Int = 0  # the window for the chunks drafted from now on (0: unchanged); see pipeline/cost.py


class KeepIndices(Message, tag="KeepIndices/1"):
    """Pruner -> target: the draft was sent `num_kept` kept video token indices (a TensorAnnounce "keep" of the
    item: an int64 tensor, then the target's (3,) token grid, which the draft checks its own against)."""

    item_id: str
    num_kept: Int


class ItemDone(Message, tag="ItemDone/1"):
    """Target -> draft and pruner: the item's final tokens, or the error that stopped it."""

    item_id: str
    token_ids: list[Int]
    error: dict[str, Any] | None


class Heartbeat(Message, tag="Heartbeat/2"):
    """Any role -> any role: I am alive at time `t` (time.time() of the sender), and what my role's thread is
    doing (vpsd/activity.py): `phase` ("" when in none) of `item` for `busy_s`; such work took at most
    `typical_s` so far in this job (0: never done). v2: what it is doing."""

    role: str
    rank: Int
    t: float
    phase: str = ""
    item: str = ""
    busy_s: float = 0.0
    typical_s: float = 0.0


class Ready(Message, tag="Ready/1"):
    """A draft or pruner -> its target, once: its models are loaded. The target starts no item before every peer
    said so, so no transfer of the job ever waits on a rank still loading (start-up has its own bound)."""

    role: str
    rank: Int
    startup_s: float  # from the rank's process group to this message: its models' load (and growth)


class Shutdown(Message, tag="Shutdown/1"):
    """Stop the receiving role's loop."""

    reason: str


class Error(Message, tag="Error/1"):
    """A role failed on an item (item_id may be empty when not item-specific). The draft sends the target
    one when it cannot draft an item (its video grid is not the target's): the target fails that item."""

    role: str
    rank: Int
    item_id: str
    message: str


# --- the job: pipelines and their coordinator (launch/coordinator.py) ----------------------------------------


class WorkRequest(Message, tag="WorkRequest/1"):
    """A pipeline's target -> the coordinator: the next item for pipeline `pipeline`; `needed`: a slot of it
    would stay empty without one (else it reads ahead)."""

    pipeline: Int
    needed: bool


class WorkGrant(Message, tag="WorkGrant/1"):
    """The coordinator -> a pipeline's target: the item to decode (a manifest item's fields, `video` an
    absolute path), or None: none now (`more`: ask again when one is needed) or none left."""

    item: dict[str, Any] | None
    more: bool


class ItemResult(Message, tag="ItemResult/2"):
    """A pipeline's target -> the coordinator: an item's results line (launch/results.py ResultRow.to_json).
    v2: `reuse`."""

    pipeline: Int
    row: dict[str, Any]
    # A served pipeline's target: its prefix cache's counters as they are when the line is sent (engine/prefix_cache.py
    # ReuseStats), for the server's /metrics; None in a job (its run's come with PipelineDone), or reuse off.
    reuse: dict[str, Int] | None = None


class PipelineDone(Message, tag="PipelineDone/1"):
    """A pipeline's target -> the coordinator, after its last result: what its run adds up to (the item loop's
    seconds, peak memory, the batch's accounting). Answered with a Shutdown once every result before it is
    written."""

    pipeline: Int
    run: dict[str, Any]


# --- a served pipeline (launch/served.py): the tokens as they commit, and requests whose client left ---------


class ItemProgress(Message, tag="ItemProgress/1"):
    """A served pipeline's target -> its coordinator, after a round: the tokens each item committed in it, by
    item id (appended to those sent before: a sender's messages arrive in order, and committed tokens never roll
    back). Only items that committed some are named. A job's pipelines never send it (their results come whole)."""

    pipeline: Int
    tokens: dict[str, list[Int]]


class CancelItem(Message, tag="CancelItem/1"):
    """The coordinator -> a served pipeline's target: the item's client left. The target drops it at its next
    round (its KV freed, its draft told as for a failed item) and answers its result as an error."""

    item_id: str

"""Wire format of the control messages: round trips, property tests, every malformed case, no pickle."""

from __future__ import annotations

import ast
import pickle
import typing
from pathlib import Path
from typing import Any, Optional

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpsd.pipeline import messages as m
from vpsd.pipeline.messages import MessageError, decode, encode

EXAMPLES: list[m.Message] = [
    m.JobStart("job-1", "item-7", 1234, 64, 5, [2, 151645], {"path": "a.mp4", "tags": ["a", "b"], "n": None},
               None, "Describe the video.", False),
    m.JobStart("job-1", "item-8", 1234, 64, 5, [2], {"path": "b.mp4", "fps": 0.5}, {"path": "c.mp4"},
               "<|im_start|>x", True),
    m.TensorAnnounce("draft_probs", [[5, 151936], []], ["float32", "int64"], 1, 3),
    m.TensorAnnounce("keep", [[480], [3]], ["int64", "int64"], 2, 0, ["cuda", "cuda"], "item-7"),
    m.TensorAnnounce("signals", [[480, 64], [5, 480]], ["float32", "int64"], 0, 0, [], "item-7",
                     ["visual_embeds", "layout"]),
    m.DraftChunk("item-7", 3, 120, [11, 22, 33, 44, 55], True),
    m.VerifyResult("item-7", 3, 120, 2, 99, 123, "pruned", False),
    m.KeepIndices("item-7", 480),
    m.ItemDone("item-7", [1, 2, 3], None),
    m.ItemDone("item-8", [], {"kind": "OOM", "rank": 0}),
    m.Heartbeat("draft", 1, 1_732_000_000.25),
    m.Ready("draft", 1, 12.5),
    m.Shutdown("all items done"),
    m.Error("pruner", 2, "item-7", "scores had NaN"),
    m.WorkRequest(1, True),
    m.WorkGrant({"id": "item-7", "video": "/data/a.mp4", "prompt": "Describe.", "prompt_special_tokens": False,
                 "max_new_tokens": None, "num_frames": 8, "fps": None, "extra": {"reference": "x"}, "line": 3}, True),
    m.WorkGrant(None, False),
    m.ItemResult(1, {"id": "item-7", "method": "hippo", "token_ids": [1, 2], "text": "a b", "stats": {"wall_s": 0.5},
                     "error": None}),
    m.ItemResult(0, {"id": "item-8#2", "method": "ar", "token_ids": [3], "text": "c", "stats": {}, "error": None},
                 {"hits": 1, "misses": 1, "reused_tokens": 70, "bytes": 2_500_000, "budget_bytes": 2**29}),
    m.PipelineDone(1, {"loop_s": 3.5, "batching": None, "peak_rss_mib": 512.0}),
    m.ItemProgress(0, {"item-7#3": [11, 12, 13], "b": [5]}),
    m.CancelItem("item-7#3"),
]


def _raw(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _wire(msg: m.Message) -> dict[str, Any]:
    return msgpack.unpackb(encode(msg), raw=False)


def test_every_registered_type_has_an_example():
    assert {type(x).TYPE for x in EXAMPLES} == set(m.registered_types())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    out = decode(data)
    assert type(out) is type(msg) and out == msg
    assert _wire(msg)["type"] == f"{type(msg).__name__}/{type(msg).VERSION}"


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        EXAMPLES[0].seed = 1  # type: ignore[misc]


def test_int_is_widened_for_float_fields():
    out = decode(encode(m.Heartbeat("target", 0, 3)))
    assert out.t == 3.0 and type(out.t) is float


# --- property test: strategies derived from the annotations, so a new message type is covered too ---

_INT64 = st.integers(-(2**63), 2**63 - 1)
_NATIVE = st.recursive(
    st.none() | st.booleans() | _INT64 | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _strategy(tp: Any) -> st.SearchStrategy:
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if tp is bool:
        return st.booleans()
    if tp is int:
        return _INT64
    if tp is float:
        return st.floats(allow_nan=False)  # NaN != NaN would fail equality, not the wire
    if tp is str:
        return st.text(max_size=16)
    if typing.get_origin(tp) is dict and typing.get_args(tp)[1] is not typing.Any:  # typed values: of that type
        key, value = typing.get_args(tp)
        return st.dictionaries(_strategy(key), _strategy(value), max_size=4)
    if tp is dict or typing.get_origin(tp) is dict:
        return st.dictionaries(st.text(max_size=6), _NATIVE, max_size=4)
    if typing.get_origin(tp) is list:
        return st.lists(_strategy(typing.get_args(tp)[0]), max_size=6)
    args = typing.get_args(tp)
    assert type(None) in args, tp
    return st.none() | _strategy(next(a for a in args if a is not type(None)))


def _message_strategy(cls: type[m.Message]) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{name: _strategy(hints[name]) for name in cls.__struct_fields__})


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(m.registered_types())).flatmap(lambda n: _message_strategy(m.registered_types()[n])))
def test_round_trip_property(msg):
    assert decode(encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_escape_as_other_errors(data):
    try:
        decode(data)
    except MessageError:
        pass


# --- malformed input -----------------------------------------------------------------------------------

GOOD = _wire(m.VerifyResult("item", 1, 10, 2, 5, 13, "full", False))


def _nested(depth: int) -> list:
    out: list = [1]
    for _ in range(depth):
        out = [out]
    return out


def _with(**changes: Any) -> dict[str, Any]:
    d = dict(GOOD)
    d.update(changes)
    return d


def _without(key: str) -> dict[str, Any]:
    d = dict(GOOD)
    del d[key]
    return d


def _done(**fields: Any) -> bytes:
    return _raw({"type": "ItemDone/1", "item_id": "i", "token_ids": [], "error": None, **fields})


MALFORMED: dict[str, bytes] = {
    "empty": b"",
    "never_used_byte": b"\xc1",
    "truncated": _raw(GOOD)[:-3],
    "trailing_bytes": _raw(GOOD) + b"\x00",
    "two_messages": _raw(GOOD) * 2,
    "json": b'{"type": "Shutdown/1", "reason": "x"}',
    "not_a_map_list": _raw(["Shutdown/1", "x"]),
    "not_a_map_int": _raw(7),
    "not_a_map_str": _raw("Shutdown/1"),
    "not_a_map_nil": _raw(None),
    "int_map_key": _raw({1: "x", "type": "Shutdown/1", "reason": "x"}),
    "invalid_utf8": b"\x82\xa4type\xaaShutdown/1\xa6reason\xa2\xff\xfe",
    "missing_type": _raw(_without("type")),
    "type_not_str": _raw(_with(type=3)),
    "type_as_bytes": _raw(_with(type=b"VerifyResult/2")),
    "unknown_type": _raw(_with(type="VerifyResults/2")),
    "type_without_version": _raw(_with(type="VerifyResult")),
    "wrong_version": _raw(_with(type=f"VerifyResult/{m.VerifyResult.VERSION + 1}")),
    "version_zero": _raw(_with(type="VerifyResult/0")),
    "missing_field": _raw(_without("num_accepted")),
    "extra_field": _raw(_with(accepted=2)),
    "int_field_str": _raw(_with(epoch="1")),
    "int_field_float": _raw(_with(epoch=1.0)),
    "int_field_bool": _raw(_with(epoch=True)),
    "int_field_nil": _raw(_with(epoch=None)),
    "int_field_uint64": _raw(_with(epoch=2**64 - 1)),
    "bool_field_int": _raw(_with(rollback=0)),
    "str_field_bytes": _raw(_with(mode=b"full")),
    "str_field_int": _raw(_with(mode=1)),
    "ext_type_field": _raw(_with(item_id=msgpack.ExtType(1, b"x"))),
    "float_field_str": _raw({"type": "Heartbeat/1", "role": "t", "rank": 0, "t": "now"}),
    "float_field_bool": _raw({"type": "Heartbeat/1", "role": "t", "rank": 0, "t": True}),
    "list_field_not_list": _done(token_ids=5),
    "list_field_map": _done(token_ids={"a": 1}),
    "list_item_wrong": _done(token_ids=[1, "2"]),
    "nested_list_wrong": _raw({"type": "TensorAnnounce/2", "tag": "t", "shapes": [[1], 2], "dtypes": ["int64"],
                               "src": 0, "epoch": 0}),
    "nested_item_wrong": _raw({"type": "TensorAnnounce/2", "tag": "t", "shapes": [[1.5]], "dtypes": ["int64"],
                               "src": 0, "epoch": 0}),
    "optional_wrong": _done(error="boom"),
    "dict_field_list": _done(error=[]),
    "dict_field_ext_value": _done(error={"a": msgpack.ExtType(5, b"")}),
    "dict_field_timestamp": _done(error={"a": msgpack.Timestamp(1, 0)}),
    "dict_field_bytes_key": _done(error={b"a": 1}),
    "dict_field_too_deep": _done(error={"a": _nested(40)}),
}


@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_is_rejected(data):
    with pytest.raises(MessageError) as info:
        decode(data)
    assert str(info.value)  # the error says why


def test_error_messages_are_specific():
    cases = {
        "unknown_type": "unknown message type 'VerifyResults/2'",
        "wrong_version": f"VerifyResult: version {m.VerifyResult.VERSION + 1} is not the supported version "
                         f"{m.VerifyResult.VERSION}",
        "missing_field": "VerifyResult: Object missing required field `num_accepted`",
        "extra_field": "VerifyResult: Object contains unknown field `accepted`",
        "int_field_str": "VerifyResult: Expected `int`, got `str` - at `$.epoch`",
        "list_item_wrong": "ItemDone: Expected `int`, got `str` - at `$.token_ids[1]`",
        "not_a_map_list": "must be a msgpack map",
        "dict_field_timestamp": "ItemDone.error.a: datetime is not plain msgpack data",
    }
    for name, text in cases.items():
        with pytest.raises(MessageError) as info:
            decode(MALFORMED[name])
        assert text in str(info.value), (name, str(info.value))


@pytest.mark.parametrize(
    "msg",
    [
        m.DraftChunk("i", 0, 0, (1, 2), False),  # type: ignore[arg-type]  # tuple is not list
        m.DraftChunk("i", 0, 0, [1, 2], 1),  # type: ignore[arg-type]
        m.DraftChunk("i", True, 0, [1, 2], False),  # type: ignore[arg-type]
        m.Heartbeat("t", 2**63, 0.0),
        m.KeepIndices(b"i", 3),  # type: ignore[arg-type]
        m.JobStart("j", "i", 0, 1, 1, [2], {1: 2}, None, "p", False),
        m.JobStart("j", "i", 0, 1, 1, [2], {"obj": object()}, None, "p", False),
        m.JobStart("j", "i", 0, 1, 1, [2], {}, None, "p", "yes"),  # type: ignore[arg-type]
    ],
)
def test_encode_rejects_invalid_fields(msg):
    with pytest.raises(MessageError):
        encode(msg)


def test_encode_rejects_unregistered():
    class Stray(msgspec.Struct):
        x: int

    with pytest.raises(MessageError, match="not a registered"):
        encode(Stray(1))  # type: ignore[arg-type]


# --- no pickle ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_is_rejected(protocol, monkeypatch):
    data = pickle.dumps(EXAMPLES[0], protocol=protocol)
    called = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: called.append(1))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: called.append(1))
    with pytest.raises(MessageError):
        decode(data)
    assert not called


def test_round_trip_never_touches_pickle(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, boom)
    for msg in EXAMPLES:
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize("path", ["vpsd/pipeline/messages.py", "vpsd/transport/control.py", "vpsd/transport/tensors.py"])
def test_wire_modules_do_not_import_pickle(path):
    src = Path(__file__).resolve().parents[2] / path
    tree = ast.parse(src.read_text())
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        else:
            continue
        assert not banned & set(names), f"{path} imports {names}"
    # These torch.distributed / pyzmq calls pickle under the hood.
    pickling_calls = {
        "send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized",
        "send_object_list", "recv_object_list", "broadcast_object_list", "all_gather_object",
        "gather_object", "scatter_object_list",
    }
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not pickling_calls & used, f"{path} calls {pickling_calls & used}"


# --- registry -------------------------------------------------------------------------------------------


@pytest.fixture
def registry_guard():
    before = dict(m._REGISTRY)
    yield
    m._REGISTRY.clear()
    m._REGISTRY.update(before)
    m._decoder.cache_clear()


def test_adding_a_message_type_is_one_class(registry_guard):
    class Probe(m.Message, tag="Probe/3"):
        item_id: str
        scores: list[float]
        note: Optional[str]
        count: m.Int | None

    msg = Probe("i", [0.5, 1], None, 4)
    out = decode(encode(msg))
    assert out == msg and out.scores == [0.5, 1.0]
    assert _wire(msg)["type"] == "Probe/3" and Probe.VERSION == 3
    with pytest.raises(MessageError, match="version 1"):
        decode(_raw({**_wire(msg), "type": "Probe/1"}))


def test_registry_rejects_bad_definitions(registry_guard):
    with pytest.raises(TypeError, match="already registered"):

        class Shutdown(m.Message, tag="Shutdown/2"):  # noqa: F811
            reason: str

    with pytest.raises(TypeError, match="Name/version"):

        class Untagged(m.Message):
            x: int

    with pytest.raises(TypeError, match="needs the tag 'Misnamed/<version>'"):

        class Misnamed(m.Message, tag="Other/1"):
            x: int

    with pytest.raises((TypeError, ValueError)):

        class UsesType(m.Message, tag="UsesType/1"):
            type: str

"""Tests of the wire format: message registry, field checks and framing."""

from __future__ import annotations

import contextlib
import itertools
import math
import struct
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.messages import (
    DEFAULT_ITEMS_MAX_LEN,
    DEFAULT_STR_MAX_LEN,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameDecoder,
    Hello,
    decode_message,
    encode_message,
    encode_message_pieces,
    frame,
    message_kind,
    wire_message,
)

INT_MIN, UINT_MAX = -(1 << 63), (1 << 64) - 1


@wire_message(250)
@dataclass(frozen=True, slots=True)
class Every:
    """A test-only message with every supported field type."""

    i: int
    f: float
    s: str = field(metadata={"max_len": 16})
    b: bytes = field(metadata={"max_len": 32})
    flag: bool
    maybe_i: int | None
    maybe_b: bytes | None
    ints: tuple[int, ...] = field(metadata={"max_len": 8})
    floats: tuple[float, ...]
    strs: tuple[str, ...] = field(metadata={"item_max_len": 8})
    maybe_items: tuple[int | None, ...]
    maybe_tuple: tuple[bytes, ...] | None
    plain: str = ""


@wire_message(251)
@dataclass(frozen=True, slots=True)
class Blob:
    payload: bytes


@wire_message(248)
@dataclass(frozen=True, slots=True)
class Tagged:
    """A payload behind other fields, as in an all-reduce part."""

    sender: str
    weight: float
    payload: bytes = field(metadata={"max_len": 1 << 20})


@wire_message(252)
@dataclass(frozen=True, slots=True)
class Checked:
    count: int

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count must be >= 0")


@wire_message(253)
@dataclass(frozen=True, slots=True)
class Loose:
    x: float = field(metadata={"allow_nonfinite": True})


def every(**changes: Any) -> Every:
    values: dict[str, Any] = {
        "i": -5,
        "f": 2.5,
        "s": "hé",
        "b": b"\x00\xff",
        "flag": True,
        "maybe_i": None,
        "maybe_b": b"",
        "ints": (1, 2, 3),
        "floats": (0.5, -1.0),
        "strs": ("a", ""),
        "maybe_items": (None, 4),
        "maybe_tuple": (b"x",),
        "plain": "p",
    }
    values.update(changes)
    return Every(**values)


def raw(version: Any, kind: Any, fields: Any) -> bytes:
    data: bytes = msgpack.packb([version, kind, fields], use_bin_type=True)
    return data


def hello_fields(**changes: Any) -> list[Any]:
    values = {"protocol": 1, "run_id": "ab" * 32, "peer_id": "12D3KooW", "agent": "atoll/0.1.0"}
    values.update(changes)
    return list(values.values())


# -- round trips ----------------------------------------------------------------------------
def test_hello_round_trip() -> None:
    msg = Hello(protocol=PROTOCOL_VERSION, run_id="f" * 64, peer_id="12D3KooWabc", agent="atoll")
    data = encode_message(msg)
    assert msgpack.unpackb(data) == [PROTOCOL_VERSION, 1, [1, "f" * 64, "12D3KooWabc", "atoll"]]
    assert decode_message(data) == msg
    assert message_kind(Hello) == 1 and message_kind(Every) == 250


def test_every_field_type_round_trips() -> None:
    for msg in (every(), every(maybe_i=7, maybe_b=None, maybe_tuple=None, ints=(), strs=())):
        out = decode_message(encode_message(msg))
        assert out == msg
        assert isinstance(out, Every) and isinstance(out.ints, tuple)


def test_int_is_accepted_for_float_and_becomes_a_float() -> None:
    out = decode_message(encode_message(every(f=3, floats=(1, 2.5))))
    assert isinstance(out, Every)
    assert out.f == 3.0 and type(out.f) is float
    assert [type(x) for x in out.floats] == [float, float]


@settings(max_examples=50, deadline=None)
@given(
    i=st.integers(INT_MIN, UINT_MAX),
    f=st.floats(allow_nan=False, allow_infinity=False),
    s=st.text(max_size=16),
    b=st.binary(max_size=32),
    flag=st.booleans(),
    maybe_i=st.none() | st.integers(INT_MIN, UINT_MAX),
    maybe_b=st.none() | st.binary(max_size=64),
    ints=st.lists(st.integers(INT_MIN, UINT_MAX), max_size=8).map(tuple),
    floats=st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=20).map(tuple),
    strs=st.lists(st.text(max_size=8), max_size=5).map(tuple),
    maybe_items=st.lists(st.none() | st.integers(-100, 100), max_size=5).map(tuple),
    maybe_tuple=st.none() | st.lists(st.binary(max_size=4), max_size=3).map(tuple),
    plain=st.text(max_size=50),
)
def test_random_messages_round_trip(**values: Any) -> None:
    msg = Every(**values)
    assert decode_message(encode_message(msg)) == msg


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_to_a_message_or_a_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode_message(data)


def test_decode_reads_a_memoryview_in_place() -> None:
    data = bytearray(encode_message(Blob(b"abc" * 100)))
    assert decode_message(memoryview(data)) == Blob(b"abc" * 100)


def test_a_large_payload_is_copied_once() -> None:
    size = 50 * 1024 * 1024
    payload = b"\x5a" * size
    data = encode_message(Blob(payload))
    tracemalloc.start()
    try:
        out = decode_message(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(out, Blob) and out.payload == payload
    assert peak < size * 1.25, f"decode peaked at {peak / size:.2f}× the payload"


# -- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (raw(2, 1, hello_fields()), "protocol version 2, this peer speaks version 1"),
        (raw(0, 1, hello_fields()), "protocol version 0"),
        (raw(True, 1, hello_fields()), "version is bool"),
        (raw(1, 9999, []), "unknown message kind 9999"),
        (raw(1, "1", hello_fields()), "kind is str"),
        (raw(1, 1, hello_fields()[:3]), "Hello: 3 fields, expected 4 to 5"),
        (raw(1, 1, [*hello_fields(), b"c", "x"]), "Hello: 6 fields, expected 4 to 5"),
        (raw(1, 1, {"protocol": 1}), "Hello: fields are dict"),
        (raw(1, 1, hello_fields(protocol=True)), r"Hello\.protocol: expected int, got bool"),
        (raw(1, 1, hello_fields(protocol=1.0)), r"Hello\.protocol: expected int, got float"),
        (raw(1, 1, hello_fields(agent=b"atoll")), r"Hello\.agent: expected str, got bytes"),
        (raw(1, 1, hello_fields(run_id="a" * 65)), r"Hello\.run_id: 65 characters, more than"),
        (raw(1, 1, hello_fields(peer_id=None)), r"Hello\.peer_id: expected str, got None"),
        (raw(1, 251, ["not bytes"]), r"Blob\.payload: expected bytes, got str"),
        (raw(1, 252, [-1]), "Checked: count must be >= 0"),
        (msgpack.packb({"v": 1}), "not a \\[version, kind, fields\\] array"),
        (msgpack.packb([1, 1]), "not a \\[version, kind, fields\\] array"),
        (msgpack.packb(7), "not a \\[version, kind, fields\\] array"),
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (b"\x93\x01\x01", "not valid msgpack"),
        (b"\x93\x01\x01\xd9\x05ab", "not valid msgpack"),
        (encode_message(Checked(1)) + b"\x00", "not valid msgpack: ExtraData"),
    ],
)
def test_decode_refuses(data: bytes, expected: str) -> None:
    with pytest.raises(CodecError, match=expected):
        decode_message(data)


def every_raw(**changes: Any) -> bytes:
    fields = msgpack.unpackb(encode_message(every()))[2]
    names = list(Every.__dataclass_fields__)
    for key, value in changes.items():
        fields[names.index(key)] = value
    return raw(1, 250, fields)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"i": True}, r"Every\.i: expected int, got bool"),
        ({"f": True}, r"Every\.f: expected float, got bool"),
        ({"f": "1.0"}, r"Every\.f: expected float, got str"),
        ({"f": math.nan}, r"Every\.f: float nan is not finite"),
        ({"floats": [1.0, math.inf]}, r"Every\.floats\[1\]: float inf is not finite"),
        ({"flag": 1}, r"Every\.flag: expected bool, got int"),
        ({"s": "x" * 17}, r"Every\.s: 17 characters, more than max_len 16"),
        ({"b": b"x" * 33}, r"Every\.b: 33 bytes, more than max_len 32"),
        ({"b": "text"}, r"Every\.b: expected bytes, got str"),
        ({"maybe_b": "text"}, r"Every\.maybe_b: expected bytes, got str"),
        ({"ints": list(range(9))}, r"Every\.ints: 9 items, more than max_len 8"),
        ({"ints": [1, False]}, r"Every\.ints\[1\]: expected int, got bool"),
        ({"ints": 5}, r"Every\.ints: expected tuple, got int"),
        ({"strs": ["ok", "x" * 9]}, r"Every\.strs\[1\]: 9 characters, more than max_len 8"),
        ({"maybe_items": [None, "x"]}, r"Every\.maybe_items\[1\]: expected int, got str"),
        ({"maybe_tuple": [b"a", 3]}, r"Every\.maybe_tuple\[1\]: expected bytes, got int"),
        ({"plain": "x" * (DEFAULT_STR_MAX_LEN + 1)}, r"Every\.plain: 4097 characters"),
        ({"i": {"a": 1}}, r"Every\.i: expected int, got dict"),
    ],
)
def test_decode_checks_every_field(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(CodecError, match=expected):
        decode_message(every_raw(**changes))


def test_non_finite_floats_only_where_allowed() -> None:
    out = decode_message(encode_message(Loose(math.inf)))
    assert out == Loose(math.inf)
    with pytest.raises(CodecError, match="not finite"):
        encode_message(every(f=math.nan))


def test_oversize_input_is_refused_before_parsing() -> None:
    data = encode_message(Blob(b"x" * 100))
    assert decode_message(data, max_bytes=len(data)) == Blob(b"x" * 100)
    with pytest.raises(CodecError, match=f"{len(data)} bytes is over the limit of 50"):
        decode_message(data, max_bytes=50)
    with pytest.raises(CodecError, match="a message is bytes"):
        decode_message("text")  # type: ignore[arg-type]


def test_encode_refuses_what_decode_would() -> None:
    with pytest.raises(CodecError, match="not a registered message"):
        encode_message(object())
    with pytest.raises(CodecError, match=r"Hello\.run_id: 65 characters"):
        encode_message(Hello(1, "a" * 65, "p", "a"))
    with pytest.raises(CodecError, match=r"Every\.i: expected int, got bool"):
        encode_message(every(i=False))
    with pytest.raises(CodecError, match=r"Every\.i: int .* outside the 64-bit range"):
        encode_message(every(i=1 << 64))
    with pytest.raises(CodecError, match="cannot encode"):
        encode_message(every(plain="\ud800"))
    with pytest.raises(CodecError, match="not a registered message"):
        message_kind(int)


@pytest.mark.parametrize("size", [0, 10, (1 << 16) - 1, 1 << 16, (1 << 16) + 7, 1 << 20])
def test_pieces_join_to_the_same_bytes(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    for msg in (Tagged("peer", 0.5, payload), Blob(payload)):
        head, tail = encode_message_pieces(msg)
        assert head + tail == encode_message(msg)
        assert decode_message(head + tail) == msg
        if size >= 1 << 16:  # the payload itself, not a copy of it
            assert tail is payload
            assert len(head) < 64
        else:
            assert tail == b""


def test_pieces_refuse_what_encode_refuses() -> None:
    with pytest.raises(CodecError, match=r"Tagged\.payload: .* more than max_len"):
        encode_message_pieces(Tagged("peer", 1.0, bytes((1 << 20) + 1)))
    with pytest.raises(CodecError, match=r"Tagged\.weight: expected float, got str"):
        encode_message_pieces(Tagged("peer", "x", bytes(1 << 17)))  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="not a registered message"):
        encode_message_pieces(object())
    # a small last field, or a message not ending in bytes: one piece
    assert encode_message_pieces(Hello(1, "a" * 64, "p", "a")) == (
        encode_message(Hello(1, "a" * 64, "p", "a")),
        b"",
    )


# -- bombs inside a well-formed message ----------------------------------------------------
def _every_with(index: int, value: bytes) -> bytes:
    """Every's wire bytes with the packed field at ``index`` replaced by ``value``."""
    fields = msgpack.unpackb(encode_message(every()))[2]
    packed = [msgpack.packb(v, use_bin_type=True) for v in fields]
    packed[index] = value
    return b"\x93\x01\xcc\xfa" + bytes([0x90 | len(packed)]) + b"".join(packed)


_N = 1 << 20
_INTS = list(Every.__dataclass_fields__).index("ints")
_INT = list(Every.__dataclass_fields__).index("i")
_FLOATS = list(Every.__dataclass_fields__).index("floats")


@pytest.mark.parametrize(
    ("index", "value", "expected"),
    [
        # a tuple field declaring far more items than its max_len (8), with them behind it
        (_INTS, b"\xdd" + _N.to_bytes(4, "big") + b"\xc0" * _N, r"Every\.ints: 1048576 items"),
        # a tuple field without max_len is bounded by DEFAULT_ITEMS_MAX_LEN
        (_FLOATS, b"\xdd" + _N.to_bytes(4, "big") + b"\x00" * _N, r"Every\.floats: 1048576"),
        # arrays or maps where a tuple's items belong
        (_INTS, b"\x91\xdd" + _N.to_bytes(4, "big") + b"\xc0" * _N, r"ints\[0\]: .*got tuple"),
        (_INTS, b"\x91\xdf" + _N.to_bytes(4, "big") + b"\x80" * _N, r"ints\[0\]: .*got dict"),
        # an array, a map or an extension where a scalar belongs
        (_INT, b"\xdd" + _N.to_bytes(4, "big") + b"\x80" * _N, r"Every\.i: .*got tuple"),
        (_INT, b"\xdf" + _N.to_bytes(4, "big") + b"\x80" * _N, r"Every\.i: .*got dict"),
        (_INT, b"\xc9" + _N.to_bytes(4, "big") + b"\x01" + b"\x00" * _N, r"Every\.i: .*ExtType"),
    ],
)
def test_bombs_in_a_field_are_refused_before_they_are_built(
    index: int, value: bytes, expected: str
) -> None:
    data = _every_with(index, value)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match=expected):
            decode_message(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"refusing a {len(data)} byte bomb peaked at {peak} bytes"


def test_a_tuple_at_its_max_len_still_decodes() -> None:
    msg = every(ints=tuple(range(8)), floats=(0.5,) * DEFAULT_ITEMS_MAX_LEN)
    assert decode_message(encode_message(msg)) == msg
    with pytest.raises(CodecError, match=f"{DEFAULT_ITEMS_MAX_LEN + 1} items"):
        encode_message(every(floats=(0.5,) * (DEFAULT_ITEMS_MAX_LEN + 1)))


# -- registration ---------------------------------------------------------------------------
def test_registration_errors_are_type_errors() -> None:
    with pytest.raises(TypeError, match="kind 1 is taken by Hello"):

        @wire_message(1)
        @dataclass(frozen=True, slots=True)
        class Again:
            x: int

    with pytest.raises(TypeError, match="needs a dataclass"):

        @wire_message(60001)
        class NotData:
            x: int

    with pytest.raises(TypeError, match="must be a frozen dataclass"):

        @wire_message(60002)
        @dataclass
        class Mutable:
            x: int

    with pytest.raises(TypeError, match="already registered as kind 250"):
        wire_message(60003)(Every)
    for bad in (-1, 1 << 16, True, "3"):
        with pytest.raises(TypeError, match="kind is an int"):
            wire_message(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        ("list[int]", "unsupported field type"),
        ("dict[str, int]", "unsupported field type"),
        ("tuple[int, str]", r"only tuple\[X, ...\]"),
        ("tuple[tuple[int, ...], ...]", "tuples of tuples"),
        ("int | str", "only 'X | None' unions"),
        ("Undefined", "cannot resolve"),
    ],
)
def test_unsupported_annotations_fail_at_registration(annotation: str, expected: str) -> None:
    namespace: dict[str, Any] = {"__annotations__": {"x": annotation}}
    cls: type[Any] = dataclass(frozen=True)(type("Bad", (), namespace))
    with pytest.raises(TypeError, match=expected):
        wire_message(60010)(cls)


def test_bad_metadata_fails_at_registration() -> None:
    with pytest.raises(TypeError, match="unknown metadata"):

        @wire_message(60020)
        @dataclass(frozen=True)
        class Typo:
            x: str = field(metadata={"maxlen": 3})

    with pytest.raises(TypeError, match="'max_len' must be an int >= 0"):

        @wire_message(60021)
        @dataclass(frozen=True)
        class Negative:
            x: str = field(metadata={"max_len": -1})


# -- framing --------------------------------------------------------------------------------
BODIES = [b"", b"a", b"hello world", bytes(range(256)) * 3, b"\x00\x00\x00\x05"]
STREAM = b"".join(frame(b) for b in BODIES)


def test_frame_layout() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"


def test_several_frames_in_one_feed() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(STREAM) == BODIES
    assert decoder.buffered == 0


def test_frames_split_at_every_byte_boundary_reassemble() -> None:
    for cut in range(len(STREAM) + 1):
        decoder = FrameDecoder()
        out = decoder.feed(STREAM[:cut])
        out += decoder.feed(memoryview(STREAM)[cut:])
        assert out == BODIES, cut
        assert decoder.buffered == 0
    decoder = FrameDecoder()
    out = []
    for i in range(len(STREAM)):
        out += decoder.feed(STREAM[i : i + 1])
    assert out == BODIES


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=10))
def test_frames_survive_any_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    decoder = FrameDecoder()
    out: list[bytes] = []
    for start, stop in itertools.pairwise(bounds):
        out += decoder.feed(STREAM[start:stop])
    assert out == BODIES


def test_partial_frames_are_buffered() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(frame(b"abcdef")[:7]) == []
    assert decoder.buffered == 7
    assert decoder.feed(b"def" + frame(b"z")[:2]) == [b"abcdef"]
    assert decoder.buffered == 2


def test_an_oversized_header_raises_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_bytes=10)
    assert decoder.feed(frame(b"x" * 10)) == [b"x" * 10]
    assert decoder.feed(struct.pack(">I", 11)[:2]) == []
    with pytest.raises(CodecError, match="frame of 11 bytes, over the limit of 10"):
        decoder.feed(struct.pack(">I", 11)[2:])
    assert decoder.buffered == 0
    with pytest.raises(CodecError, match="failed earlier"):
        decoder.feed(b"")
    default = FrameDecoder()
    with pytest.raises(CodecError, match="over the limit"):
        default.feed(struct.pack(">I", MAX_FRAME_BYTES + 1))


def test_frame_refuses_an_oversized_body() -> None:
    with pytest.raises(CodecError, match="11 bytes is over the limit of 10"):
        frame(b"x" * 11, max_bytes=10)

    class Huge(bytes):
        def __len__(self) -> int:
            return MAX_FRAME_BYTES + 1

    with pytest.raises(CodecError, match="over the limit"):
        frame(Huge())


def test_bad_limits_are_config_errors() -> None:
    for bad in (-1, 1 << 32, True, 1.5):
        with pytest.raises(ConfigError):
            FrameDecoder(bad)  # type: ignore[arg-type]


def test_messages_through_frames() -> None:
    msgs = [Hello(1, "a" * 64, "peer", "atoll/0.1.0"), every(), Blob(b"\x01" * 5000)]
    stream = b"".join(frame(encode_message(m)) for m in msgs)
    decoder = FrameDecoder()
    out = []
    for i in range(0, len(stream), 1000):
        out += [decode_message(body) for body in decoder.feed(stream[i : i + 1000])]
    assert out == msgs


@given(
    sizes=st.lists(st.sampled_from([0, 3, 65535, 65536, 70001, 200000]), max_size=5),
    cuts=st.lists(st.integers(min_value=0, max_value=400000), max_size=12),
    as_bytearray=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_frame_decoder_reassembles_large_and_small_bodies_cut_anywhere(
    sizes: list[int], cuts: list[int], as_bytearray: bool
) -> None:
    bodies = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    stream = b"".join(frame(b) for b in bodies)
    points = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    decoder = FrameDecoder()
    got: list[bytes] = []
    for a, b in itertools.pairwise(points):
        piece = stream[a:b]
        got.extend(decoder.feed(bytearray(piece) if as_bytearray else piece))
    assert got == bodies
    assert decoder.buffered == 0

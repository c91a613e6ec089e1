"""Every decoder that reads a peer's bytes, fuzzed: only the documented errors come out.

The property, for each decoder: whatever the bytes (random, a valid encoding mutated,
a msgpack "bomb" declaring huge lengths, deep nesting, a wrong type in any field), the
call returns or raises one of the :mod:`atoll.protocol.errors` tree's
:class:`~atoll.protocol.errors.RejectedInput` branch (``CodecError``,
``RejectedRecord``, ``BadSignature``, ...) — never another exception, never a hang
(hypothesis' deadline bounds each call) — and, for the bombs, the memory a call peaks at
stays within a stated multiple of its input (measured with :mod:`tracemalloc`).

Targets: :func:`~atoll.protocol.messages.decode_message` and
:class:`~atoll.protocol.messages.FrameDecoder`, every DHT record through
:func:`~atoll.dht.records.decode_value`, :meth:`~atoll.security.signing.SignedEnvelope.
from_bytes` and :func:`~atoll.security.signing.open_envelope`, every codec's ``decode``,
``decode_into`` and ``slice_payload``, the state-transfer chunks
(:class:`~atoll.protocol.statesync.StateAssembler`, :func:`~atoll.protocol.statesync.
decode_state`), and the budgeted frame reader of :mod:`atoll.node.net.transport`.

Runs are reproducible: every test is derandomized, with a small example count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tracemalloc
import typing
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atoll.dht.records import (
    MAX_VALUE_BYTES,
    PeerRecord,
    ReadyRecord,
    StateRecord,
    decode_value,
)
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier
from atoll.node.net.transport import FrameBudget, read_frames
from atoll.protocol import allreduce, matchmaking, statepieces, statesync
from atoll.protocol.codecs import CODEC_NAMES, Codec, make_codec
from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.messages import (
    PROTOCOL_VERSION,
    FrameDecoder,
    Hello,
    decode_message,
    encode_message,
    frame,
    message_kind,
)
from atoll.security.identity import Identity
from atoll.security.signing import (
    MAX_ENVELOPE_BYTES,
    SignedEnvelope,
    open_envelope,
    seal,
)

# a deadline bounds every example: a decoder that hangs (or takes seconds) fails it
FUZZ = settings(
    max_examples=100,
    deadline=2000,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(FUZZ, max_examples=40)

T0 = 1_700_000_000.0
RUN = "3f" * 32
DIGEST = "ab" * 32
IDENTITY = Identity.from_private_bytes(bytes(range(32)))
PEER = IDENTITY.peer_id
SIGNER = EnvelopeSigner(IDENTITY)
VERIFIER = EnvelopeVerifier()

# -- samples of every wire message ----------------------------------------------------------
_SAMPLES: dict[object, object] = {
    str: "peer-a",
    int: 7,
    float: 3.5,
    bool: True,
    bytes: b"\x01\x02\x03",
    tuple[str, ...]: ("peer-a", "peer-b"),
    tuple[int, ...]: (1, 2),
}
MESSAGES: list[type] = [
    Hello,
    allreduce.Part,
    allreduce.Reduced,
    allreduce.Abort,
    matchmaking.JoinRequest,
    matchmaking.JoinAccept,
    matchmaking.Redirect,
    matchmaking.GroupFormed,
    matchmaking.Disband,
    statesync.StateRequest,
    statesync.StateChunk,
    statepieces.StateIndexRequest,
    statepieces.StateIndex,
    statepieces.StatePieceRequest,
    statepieces.StatePiece,
]


def _sample_of(hint: object) -> object:
    if hint in _SAMPLES:
        return _SAMPLES[hint]
    args = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(hint) is tuple:
        return (_sample_of(args[0]),)
    return _sample_of(args[0])  # X | None: an X


def _sample(cls: type) -> object:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample_of(hints[f.name]) for f in dataclasses.fields(cls)})


def _records() -> list[PeerRecord | ReadyRecord | StateRecord]:
    return [
        PeerRecord(
            peer_id=PEER,
            run_id=RUN,
            addrs=("/ip4/203.0.113.7/tcp/4001",),
            agent="atoll/0.1.0",
            tokens_per_s=1234.5,
            versions=(3, 2),
            digests=(DIGEST, "cd" * 32),
            serving=True,
            issued_at=T0,
            expires_at=T0 + 300,
        ),
        ReadyRecord(
            run_id=RUN,
            fragment=1,
            slot=9,
            peer_id=PEER,
            version=4,
            digest=DIGEST,
            weight=2048.0,
            declared_at=T0,
            issued_at=T0,
            expires_at=T0 + 60,
        ),
        StateRecord(
            peer_id=PEER,
            run_id=RUN,
            fragment=1,
            version=4,
            digest=DIGEST,
            issued_at=T0,
            expires_at=T0 + 120,
        ),
    ]


VALID_MESSAGES = [encode_message(_sample(c)) for c in MESSAGES]
RECORDS = _records()
VALID_VALUES = [(SIGNER.seal("atoll/dht/record/v1", encode_message(r)), r.key()) for r in RECORDS]


# -- strategies ----------------------------------------------------------------------------
def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """``data`` with each edit (kind, where, value) applied: flip, insert, delete, cut."""
    out = bytearray(data)
    for kind, where, value in edits:
        if not out:
            out.append(value)
            continue
        i = where % len(out)
        if kind == 0:
            out[i] ^= 1 << (value % 8)
        elif kind == 1:
            out[i] = value
        elif kind == 2:
            out.insert(i, value)
        elif kind == 3:
            del out[i]
        else:
            del out[i:]
    return bytes(out)


edits = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 1 << 20), st.integers(0, 255)),
    min_size=1,
    max_size=6,
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
)
# any msgpack value, nested; maps with str keys (strict_map_key refuses the others anyway)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _bombs(n: int) -> dict[str, bytes]:
    """msgpack bodies of about ``n`` bytes that declare or build far more than ``n``."""
    big = (1 << 32) - 1
    return {
        # headers that declare 4 G items or bytes, with nothing behind them
        "array32": b"\xdd" + big.to_bytes(4, "big"),
        "map32": b"\xdf" + big.to_bytes(4, "big"),
        "bin32": b"\xc6" + big.to_bytes(4, "big"),
        "str32": b"\xdb" + big.to_bytes(4, "big"),
        "ext32": b"\xc9" + big.to_bytes(4, "big") + b"\x01",
        # a deep nest of one-item arrays and maps
        "deep-array": b"\x91" * n,
        "deep-map": b"\x81\xa1k" * (n // 3),
        # a large array whose items are the costliest objects per byte: tiny maps, arrays
        "maps": b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n,
        "arrays": b"\xdd" + n.to_bytes(4, "big") + b"\x91\xc0" * (n // 2),
        "nils": b"\xdd" + n.to_bytes(4, "big") + b"\xc0" * n,
    }


def _message_bombs(n: int) -> dict[str, bytes]:
    """The bombs, bare and inside a wire message's field list."""
    out: dict[str, bytes] = {}
    for name, body in _bombs(n).items():
        out[name] = body
        out[name + "-in-fields"] = b"\x93\x01\x0a" + body  # [1, Part, <bomb>]
        out[name + "-in-a-field"] = b"\x93\x01\x0a\x91" + body  # [1, Part, [<bomb>]]
    return out


def _peak(call: Callable[[], object]) -> int:
    """Bytes of Python memory ``call`` peaks at (its exception, if any, swallowed)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with contextlib.suppress(RejectedInput):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


BOMB_BYTES = 1 << 20  # a bomb's size: large enough to measure, small enough to stay fast
BOMB_SLACK = 1 << 20  # fixed bytes any call may use beyond its multiple


# -- wire messages -------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_decode_message(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode_message(data)


@FUZZ
@given(st.sampled_from(VALID_MESSAGES), edits)
def test_mutated_messages_never_crash_decode_message(
    data: bytes, changes: list[tuple[int, int, int]]
) -> None:
    with contextlib.suppress(CodecError):
        decode_message(_mutate(data, changes))


@FUZZ
@given(st.sampled_from(MESSAGES), st.data())
def test_a_wrong_value_in_any_field_is_a_codec_error(cls: type, data: st.DataObject) -> None:
    msg = _sample(cls)
    fields = [getattr(msg, f.name) for f in dataclasses.fields(cls)]
    where = data.draw(st.integers(0, len(fields) - 1))
    fields[where] = data.draw(values)
    raw = _pack([PROTOCOL_VERSION, message_kind(cls), fields])
    try:
        decoded = decode_message(raw)
    except CodecError:
        return
    assert type(decoded) is cls  # what decodes is the message its kind names


@FUZZ
@given(values)
def test_any_msgpack_value_is_refused_or_decoded(value: object) -> None:
    with contextlib.suppress(CodecError):
        decode_message(_pack(value))


@FUZZ
@given(st.lists(st.integers(1, 64), max_size=12), st.binary(max_size=16))
def test_the_frame_decoder_takes_any_cut_and_garbage(cuts: list[int], junk: bytes) -> None:
    stream = b"".join(frame(m) for m in VALID_MESSAGES[:3]) + junk
    decoder = FrameDecoder(1 << 16)
    bodies: list[bytes] = []
    pos = 0
    try:
        for cut in [*cuts, len(stream)]:
            bodies += decoder.feed(stream[pos : pos + cut])
            pos += cut
    except CodecError:
        return
    assert bodies[:3] == VALID_MESSAGES[:3]


def test_a_huge_frame_header_is_refused_before_its_body() -> None:
    decoder = FrameDecoder(1 << 20)
    with pytest.raises(CodecError):
        decoder.feed(b"\xff\xff\xff\xff")
    assert decoder.buffered <= 4


@pytest.mark.parametrize("name", sorted(_message_bombs(64)))
def test_message_bombs_are_codec_errors(name: str) -> None:
    with pytest.raises(CodecError):
        decode_message(_message_bombs(4096)[name])


# Found by this file: decode_message handed the whole frame to msgpack before any schema
# check, and msgpack built every object the bytes described: a frame of empty maps (one
# byte each) peaked at ~80x its size, one of nils or one-item arrays at ~16x. The decoder
# now walks the headers against the schema first, so none of these is ever built.
@pytest.mark.parametrize("name", sorted(_message_bombs(64)))
def test_message_bombs_peak_at_a_small_multiple_of_their_size(name: str) -> None:
    data = _message_bombs(BOMB_BYTES)[name]
    assert _peak(lambda: decode_message(data)) <= 8 * len(data) + BOMB_SLACK


# -- signed envelopes ----------------------------------------------------------------------
VALID_ENVELOPE = seal(IDENTITY, "atoll/test/v1", b"payload").to_bytes()


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.builds(_mutate, st.just(VALID_ENVELOPE), edits)))
def test_envelope_bytes_never_crash(data: bytes) -> None:
    try:
        env = SignedEnvelope.from_bytes(data)
    except CodecError:
        return
    with contextlib.suppress(RejectedInput):
        open_envelope(env, domain="atoll/test/v1", max_payload=1024)


@FUZZ
@given(st.lists(values, min_size=5, max_size=5), st.integers(0, 4))
def test_envelope_fields_of_any_type_are_codec_errors(fields: list[object], keep: int) -> None:
    good = msgpack.unpackb(VALID_ENVELOPE)
    fields[keep] = good[keep]
    with contextlib.suppress(CodecError):
        SignedEnvelope.from_bytes(_pack(fields))


@pytest.mark.parametrize("name", sorted(_bombs(64)))
def test_envelope_bombs_are_codec_errors_in_bounded_memory(name: str) -> None:
    data = _bombs(MAX_ENVELOPE_BYTES - 8)[name]
    with pytest.raises(CodecError):
        SignedEnvelope.from_bytes(data)
    assert _peak(lambda: SignedEnvelope.from_bytes(data)) <= 2 * len(data) + BOMB_SLACK


def test_an_envelope_nesting_its_fields_stays_bounded() -> None:
    # the one shape the array bound lets through: five fields, each a tree of five-item
    # arrays, about a megabyte in all
    def tree(depth: int) -> bytes:
        return b"\xc0" if depth == 0 else b"\x95" + tree(depth - 1) * 5

    data = b"\x95" + tree(7) * 5
    assert len(data) < MAX_ENVELOPE_BYTES
    with pytest.raises(CodecError):
        SignedEnvelope.from_bytes(data)
    assert _peak(lambda: SignedEnvelope.from_bytes(data)) <= 24 * len(data) + BOMB_SLACK


# -- DHT records ---------------------------------------------------------------------------
@FUZZ
@given(st.sampled_from(VALID_VALUES), edits)
def test_mutated_dht_values_are_rejected_records(
    value: tuple[bytes, str], changes: list[tuple[int, int, int]]
) -> None:
    data, key = value
    with contextlib.suppress(RejectedInput):
        decode_value(_mutate(data, changes), key=key, now=T0 + 1, verifier=VERIFIER)


@FUZZ
@given(st.sampled_from(RECORDS), st.data())
def test_a_signed_record_with_any_field_wrong_is_rejected(
    record: PeerRecord | ReadyRecord | StateRecord, data: st.DataObject
) -> None:
    cls = type(record)
    fields = [getattr(record, f.name) for f in dataclasses.fields(cls)]
    where = data.draw(st.integers(0, len(fields) - 1))
    fields[where] = data.draw(values)
    payload = _pack([PROTOCOL_VERSION, message_kind(cls), fields])
    try:
        sealed = SIGNER.seal("atoll/dht/record/v1", payload)
    except ConfigError:
        return
    with contextlib.suppress(RejectedInput):
        decode_value(sealed, key=record.key(), now=T0 + 1, verifier=VERIFIER)


@FEW
@given(st.binary(max_size=MAX_VALUE_BYTES + 16))
def test_random_dht_values_are_rejected_records(data: bytes) -> None:
    with pytest.raises(RejectedInput):
        decode_value(data, key=RECORDS[0].key(), now=T0 + 1, verifier=VERIFIER)


@pytest.mark.parametrize("name", sorted(_message_bombs(64)))
def test_a_signed_bomb_record_is_rejected(name: str) -> None:
    payload = _message_bombs(4000)[name][:4000]
    sealed = SIGNER.seal("atoll/dht/record/v1", payload)
    with pytest.raises(RejectedInput):
        decode_value(sealed, key=RECORDS[0].key(), now=T0 + 1, verifier=VERIFIER)


# -- codecs --------------------------------------------------------------------------------
CODECS = [make_codec(n) for n in CODEC_NAMES] + [make_codec("int8", block=7)]


@FUZZ
@given(st.sampled_from(CODECS), st.binary(max_size=600), st.integers(0, 400))
def test_codec_garbage_is_a_codec_error(codec: Codec, data: bytes, numel: int) -> None:
    try:
        out = codec.decode(data, numel)
    except CodecError:
        return
    assert out.shape == (numel,) and out.dtype == np.float32
    assert np.isfinite(out).all()


@FUZZ
@given(st.sampled_from(CODECS), st.integers(1, 300), edits, st.data())
def test_codec_payloads_mutated_or_cut_are_codec_errors(
    codec: Codec, numel: int, changes: list[tuple[int, int, int]], data: st.DataObject
) -> None:
    x = np.asarray(
        data.draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=numel, max_size=numel)),
        dtype=np.float32,
    )
    payload = _mutate(codec.encode(x), changes)
    out = np.empty(numel, dtype=np.float32)
    calls: list[Callable[[], object]] = [
        lambda: codec.decode(payload, numel),
        lambda: codec.decode_into(payload, numel, out),
        lambda: codec.slice_payload(payload, numel, 0, numel),
    ]
    for call in calls:
        with contextlib.suppress(CodecError):
            call()


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("numel", [10**12, 1 << 62, 1 << 70, -1])
def test_codec_huge_counts_are_codec_errors_without_allocating(codec: Codec, numel: int) -> None:
    for payload in (b"", b"\x00" * 64):
        assert _peak(functools.partial(codec.decode, payload, numel)) < BOMB_SLACK
        with pytest.raises(CodecError):
            codec.decode(payload, numel)


@pytest.mark.parametrize("name", ["int8", "e3m0"])
@pytest.mark.parametrize("scale", [b"\x00\x00\x80\x7f", b"\xff\xff\xff\xff", b"\x00\x00\x80\xff"])
def test_codec_huge_or_bad_scales_are_codec_errors(name: str, scale: bytes) -> None:
    codec = make_codec(name, block=4)
    payload = bytearray(codec.encode(np.ones(8, dtype=np.float32)))
    width = 4 if name == "int8" else 2
    payload[0:width] = scale[-width:]
    with pytest.raises(CodecError):
        codec.decode(bytes(payload), 8)


# -- state transfer ------------------------------------------------------------------------
def _state(numel: int) -> statesync.FragmentState:
    return statesync.FragmentState(
        3, 5, 7, np.arange(numel, dtype=np.float32), np.ones(numel, dtype=np.float32)
    )


@FUZZ
@given(st.integers(0, 40), edits)
def test_decode_state_of_mutated_bytes_is_a_codec_error(
    numel: int, changes: list[tuple[int, int, int]]
) -> None:
    data = _mutate(_state(numel).wire(), changes)
    with contextlib.suppress(CodecError):
        statesync.decode_state(data, numel)


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.integers(-(1 << 63), (1 << 64) - 1),
            st.integers(-(1 << 63), (1 << 64) - 1),
            st.binary(max_size=64),
            st.sampled_from(["", "ab" * 16, "zz"]),
        ),
        max_size=6,
    ),
    st.integers(0, 20),
)
def test_the_state_assembler_refuses_any_hostile_chunk_stream(
    chunks: list[tuple[int, int, bytes, str]], numel: int
) -> None:
    assembler = statesync.StateAssembler(numel)
    try:
        for offset, total, payload, digest in chunks:
            msg = statesync.StateChunk("peer", RUN, 0, 1, digest, offset, total, payload)
            assembler.feed(decode_message(encode_message(msg)))
    except CodecError:
        pass


def test_a_chunk_announcing_a_huge_total_is_refused_before_buffering() -> None:
    assembler = statesync.StateAssembler(4)
    chunk = statesync.StateChunk("peer", RUN, 0, 1, "ab" * 16, 0, (1 << 64) - 1, b"x")
    with pytest.raises(CodecError):
        assembler.feed(chunk)


# -- the transport's budgeted frame reader -------------------------------------------------
class _Script:
    """A stream whose reads return the given pieces, then end."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.pieces.pop(0) if self.pieces else b""


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=8), st.sampled_from(VALID_MESSAGES))
def test_the_frame_reader_turns_any_bytes_into_frames_or_a_codec_error(
    pieces: list[bytes], good: bytes
) -> None:
    budget = FrameBudget(1 << 12)

    async def main() -> None:
        got: list[bytes] = []

        async def on_frame(body: bytes) -> None:
            got.append(body)

        stream = _Script([frame(good), *pieces])
        with contextlib.suppress(CodecError):
            await read_frames(stream, peer="p", budget=budget, max_bytes=1 << 10, on_frame=on_frame)
        assert got[:1] == [good]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert budget.used == 0  # whatever happened, nothing stays charged

"""Tests of signed envelopes: domain binding, tampering, size limits and the wire form."""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.security.identity import generate
from atoll.security.signing import (
    ENVELOPE_VERSION,
    MAX_DOMAIN_CHARS,
    BadSignature,
    SignedEnvelope,
    open_envelope,
    seal,
    signer_peer_id,
)

ALICE = generate()
BOB = generate()
DOMAIN = "atoll/peer-record/v1"
PAYLOAD = b"\x93\x01\x02\x03 some record"
LIMIT = 1024

domains = st.from_regex(r"[A-Za-z0-9._/:-]{1,128}", fullmatch=True)


def _sealed() -> SignedEnvelope:
    return seal(ALICE, DOMAIN, PAYLOAD)


def _flip(data: bytes, index: int = 0) -> bytes:
    return data[:index] + bytes([data[index] ^ 1]) + data[index + 1 :]


def test_seal_open_round_trip() -> None:
    env = _sealed()
    assert open_envelope(env, domain=DOMAIN, max_payload=LIMIT) == PAYLOAD
    assert open_envelope(env, domain=DOMAIN, max_payload=LIMIT, signer=ALICE.peer_id) == PAYLOAD
    assert signer_peer_id(env) == ALICE.peer_id
    assert env.public_key == ALICE.public_key and len(env.signature) == 64
    assert open_envelope(seal(ALICE, DOMAIN, b""), domain=DOMAIN, max_payload=0) == b""


def test_bad_signature_is_hostile_input() -> None:
    assert issubclass(BadSignature, RejectedInput)


_ENV = seal(ALICE, DOMAIN, PAYLOAD)


@pytest.mark.parametrize(
    "tampered",
    [
        dataclasses.replace(_ENV, payload=PAYLOAD + b"!"),
        dataclasses.replace(_ENV, payload=_flip(PAYLOAD, 3)),
        dataclasses.replace(_ENV, signature=_flip(_ENV.signature, 10)),
        dataclasses.replace(_ENV, signature=_flip(_ENV.signature, 63)),
        dataclasses.replace(_ENV, public_key=BOB.public_key),
        dataclasses.replace(_ENV, public_key=bytes(32)),
        dataclasses.replace(_ENV, public_key=b"\xff" * 32),
    ],
    ids=["longer-payload", "flipped-payload", "sig-bit-10", "sig-bit-63", "bob", "zero", "ff"],
)
def test_tampered_envelope_does_not_verify(tampered: SignedEnvelope) -> None:
    with pytest.raises(BadSignature, match="does not verify"):
        open_envelope(tampered, domain=DOMAIN, max_payload=LIMIT)


def test_signature_moved_to_another_domain_does_not_verify() -> None:
    env = dataclasses.replace(_sealed(), domain="atoll/round-vote/v1")
    with pytest.raises(BadSignature, match="does not verify"):
        open_envelope(env, domain="atoll/round-vote/v1", max_payload=LIMIT)


def test_domain_and_payload_boundary_is_unambiguous() -> None:
    # "atoll/a" + "b..." must not verify as "atoll/ab" + "..."
    env = seal(ALICE, "atoll/a", b"bxyz")
    moved = dataclasses.replace(env, domain="atoll/ab", payload=b"xyz")
    with pytest.raises(BadSignature):
        open_envelope(moved, domain="atoll/ab", max_payload=LIMIT)


def test_wrong_domain_is_refused_before_anything_else() -> None:
    with pytest.raises(BadSignature, match="expected 'atoll/round-vote/v1'"):
        open_envelope(_sealed(), domain="atoll/round-vote/v1", max_payload=LIMIT)


def test_wrong_signer_is_refused() -> None:
    with pytest.raises(BadSignature, match=BOB.peer_id):
        open_envelope(_sealed(), domain=DOMAIN, max_payload=LIMIT, signer=BOB.peer_id)


def test_oversize_payload_is_refused() -> None:
    env = _sealed()
    assert open_envelope(env, domain=DOMAIN, max_payload=len(PAYLOAD)) == PAYLOAD
    with pytest.raises(BadSignature, match="over the limit"):
        open_envelope(env, domain=DOMAIN, max_payload=len(PAYLOAD) - 1)


def test_raw_signature_of_the_payload_is_not_an_envelope_signature() -> None:
    forged = dataclasses.replace(_sealed(), signature=ALICE.sign(PAYLOAD))
    with pytest.raises(BadSignature):
        open_envelope(forged, domain=DOMAIN, max_payload=LIMIT)


@pytest.mark.parametrize("domain", ["", "x" * (MAX_DOMAIN_CHARS + 1), "atoll peer", "atoll\n"])
def test_caller_mistakes_are_config_errors(domain: str) -> None:
    with pytest.raises(ConfigError):
        seal(ALICE, domain, PAYLOAD)
    with pytest.raises(ConfigError):
        open_envelope(_sealed(), domain=domain, max_payload=LIMIT)


def test_bad_max_payload_is_a_config_error() -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError):
            open_envelope(_sealed(), domain=DOMAIN, max_payload=bad)  # type: ignore[arg-type]


@given(domain=domains, payload=st.binary(max_size=300))
def test_wire_round_trip(domain: str, payload: bytes) -> None:
    env = seal(ALICE, domain, payload)
    back = SignedEnvelope.from_bytes(env.to_bytes())
    assert back == env
    assert SignedEnvelope.from_bytes(memoryview(env.to_bytes())) == env
    assert open_envelope(back, domain=domain, max_payload=len(payload)) == payload


def _packed(*fields: object) -> bytes:
    data: bytes = msgpack.packb(list(fields), use_bin_type=True)
    return data


_GOOD = (ENVELOPE_VERSION, DOMAIN, PAYLOAD, _ENV.public_key, _ENV.signature)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        _ENV.to_bytes()[:-1],  # truncated
        _ENV.to_bytes() + b"\x00",  # trailing bytes
        _packed(*_GOOD[:4]),
        _packed(*_GOOD, b"extra"),
        msgpack.packb({"domain": DOMAIN}),
        _packed(2, *_GOOD[1:]),
        _packed(True, *_GOOD[1:]),
        _packed("1", *_GOOD[1:]),
        _packed(ENVELOPE_VERSION, DOMAIN.encode(), *_GOOD[2:]),
        _packed(ENVELOPE_VERSION, "bad domain", *_GOOD[2:]),
        _packed(ENVELOPE_VERSION, "", *_GOOD[2:]),
        _packed(ENVELOPE_VERSION, DOMAIN, PAYLOAD.decode("latin-1"), *_GOOD[3:]),
        _packed(*_GOOD[:3], _ENV.public_key[:31], _ENV.signature),
        _packed(*_GOOD[:3], _ENV.public_key, _ENV.signature + b"\x00"),
        _packed(*_GOOD[:3], None, _ENV.signature),
    ],
)
def test_garbage_is_a_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError):
        SignedEnvelope.from_bytes(data)


def test_wire_size_limit_and_type() -> None:
    data = _ENV.to_bytes()
    assert SignedEnvelope.from_bytes(data, max_bytes=len(data)) == _ENV
    with pytest.raises(CodecError, match="over the limit"):
        SignedEnvelope.from_bytes(data, max_bytes=len(data) - 1)
    with pytest.raises(CodecError):
        SignedEnvelope.from_bytes("not bytes")  # type: ignore[arg-type]


@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        SignedEnvelope.from_bytes(data)


def test_envelope_shape_is_checked_on_construction() -> None:
    with pytest.raises(CodecError):
        SignedEnvelope(DOMAIN, PAYLOAD, b"\x00" * 31, _ENV.signature)
    with pytest.raises(CodecError):
        SignedEnvelope(DOMAIN, bytearray(PAYLOAD), _ENV.public_key, _ENV.signature)  # type: ignore[arg-type]

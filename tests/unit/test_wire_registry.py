"""Every message the protocol sends is registered with the wire codec and round-trips."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import pytest

from atoll.protocol import allreduce, certificate, matchmaking, partseal, statepieces, statesync
from atoll.protocol.errors import CodecError
from atoll.protocol.messages import (
    PROTOCOL_VERSION,
    Hello,
    decode_message,
    encode_message,
    message_kind,
)

SAMPLES: dict[object, object] = {
    str: "peer-a",
    int: 7,
    float: 3.5,
    bytes: b"\x01\x02\x03",
    tuple[str, ...]: ("peer-a", "peer-b"),
    bytes | None: b"\x09",
    tuple[bytes, ...]: (b"\x01" * 32, b"\x02" * 32),
    tuple[float, ...]: (1.0, 2.5),
}
MESSAGES = [
    Hello,
    allreduce.Part,
    allreduce.Reduced,
    allreduce.Abort,
    allreduce.Verified,
    allreduce.Evidence,
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
    certificate.AttestationRequest,
    certificate.AttestationReply,
    partseal.PartStatement,
]


def _sample(cls: type) -> object:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: SAMPLES[hints[f.name]] for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_registered_and_round_trips(cls: type) -> None:
    msg = _sample(cls)
    assert decode_message(encode_message(msg)) == msg


def test_kinds_are_unique() -> None:
    kinds = [message_kind(c) for c in MESSAGES]
    assert len(set(kinds)) == len(kinds)


def test_a_hostile_part_with_a_non_finite_weight_does_not_decode() -> None:
    part = _sample(allreduce.Part)
    fields = [getattr(part, f.name) for f in dataclasses.fields(allreduce.Part)]
    fields[5] = float("nan")  # the weight
    raw = msgpack.packb([PROTOCOL_VERSION, message_kind(allreduce.Part), fields], use_bin_type=True)
    with pytest.raises(CodecError, match="weight"):
        decode_message(raw)


def test_an_attestation_reply_is_bounded_in_seals_and_their_size() -> None:
    """A reply holds at most MAX_REPLY_SEALS seals of at most MAX_SEALED_BYTES each;
    one over either bound does not decode."""
    reply = certificate.AttestationReply(
        "ab" * 32,
        0,
        3,
        "0f" * 16,
        "peer-a",
        tuple(b"\x07" * certificate.MAX_SEALED_BYTES for _ in range(certificate.MAX_REPLY_SEALS)),
    )
    assert decode_message(encode_message(reply)) == reply
    fields = [getattr(reply, f.name) for f in dataclasses.fields(reply)]
    kind = message_kind(certificate.AttestationReply)
    for seals in (
        (*reply.seals, b"\x07"),  # one seal too many
        (b"\x07" * (certificate.MAX_SEALED_BYTES + 1),),  # one seal too large
    ):
        raw = msgpack.packb([PROTOCOL_VERSION, kind, [*fields[:-1], seals]], use_bin_type=True)
        with pytest.raises(CodecError):
            decode_message(raw)

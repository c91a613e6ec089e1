"""Attack injection (atoll.node.net.attacks): what a hostile node sends is what the
benchmarks claim it sends."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier
from atoll.node.net.attacks import HostileTransport, owner_tamper, parse_attack
from atoll.protocol import allreduce as ar
from atoll.protocol.codecs import make_codec
from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.partseal import seal_part, seal_problem
from atoll.security.identity import generate


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "e3m0"])
@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000])
def test_a_hostile_owner_sends_a_well_formed_wrong_chunk(codec: str, n: int) -> None:
    c = make_codec(codec)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    payload = c.encode(x)
    bad = owner_tamper(c)(payload)
    assert len(bad) == len(payload)
    y = c.decode(bad, n)  # it decodes: only a check of the owner's work catches it
    assert float(np.dot(y, c.decode(payload, n))) < 0  # pointed the other way


def test_only_the_owner_attack_tampers_with_reduced_chunks() -> None:
    c = make_codec("e3m0")
    owner = parse_attack("owner")
    assert owner is not None and owner.tamper is None and not owner.on_the_wire
    assert owner.tamper_reduced(c) is not None
    huge = parse_attack("huge")
    assert huge is not None and huge.tamper_reduced(c) is None
    with pytest.raises(ConfigError):
        parse_attack("owner:3")


class _Sink:
    peer_id = "sink"

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def send(self, peer: str, msg: object, /) -> None:
        self.sent.append((peer, msg))

    async def receive(self) -> tuple[str, object]:
        raise AssertionError("not used")


def test_a_nan_attacker_seals_its_spoiled_parts_again() -> None:
    """In a round with sealed parts the hostile node's NaN part carries a valid seal of
    its own over the NaN payload (so the proof against it holds)."""
    me = generate()
    signer = EnvelopeSigner(me)
    c = make_codec("e3m0")
    piece = c.encode(np.ones(256, np.float32))
    seal = seal_part(signer, "r" * 64, 0, 3, me.peer_id, 1, 10.0, piece)
    part = ar.Part("r" * 64, 0, 3, me.peer_id, 1, 10.0, piece, (), seal)
    nan = parse_attack("nan")
    assert nan is not None
    sink = _Sink()
    hostile = HostileTransport(sink, nan, "e3m0", signer)  # type: ignore[arg-type]
    trio.run(hostile.send, "owner", part)
    ((_, sent),) = sink.sent
    assert isinstance(sent, ar.Part) and sent.payload != piece
    with pytest.raises(CodecError):
        c.decode(sent.payload, 256)
    ok = ("r" * 64, 0, 3, me.peer_id, 1, 10.0, sent.payload)
    assert seal_problem(EnvelopeVerifier(), sent.seal, *ok) is None

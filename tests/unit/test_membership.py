"""Membership of a run: certificates, allowlist, expiry, revocation, tampering, garbage."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.dht.records import MAX_RECORD_BYTES, MAX_SEAL_OVERHEAD, RECORD_DOMAIN
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier
from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.manifest import MembershipSettings
from atoll.security.identity import generate
from atoll.security.membership import (
    MAX_CERTIFICATE_BYTES,
    Membership,
    NotAMember,
    issue,
    read_certificate,
)
from atoll.security.signing import BadSignature, SignedEnvelope, seal

NOW = 1_800_000_000
DAY = 86_400
ORG = generate()
MEMBER = generate()
STRANGER = generate()


def cert(peer: str = MEMBER.peer_id, *, org=ORG, role: str = "member", days: int = 30) -> bytes:
    return issue(org, peer, role=role, issued_at=NOW - DAY, expires_at=NOW + days * DAY)


def org_policy(**kw: object) -> Membership:
    return Membership(private=True, org_key=ORG.public_key, **kw)  # type: ignore[arg-type]


def refused(policy: Membership, peer: str, certificate: bytes | None, now: float = NOW) -> str:
    with pytest.raises(NotAMember) as info:
        policy.check(peer, certificate, now)
    assert info.value.peer_id == peer
    assert "\n" not in str(info.value)
    return str(info.value)


# -- certificates ---------------------------------------------------------------------------
def test_a_certificate_reads_back() -> None:
    data = cert(role="trainer")
    c = read_certificate(data)
    assert (c.peer_id, c.role, c.org_peer_id) == (MEMBER.peer_id, "trainer", ORG.peer_id)
    assert (c.issued_at, c.expires_at) == (NOW - DAY, NOW + 30 * DAY)
    assert len(c.cert_id) == 64 and c.raw == data
    assert len(data) <= MAX_CERTIFICATE_BYTES


def test_the_largest_certificate_fits_its_bound_and_a_member_seal() -> None:
    data = issue(
        ORG, MEMBER.peer_id, role="r" * 32, issued_at=(1 << 40) - 2, expires_at=(1 << 40) - 1
    )
    assert len(data) <= MAX_CERTIFICATE_BYTES
    sealed = EnvelopeSigner(MEMBER, data).seal(RECORD_DOMAIN, b"x" * MAX_RECORD_BYTES)
    assert len(sealed) <= MAX_RECORD_BYTES + MAX_SEAL_OVERHEAD


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"peer_id": "nope"}, "cannot issue a certificate"),
        ({"role": "Admin!"}, "role must be"),
        ({"role": ""}, "role must be"),
        ({"expires_at": NOW - DAY}, "must be after issued_at"),
        ({"expires_at": -1}, "whole Unix seconds"),
    ],
)
def test_issue_refuses_bad_arguments(kw: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"peer_id": MEMBER.peer_id, "issued_at": NOW, "expires_at": NOW + 1}
    args.update(kw)
    with pytest.raises(ConfigError, match=message):
        issue(ORG, **args)  # type: ignore[arg-type]


def test_a_valid_member_is_admitted() -> None:
    assert org_policy().check(MEMBER.peer_id, cert(), NOW) is None


def test_no_certificate() -> None:
    assert "showed no member certificate" in refused(org_policy(), MEMBER.peer_id, None)


def test_expired_and_not_yet_valid() -> None:
    data = cert(days=1)
    assert "expired at" in refused(org_policy(), MEMBER.peer_id, data, NOW + 2 * DAY)
    later = issue(ORG, MEMBER.peer_id, issued_at=NOW + DAY, expires_at=NOW + 2 * DAY)
    assert "counts only from" in refused(org_policy(), MEMBER.peer_id, later)
    org_policy().check(MEMBER.peer_id, later, NOW + DAY - 60)  # within the clock skew


def test_wrong_org_key() -> None:
    other = generate()
    message = refused(org_policy(), MEMBER.peer_id, cert(org=other))
    assert "not by the run's organisation key" in message


def test_someone_elses_certificate() -> None:
    message = refused(org_policy(), STRANGER.peer_id, cert(MEMBER.peer_id))
    assert f"showed the certificate of peer {MEMBER.peer_id}" in message


def test_a_member_signing_its_own_certificate_is_refused() -> None:
    assert "not by the run's organisation key" in refused(
        org_policy(), MEMBER.peer_id, cert(org=MEMBER)
    )


def test_tampering_any_byte_is_refused() -> None:
    data = cert()
    policy = org_policy()
    for i in range(len(data)):
        for flip in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= flip
            with pytest.raises(NotAMember):
                policy.check(MEMBER.peer_id, bytes(bad), NOW)


def test_a_payload_of_another_shape_signed_by_the_org_is_refused() -> None:
    from atoll.security.membership import CERTIFICATE_DOMAIN

    for payload in (
        msgpack.packb([1, MEMBER.peer_id, "member", NOW]),
        msgpack.packb([2, MEMBER.peer_id, "member", NOW, NOW + 1]),
        msgpack.packb([1, MEMBER.peer_id, "member", NOW + 1, NOW]),
        msgpack.packb([1, "x", "member", NOW, NOW + 1]),
        msgpack.packb({"peer": MEMBER.peer_id}),
        b"\xc1",
    ):
        data = seal(ORG, CERTIFICATE_DOMAIN, payload).to_bytes()
        with pytest.raises(CodecError):
            read_certificate(data)
        assert "unreadable" in refused(org_policy(), MEMBER.peer_id, data)


def test_a_signature_for_another_domain_is_refused() -> None:
    env = seal(ORG, "atoll/other/v1", msgpack.packb([1, MEMBER.peer_id, "m", NOW, NOW + 9]))
    with pytest.raises(BadSignature):
        read_certificate(env.to_bytes())


@pytest.mark.parametrize(
    "data", [b"", b"\x00", b"\xff" * 10, b"\x95" + b"\x00" * 5, b"x" * (MAX_CERTIFICATE_BYTES + 1)]
)
def test_garbage_is_refused_clearly(data: bytes) -> None:
    with pytest.raises(CodecError):
        read_certificate(data)
    assert "unreadable" in refused(org_policy(), MEMBER.peer_id, data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_escape_as_anything_else(data: bytes) -> None:
    with pytest.raises(RejectedInput):
        read_certificate(data)


def test_not_bytes_is_refused() -> None:
    with pytest.raises(CodecError):
        read_certificate("text")


# -- allowlist, revocation, public ---------------------------------------------------------
def test_allowlist() -> None:
    policy = Membership(private=True, allowlist=[MEMBER.peer_id])
    policy.check(MEMBER.peer_id, None, NOW)
    assert "not on the run's allowlist" in refused(policy, STRANGER.peer_id, None)
    # a certificate means nothing without an org key
    assert "not on the run's allowlist" in refused(policy, STRANGER.peer_id, cert(STRANGER.peer_id))


def test_allowlist_and_org_key_together() -> None:
    policy = org_policy(allowlist=[STRANGER.peer_id])
    policy.check(STRANGER.peer_id, None, NOW)
    policy.check(MEMBER.peer_id, cert(), NOW)
    third = generate().peer_id
    assert "not on the run's allowlist and showed no member certificate" in refused(
        policy, third, None
    )


def test_revoked_peer_and_revoked_certificate() -> None:
    data = cert()
    by_peer = org_policy(revoked=[MEMBER.peer_id])
    assert "revokes this peer" in refused(by_peer, MEMBER.peer_id, data)
    by_cert = org_policy(revoked=[read_certificate(data).cert_id])
    assert "revokes its certificate" in refused(by_cert, MEMBER.peer_id, data)
    # a new certificate for the same peer is not revoked by the old one's id
    by_cert.check(MEMBER.peer_id, cert(days=60), NOW)
    allowed_but_revoked = Membership(
        private=True, allowlist=[MEMBER.peer_id], revoked=[MEMBER.peer_id]
    )
    assert "revokes this peer" in refused(allowed_but_revoked, MEMBER.peer_id, None)


def test_public_admits_all_but_the_revoked() -> None:
    policy = Membership(revoked=[STRANGER.peer_id])
    assert not policy.private
    policy.check(MEMBER.peer_id, None, NOW)
    policy.check(MEMBER.peer_id, b"garbage is never read", NOW)
    assert "revokes this peer" in refused(policy, STRANGER.peer_id, None)


@pytest.mark.parametrize(
    "kw",
    [
        {"private": True},
        {"allowlist": ["x"]},
        {"private": True, "allowlist": ["not-a-peer"]},
        {"private": True, "org_key": b"short"},
        {"allowlist": [MEMBER.peer_id]},
        {"revoked": ["zz"]},
    ],
)
def test_bad_policies_are_config_errors(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Membership(**kw)  # type: ignore[arg-type]


def test_from_manifest_settings() -> None:
    settings_ = MembershipSettings(
        mode="private", org_key=ORG.public_key.hex(), revoked=(STRANGER.peer_id,)
    )
    policy = Membership.from_settings(settings_)
    assert policy.private and policy.uses_certificates and policy.org_peer_id == ORG.peer_id
    policy.check(MEMBER.peer_id, cert(), NOW)
    assert "revokes" in refused(policy, STRANGER.peer_id, cert(STRANGER.peer_id))
    assert not Membership.from_settings(MembershipSettings()).private


# -- DHT seals ------------------------------------------------------------------------------
def test_member_seals_open_for_members_only() -> None:
    policy = org_policy()
    verifier = EnvelopeVerifier(policy, wall=lambda: NOW)
    sealed = EnvelopeSigner(MEMBER, cert()).seal(RECORD_DOMAIN, b"record")
    assert verifier.open(sealed, domain=RECORD_DOMAIN, max_payload=100) == (
        b"record",
        MEMBER.peer_id,
    )
    # a plain verifier (atoll status) reads member seals too
    assert EnvelopeVerifier().open(sealed, domain=RECORD_DOMAIN, max_payload=100)[0] == b"record"
    bare = EnvelopeSigner(MEMBER).seal(RECORD_DOMAIN, b"record")
    with pytest.raises(NotAMember, match="no member certificate"):
        verifier.open(bare, domain=RECORD_DOMAIN, max_payload=100)
    # a stranger carrying a member's certificate is refused
    stolen = EnvelopeSigner(STRANGER, cert()).seal(RECORD_DOMAIN, b"record")
    with pytest.raises(NotAMember, match="certificate of peer"):
        verifier.open(stolen, domain=RECORD_DOMAIN, max_payload=100)


def test_allowlist_seals() -> None:
    verifier = EnvelopeVerifier(Membership(private=True, allowlist=[MEMBER.peer_id]))
    verifier.open(
        EnvelopeSigner(MEMBER).seal(RECORD_DOMAIN, b"r"), domain=RECORD_DOMAIN, max_payload=9
    )
    with pytest.raises(NotAMember, match="allowlist"):
        verifier.open(
            EnvelopeSigner(STRANGER).seal(RECORD_DOMAIN, b"r"), domain=RECORD_DOMAIN, max_payload=9
        )


@pytest.mark.parametrize(
    "data",
    [
        b"\x92",
        msgpack.packb([b"a", "b"]),
        msgpack.packb([b"a", b"b"]),
        msgpack.packb([b"a", b"b" * (MAX_CERTIFICATE_BYTES + 1)]),
        msgpack.packb([1, 2]),
    ],
)
def test_malformed_member_seals_are_codec_errors(data: bytes) -> None:
    with pytest.raises(CodecError):
        EnvelopeVerifier(org_policy()).open(data, domain=RECORD_DOMAIN, max_payload=100)


def test_envelope_wire_form_is_unchanged_without_a_certificate() -> None:
    sealed = EnvelopeSigner(MEMBER).seal(RECORD_DOMAIN, b"x")
    SignedEnvelope.from_bytes(sealed)  # a bare envelope, as before member seals


# -- the Hello's certificate, old peers ------------------------------------------------------
def test_a_hello_without_certificate_is_the_old_four_field_form() -> None:
    from atoll.protocol.messages import PROTOCOL_VERSION, Hello, decode_message, encode_message

    old = Hello(PROTOCOL_VERSION, "ab" * 32, MEMBER.peer_id, "atoll/0")
    wire = encode_message(old)
    assert msgpack.unpackb(wire)[2] == [PROTOCOL_VERSION, "ab" * 32, MEMBER.peer_id, "atoll/0"]
    assert decode_message(wire) == old and old.certificate is None
    with_cert = Hello(PROTOCOL_VERSION, "ab" * 32, MEMBER.peer_id, "atoll/0", cert())
    assert decode_message(encode_message(with_cert)) == with_cert
    with pytest.raises(CodecError):
        encode_message(Hello(PROTOCOL_VERSION, "ab" * 32, MEMBER.peer_id, "a", b"x" * 321))

"""Who may take part in a run: public, an allowlist, or certificates of an organisation.

A run's manifest names its membership (:class:`~atoll.protocol.manifest.MembershipSettings`,
the ``[membership]`` table); :class:`Membership` is that policy, ready to answer one
question, :meth:`Membership.check`: may this peer take part, given the certificate it
showed and the time now? The answer is ``None`` (yes) or :class:`NotAMember` with one line
saying why not. The node asks it when a connection opens (the Hello exchange), for every
DHT record, and for every peer that declares itself ready for a round.

Modes:

- ``public``: anyone, except the peers the manifest revokes;
- ``private``: a peer on the manifest's ``allowlist``, or a peer that shows a valid
  *member certificate* signed by the organisation key ``org_key``; never a revoked peer
  or a revoked certificate. A private manifest names an allowlist, an organisation key,
  or both.

A member certificate is an :class:`~atoll.security.signing.SignedEnvelope` of the
organisation's Ed25519 key for the domain :data:`CERTIFICATE_DOMAIN`, whose payload is the
msgpack array ``[1, peer_id, role, issued_at, expires_at]`` (times in whole Unix seconds).
:func:`issue` makes one, :func:`read_certificate` decodes and verifies one. Certificates are
at most :data:`MAX_CERTIFICATE_BYTES` (small enough to ride along in a Hello and in the
seal of every DHT record). A certificate's id (:attr:`Certificate.cert_id`) is the sha256 of
its bytes in hex, what the manifest's ``revoked`` list names to revoke one certificate and
not the peer.

Time: ``now`` is the checker's wall clock. A certificate counts from ``issued_at`` (with
:data:`CLOCK_SKEW_S` of slack for clocks that disagree) until ``expires_at``.

Errors::

    RejectedInput (atoll.protocol.errors)
    └── NotAMember   a peer the run's membership does not admit (one line: why)
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.manifest import MembershipSettings
from atoll.security.identity import Identity, peer_id_from_public_key, public_key_from_peer_id
from atoll.security.signing import (
    BadSignature,
    SignedEnvelope,
    open_envelope,
    seal,
    signer_peer_id,
)

__all__ = [
    "CERTIFICATE_DOMAIN",
    "CLOCK_SKEW_S",
    "MAX_CERTIFICATE_BYTES",
    "MAX_ROLE_CHARS",
    "Certificate",
    "Membership",
    "NotAMember",
    "issue",
    "read_certificate",
]

CERTIFICATE_DOMAIN: str = "atoll/member-certificate/v1"
"""Signature domain of member certificates: no other signature of the key verifies here."""

MAX_CERTIFICATE_BYTES: int = 320
"""Most bytes of an encoded certificate (a typical one is about 230)."""

MAX_ROLE_CHARS: int = 32
"""Longest role name."""

CLOCK_SKEW_S: float = 300.0
"""How far ahead of the checker's clock ``issued_at`` may lie, in seconds."""

_PAYLOAD_VERSION = 1
_MAX_PAYLOAD = MAX_CERTIFICATE_BYTES  # the payload is part of the certificate
_ROLE = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_TIME_BOUND = 1 << 40  # whole seconds; far beyond any real date, within int64


class NotAMember(RejectedInput):
    """A peer that the run's membership does not admit; the message says why in one line.

    ``peer_id`` is the peer refused.
    """

    def __init__(self, peer_id: str, reason: str) -> None:
        super().__init__(f"peer {peer_id} is not a member of this run: {reason}")
        self.peer_id = peer_id
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Certificate:
    """A decoded member certificate whose signature verified (see :func:`read_certificate`).

    Verified means: signed by ``org_peer_id``'s key for :data:`CERTIFICATE_DOMAIN`. Whether
    that key is the run's organisation key, and whether the certificate is current, is
    :meth:`Membership.check`'s business.
    """

    peer_id: str
    """the member the certificate is for"""
    role: str
    """what the member is (``member`` unless the organisation said otherwise)"""
    issued_at: int
    """Unix seconds from which it counts"""
    expires_at: int
    """Unix seconds from which it no longer counts"""
    org_peer_id: str
    """the peer id of the key that signed it"""
    raw: bytes = field(repr=False)
    """the certificate's bytes, exactly as read"""

    @property
    def cert_id(self) -> str:
        """The certificate's id: sha256 of its bytes, 64 lowercase hex digits."""
        return hashlib.sha256(self.raw).hexdigest()


def issue(
    org: Identity,
    peer_id: str,
    *,
    role: str = "member",
    issued_at: int | None = None,
    expires_at: int,
) -> bytes:
    """A member certificate for ``peer_id`` signed by the organisation key ``org``.

    ``issued_at`` defaults to now (whole seconds). Raises
    :class:`~atoll.protocol.errors.ConfigError` for a peer id that is not an Ed25519 peer
    id, a role that is not 1 to 32 of ``a-z 0-9 _ . -`` (starting with a letter or digit),
    or times out of order.
    """
    try:
        public_key_from_peer_id(peer_id)
    except CodecError as e:
        raise ConfigError(f"cannot issue a certificate: {e}") from None
    if not isinstance(role, str) or len(role) > MAX_ROLE_CHARS or not _ROLE.fullmatch(role):
        raise ConfigError(
            f"role must be 1 to {MAX_ROLE_CHARS} characters of a-z 0-9 _ . -, not {role!r}"
        )
    start = int(time.time()) if issued_at is None else issued_at
    for name, value in (("issued_at", start), ("expires_at", expires_at)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _TIME_BOUND:
            raise ConfigError(f"{name} must be whole Unix seconds, not {value!r}")
    if expires_at <= start:
        raise ConfigError(f"expires_at ({expires_at}) must be after issued_at ({start})")
    payload: bytes = msgpack.packb(
        [_PAYLOAD_VERSION, peer_id, role, start, expires_at], use_bin_type=True
    )
    data = seal(org, CERTIFICATE_DOMAIN, payload).to_bytes()
    if len(data) > MAX_CERTIFICATE_BYTES:  # pragma: no cover - the bounds above keep it small
        raise ConfigError(f"certificate of {len(data)} bytes over {MAX_CERTIFICATE_BYTES}")
    return data


def read_certificate(data: object) -> Certificate:
    """The certificate in ``data``, decoded strictly and its signature verified.

    Raises :class:`~atoll.protocol.errors.CodecError` for bytes that are not one
    certificate (over :data:`MAX_CERTIFICATE_BYTES`, not an envelope, a payload of another
    shape) and :class:`~atoll.security.signing.BadSignature` for one whose signature does
    not verify. Never anything else, whatever the bytes.
    """
    if not isinstance(data, bytes):
        raise CodecError(f"a certificate is bytes, not {type(data).__name__}")
    if len(data) > MAX_CERTIFICATE_BYTES:
        raise CodecError(
            f"certificate of {len(data)} bytes is over the limit of {MAX_CERTIFICATE_BYTES}"
        )
    env = SignedEnvelope.from_bytes(data, max_bytes=MAX_CERTIFICATE_BYTES)
    payload = open_envelope(env, domain=CERTIFICATE_DOMAIN, max_payload=_MAX_PAYLOAD)
    try:
        fields = msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=True)
    except Exception as e:  # hostile bytes may raise anything msgpack has; none escapes
        raise CodecError(f"certificate payload is not msgpack: {type(e).__name__}") from None
    if not isinstance(fields, tuple) or len(fields) != 5:
        raise CodecError("certificate payload is not an array of 5 fields")
    version, peer_id, role, issued_at, expires_at = fields
    if version != _PAYLOAD_VERSION or isinstance(version, bool):
        raise CodecError(f"certificate version {version!r}; this peer reads version 1")
    if not isinstance(peer_id, str):
        raise CodecError("certificate peer id is not a string")
    public_key_from_peer_id(peer_id)  # CodecError when it is not an Ed25519 peer id
    if not isinstance(role, str) or len(role) > MAX_ROLE_CHARS or not _ROLE.fullmatch(role):
        raise CodecError("certificate role is not 1 to 32 of a-z 0-9 _ . -")
    for name, value in (("issued_at", issued_at), ("expires_at", expires_at)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _TIME_BOUND:
            raise CodecError(f"certificate {name} is not whole Unix seconds")
    if expires_at <= issued_at:
        raise CodecError("certificate expires before it is issued")
    return Certificate(peer_id, role, issued_at, expires_at, signer_peer_id(env), data)


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


class Membership:
    """A run's membership policy (see the module docstring); immutable.

    Build it from the manifest's table with :meth:`from_settings`, or directly. Invalid
    arguments raise :class:`~atoll.protocol.errors.ConfigError`.
    """

    __slots__ = ("_allow", "_org_id", "_private", "_revoked_certs", "_revoked_peers")

    def __init__(
        self,
        *,
        private: bool = False,
        allowlist: Iterable[str] = (),
        org_key: bytes | None = None,
        revoked: Iterable[str] = (),
    ) -> None:
        allow = frozenset(allowlist)
        for peer in allow:
            _check_peer_id(peer, "allowlist")
        self._org_id: str | None = None
        if org_key is not None:
            try:
                self._org_id = peer_id_from_public_key(org_key)
            except CodecError as e:
                raise ConfigError(f"org_key: {e}") from None
        peers, certs = set(), set()
        for item in revoked:
            if isinstance(item, str) and len(item) == 64 and set(item) <= set("0123456789abcdef"):
                certs.add(item)
            else:
                _check_peer_id(item, "revoked")
                peers.add(item)
        if private and not allow and self._org_id is None:
            raise ConfigError("a private membership needs an allowlist, an org_key or both")
        if not private and (allow or self._org_id is not None):
            raise ConfigError("an allowlist or an org_key needs the private mode")
        self._private = bool(private)
        self._allow = allow
        self._revoked_peers = frozenset(peers)
        self._revoked_certs = frozenset(certs)

    @classmethod
    def from_settings(cls, settings: MembershipSettings) -> Membership:
        """The policy of a manifest's ``[membership]`` table."""
        return cls(
            private=settings.mode == "private",
            allowlist=settings.allowlist,
            org_key=bytes.fromhex(settings.org_key) if settings.org_key else None,
            revoked=settings.revoked,
        )

    @property
    def private(self) -> bool:
        """Whether only members may take part (else anyone not revoked)."""
        return self._private

    @property
    def uses_certificates(self) -> bool:
        """Whether members may prove themselves with an organisation's certificate."""
        return self._org_id is not None

    @property
    def org_peer_id(self) -> str | None:
        """The peer id of the organisation key, when there is one."""
        return self._org_id

    def check(self, peer_id: str, certificate: bytes | None, now: float) -> None:
        """Return when ``peer_id`` may take part; raise :class:`NotAMember` saying why not.

        ``certificate`` is what the peer showed (None: nothing); it is read only when the
        peer is neither revoked nor on the allowlist. ``now`` is this machine's wall
        clock in Unix seconds.
        """
        if peer_id in self._revoked_peers:
            raise NotAMember(peer_id, "the run manifest revokes this peer")
        if not self._private or peer_id in self._allow:
            return
        if self._org_id is None:
            raise NotAMember(peer_id, "it is not on the run's allowlist")
        if certificate is None:
            if self._allow:
                raise NotAMember(
                    peer_id, "it is not on the run's allowlist and showed no member certificate"
                )
            raise NotAMember(peer_id, "it showed no member certificate (start it with --cert)")
        try:
            cert = read_certificate(certificate)
        except (CodecError, BadSignature) as e:
            raise NotAMember(peer_id, f"its certificate is unreadable: {e}") from None
        if cert.org_peer_id != self._org_id:
            raise NotAMember(
                peer_id,
                f"its certificate is signed by key {cert.org_peer_id}, not by the run's "
                f"organisation key {self._org_id}",
            )
        if cert.peer_id != peer_id:
            raise NotAMember(peer_id, f"it showed the certificate of peer {cert.peer_id}")
        if cert.cert_id in self._revoked_certs:
            raise NotAMember(peer_id, f"the run manifest revokes its certificate {cert.cert_id}")
        if now + CLOCK_SKEW_S < cert.issued_at:
            raise NotAMember(peer_id, f"its certificate counts only from {_utc(cert.issued_at)}")
        if now >= cert.expires_at:
            raise NotAMember(peer_id, f"its certificate expired at {_utc(cert.expires_at)}")

    def __repr__(self) -> str:
        if not self._private:
            return f"Membership(public, {len(self._revoked_peers)} revoked)"
        return (
            f"Membership(private, {len(self._allow)} allowed, org={self._org_id}, "
            f"{len(self._revoked_peers) + len(self._revoked_certs)} revoked)"
        )


def _check_peer_id(peer: object, where: str) -> None:
    if not isinstance(peer, str):
        raise ConfigError(f"{where}: a peer id is a string, not {type(peer).__name__}")
    try:
        public_key_from_peer_id(peer)
    except CodecError as e:
        raise ConfigError(f"{where}: {e}") from None

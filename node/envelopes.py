"""The DHT's record seal, made of atoll.security's Ed25519 envelopes.

:mod:`atoll.dht.records` declares what it needs to seal and open records
(:class:`~atoll.dht.records.RecordSigner`, :class:`~atoll.dht.records.RecordVerifier`)
and :mod:`atoll.security.signing` provides signed envelopes; ``dht`` and ``security``
never import each other, so the node, which wires both, joins them here:

- :class:`EnvelopeSigner` seals a record's bytes as a
  :class:`~atoll.security.signing.SignedEnvelope` of the node's identity, on the wire as
  :meth:`~atoll.security.signing.SignedEnvelope.to_bytes`;
- :class:`EnvelopeVerifier` decodes such bytes (at most ``max_payload`` plus
  :data:`~atoll.dht.records.MAX_SEAL_OVERHEAD`, before any crypto), opens the envelope
  for the expected domain and payload limit with
  :func:`~atoll.security.signing.open_envelope`, and names the signer by its peer id.

Everything it refuses is a :class:`~atoll.protocol.errors.RejectedInput`
(``CodecError`` for bytes that are no envelope, ``BadSignature`` for one that does not
open, :class:`~atoll.security.membership.NotAMember` for a signer the run does not admit),
which the DHT reports as a record refused by the ``seal`` rule.

Membership. In a private run every DHT record must come from a member. Given the run's
:class:`~atoll.security.membership.Membership`, :class:`EnvelopeVerifier` checks the
signer of every record it opens. A peer on the allowlist is known by its peer id alone;
a member by certificate proves itself in every record: :class:`EnvelopeSigner` given the
node's certificate seals as the msgpack array ``[envelope, certificate]`` (a *member
seal*, about 200 bytes more, within :data:`~atoll.dht.records.MAX_SEAL_OVERHEAD`) instead
of the bare envelope. Every record then stands on its own: a node checks it without
having met its publisher, and no record type depends on another having been seen first.
A verifier reads both forms (``atoll status`` reads the records of any run).

:class:`SystemClock` is the DHT's :class:`~atoll.dht.directory.Clock` for real peers:
this machine's wall time, on which records are stamped and expire.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack

from atoll.dht.records import MAX_SEAL_OVERHEAD
from atoll.protocol.errors import CodecError
from atoll.security.identity import Identity
from atoll.security.membership import MAX_CERTIFICATE_BYTES, Membership
from atoll.security.signing import SignedEnvelope, open_envelope, seal, signer_peer_id

__all__ = ["EnvelopeSigner", "EnvelopeVerifier", "SystemClock"]

_MEMBER_SEAL = 0x92  # msgpack fixarray of 2: [envelope, certificate]; an envelope is 5


class EnvelopeSigner:
    """A :class:`~atoll.dht.records.RecordSigner`: seals with ``identity``'s Ed25519 key.

    With ``certificate`` (the node's member certificate), every seal carries it: a member
    seal (module docstring).
    """

    __slots__ = ("_certificate", "_identity")

    def __init__(self, identity: Identity, certificate: bytes | None = None) -> None:
        self._identity = identity
        self._certificate = certificate

    @property
    def peer_id(self) -> str:
        """The peer id every seal of this signer names."""
        return self._identity.peer_id

    def seal(self, domain: str, payload: bytes) -> bytes:
        """``payload`` in an envelope for ``domain`` signed by the identity, as bytes."""
        envelope = seal(self._identity, domain, payload).to_bytes()
        if self._certificate is None:
            return envelope
        packed: bytes = msgpack.packb([envelope, self._certificate], use_bin_type=True)
        return packed


class EnvelopeVerifier:
    """A :class:`~atoll.dht.records.RecordVerifier` for :class:`EnvelopeSigner`'s seals.

    Stateless: any peer's envelope opens if its signature verifies; that the signer is
    the peer a record is about is :func:`atoll.dht.records.decode_value`'s check. With
    ``membership``, the signer must also be a member of the run at ``wall()`` (a member
    by certificate: the certificate in the member seal).
    """

    __slots__ = ("_membership", "_wall")

    def __init__(
        self, membership: Membership | None = None, *, wall: Callable[[], float] = time.time
    ) -> None:
        self._membership = membership
        self._wall = wall

    def open(self, data: bytes, *, domain: str, max_payload: int) -> tuple[bytes, str]:
        """The payload sealed in ``data`` and the peer id of its signer.

        Raises :class:`~atoll.protocol.errors.CodecError` when ``data`` is not one
        envelope (or member seal) of at most ``max_payload + MAX_SEAL_OVERHEAD`` bytes,
        :class:`~atoll.security.signing.BadSignature` when it is for another domain, its
        payload is over ``max_payload`` or its signature does not verify, and
        :class:`~atoll.security.membership.NotAMember` when the signer is not a member.
        """
        limit = max_payload + MAX_SEAL_OVERHEAD
        if len(data) > limit:
            raise CodecError(f"sealed value of {len(data)} bytes is over the limit of {limit}")
        certificate: bytes | None = None
        if data[:1] == bytes([_MEMBER_SEAL]):
            data, certificate = _split_member_seal(data)
        env = SignedEnvelope.from_bytes(data, max_bytes=limit)
        payload = open_envelope(env, domain=domain, max_payload=max_payload)
        signer = signer_peer_id(env)
        if self._membership is not None:
            self._membership.check(signer, certificate, self._wall())
        return payload, signer


def _split_member_seal(data: bytes) -> tuple[bytes, bytes]:
    """The envelope and the certificate of a member seal; CodecError when malformed."""
    try:
        fields = msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True)
    except Exception as e:  # hostile bytes may raise anything msgpack has; none escapes
        raise CodecError(f"member seal is not valid msgpack: {type(e).__name__}") from None
    if (
        not isinstance(fields, tuple)
        or len(fields) != 2
        or not all(isinstance(f, bytes) for f in fields)
    ):
        raise CodecError("member seal is not an array of [envelope, certificate] bytes")
    envelope, certificate = fields
    if len(certificate) > MAX_CERTIFICATE_BYTES:
        raise CodecError(f"member seal holds a certificate over {MAX_CERTIFICATE_BYTES} bytes")
    return envelope, certificate


class SystemClock:
    """The DHT's clock: this machine's wall time (records expire on it)."""

    def wall(self) -> float:
        return time.time()

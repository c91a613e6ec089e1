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
open), which the DHT reports as a record refused by the ``seal`` rule.

:class:`SystemClock` is the DHT's :class:`~atoll.dht.directory.Clock` for real peers:
this machine's wall time, on which records are stamped and expire.
"""

from __future__ import annotations

import time

from atoll.dht.records import MAX_SEAL_OVERHEAD
from atoll.security.identity import Identity
from atoll.security.signing import SignedEnvelope, open_envelope, seal, signer_peer_id

__all__ = ["EnvelopeSigner", "EnvelopeVerifier", "SystemClock"]


class EnvelopeSigner:
    """A :class:`~atoll.dht.records.RecordSigner`: seals with ``identity``'s Ed25519 key."""

    __slots__ = ("_identity",)

    def __init__(self, identity: Identity) -> None:
        self._identity = identity

    @property
    def peer_id(self) -> str:
        """The peer id every seal of this signer names."""
        return self._identity.peer_id

    def seal(self, domain: str, payload: bytes) -> bytes:
        """``payload`` in an envelope for ``domain`` signed by the identity, as bytes."""
        return seal(self._identity, domain, payload).to_bytes()


class EnvelopeVerifier:
    """A :class:`~atoll.dht.records.RecordVerifier` for :class:`EnvelopeSigner`'s seals.

    Stateless: any peer's envelope opens if its signature verifies; that the signer is
    the peer a record is about is :func:`atoll.dht.records.decode_value`'s check.
    """

    __slots__ = ()

    def open(self, data: bytes, *, domain: str, max_payload: int) -> tuple[bytes, str]:
        """The payload sealed in ``data`` and the peer id of its signer.

        Raises :class:`~atoll.protocol.errors.CodecError` when ``data`` is not one
        envelope of at most ``max_payload + MAX_SEAL_OVERHEAD`` bytes, and
        :class:`~atoll.security.signing.BadSignature` when it is for another domain, its
        payload is over ``max_payload`` or its signature does not verify.
        """
        env = SignedEnvelope.from_bytes(data, max_bytes=max_payload + MAX_SEAL_OVERHEAD)
        return open_envelope(env, domain=domain, max_payload=max_payload), signer_peer_id(env)


class SystemClock:
    """The DHT's clock: this machine's wall time (records expire on it)."""

    def wall(self) -> float:
        return time.time()

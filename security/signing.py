"""Signed envelopes: a payload, what kind of payload it is, and who vouches for it.

Records put in the DHT and messages relayed through other peers arrive from someone other
than their author, so their author signs them. A :class:`SignedEnvelope` carries

- ``domain``: what the payload is (``"atoll/peer-record/v1"``); the signature covers it,
  so a signature made for one domain never verifies for another and a peer record cannot
  be replayed as, say, a round vote;
- ``payload``: the bytes signed, opaque here (usually a msgpack-encoded message);
- ``public_key``: the signer's raw Ed25519 key (its peer id is :func:`signer_peer_id`);
- ``signature``: Ed25519 over the canonical bytes::

      b"atoll-signed-envelope\\0" | u16 len(domain) | domain | u64 len(payload) | payload

  (lengths big-endian). The fixed prefix keeps these signatures apart from anything else
  the same key signs (libp2p's Noise handshake and its own signed peer records);
  the length prefixes make the split between domain and payload unambiguous.

:func:`seal` makes an envelope; :func:`open_envelope` is the one door back to the payload:
it checks the expected domain, the payload size limit the caller gives, optionally the
expected signer, and the signature, and raises :class:`BadSignature` with the reason
otherwise. On the wire an envelope is the msgpack array ``[1, domain, payload,
public_key, signature]`` (:meth:`SignedEnvelope.to_bytes`); :meth:`SignedEnvelope.from_bytes`
refuses anything else with :class:`~atoll.protocol.errors.CodecError`.

Domains are 1 to 128 characters of ``A-Z a-z 0-9 . _ / : -``, compared exactly; the
convention is ``atoll/<what>/v<version>``.

Errors::

    RejectedInput (atoll.protocol.errors)
    └── BadSignature   an envelope that must not be trusted (wrong domain or signer,
                       payload over the limit, signature that does not verify)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.security.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    peer_id_from_public_key,
)

__all__ = [
    "ENVELOPE_VERSION",
    "MAX_DOMAIN_CHARS",
    "MAX_ENVELOPE_BYTES",
    "BadSignature",
    "SignedEnvelope",
    "open_envelope",
    "seal",
    "signer_peer_id",
]

ENVELOPE_VERSION: int = 1
"""Version of the envelope's wire form and of its signed bytes."""

MAX_DOMAIN_CHARS: int = 128
"""Longest domain string."""

MAX_ENVELOPE_BYTES: int = 1 << 20
"""Largest encoded envelope :meth:`SignedEnvelope.from_bytes` accepts by default (1 MiB)."""

_SIGNING_PREFIX = b"atoll-signed-envelope\0"
_DOMAIN_RE = re.compile(r"[A-Za-z0-9._/:-]+")
_FIELDS = 5  # version, domain, payload, public_key, signature


class BadSignature(RejectedInput):
    """An envelope that must not be trusted: for another domain or signer, a payload over
    the limit, or a signature that does not verify. Hostile or broken input: drop it and
    count it against the peer that sent it; never retry it as is."""


def _check_domain(domain: object) -> str | None:
    """Why ``domain`` is not a valid domain, or None when it is."""
    if not isinstance(domain, str):
        return f"domain is {type(domain).__name__}, not str"
    if not 0 < len(domain) <= MAX_DOMAIN_CHARS:
        return f"domain has {len(domain)} characters, expected 1 to {MAX_DOMAIN_CHARS}"
    if not _DOMAIN_RE.fullmatch(domain):
        return f"domain {domain!r} has characters outside A-Z a-z 0-9 . _ / : -"
    return None


@dataclass(frozen=True, slots=True)
class SignedEnvelope:
    """A payload signed by an Ed25519 key for one domain. See the module docstring.

    Construction checks only the shape (types, key and signature lengths, domain syntax;
    :class:`~atoll.protocol.errors.CodecError` otherwise). Nothing in an envelope is
    trusted before :func:`open_envelope` returns its payload.
    """

    domain: str
    payload: bytes
    public_key: bytes
    signature: bytes

    def __post_init__(self) -> None:
        reason = _check_domain(self.domain)
        if reason is not None:
            raise CodecError(f"envelope: {reason}")
        for name, value, size in (
            ("payload", self.payload, None),
            ("public_key", self.public_key, PUBLIC_KEY_BYTES),
            ("signature", self.signature, SIGNATURE_BYTES),
        ):
            if not isinstance(value, bytes):
                raise CodecError(f"envelope: {name} is {type(value).__name__}, not bytes")
            if size is not None and len(value) != size:
                raise CodecError(f"envelope: {name} is {len(value)} bytes, expected {size}")

    def to_bytes(self) -> bytes:
        """The wire form: msgpack ``[ENVELOPE_VERSION, domain, payload, public_key,
        signature]``."""
        packed: bytes = msgpack.packb(
            [ENVELOPE_VERSION, self.domain, self.payload, self.public_key, self.signature],
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_bytes(
        cls, data: bytes | memoryview, *, max_bytes: int = MAX_ENVELOPE_BYTES
    ) -> SignedEnvelope:
        """The envelope encoded in ``data`` (exactly one, nothing after it).

        Size, version, field count and every field's type and length are checked;
        anything else raises :class:`~atoll.protocol.errors.CodecError`. The signature
        is *not* checked here: that is :func:`open_envelope`'s job.
        """
        try:
            size = memoryview(data).nbytes
        except TypeError:
            raise CodecError(f"an envelope is bytes, not {type(data).__name__}") from None
        if size > max_bytes:
            raise CodecError(f"envelope of {size} bytes is over the limit of {max_bytes} bytes")
        try:
            # an envelope holds no map and no array but its own five fields: limits that
            # say so keep a hostile megabyte of tiny maps or array headers (a "msgpack
            # bomb", ~80 bytes of Python objects per byte) from being built at all
            fields = msgpack.unpackb(
                data,
                raw=False,
                use_list=False,
                strict_map_key=True,
                max_map_len=0,
                max_array_len=_FIELDS,
                max_ext_len=0,
            )
        except Exception as e:  # hostile bytes may raise anything msgpack has; none escapes
            raise CodecError(f"envelope is not valid msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(fields, tuple) or len(fields) != _FIELDS:
            raise CodecError(f"envelope is not an array of {_FIELDS} fields")
        version, domain, payload, public_key, signature = fields
        if isinstance(version, bool) or not isinstance(version, int):
            raise CodecError(f"envelope version is {type(version).__name__}, not int")
        if version != ENVELOPE_VERSION:
            raise CodecError(
                f"envelope version {version}; this peer reads version {ENVELOPE_VERSION}"
            )
        return cls(domain, payload, public_key, signature)


def _signed_bytes(domain: str, payload: bytes) -> bytes:
    """The exact bytes an envelope's signature covers (see the module docstring)."""
    d = domain.encode("ascii")
    return b"".join(
        (_SIGNING_PREFIX, len(d).to_bytes(2, "big"), d, len(payload).to_bytes(8, "big"), payload)
    )


def seal(identity: Identity, domain: str, payload: bytes) -> SignedEnvelope:
    """``payload`` signed by ``identity`` for ``domain``.

    Raises :class:`~atoll.protocol.errors.ConfigError` for a malformed domain or a payload
    that is not ``bytes``: these are the caller's mistakes, not a peer's.
    """
    reason = _check_domain(domain)
    if reason is not None:
        raise ConfigError(reason)
    if not isinstance(payload, bytes):
        raise ConfigError(f"payload is {type(payload).__name__}, not bytes")
    signature = identity.sign(_signed_bytes(domain, payload))
    return SignedEnvelope(domain, payload, identity.public_key, signature)


def open_envelope(
    env: SignedEnvelope,
    *,
    domain: str,
    max_payload: int,
    signer: str | None = None,
) -> bytes:
    """The payload of ``env``, once it is proven to be what the caller expects.

    Checks, in order: ``env`` is for ``domain``; its payload is at most ``max_payload``
    bytes; if ``signer`` (a peer id) is given, ``env`` was signed by that peer; the
    Ed25519 signature verifies over the domain and payload. Any failure raises
    :class:`BadSignature` saying which. A bad ``domain`` or ``max_payload`` argument is
    the caller's mistake and raises :class:`~atoll.protocol.errors.ConfigError`.
    """
    reason = _check_domain(domain)
    if reason is not None:
        raise ConfigError(f"expected {reason}")
    if isinstance(max_payload, bool) or not isinstance(max_payload, int) or max_payload < 0:
        raise ConfigError(f"max_payload must be a non-negative int, not {max_payload!r}")
    if not isinstance(env, SignedEnvelope):
        raise BadSignature(f"expected a SignedEnvelope, not {type(env).__name__}")
    if env.domain != domain:
        raise BadSignature(f"envelope is for domain {env.domain!r}, expected {domain!r}")
    if len(env.payload) > max_payload:
        raise BadSignature(
            f"{domain} payload of {len(env.payload)} bytes is over the limit of {max_payload} bytes"
        )
    if signer is not None and signer_peer_id(env) != signer:
        raise BadSignature(f"{domain} envelope is signed by {signer_peer_id(env)}, not {signer}")
    try:
        key = Ed25519PublicKey.from_public_bytes(env.public_key)
        key.verify(env.signature, _signed_bytes(env.domain, env.payload))
    except (InvalidSignature, ValueError):
        raise BadSignature(
            f"{domain} envelope signature does not verify for signer {signer_peer_id(env)}"
        ) from None
    return env.payload


def signer_peer_id(env: SignedEnvelope) -> str:
    """The peer id of the key that claims to have signed ``env``.

    A claim only, until :func:`open_envelope` has verified the signature.
    """
    return peer_id_from_public_key(env.public_key)

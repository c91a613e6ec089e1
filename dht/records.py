"""Typed, signed, expiring DHT records, and the rules a record must pass to be used.

Five records, each a wire message (:func:`atoll.protocol.messages.wire_message`) stored
under the key :mod:`atoll.dht.keys` gives it:

- :class:`PeerRecord`  who a peer is: addresses, agent, throughput, per-fragment versions;
- :class:`ReadyRecord` a :class:`~atoll.protocol.matchmaking.Declaration` with a lifetime:
  the peer is ready to average one fragment's sync slot;
- :class:`StateRecord` the peer can serve one fragment's global state at a version;
- :class:`AttestationRecord` the peer's signed attestation that its round committed one
  fragment's version (:class:`~atoll.protocol.certificate.Attestation`): a quorum of
  them, from distinct members, certifies that state;
- :class:`EvidenceRecord` the peer's evidence that other peers forged claims: their own
  sealed :class:`PeerRecord` values, each declaring a state no certificate vouches for
  (:func:`open_claim` opens one; whether it is a forgery is the reader's to judge against
  what it believes).

A stored DHT value is the record's wire bytes *sealed* by its publisher
(:class:`RecordSigner`): :func:`encode_value` checks and seals, :func:`decode_value`
opens (:class:`RecordVerifier`), decodes and applies :func:`validate`. The signature
scheme is not chosen here (:mod:`atoll.security` provides it and the node injects it);
this module only requires that the peer who sealed a record is the peer the record is
about, so a peer publishes for itself alone.

The rules, each refused with a :class:`RejectedRecord` whose :attr:`~RejectedRecord.rule`
names it:

- ``size``: the record encodes to more than :data:`MAX_RECORD_BYTES` (4 KiB), or the sealed
  value to more than :data:`MAX_VALUE_BYTES`;
- ``malformed``: a field of the wrong type or out of range (base58 peer id, 64 hex digit
  run id, hex digests, printable addresses and agent, counts and rates >= 0), a
  ``PeerRecord`` whose ``versions`` and ``digests`` differ in length, bytes that do not
  decode, a message that is not a DHT record;
- ``key``: the key is not a record key, or names another kind of record, peer, fragment or
  slot than the record; ``run``: the record's run id does not start with the key's run tag;
- ``ttl``: ``expires_at`` is not after ``issued_at``, or more than :data:`MAX_TTL_S` after;
- ``future``: ``issued_at`` is more than ``max_skew_s`` ahead of the reader's clock;
- ``expired``: the reader's clock has reached ``expires_at``;
- ``seal``: the verifier refused to open the value (a bad or foreign signature, or a
  payload over :data:`MAX_RECORD_BYTES`); ``signer``: the sealing peer is not the record's
  ``peer_id``.

Time. Expiry is the one place atoll compares wall clocks of different machines. A record
carries its publisher's wall time; the reader passes its own as ``now``. Clocks are
assumed to agree within ``max_skew_s`` (:data:`DEFAULT_MAX_SKEW_S`, 30 s), which bounds how
far a record may claim to come from the future, and so how long past its publisher's
intent it can live: at most ``MAX_TTL_S + max_skew_s``. A publisher whose clock runs
behind sees its records expire early at the others, so publishers refresh at intervals
well below the TTL (half of it, say), and the TTL must exceed the skew. Among records for
one key the latest ``issued_at`` wins (:func:`is_newer`, :func:`select_value`); on a tie
the one already held stays, so a replayed copy never displaces anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias

from atoll.dht.keys import (
    MAX_FRAGMENT,
    MAX_PEER_ID_LEN,
    MAX_SLOT,
    RUN_ID_LEN,
    AttestKey,
    EvidenceKey,
    PeerKey,
    ReadyKey,
    StateKey,
    attest_key,
    check_peer_id,
    check_run_id,
    evidence_key,
    parse_key,
    peer_key,
    ready_key,
    state_key,
)
from atoll.protocol.certificate import MAX_ATTESTATION_BYTES
from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.matchmaking import Declaration
from atoll.protocol.messages import decode_message, encode_message, wire_message

__all__ = [
    "DEFAULT_MAX_SKEW_S",
    "MAX_ADDRS",
    "MAX_ADDR_LEN",
    "MAX_AGENT_LEN",
    "MAX_CLAIMS",
    "MAX_CLAIM_BYTES",
    "MAX_DIGEST_LEN",
    "MAX_FRAGMENTS",
    "MAX_RECORD_BYTES",
    "MAX_SEAL_OVERHEAD",
    "MAX_TTL_S",
    "MAX_VALUE_BYTES",
    "RECORD_DOMAIN",
    "AttestationRecord",
    "EvidenceRecord",
    "PeerRecord",
    "ReadyRecord",
    "Record",
    "RecordSigner",
    "RecordVerifier",
    "RejectedRecord",
    "Rule",
    "StateRecord",
    "check_record",
    "decode_value",
    "encode_value",
    "is_newer",
    "open_claim",
    "select_value",
    "validate",
]

MAX_RECORD_BYTES: int = 4096
"""Most bytes of a record's wire encoding (the payload that gets sealed)."""

MAX_SEAL_OVERHEAD: int = 512
"""Most bytes a seal may add to the payload (an Ed25519 seal needs about 100)."""

MAX_VALUE_BYTES: int = MAX_RECORD_BYTES + MAX_SEAL_OVERHEAD
"""Most bytes of a stored DHT value; larger values are refused before any crypto."""

MAX_TTL_S: float = 600.0
"""Longest lifetime of a record, ``expires_at - issued_at``, in seconds."""

DEFAULT_MAX_SKEW_S: float = 30.0
"""How far apart the wall clocks of two peers may be, in seconds."""

RECORD_DOMAIN: str = "atoll/dht/record/v1"
"""Signature domain of DHT records: a seal made for another purpose never opens here."""

MAX_ADDRS: int = 16
"""Most multiaddrs in a :class:`PeerRecord`."""

MAX_ADDR_LEN: int = 256
"""Most characters of one multiaddr."""

MAX_AGENT_LEN: int = 64
"""Most characters of an agent string such as ``atoll/0.1.0``."""

MAX_DIGEST_LEN: int = 128
"""Most hex digits of a fragment digest (the matchmaking limit)."""

MAX_FRAGMENTS: int = 256
"""Most items of ``versions`` and ``digests`` on the wire; the 4 KiB total usually binds
first (about 50 fragments with sha256 digests)."""

Rule: TypeAlias = Literal[
    "malformed",
    "size",
    "key",
    "run",
    "ttl",
    "future",
    "expired",
    "seal",
    "signer",
    "capacity",
]
"""Which rule refused a record; ``capacity`` is :class:`~atoll.dht.directory.PeerDirectory`
being full."""

_HEX = re.compile("[0-9a-f]*")
_ADDR = re.compile("/[\x21-\x7e]*")  # printable ASCII, no spaces: safe in logs and status
_AGENT = re.compile("[\x20-\x7e]*")


class RejectedRecord(RejectedInput):
    """A DHT record (or value) that must not be used; :attr:`rule` says which rule failed.

    A peer that publishes such records is misbehaving or badly out of sync; it is the
    node's call whether to strike it. The message is safe to log (values are clipped).
    """

    rule: Rule
    """the rule that failed"""
    reason: str
    """what was wrong, in words"""

    def __init__(self, rule: Rule, reason: str) -> None:
        super().__init__(f"record refused ({rule}): {reason}")
        self.rule = rule
        self.reason = reason


# -- the records ------------------------------------------------------------------------------
_PEER = {"max_len": MAX_PEER_ID_LEN}
_RUN = {"max_len": RUN_ID_LEN}
_DIGEST = {"max_len": MAX_DIGEST_LEN}


REACHES = ("", "public", "private", "unknown")
"""the values of :attr:`PeerRecord.reach`"""


@wire_message(100)
@dataclass(frozen=True, slots=True)
class PeerRecord:
    """What a peer says about itself: how to reach it and where its training stands.

    ``versions[i]`` and ``digests[i]`` are the global version and digest of fragment ``i``
    as the peer holds them, so a newcomer can tell whom to fetch state from and an
    operator can see who lags. ``tokens_per_s`` is self-reported and informative only:
    nothing that decides a round may trust it.
    """

    peer_id: str = field(metadata=_PEER)
    """the publisher's libp2p peer id (base58)"""
    run_id: str = field(metadata=_RUN)
    """the run it trains in (64 hex digits)"""
    addrs: tuple[str, ...] = field(metadata={"max_len": MAX_ADDRS, "item_max_len": MAX_ADDR_LEN})
    """multiaddrs it listens on, e.g. ``/ip4/203.0.113.7/tcp/4001``"""
    agent: str = field(metadata={"max_len": MAX_AGENT_LEN})
    """its software and version, e.g. ``atoll/0.1.0``"""
    tokens_per_s: float
    """its recent training throughput (self-reported)"""
    versions: tuple[int, ...] = field(metadata={"max_len": MAX_FRAGMENTS})
    """per fragment: the global version it holds"""
    digests: tuple[str, ...] = field(
        metadata={"max_len": MAX_FRAGMENTS, "item_max_len": MAX_DIGEST_LEN}
    )
    """per fragment: hex digest of its global copy ("" while unknown)"""
    serving: bool
    """whether it answers requests for global state"""
    issued_at: float
    """publisher's wall time at publication (seconds since the epoch)"""
    expires_at: float
    """publisher's wall time after which the record is void"""
    training: bool = True
    """False once its trainer stopped (the node settles or leaves): it still holds and
    serves its global copy, but joins no more groups, so it counts toward no quorum"""
    reach: str = field(default="", metadata={"max_len": 16})
    """whether peers can dial it (:mod:`~atoll.protocol.reachability`): ``public``,
    ``private`` (behind a NAT or a firewall: it dials out only), ``unknown``, or empty
    before its check. Self-reported: a peer that claims ``public`` falsely only fails its
    own rounds; one that claims ``private`` is grouped with fewer peers"""
    step: int = -1
    """the inner step its trainer had reached at publication (-1: not known), so that a
    node resuming from a checkpoint or joining starts near the swarm's step instead of
    finding the slots of its old step passed (self-reported: nothing that decides a round
    trusts it; a peer that lies about it moves nobody further than the median)"""

    def key(self) -> str:
        """The DHT key this record is stored under."""
        return peer_key(self.run_id, self.peer_id)


@wire_message(101)
@dataclass(frozen=True, slots=True)
class ReadyRecord:
    """A matchmaking :class:`~atoll.protocol.matchmaking.Declaration` with a lifetime.

    The first eight fields are the declaration's, in its order; see it for their meaning.
    """

    run_id: str = field(metadata=_RUN)
    fragment: int
    slot: int
    peer_id: str = field(metadata=_PEER)
    version: int
    digest: str = field(metadata=_DIGEST)
    weight: float
    declared_at: float
    issued_at: float
    """publisher's wall time at publication"""
    expires_at: float
    """publisher's wall time after which the record is void"""

    @classmethod
    def from_declaration(
        cls, declaration: Declaration, *, issued_at: float, expires_at: float
    ) -> ReadyRecord:
        """The record that publishes ``declaration`` from ``issued_at`` to ``expires_at``."""
        d = declaration
        return cls(
            d.run_id,
            d.fragment,
            d.slot,
            d.peer_id,
            d.version,
            d.digest,
            d.weight,
            d.declared_at,
            issued_at,
            expires_at,
        )

    def to_declaration(self) -> Declaration:
        """The declaration this record publishes, for the matchmaker."""
        return Declaration(
            self.run_id,
            self.fragment,
            self.slot,
            self.peer_id,
            self.version,
            self.digest,
            self.weight,
            self.declared_at,
        )

    def key(self) -> str:
        """The DHT key this record is stored under."""
        return ready_key(self.run_id, self.fragment, self.slot, self.peer_id)


@wire_message(102)
@dataclass(frozen=True, slots=True)
class StateRecord:
    """The peer can serve the global state of ``fragment`` at ``version``.

    ``digest`` (hex, not empty) lets the fetcher check what it downloaded.
    """

    peer_id: str = field(metadata=_PEER)
    """the publisher's libp2p peer id (base58)"""
    run_id: str = field(metadata=_RUN)
    """the run it trains in (64 hex digits)"""
    fragment: int
    """the fragment index"""
    version: int
    """the global version it serves"""
    digest: str = field(metadata=_DIGEST)
    """hex digest of the global copy it serves"""
    issued_at: float
    """publisher's wall time at publication"""
    expires_at: float
    """publisher's wall time after which the record is void"""

    def key(self) -> str:
        """The DHT key this record is stored under."""
        return state_key(self.run_id, self.fragment, self.peer_id)


MAX_SEALED_ATTESTATION: int = MAX_ATTESTATION_BYTES + MAX_SEAL_OVERHEAD
"""Most bytes of the sealed attestation an :class:`AttestationRecord` carries."""


@wire_message(103)
@dataclass(frozen=True, slots=True)
class AttestationRecord:
    """The peer's sealed attestation of ``fragment`` at ``version`` with ``digest``.

    ``attestation`` is :func:`~atoll.protocol.certificate.seal_attestation`'s output,
    signed on its own (domain ``atoll/state-attestation/v1``), so a certificate gathered
    from these records can be handed on and checked without the DHT. ``version`` and
    ``digest`` repeat what it attests, so a reader picks the records of one state before
    opening any seal; a record whose attestation says otherwise is refused by the reader's
    certificate check, not here (the record rules check no second signature).
    """

    peer_id: str = field(metadata=_PEER)
    """the publisher (and signer of the attestation)"""
    run_id: str = field(metadata=_RUN)
    """the run it trains in (64 hex digits)"""
    fragment: int
    """the fragment index"""
    version: int
    """the version the attested round made"""
    digest: str = field(metadata=_DIGEST)
    """hex digest of that state"""
    attestation: bytes = field(metadata={"max_len": MAX_SEALED_ATTESTATION})
    """the sealed :class:`~atoll.protocol.certificate.Attestation`"""
    issued_at: float
    """publisher's wall time at publication"""
    expires_at: float
    """publisher's wall time after which the record is void"""

    def key(self) -> str:
        """The DHT key this record is stored under."""
        return attest_key(self.run_id, self.fragment, self.version, self.peer_id)


MAX_CLAIMS: int = 3
"""Most forged claims one :class:`EvidenceRecord` carries."""

MAX_CLAIM_BYTES: int = 1200
"""Most bytes of one claim (a sealed PeerRecord value) in an :class:`EvidenceRecord`:
three fit the 4 KiB record limit; a larger record is not shared as evidence."""


@wire_message(104)
@dataclass(frozen=True, slots=True)
class EvidenceRecord:
    """Evidence, published by the accuser ``peer_id``, that other peers forged claims.

    Each claim is an offender's own sealed :class:`PeerRecord` value, as the offender
    published it under its peer key, so a reader checks the offender's signature itself
    (:func:`open_claim`) and needs to trust the accuser for nothing: whether the claim is
    a forgery (a version far past anything certified) it judges against its own beliefs.
    The rules check the record's own fields only; a claim that does not open is the
    reader's to drop.
    """

    peer_id: str = field(metadata=_PEER)
    """the accuser (the publisher)"""
    run_id: str = field(metadata=_RUN)
    """the run it trains in (64 hex digits)"""
    claims: tuple[bytes, ...] = field(
        metadata={"max_len": MAX_CLAIMS, "item_max_len": MAX_CLAIM_BYTES}
    )
    """offenders' sealed PeerRecord values, newest first"""
    issued_at: float
    """publisher's wall time at publication"""
    expires_at: float
    """publisher's wall time after which the record is void"""

    def key(self) -> str:
        """The DHT key this record is stored under."""
        return evidence_key(self.run_id, self.peer_id)


Record: TypeAlias = PeerRecord | ReadyRecord | StateRecord | AttestationRecord | EvidenceRecord
"""Any DHT record."""

_RECORD_TYPES = (PeerRecord, ReadyRecord, StateRecord, AttestationRecord, EvidenceRecord)
_KEY_TYPES: dict[type, type] = {
    PeerRecord: PeerKey,
    ReadyRecord: ReadyKey,
    EvidenceRecord: EvidenceKey,
    StateRecord: StateKey,
    AttestationRecord: AttestKey,
}


# -- signatures -------------------------------------------------------------------------------
class RecordSigner(Protocol):
    """Seals record bytes with the local peer's identity (implemented by atoll.security)."""

    def seal(self, domain: str, payload: bytes) -> bytes:
        """``payload`` bound to ``domain`` and signed by the local peer, as one byte string."""
        ...


class RecordVerifier(Protocol):
    """Opens sealed bytes and says who sealed them (implemented by atoll.security)."""

    def open(self, data: bytes, *, domain: str, max_payload: int) -> tuple[bytes, str]:
        """The payload sealed in ``data`` and the base58 peer id of the peer that sealed it.

        Must refuse, with a :class:`~atoll.protocol.errors.RejectedInput`, a seal that does
        not verify, one made for another ``domain``, and a payload over ``max_payload``
        bytes (before spending work on it).
        """
        ...


# -- the rules --------------------------------------------------------------------------------
def _clip(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _index_problem(name: str, value: int, limit: int) -> str | None:
    return None if 0 <= value <= limit else f"{name} {value} is outside [0, {limit}]"


def _digest_problem(name: str, digest: str, *, empty: bool) -> str | None:
    if _HEX.fullmatch(digest) is None:
        return f"{name} {_clip(digest)} is not lowercase hex"
    if not digest and not empty:
        return f"{name} is empty"
    return None


def _peer_problem(r: PeerRecord) -> str | None:
    if r.reach not in REACHES:
        return f"reach {_clip(r.reach)} is not one of {REACHES}"
    if r.tokens_per_s < 0:
        return f"tokens_per_s {r.tokens_per_s} is negative"
    if r.step < -1:
        return f"step {r.step} is below -1"
    if _AGENT.fullmatch(r.agent) is None:
        return f"agent {_clip(r.agent)} is not printable ASCII"
    for addr in r.addrs:
        if _ADDR.fullmatch(addr) is None:
            return f"address {_clip(addr)} is not a printable multiaddr starting with '/'"
    if len(r.versions) != len(r.digests):
        return f"{len(r.versions)} versions but {len(r.digests)} digests"
    for i, (version, digest) in enumerate(zip(r.versions, r.digests, strict=True)):
        if version < 0:
            return f"versions[{i}] {version} is negative"
        problem = _digest_problem(f"digests[{i}]", digest, empty=True)
        if problem is not None:
            return problem
    return None


def _ready_problem(r: ReadyRecord) -> str | None:
    return (
        _index_problem("fragment", r.fragment, MAX_FRAGMENT)
        or _index_problem("slot", r.slot, MAX_SLOT)
        or _index_problem("version", r.version, 2**63 - 1)
        or _digest_problem("digest", r.digest, empty=True)
        or (f"weight {r.weight} is negative" if r.weight < 0 else None)
    )


def _state_problem(r: StateRecord) -> str | None:
    return (
        _index_problem("fragment", r.fragment, MAX_FRAGMENT)
        or _index_problem("version", r.version, 2**63 - 1)
        or _digest_problem("digest", r.digest, empty=False)
    )


def _attestation_problem(r: AttestationRecord) -> str | None:
    return (
        _index_problem("fragment", r.fragment, MAX_FRAGMENT)
        or _index_problem("version", r.version, MAX_SLOT)
        or (None if r.version >= 1 else "version 0 (the seed) is never attested")
        or _digest_problem("digest", r.digest, empty=False)
        or (None if r.attestation else "attestation is empty")
    )


def _checked_payload(record: object) -> bytes:
    """The wire bytes of ``record`` once every rule that needs no key or clock holds."""
    if not isinstance(record, _RECORD_TYPES):
        raise RejectedRecord("malformed", f"{type(record).__name__} is not a DHT record")
    try:
        payload = encode_message(record)  # every field's type, range and length
        check_peer_id(record.peer_id)
        check_run_id(record.run_id)
    except CodecError as e:
        raise RejectedRecord("malformed", str(e)) from e
    if len(payload) > MAX_RECORD_BYTES:
        raise RejectedRecord(
            "size", f"record encodes to {len(payload)} bytes, over {MAX_RECORD_BYTES}"
        )
    if isinstance(record, PeerRecord):
        problem = _peer_problem(record)
    elif isinstance(record, ReadyRecord):
        problem = _ready_problem(record)
    elif isinstance(record, AttestationRecord):
        problem = _attestation_problem(record)
    elif isinstance(record, EvidenceRecord):
        problem = None if record.claims and all(record.claims) else "no claims, or an empty one"

    else:
        problem = _state_problem(record)
    if problem is not None:
        raise RejectedRecord("malformed", f"{type(record).__name__}: {problem}")
    if not record.expires_at > record.issued_at:
        raise RejectedRecord(
            "ttl", f"expires_at {record.expires_at} is not after issued_at {record.issued_at}"
        )
    if record.expires_at - record.issued_at > MAX_TTL_S:
        raise RejectedRecord(
            "ttl",
            f"lifetime {record.expires_at - record.issued_at:.1f} s is over {MAX_TTL_S:.0f} s",
        )
    return payload


def _check_clock(now: float, max_skew_s: float) -> None:
    """Refuse a caller's clock arguments that no record could be checked against."""
    if not isinstance(now, int | float) or isinstance(now, bool) or not math.isfinite(now):
        raise ConfigError(f"now must be a finite number, not {now!r}")
    if (
        not isinstance(max_skew_s, int | float)
        or isinstance(max_skew_s, bool)
        or not math.isfinite(max_skew_s)
        or max_skew_s < 0
    ):
        raise ConfigError(f"max_skew_s must be finite and >= 0, not {max_skew_s!r}")


def _check_time(record: Record, now: float, max_skew_s: float) -> None:
    if record.issued_at > now + max_skew_s:
        raise RejectedRecord(
            "future",
            f"issued_at is {record.issued_at - now:.1f} s ahead of this clock,"
            f" more than the {max_skew_s:.0f} s skew allowed",
        )
    if now >= record.expires_at:
        raise RejectedRecord("expired", f"expired {now - record.expires_at:.1f} s ago")


def _check_key(record: Record, key: str) -> None:
    try:
        parsed = parse_key(key)
    except CodecError as e:
        raise RejectedRecord("key", str(e)) from e
    name = type(record).__name__
    if not isinstance(parsed, _KEY_TYPES[type(record)]):
        raise RejectedRecord("key", f"a {name} cannot be stored under {_clip(key)}")
    if not record.run_id.startswith(parsed.run_tag):
        raise RejectedRecord(
            "run",
            f"the {name} is of run {record.run_id[:12]}, the key of run {parsed.run_tag[:12]}",
        )
    if parsed.peer_id != record.peer_id:
        raise RejectedRecord(
            "key", f"the {name} is about peer {record.peer_id}, the key names {parsed.peer_id}"
        )
    if isinstance(parsed, ReadyKey | StateKey | AttestKey):
        assert isinstance(record, ReadyRecord | StateRecord | AttestationRecord)
        if parsed.fragment != record.fragment:
            raise RejectedRecord(
                "key", f"the {name} is for fragment {record.fragment}, the key {parsed.fragment}"
            )
    if isinstance(parsed, ReadyKey):
        assert isinstance(record, ReadyRecord)
        if parsed.slot != record.slot:
            raise RejectedRecord(
                "key", f"the {name} is for slot {record.slot}, the key for slot {parsed.slot}"
            )
    if isinstance(parsed, AttestKey):
        assert isinstance(record, AttestationRecord)
        if parsed.version != record.version:
            raise RejectedRecord(
                "key",
                f"the {name} is for version {record.version}, the key for {parsed.version}",
            )


def check_record(record: Record, *, now: float, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
    """Every rule of :func:`validate` except the key's: for records not read from a key.

    Raises:
        RejectedRecord: a rule failed (see the module docstring).
        ConfigError: ``now`` or ``max_skew_s`` is not a finite number (``max_skew_s`` >= 0).
    """
    _check_clock(now, max_skew_s)
    _checked_payload(record)
    _check_time(record, now, max_skew_s)


def validate(
    record: Record, *, key: str, now: float, max_skew_s: float = DEFAULT_MAX_SKEW_S
) -> None:
    """Refuse ``record`` unless it may be used as the value of ``key`` at wall time ``now``.

    Checks the fields, the size, that ``key`` is this record's key (kind, run, peer,
    fragment, slot), the lifetime bound, that it is not from further in the future than
    ``max_skew_s``, and that it has not expired.

    Raises:
        RejectedRecord: a rule failed; its ``rule`` says which (see the module docstring).
        ConfigError: ``now`` or ``max_skew_s`` is not a finite number (``max_skew_s`` >= 0).
    """
    _check_clock(now, max_skew_s)
    _checked_payload(record)
    _check_key(record, key)
    _check_time(record, now, max_skew_s)


# -- values -----------------------------------------------------------------------------------
def encode_value(record: Record, signer: RecordSigner) -> bytes:
    """The DHT value that publishes ``record``: its wire bytes sealed by ``signer``.

    The rules that need no key or clock are checked first, so a peer never publishes what
    its peers would refuse; time is the caller's to get right (issue, then publish).

    Raises:
        RejectedRecord: the record breaks a rule, or the seal makes it too large.
    """
    payload = _checked_payload(record)
    sealed = signer.seal(RECORD_DOMAIN, payload)
    if len(sealed) > MAX_VALUE_BYTES:
        raise RejectedRecord(
            "size", f"sealed value of {len(sealed)} bytes is over {MAX_VALUE_BYTES}"
        )
    return sealed


def decode_value(
    data: bytes,
    *,
    key: str,
    now: float,
    verifier: RecordVerifier,
    max_skew_s: float = DEFAULT_MAX_SKEW_S,
) -> Record:
    """The record stored as ``data`` under ``key``, once it passed every rule.

    In order: the size, the seal (``verifier``), the wire decoding, that the sealing peer
    is the record's ``peer_id``, then :func:`validate`. Anything wrong raises
    :class:`RejectedRecord`, whatever the bytes are.

    Raises:
        RejectedRecord: the value must not be used; ``rule`` says why.
        ConfigError: ``now`` or ``max_skew_s`` is not a finite number.
    """
    _check_clock(now, max_skew_s)
    if not isinstance(data, bytes):
        raise RejectedRecord("malformed", f"a DHT value is bytes, not {type(data).__name__}")
    if len(data) > MAX_VALUE_BYTES:
        raise RejectedRecord("size", f"value of {len(data)} bytes is over {MAX_VALUE_BYTES}")
    try:
        payload, signer = verifier.open(data, domain=RECORD_DOMAIN, max_payload=MAX_RECORD_BYTES)
    except RejectedInput as e:
        raise RejectedRecord("seal", str(e)) from e
    if len(payload) > MAX_RECORD_BYTES:  # a verifier that ignored max_payload
        raise RejectedRecord("size", f"record of {len(payload)} bytes is over {MAX_RECORD_BYTES}")
    try:
        record = decode_message(payload, max_bytes=MAX_RECORD_BYTES)
    except CodecError as e:
        raise RejectedRecord("malformed", str(e)) from e
    if not isinstance(record, _RECORD_TYPES):
        raise RejectedRecord("malformed", f"a {type(record).__name__} is not a DHT record")
    if signer != record.peer_id:
        raise RejectedRecord(
            "signer", f"{_clip(signer)} sealed a record about {_clip(record.peer_id)}"
        )
    validate(record, key=key, now=now, max_skew_s=max_skew_s)
    return record


def is_newer(candidate: Record, held: Record) -> bool:
    """Whether ``candidate`` replaces ``held`` for the same key: a later ``issued_at``.

    On a tie the held record stays, so a replayed or re-served copy changes nothing.
    """
    return candidate.issued_at > held.issued_at


def select_value(
    values: Sequence[bytes],
    *,
    key: str,
    now: float,
    verifier: RecordVerifier,
    max_skew_s: float = DEFAULT_MAX_SKEW_S,
) -> int:
    """Index of the value to keep among ``values`` for ``key``: the newest valid record.

    The rule a DHT validator's ``select`` applies: invalid values never win; among valid
    ones the latest ``issued_at``, the earliest index on a tie (libp2p passes the held
    value first).

    Raises:
        RejectedRecord: no value is valid (the first value's refusal is raised).
        ConfigError: ``now`` or ``max_skew_s`` is not a finite number.
    """
    _check_clock(now, max_skew_s)
    best: tuple[int, Record] | None = None
    first_error: RejectedRecord | None = None
    for i, data in enumerate(values):
        try:
            record = decode_value(data, key=key, now=now, verifier=verifier, max_skew_s=max_skew_s)
        except RejectedRecord as e:
            first_error = first_error or e
            continue
        if best is None or is_newer(record, best[1]):
            best = (i, record)
    if best is None:
        raise first_error or RejectedRecord("malformed", "no values to select from")
    return best[0]


def open_claim(data: bytes, *, run_id: str, verifier: RecordVerifier) -> PeerRecord:
    """The :class:`PeerRecord` a claim of an :class:`EvidenceRecord` holds, once its seal
    opened and its signer is the record's peer, of run ``run_id``.

    Its lifetime is not checked: an expired record still proves what its signer said
    (the reader judges the claim against what it believes now).

    Raises:
        RejectedRecord: the claim is not a sealed PeerRecord of ``run_id`` by its peer.
    """
    if not isinstance(data, bytes) or len(data) > MAX_VALUE_BYTES:
        raise RejectedRecord("size", "a claim is bytes of a DHT value's size")
    try:
        payload, signer = verifier.open(data, domain=RECORD_DOMAIN, max_payload=MAX_RECORD_BYTES)
        record = decode_message(payload, max_bytes=MAX_RECORD_BYTES)
    except (RejectedInput, CodecError) as e:
        raise RejectedRecord("seal", str(e)) from e
    if not isinstance(record, PeerRecord):
        raise RejectedRecord(
            "malformed", f"a claim holds a PeerRecord, not {type(record).__name__}"
        )
    if signer != record.peer_id:
        raise RejectedRecord(
            "signer", f"{_clip(signer)} sealed a record about {_clip(record.peer_id)}"
        )
    if record.run_id != run_id:
        raise RejectedRecord("run", f"the claim is of run {record.run_id[:12]}")
    _checked_payload(record)
    return record

"""The DHT key schema: where each atoll record lives, and how a key is read back.

Every key starts with ``/atoll/v1/`` and a *run tag*, so records of different runs and of
future schema versions never share a key, and a libp2p ``NamespacedValidator`` sends every
atoll key to the one validator registered for the namespace ``atoll``. Two families:

*Record keys* hold one signed record each (``PUT_VALUE``/``GET_VALUE``)::

    /atoll/v1/<run_tag>/peer/<peer_id>                      a PeerRecord
    /atoll/v1/<run_tag>/ready/<fragment>/<slot>/<peer_id>   a ReadyRecord
    /atoll/v1/<run_tag>/state/<fragment>/<peer_id>          a StateRecord
    /atoll/v1/<run_tag>/cert/<fragment>/<version>/<peer_id> an AttestationRecord
    /atoll/v1/<run_tag>/evidence/<peer_id>                  an EvidenceRecord

*Topic keys* are rendezvous points that many peers announce themselves under as libp2p
*providers* (``ADD_PROVIDER``/``GET_PROVIDERS``); a reader lists the providers of a topic
and then fetches each one's record key::

    /atoll/v1/<run_tag>/peers                  every peer of the run
    /atoll/v1/<run_tag>/ready/<fragment>/<slot> peers ready for that sync
    /atoll/v1/<run_tag>/state/<fragment>       peers that can serve that fragment's state
    /atoll/v1/<run_tag>/cert/<fragment>/<version> peers that attested that version
    /atoll/v1/<run_tag>/evidence               peers that published evidence of a forgery

Why the peer id is part of every record key: a Kademlia key holds a single value (the
validator's ``select`` keeps one), so a key shared by all ready peers of a slot would keep
only the last writer. Why a run *tag* rather than the run id: py-libp2p refuses
``GET_VALUE`` and ``GET_PROVIDERS`` keys over 128 bytes and ``ADD_PROVIDER`` keys over 80,
and a 64-digit run id plus a peer id does not fit. The tag is the first
:data:`RUN_TAG_LEN` hex digits (128 bits) of the run id; records carry the full run id,
and :func:`atoll.dht.records.validate` checks that it starts with the key's tag.

Text rules, so that every key has exactly one spelling (``parse_key(k).key() == k``):
run ids are :data:`RUN_ID_LEN` lowercase hex digits; peer ids are base58 (the Bitcoin
alphabet libp2p uses), 1 to :data:`MAX_PEER_ID_LEN` characters; fragments and slots are
decimal without sign or leading zeros, at most :data:`MAX_FRAGMENT` and :data:`MAX_SLOT`.
Anything else raises :class:`~atoll.protocol.errors.CodecError`. The limits are chosen so
that the longest record key is :data:`MAX_KEY_BYTES` or less and the longest topic key
:data:`MAX_TOPIC_BYTES` or less (tests check both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeAlias

from atoll.protocol.errors import CodecError

__all__ = [
    "BASE58_ALPHABET",
    "KEY_PREFIX",
    "MAX_FRAGMENT",
    "MAX_KEY_BYTES",
    "MAX_PEER_ID_LEN",
    "MAX_SLOT",
    "MAX_TOPIC_BYTES",
    "NAMESPACE",
    "RUN_ID_LEN",
    "RUN_TAG_LEN",
    "AttestKey",
    "EvidenceKey",
    "PeerKey",
    "ReadyKey",
    "RecordKey",
    "StateKey",
    "attest_key",
    "attest_topic",
    "check_peer_id",
    "check_run_id",
    "evidence_key",
    "evidence_topic",
    "parse_key",
    "peer_key",
    "peers_topic",
    "ready_key",
    "ready_topic",
    "run_tag",
    "state_key",
    "state_topic",
]

NAMESPACE: str = "atoll"
"""The first key segment: the namespace a libp2p ``NamespacedValidator`` dispatches on."""

KEY_PREFIX: str = f"/{NAMESPACE}/v1/"
"""Start of every key; the ``v1`` changes when the schema does."""

RUN_ID_LEN: int = 64
"""Hex digits of a run id (a sha256, :meth:`atoll.protocol.manifest.RunManifest.run_id`)."""

RUN_TAG_LEN: int = 32
"""Hex digits of the run id kept in keys: 128 bits, so runs never collide in practice."""

MAX_PEER_ID_LEN: int = 61
"""Longest base58 peer id: an identity multihash (2 header bytes, a 42-byte key)."""

MAX_FRAGMENT: int = 0xFFFF
"""Largest fragment index in a key (5 digits)."""

MAX_SLOT: int = 0xFFFF_FFFF
"""Largest slot in a key (10 digits): billions of syncs of one fragment."""

MAX_KEY_BYTES: int = 128
"""Longest record key: py-libp2p refuses longer ``GET_VALUE`` keys."""

MAX_TOPIC_BYTES: int = 80
"""Longest topic key: py-libp2p refuses longer ``ADD_PROVIDER`` keys."""

BASE58_ALPHABET: str = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
"""The characters of a base58 peer id (no ``0``, ``O``, ``I``, ``l``)."""

# ASCII-only classes: str.isdigit() and \d would also accept other scripts' digits
_RUN_ID = re.compile(f"[0-9a-f]{{{RUN_ID_LEN}}}")
_RUN_TAG = re.compile(f"[0-9a-f]{{{RUN_TAG_LEN}}}")
_PEER_ID = re.compile(f"[{BASE58_ALPHABET}]{{1,{MAX_PEER_ID_LEN}}}")
_INDEX = re.compile("0|[1-9][0-9]{0,9}")


def _show(value: object) -> str:
    """A short, log-safe rendering of a refused value."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_run_id(run_id: object) -> str:
    """``run_id`` if it is :data:`RUN_ID_LEN` lowercase hex digits, else CodecError."""
    if not isinstance(run_id, str) or _RUN_ID.fullmatch(run_id) is None:
        raise CodecError(f"a run id is {RUN_ID_LEN} lowercase hex digits, not {_show(run_id)}")
    return run_id


def check_peer_id(peer_id: object) -> str:
    """``peer_id`` if it is base58 of 1 to :data:`MAX_PEER_ID_LEN` characters, else CodecError.

    Only the text is checked: whether it decodes as a multihash, and whose key it names, is
    for the transport and the record verifier to say.
    """
    if not isinstance(peer_id, str) or _PEER_ID.fullmatch(peer_id) is None:
        raise CodecError(
            f"a peer id is 1 to {MAX_PEER_ID_LEN} base58 characters, not {_show(peer_id)}"
        )
    return peer_id


def _check_index(name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise CodecError(f"a {name} is an int in [0, {limit}], not {_show(value)}")
    return int(value)  # a plain int: an int subclass may print otherwise


def run_tag(run_id: str) -> str:
    """The part of ``run_id`` that keys carry: its first :data:`RUN_TAG_LEN` hex digits."""
    return check_run_id(run_id)[:RUN_TAG_LEN]


def _parse_index(name: str, text: str, limit: int) -> int:
    if _INDEX.fullmatch(text) is None:
        raise CodecError(f"key {name} {_show(text)} is not a decimal without leading zeros")
    return _check_index(name, int(text), limit)


# -- record keys ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PeerKey:
    """The key of a peer's :class:`~atoll.dht.records.PeerRecord`."""

    run_tag: str
    peer_id: str

    def key(self) -> str:
        """The key text."""
        return f"{KEY_PREFIX}{self.run_tag}/peer/{self.peer_id}"


@dataclass(frozen=True, slots=True)
class ReadyKey:
    """The key of a peer's :class:`~atoll.dht.records.ReadyRecord` for one sync."""

    run_tag: str
    fragment: int
    slot: int
    peer_id: str

    def key(self) -> str:
        """The key text."""
        return f"{KEY_PREFIX}{self.run_tag}/ready/{self.fragment}/{self.slot}/{self.peer_id}"


@dataclass(frozen=True, slots=True)
class StateKey:
    """The key of a peer's :class:`~atoll.dht.records.StateRecord` for one fragment."""

    run_tag: str
    fragment: int
    peer_id: str

    def key(self) -> str:
        """The key text."""
        return f"{KEY_PREFIX}{self.run_tag}/state/{self.fragment}/{self.peer_id}"


@dataclass(frozen=True, slots=True)
class AttestKey:
    """The key of a peer's :class:`~atoll.dht.records.AttestationRecord` for one version
    of one fragment (its version is a slot: same bounds)."""

    run_tag: str
    fragment: int
    version: int
    peer_id: str

    def key(self) -> str:
        """The key text."""
        return f"{KEY_PREFIX}{self.run_tag}/cert/{self.fragment}/{self.version}/{self.peer_id}"


@dataclass(frozen=True, slots=True)
class EvidenceKey:
    """The key of a peer's :class:`~atoll.dht.records.EvidenceRecord` (the peer is the
    accuser, who publishes it)."""

    run_tag: str
    peer_id: str

    def key(self) -> str:
        """The key text."""
        return f"{KEY_PREFIX}{self.run_tag}/evidence/{self.peer_id}"


RecordKey: TypeAlias = PeerKey | ReadyKey | StateKey | AttestKey | EvidenceKey
"""A parsed record key."""


def peer_key(run_id: str, peer_id: str) -> str:
    """Where ``peer_id`` publishes its :class:`~atoll.dht.records.PeerRecord`."""
    return PeerKey(run_tag(run_id), check_peer_id(peer_id)).key()


def ready_key(run_id: str, fragment: int, slot: int, peer_id: str) -> str:
    """Where ``peer_id`` publishes that it is ready for ``fragment``'s sync ``slot``."""
    return ReadyKey(
        run_tag(run_id),
        _check_index("fragment", fragment, MAX_FRAGMENT),
        _check_index("slot", slot, MAX_SLOT),
        check_peer_id(peer_id),
    ).key()


def state_key(run_id: str, fragment: int, peer_id: str) -> str:
    """Where ``peer_id`` publishes that it can serve ``fragment``'s global state."""
    return StateKey(
        run_tag(run_id), _check_index("fragment", fragment, MAX_FRAGMENT), check_peer_id(peer_id)
    ).key()


def attest_key(run_id: str, fragment: int, version: int, peer_id: str) -> str:
    """Where ``peer_id`` publishes its attestation of ``fragment`` at ``version``."""
    return AttestKey(
        run_tag(run_id),
        _check_index("fragment", fragment, MAX_FRAGMENT),
        _check_index("version", version, MAX_SLOT),
        check_peer_id(peer_id),
    ).key()


def evidence_key(run_id: str, peer_id: str) -> str:
    """Where ``peer_id`` publishes its evidence of other peers' forged claims."""
    return EvidenceKey(run_tag(run_id), check_peer_id(peer_id)).key()


def parse_key(key: object) -> RecordKey:
    """The record key spelled by ``key``; anything else (a topic key too) is CodecError.

    Strict: one spelling per key, so ``parse_key(k).key() == k`` for every accepted ``k``.
    """
    if not isinstance(key, str):
        raise CodecError(f"a DHT key is a str, not {type(key).__name__}")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise CodecError(f"DHT key of {len(key)} characters is over {MAX_KEY_BYTES} bytes")
    if not key.startswith(KEY_PREFIX):
        raise CodecError(f"DHT key {_show(key)} does not start with {KEY_PREFIX!r}")
    parts = key[len(KEY_PREFIX) :].split("/")
    tag, kind, rest = parts[0], parts[1] if len(parts) > 1 else "", parts[2:]
    if _RUN_TAG.fullmatch(tag) is None:
        raise CodecError(f"DHT key {_show(key)}: the run tag is not {RUN_TAG_LEN} hex digits")
    shapes = {"peer": 1, "ready": 3, "state": 2, "cert": 3, "evidence": 1}
    if kind not in shapes or len(rest) != shapes[kind]:
        raise CodecError(
            f"DHT key {_show(key)} is not a record key (peer/<id>, ready/<fragment>/<slot>/<id>"
            ", state/<fragment>/<id>, cert/<fragment>/<version>/<id> or evidence/<id>)"
        )
    peer_id = check_peer_id(rest[-1])
    if kind == "peer":
        return PeerKey(tag, peer_id)
    if kind == "evidence":
        return EvidenceKey(tag, peer_id)
    fragment = _parse_index("fragment", rest[0], MAX_FRAGMENT)
    if kind == "state":
        return StateKey(tag, fragment, peer_id)
    if kind == "cert":
        return AttestKey(tag, fragment, _parse_index("version", rest[1], MAX_SLOT), peer_id)
    return ReadyKey(tag, fragment, _parse_index("slot", rest[1], MAX_SLOT), peer_id)


# -- topic keys -------------------------------------------------------------------------------
def peers_topic(run_id: str) -> str:
    """The topic every peer of the run provides, to be found by the others."""
    return f"{KEY_PREFIX}{run_tag(run_id)}/peers"


def ready_topic(run_id: str, fragment: int, slot: int) -> str:
    """The topic the peers ready for ``fragment``'s sync ``slot`` provide."""
    fragment = _check_index("fragment", fragment, MAX_FRAGMENT)
    slot = _check_index("slot", slot, MAX_SLOT)
    return f"{KEY_PREFIX}{run_tag(run_id)}/ready/{fragment}/{slot}"


def state_topic(run_id: str, fragment: int) -> str:
    """The topic the peers that can serve ``fragment``'s global state provide."""
    fragment = _check_index("fragment", fragment, MAX_FRAGMENT)
    return f"{KEY_PREFIX}{run_tag(run_id)}/state/{fragment}"


def attest_topic(run_id: str, fragment: int, version: int) -> str:
    """The topic the peers that attested ``fragment`` at ``version`` provide."""
    fragment = _check_index("fragment", fragment, MAX_FRAGMENT)
    version = _check_index("version", version, MAX_SLOT)
    return f"{KEY_PREFIX}{run_tag(run_id)}/cert/{fragment}/{version}"


def evidence_topic(run_id: str) -> str:
    """The topic the peers that publish evidence of forged claims provide."""
    return f"{KEY_PREFIX}{run_tag(run_id)}/evidence"

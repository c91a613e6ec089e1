"""Every py-libp2p 0.8.1 internal that atoll.dht relies on, in one place.

:mod:`atoll.dht.kad` runs py-libp2p's ``KadDHT`` as it is, but its client side asks peers
one at a time with the library's own one-peer RPCs (private methods of the value and
provider stores), reads and fills the local stores and the routing table directly
(``KadDHT`` attributes with no documented API), and spells the library's protocol id to
rename it on the wire. Those reach-ins live here, as small functions whose docstrings say
which internal they touch and why; :mod:`atoll.dht.kad` calls these and never touches a
``KadDHT`` part or a private name itself.

:data:`INTERNALS` lists each internal with its expected kind (and parameters where the
signature matters), ``ValueStore.store`` too, which :mod:`atoll.dht.status` reads itself;
``tests/unit/test_libp2p_internals.py`` walks the list against the installed py-libp2p,
so upgrading the pin starts with that test: a failure names the internal that moved and
the atoll code that needs it.

The stores' inbound paths. ``KadDHT``'s stream handler keeps what peers send with two
calls: ``ValueStore.put_record`` (a PUT_VALUE that passed the validator) and
``ProviderStore.add_provider`` (an ADD_PROVIDER, its provider the sender). Neither store
bounds what it keeps per peer, and the provider store not in all (the value store keeps
50,000). :func:`bound_value_store` and :func:`bound_provider_store` put a gate of
atoll's in front of those two calls on the store objects themselves (the library looks
its methods up on them at each request), and carry out what the gate says: drop these
entries, keep or refuse this one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.common import BUCKET_SIZE, PROTOCOL_ID, format_time_rfc3339
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record as KadRecord
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.kad_dht.value_store import ValueStore
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

__all__ = [
    "INTERNALS",
    "LIBRARY_PROTOCOL",
    "REFUSED_BY_BOUND",
    "Internal",
    "ProviderGate",
    "RefusedByBound",
    "ValueGate",
    "add_local_provider",
    "admit_to_routing_table",
    "bound_provider_store",
    "bound_value_store",
    "clear_dial_backoff",
    "find_closest_peers",
    "in_routing_table",
    "keep_local_value",
    "local_providers",
    "local_value",
    "providers_from_peer",
    "routing_table_closest",
    "routing_table_peer_ids",
    "routing_table_size",
    "send_add_provider",
    "store_at_peer",
    "takes_provider",
    "value_from_peer",
    "value_store_of",
]

logger = logging.getLogger(__name__)


class Internal(NamedTuple):
    """One py-libp2p internal atoll relies on, as the shape test checks it."""

    path: str
    """``module:Qual.name`` (a bare ``module`` for a module)"""
    kind: str
    """module, class, function, method, async method, property, instance attribute,
    int constant or str constant"""
    params: tuple[str, ...] | None = None
    """the parameter names in order (``self`` included), where the signature matters"""
    used_by: str = ""
    """the function here that relies on it"""


_KAD = "libp2p.kad_dht.kad_dht:KadDHT"
_VALUES = "libp2p.kad_dht.value_store:ValueStore"
_PROVIDERS = "libp2p.kad_dht.provider_store:ProviderStore"
_TABLE = "libp2p.kad_dht.routing_table:RoutingTable"

INTERNALS: tuple[Internal, ...] = (
    Internal("libp2p.kad_dht.common:PROTOCOL_ID", "str constant", None, "LIBRARY_PROTOCOL"),
    Internal("libp2p.kad_dht.pb.kademlia_pb2:Record", "class", None, "value_from_peer"),
    Internal(
        "libp2p.network.swarm:Swarm._negative_peer_cache",
        "instance attribute",
        None,
        "clear_dial_backoff",
    ),
    Internal(
        "libp2p.network.swarm:_NegativePeerCache.evict",
        "method",
        ("self", "peer_id"),
        "clear_dial_backoff",
    ),
    Internal(
        f"{_KAD}.value_store", "instance attribute", None, "value_store_of and the value functions"
    ),
    Internal(f"{_KAD}.provider_store", "instance attribute", None, "the provider functions"),
    Internal(f"{_KAD}.routing_table", "instance attribute", None, "the routing-table functions"),
    Internal(f"{_KAD}.peer_routing", "instance attribute", None, "find_closest_peers"),
    Internal(_VALUES, "class", None, "value_store_of"),
    Internal(f"{_VALUES}.get", "method", ("self", "key"), "local_value"),
    Internal(f"{_VALUES}.put", "method", ("self", "key", "value", "validity"), "keep_local_value"),
    Internal(f"{_VALUES}.local_keys", "instance attribute", None, "keep_local_value"),
    Internal(
        f"{_VALUES}.put_record",
        "method",
        ("self", "key", "record"),
        "bound_value_store (the inbound PUT_VALUE path)",
    ),
    Internal(f"{_VALUES}.remove", "method", ("self", "key"), "bound_value_store"),
    Internal(
        "libp2p.kad_dht.common:format_time_rfc3339",
        "function",
        None,
        "bound_value_store (the arrival time of a kept record)",
    ),
    Internal(
        f"{_VALUES}.store",
        "instance attribute",
        None,
        "atoll.dht.status.stored_peer_values (reads its key -> (record, expiry) items)",
    ),
    Internal(
        f"{_VALUES}._store_at_peer",
        "async method",
        ("self", "peer_id", "key", "value", "record"),
        "store_at_peer",
    ),
    Internal(
        f"{_VALUES}._get_from_peer",
        "async method",
        ("self", "peer_id", "key", "return_record", "return_closer_peers"),
        "value_from_peer",
    ),
    Internal(_PROVIDERS, "class", None, "bound_provider_store"),
    Internal(
        f"{_PROVIDERS}.add_provider",
        "method",
        ("self", "key", "provider"),
        "add_local_provider, bound_provider_store (the inbound ADD_PROVIDER path)",
    ),
    Internal(
        f"{_PROVIDERS}.providers",
        "instance attribute",
        None,
        "bound_provider_store, takes_provider (key -> {peer id text -> ProviderRecord})",
    ),
    Internal("libp2p.kad_dht.common:BUCKET_SIZE", "int constant", None, "takes_provider"),
    Internal(f"{_PROVIDERS}.get_providers", "method", ("self", "key"), "local_providers"),
    Internal(
        f"{_PROVIDERS}._send_add_provider",
        "async method",
        ("self", "peer_id", "key"),
        "send_add_provider",
    ),
    Internal(
        f"{_PROVIDERS}._get_providers_from_peer_with_closers",
        "async method",
        ("self", "peer_id", "key"),
        "providers_from_peer",
    ),
    Internal(f"{_TABLE}.get_peer_ids", "method", ("self",), "routing_table_peer_ids"),
    Internal(
        f"{_TABLE}.find_local_closest_peers",
        "method",
        ("self", "key", "count"),
        "routing_table_closest",
    ),
    Internal(f"{_TABLE}.size", "method", ("self",), "routing_table_size"),
    Internal(f"{_TABLE}.peer_in_table", "method", ("self", "peer_id"), "in_routing_table"),
    Internal(
        f"{_TABLE}.add_peer",
        "async method",
        ("self", "peer_obj", "skip_server_mode_check"),
        "admit_to_routing_table",
    ),
    Internal(
        "libp2p.kad_dht.peer_routing:PeerRouting.find_closest_peers_network",
        "async method",
        ("self", "target_key", "count"),
        "find_closest_peers",
    ),
)
"""The py-libp2p 0.8.1 internals atoll.dht relies on (see the module docstring)."""

LIBRARY_PROTOCOL: TProtocol = PROTOCOL_ID
"""The protocol id ``KadDHT`` spells for every Kademlia stream: ``PROTOCOL_ID`` of
``libp2p.kad_dht.common`` (``/ipfs/kad/1.0.0``; ``KadDHT(protocol_prefix=...)`` stores the
prefix and ignores it). atoll's host proxy renames exactly this id on the wire."""


REFUSED_BY_BOUND = "refused by atoll's store bound"
"""Ends the text of every :class:`RefusedByBound`, so that the library's log line about the
refused PUT_VALUE can be told apart (and left out: atoll logs its own)."""

ValueGate = Callable[[bytes, bytes], tuple[Sequence[bytes], str | None]]
"""``gate(key, value)`` of a record a peer sent: the keys to drop from the store first,
and why the record is refused (None: keep it)."""

ProviderGate = Callable[[bytes, PeerInfo], tuple[Sequence[tuple[bytes, str]], PeerInfo | None]]
"""``gate(key, provider)`` of a provider entry: the ``(key, peer id text)`` entries to drop
first, and the entry to keep (its addresses maybe clipped), or None to refuse it."""


class RefusedByBound(Exception):
    """A record refused by atoll's store bound: raised out of ``ValueStore.put_record``,
    so the library's handler resets the PUT_VALUE stream (the sender sees a refusal)."""


# -- dialing ----------------------------------------------------------------------------------
def clear_dial_backoff(host: IHost, peer_id: str) -> None:
    """Let ``peer_id`` be dialed at once, even if all its addresses failed lately.

    Touches ``Swarm._negative_peer_cache`` (a ``_NegativePeerCache``) and its ``evict``:
    the swarm refuses for a while to dial a peer whose addresses all failed, and a
    bootstrap (maybe of a peer that just came back) deserves a real try. A network
    without the cache, or a cache without ``evict``, is left alone.
    """
    cache = getattr(host.get_network(), "_negative_peer_cache", None)
    if cache is not None and hasattr(cache, "evict"):
        cache.evict(peer_id)


# -- the value store --------------------------------------------------------------------------
def value_store_of(kad: KadDHT) -> ValueStore:
    """``KadDHT.value_store``, the local store of values this node serves (read by
    :mod:`atoll.dht.status` through :attr:`~atoll.dht.kad.AtollDHT.value_store`)."""
    return kad.value_store


def local_value(kad: KadDHT, key: bytes) -> bytes | None:
    """The value this node's store holds under ``key`` (its bytes, maybe empty), or None.

    Touches ``ValueStore.get``, which returns the library's ``Record`` (never a cached
    answer from the network: only what was put here or stored here by a peer).
    """
    held = kad.value_store.get(key)
    return None if held is None else held.value


def keep_local_value(kad: KadDHT, key: bytes, value: bytes) -> None:
    """Keep ``value`` under ``key`` in this node's store, not marked for republishing.

    Touches ``ValueStore.put`` and ``ValueStore.local_keys``: the library republishes
    every locally put key each 22 h, and atoll's records live minutes, their publishers
    issuing fresh ones; so the key is taken out of ``local_keys`` again.
    """
    kad.value_store.put(key, value)
    kad.value_store.local_keys.discard(key)


def bound_value_store(kad: KadDHT, gate: ValueGate) -> None:
    """Route every value a peer stores here (a PUT_VALUE that passed the validator) through
    ``gate``: its drops are removed from the store, then the value is kept, or refused by
    raising :class:`RefusedByBound` (the stream is reset).

    Touches ``ValueStore.put_record`` (replaced on ``KadDHT.value_store``, the library's
    handler calls it for each value it keeps and nothing else of atoll's does) and
    ``ValueStore.remove``. A kept value is stored as a fresh ``Record`` of its key, value and
    arrival time only: the library would keep the sender's ``author`` and ``signature``
    fields as sent (up to 1 MiB, unchecked when the signature is empty), and atoll's
    readers open the sealed value, never those. What this node puts itself
    (:func:`keep_local_value`, ``ValueStore.put``) does not pass the gate.
    """
    store = kad.value_store
    keep = store.put_record

    def put_record(key: bytes, record: KadRecord) -> None:
        drop, refusal = gate(key, record.value)
        for gone in drop:
            store.remove(gone)
        if refusal is not None:
            raise RefusedByBound(f"{refusal}: {REFUSED_BY_BOUND}")
        keep(key, KadRecord(key=key, value=record.value, timeReceived=format_time_rfc3339()))

    setattr(store, "put_record", put_record)  # noqa: B010 (mypy: no assigning to a method)


async def store_at_peer(kad: KadDHT, peer: ID, key: bytes, value: bytes) -> bool:
    """Ask ``peer`` to store ``value`` under ``key`` (one PUT_VALUE); whether it did.

    Touches ``ValueStore._store_at_peer``, the library's one-peer PUT_VALUE: atoll stores
    at the peers closest to its own lookup target, where ``KadDHT.put_value`` looks the
    key up by its bytes (see :func:`atoll.dht.kad._lookup_target`).
    """
    return await kad.value_store._store_at_peer(peer, key, value)


async def value_from_peer(kad: KadDHT, peer: ID, key: bytes) -> bytes | None:
    """The non-empty value ``peer`` holds under ``key`` (one GET_VALUE), else None.

    Touches ``ValueStore._get_from_peer`` with ``return_record=True`` (its answer is a
    ``Record`` of ``libp2p.kad_dht.pb.kademlia_pb2``, or something else on failure): atoll
    asks chosen peers now, where ``KadDHT.get_value`` answers from the local store and
    caches what it finds. The value is not validated here.
    """
    got = await kad.value_store._get_from_peer(peer, key, return_record=True)
    if isinstance(got, KadRecord) and got.value:
        return got.value
    return None


# -- the provider store -----------------------------------------------------------------------
def add_local_provider(kad: KadDHT, key: bytes, provider: PeerInfo) -> None:
    """Keep ``provider`` as a provider of ``key`` in this node's provider store.

    Touches ``ProviderStore.add_provider``, not ``KadDHT.provide``, so the key is not put
    in ``providing_keys`` and never republished (atoll's announcements last as long as
    their records).
    """
    kad.provider_store.add_provider(key, provider)


def bound_provider_store(kad: KadDHT, gate: ProviderGate) -> None:
    """Route every provider entry through ``gate``: its drops are removed from the store,
    then the entry it returns is kept (None: nothing is).

    Touches ``ProviderStore.add_provider`` (replaced on ``KadDHT.provider_store``; the
    library's ADD_PROVIDER handler calls it for the sender, :func:`add_local_provider`
    for this node) and ``ProviderStore.providers`` (key -> {peer id text -> record}), from
    which dropped entries are deleted. A refused ADD_PROVIDER is still echoed: the library
    answers before it knows, and its sender never waits for the answer anyway.
    """
    store = kad.provider_store
    keep = store.add_provider

    def add_provider(key: bytes, provider: PeerInfo) -> None:
        drop, kept = gate(key, provider)
        for topic, peer in drop:
            _drop_provider(store, topic, peer)
        if kept is not None:
            keep(key, kept)

    setattr(store, "add_provider", add_provider)  # noqa: B010 (mypy: no assigning to a method)


def takes_provider(kad: KadDHT, key: bytes, peer: str) -> bool:
    """Whether ``ProviderStore.add_provider`` would keep ``peer``'s entry under ``key``: it
    is there already, or the key has fewer than ``BUCKET_SIZE`` (20) providers (the library
    ignores any more, the first to announce staying). Reads ``ProviderStore.providers``."""
    held = kad.provider_store.providers.get(key)
    return held is None or peer in held or len(held) < BUCKET_SIZE


def _drop_provider(store: ProviderStore, key: bytes, peer: str) -> None:
    """Delete ``peer``'s entry under ``key`` from ``ProviderStore.providers`` (and the key,
    once it has none); nothing when it is not there."""
    held = store.providers.get(key)
    if held is not None and peer in held:
        del held[peer]
        if not held:
            del store.providers[key]


def local_providers(kad: KadDHT, key: bytes) -> list[PeerInfo]:
    """The providers of ``key`` in this node's provider store (``ProviderStore.get_providers``)."""
    return kad.provider_store.get_providers(key)


async def send_add_provider(kad: KadDHT, peer: ID, key: bytes) -> bool:
    """Tell ``peer`` that this node provides ``key`` (one ADD_PROVIDER); whether it took it.

    Touches ``ProviderStore._send_add_provider``, the library's one-peer ADD_PROVIDER:
    atoll announces at the peers closest to its own lookup target.
    """
    return await kad.provider_store._send_add_provider(peer, key)


async def providers_from_peer(kad: KadDHT, peer: ID, key: bytes) -> list[PeerInfo]:
    """The providers of ``key`` that ``peer`` knows of (one GET_PROVIDERS).

    Touches ``ProviderStore._get_providers_from_peer_with_closers`` (the closer peers it
    also returns are dropped): atoll asks chosen peers now, where ``find_providers``
    answers from the local store and caches.
    """
    providers, _ = await kad.provider_store._get_providers_from_peer_with_closers(peer, key)
    return providers


# -- routing ----------------------------------------------------------------------------------
async def find_closest_peers(kad: KadDHT, target: bytes) -> list[ID]:
    """The (up to 20) peers closest to ``target`` in the network: an iterative FIND_NODE
    lookup (``KadDHT.peer_routing.find_closest_peers_network``).

    The library bounds each query by its ``QUERY_TIMEOUT`` (10 s) and waits for every
    query of a round before the next, so one silent peer holds a lookup up to that long
    (or the host's stream negotiation timeout, if shorter); :mod:`atoll.dht.kad` bounds
    the streams and the whole lookup itself, and falls back on
    :func:`routing_table_closest`.
    """
    return await kad.peer_routing.find_closest_peers_network(target)


def routing_table_closest(kad: KadDHT, target: bytes, count: int) -> list[ID]:
    """The (up to ``count``) peers of ``KadDHT.routing_table`` closest to ``target``
    (``RoutingTable.find_local_closest_peers``): no network, what a lookup cut short
    falls back on."""
    return kad.routing_table.find_local_closest_peers(target, count)


def routing_table_peer_ids(kad: KadDHT) -> list[ID]:
    """The peer ids in ``KadDHT.routing_table`` (``RoutingTable.get_peer_ids``)."""
    return kad.routing_table.get_peer_ids()


def routing_table_size(kad: KadDHT) -> int:
    """How many peers ``KadDHT.routing_table`` holds (``RoutingTable.size``)."""
    return kad.routing_table.size()


def in_routing_table(kad: KadDHT, peer: ID) -> bool:
    """Whether ``peer`` is in ``KadDHT.routing_table`` (``RoutingTable.peer_in_table``)."""
    return kad.routing_table.peer_in_table(peer)


async def admit_to_routing_table(kad: KadDHT, peer: ID | PeerInfo) -> bool:
    """Add ``peer`` to ``KadDHT.routing_table``; False when its bucket is full.

    Touches ``RoutingTable.add_peer`` with ``skip_server_mode_check=True``: the peer has
    just proven it speaks atoll's DHT (it accepted a stream of its protocol), whatever
    identify said. A full bucket pings its oldest peer first; the caller bounds the time.
    """
    return await kad.routing_table.add_peer(peer, skip_server_mode_check=True)

"""The Kademlia DHT adapter: py-libp2p's ``KadDHT`` speaking atoll's own protocol id.

:class:`AtollDHT` runs py-libp2p 0.8.1's Kademlia DHT on a libp2p host the node already
runs, publishes atoll's sealed records (:mod:`atoll.dht.records`) under atoll's keys
(:mod:`atoll.dht.keys`) and reads them back, fresh from the network and validated on the
injected clock. All of it runs in the trio loop of the node's network process.

Atoll's own network
-------------------
Every Kademlia stream uses :data:`DHT_PROTOCOL` (``/atoll/kad/1.0.0``), never the IPFS
id, so an atoll node neither joins nor serves any other network's DHT, and only peers that
speak :data:`DHT_PROTOCOL` enter its routing table.

How: ``KadDHT`` spells its protocol id as the constant ``PROTOCOL_ID`` of
``libp2p.kad_dht.common`` (``protocol_prefix`` is stored and ignored), imported by name
into the modules that open streams. Rather than subclass ``KadDHT``, ``ValueStore``,
``PeerRouting`` and ``ProviderStore`` and copy the five stream-opening methods and the
handler registration (some 500 lines of library code to keep in step with upstream), or
patch the module constants (process-wide: any other ``KadDHT`` in the process would move
too), ``KadDHT`` is handed :class:`_KadHost`, a thin proxy of the real host that renames
the id in ``new_stream``, ``set_stream_handler`` and ``remove_stream_handler`` and
delegates everything else. No library code is copied; the price is a dependence on which
host methods ``KadDHT`` calls, which the integration tests pin down.

Who enters the routing table. The library's check (``RoutingTable.add_peer``) reads the
peer's protocols from the peerstore and admits the peer when they list the Kademlia id,
but also when nothing is known of the peer yet (identify has not run, or the peer is not in
the peerstore at all: the lookup raises and the check is skipped), which would let any
peer named in a FIND_NODE answer in. The proxy's peerstore answers that check itself
(:class:`_KadPeerstore`): "yes" only when identify said the peer serves
:data:`DHT_PROTOCOL`, "no" otherwise, unknown peers included. A peer whose stream of
:data:`DHT_PROTOCOL` we opened or accepted has proven it speaks atoll's DHT and is admitted
at once (the library does so for accepted streams; :class:`AtollDHT` for opened ones).

Records
-------
A libp2p ``Validator`` for the ``atoll`` namespace runs
:func:`~atoll.dht.records.decode_value` and :func:`~atoll.dht.records.select_value` on
the injected :class:`~atoll.dht.directory.Clock`, and the namespaced validator is strict,
so a peer stores nothing outside ``/atoll/`` (not even the ``pk`` and ``ipns`` records
the library accepts by default). Serving peers answer GET_VALUE from their store without
validating, so every reader validates again: :meth:`AtollDHT.get` never trusts a stored
copy, its own included.

What is used of the library, and what not. Its server side (the stream handler, the
value and provider stores, behind atoll's gates: see "What peers may store here"), its
routing table and its iterative FIND_NODE lookup (``find_closest_peers_network``, its
streams bounded by the host proxy, see "Timeouts and failures") are used as they are, and
so are its one-peer RPCs
(``_store_at_peer``, ``_get_from_peer``, ``_send_add_provider``,
``_get_providers_from_peer_with_closers``: private names). Every such reach-in, the
stores and the routing table included, goes through :mod:`atoll.dht.libp2p_internals`,
whose list of internals the unit tests check against the installed library. Its
client-side ``put_value``, ``get_value``, ``provide`` and ``find_providers`` are not:

- they look a key up by its own bytes, and a py-libp2p server answers FIND_NODE only for a
  multihash or a key of 2 to 50 bytes (it resets the stream otherwise), so a lookup of an
  atoll key never got past the peers already known; atoll looks keys up by their sha2-256
  multihash (:func:`_lookup_target`) and stores, reads and announces at the peers closest
  to that;
- ``get_value`` answers from the local store when it holds the key, so a second read never
  sees a newer record, and caches what it found for 24 h; ``find_providers`` answers from
  the local provider store as soon as it holds any provider of the key, so it never sees
  providers that came later, and caches every provider it hears of. :meth:`AtollDHT.get`,
  :meth:`AtollDHT.find_ready` and :meth:`AtollDHT.find_peers` ask the closest peers every
  time, plus the local store;
- ``put_value`` and ``provide`` mark the key for republishing every 22 h (the first time
  at the first maintenance pass, where a server holding the same value refuses it as not
  newer); atoll's records live minutes and their publishers issue fresh ones.

Run-agnostic serving (bootstrap peers)
--------------------------------------
``run_id=None`` starts a DHT that belongs to no run: it serves, stores (after the same
validation) and reads records of every run, and publishes none (:meth:`~AtollDHT.put`,
the ``announce_*`` and the ``find_*`` methods raise ``ConfigError``).
The validator needs no run of its own: a record is checked against its key, whose run tag
must begin the record's run id. This is what ``atoll bootstrap`` runs, for the peers of
whatever runs an organisation hosts.

Timeouts and failures
---------------------
Two bounds: ``timeout_s`` (10 s by default) for a whole operation, and ``rpc_timeout_s``
(by default ``min(3, timeout_s / 2)``) for one request to one peer. A peer whose link
dropped silently (it neither answers nor refuses) would otherwise hold every operation to
its end; here it costs one request's bound, once, and is skipped while it is suspected.

- Liveness: each outcome is noted in the node's :class:`~atoll.protocol.liveness.Liveness`
  (:attr:`AtollDHT.liveness`, shared with its round drivers; times on
  ``trio.current_time()``). Heard: a stream of :data:`DHT_PROTOCOL` to the peer opened
  (opening one needs the peer's own answer, the protocol negotiation), or the peer opened
  one here. Failed: a stream that did not open (refused, unreachable, not within
  ``rpc_timeout_s``), or a request with no answer within ``rpc_timeout_s``; the peer is
  then suspected for a hold that doubles with each failure in a row. The library's
  one-peer requests return the same False, None or [] for "refused", "had none" and
  "failed" and raise nothing; a refused connection (a process gone) fails at once, a
  silent peer when its bound runs out, and both count as failed.
- Every one-peer request (store, read, provider announcement, provider list, and the
  stream opening inside each, a lookup's queries included) is bounded by
  ``rpc_timeout_s``.
- The closest peers: the library's iterative FIND_NODE lookup waits in each round for
  every peer it queried, up to its 10 s query timeout (or the host's stream negotiation
  timeout, when shorter), so one silent peer held up every lookup. Here its streams are
  bounded by ``rpc_timeout_s``; a suspected peer (within its hold) is refused at once
  (the library then drops it from the routing table; it comes back at its next answer);
  and the whole lookup is bounded by ``min(timeout_s, 2 * rpc_timeout_s)``, past which
  the routing table's closest peers are used. Suspected peers are then left out of the
  peers asked, unless every one is suspected (better a probe than nobody). Once its hold
  has passed, a silent peer is asked again by lookups, stores and reads (a probe, which
  costs one request bound while it stays silent), and :meth:`~AtollDHT.probe` asks it
  directly: a healed link is found within a hold.
- Writes, :meth:`~AtollDHT.put` and the provider announcements of
  :meth:`~AtollDHT.announce_ready` and :meth:`~AtollDHT.announce_peer`: all the closest
  peers asked are sent the record (10 at a time), and the write is done once a majority of
  them (more than half: 2 of 3, 3 of 4 or 5, 11 of 20) took it; the other requests go on
  in the background, each within ``rpc_timeout_s``, so that their peers' liveness is still
  learned. A majority rather than a fixed count: a write and a read each at a majority of
  the same peers share at least one, so a reader hears of the newest record; and in a
  swarm of four a majority of the other three (two) leaves room for one silent peer,
  where ``min(3, n)`` would wait for it. Raises
  :class:`~atoll.protocol.errors.ExchangeTimeout` only when ``timeout_s`` ran out before
  the quorum and before every asked peer was done (the record is then held here and
  maybe by some peers). When every asked peer is done with fewer than a quorum (they
  refused or failed), that is logged; a node with no peer keeps and serves its record.
- Reads, :meth:`~AtollDHT.get`: the closest peers are asked at once, and the read is done
  when every one answered or failed, or once a majority of them gave a valid record and a
  grace of ``min(0.2 s, rpc_timeout_s / 4)`` more passed for answers in flight. Returns
  the newest valid record heard of by then (this node's store included), else ``None``
  when the peers that answered had none; raises
  :class:`~atoll.protocol.errors.ExchangeTimeout` when ``timeout_s`` ran out first or none
  of the peers answered, :class:`~atoll.protocol.errors.PeerUnavailable` when there was no
  peer to ask.
- :meth:`~AtollDHT.find_ready` and :meth:`~AtollDHT.find_peers`: the provider lists of
  the closest peers (and this node's own), done when every asked peer answered or failed
  (errors as for ``get`` when no provider was found); then each provider's record, 8 at a
  time, all within another ``timeout_s``: asked of the provider itself within
  ``rpc_timeout_s`` (not at all when it is suspected: the provider may be the silent
  peer), else read from the DHT as ``get`` does. At most ``2 * timeout_s`` in all;
  records not fetched by then are left out.
- :meth:`~AtollDHT.bootstrap`: each address, dial and protocol check, within
  ``timeout_s``; then one lookup of this node's own id (as above), within ``timeout_s``.
  Failures are counted, not raised.

Limits the library sets: a serving peer keeps at most 20 providers per key (the first to
announce), accepts at most 10 ADD_PROVIDER per peer per 10 s, keeps 50,000 values; a
ready topic, or a run's peers topic, with more than 20 peers is seen in part by each
server.

What peers may store here
-------------------------
The library bounds neither store per peer, nor its provider store in all, and a peer may
store under any number of keys (one signer can seal records for any run, fragment and
slot; identities are free). So every value and provider entry a peer sends passes a gate
(:func:`~atoll.dht.libp2p_internals.bound_value_store`,
:func:`~atoll.dht.libp2p_internals.bound_provider_store`) that counts it in a
:class:`~atoll.dht.storebound.StoreLedger`, one per store, under
:class:`~atoll.dht.storebound.StoreBounds`; :mod:`atoll.dht.storebound` tells the bounds
and the rule by which entries are evicted or refused (a flooder evicts its own entries
first, and no peer's entry evicts another's fair share). A value counts for its signer
(the peer id in its key, which the validator has just checked against the seal) and
expires at its record's ``expires_at``; a provider entry counts for its provider (the
library keeps the sender's own only) and expires ``MAX_TTL_S + max_skew_s`` after it
arrived, when any record it may point to has expired.

A refused PUT_VALUE is reset; a refused ADD_PROVIDER is echoed and not kept, as is one the
library would not keep (its topic holds 20 providers already). This node's own
records (put by :meth:`AtollDHT.put` and the ``announce_*`` methods, or stored back here
by a peer) are neither counted nor evicted. A kept value is stored as its key, value and
arrival time only (the library would keep whatever ``author`` field the sender set, up to
1 MiB), a kept provider entry with at most :data:`~atoll.dht.records.MAX_ADDRS` addresses.
Drops and refusals are logged at INFO, naming the peer (and the sender, when another), at
most once a minute per peer and kind and 20 lines a minute in all;
:meth:`AtollDHT.store_usage` tells the counts.

The host must have this module's stream handler before it connects to anyone: identify
tells peers which protocols a host serves, and peers that identified this host earlier do
not learn of :data:`DHT_PROTOCOL` until they connect again. Enter :meth:`AtollDHT.start`
right after the host starts.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

import trio
from libp2p.abc import IHost, INetStream, IPeerStore
from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.records.validator import NamespacedValidator, Validator
from libp2p.tools.anyio_service import background_trio_service

from atoll.dht import libp2p_internals, quorum
from atoll.dht.directory import Clock
from atoll.dht.keys import (
    KEY_PREFIX,
    NAMESPACE,
    attest_key,
    attest_topic,
    check_run_id,
    evidence_key,
    evidence_topic,
    parse_key,
    peer_key,
    peers_topic,
    ready_key,
    ready_topic,
)
from atoll.dht.libp2p_internals import LIBRARY_PROTOCOL
from atoll.dht.peeraddr import parse_peer_addr
from atoll.dht.quorum import Reply, Tally
from atoll.dht.records import (
    DEFAULT_MAX_SKEW_S,
    MAX_ADDR_LEN,
    MAX_ADDRS,
    MAX_TTL_S,
    AttestationRecord,
    EvidenceRecord,
    PeerRecord,
    ReadyRecord,
    Record,
    RecordSigner,
    RecordVerifier,
    RejectedRecord,
    decode_value,
    encode_value,
    is_newer,
    select_value,
)
from atoll.dht.storebound import (
    _NOTICE_BUDGET,
    Admission,
    StoreBounds,
    StoreLedger,
    StoreUsage,
    _Notices,
)
from atoll.protocol.errors import (
    CodecError,
    ConfigError,
    ExchangeTimeout,
    PeerUnavailable,
    RetryableError,
    unwrap_lone,
)
from atoll.protocol.liveness import Liveness

__all__ = [
    "DHT_PROTOCOL",
    "AtollDHT",
]

logger = logging.getLogger(__name__)

DHT_PROTOCOL: TProtocol = TProtocol("/atoll/kad/1.0.0")
"""The libp2p protocol id of atoll's Kademlia streams (the IPFS DHT's is /ipfs/kad/1.0.0)."""

_NOT_ATOLL_DHT = "/atoll/kad/not-served"  # what the routing table's check reads for a non-server
_QUERY_CONCURRENCY = 10  # peers asked at once in one lookup (Kademlia's alpha, as the library)
_CLOSEST = 20  # peers a lookup keeps (Kademlia's k, as the library)
_MAX_RPC_TIMEOUT_S = 3.0  # the default bound of one request to one peer, at most
_READ_GRACE_S = 0.2  # how long a read at its quorum still waits for answers in flight
_LEFT_OUT = "left out of lookups"  # the refusal of a silent peer's lookup stream
_FETCH_CONCURRENCY = 8  # providers' records fetched at once by find_ready and find_peers
_PROVIDER_ADDR_TTL_S = 600  # how long a provider's addresses stay in the peerstore

_R = TypeVar("_R", bound=Record)  # a record kind: PeerRecord, ReadyRecord, StateRecord
_T = TypeVar("_T")

_IN_LOOKUP: contextvars.ContextVar[bool] = contextvars.ContextVar("atoll_dht_lookup", default=False)
"""True in the task of an iterative lookup (:meth:`AtollDHT._lookup`) and the tasks the
library starts for it: :class:`_KadHost` then refuses streams to silent peers."""

_SENDER: contextvars.ContextVar[str] = contextvars.ContextVar("atoll_dht_sender", default="")
"""The peer id of the peer whose DHT stream this task serves ("" elsewhere): set by
:class:`_KadHost` for the library's handler, read by the store gates' log lines."""

_KEY_PREFIX_BYTES = KEY_PREFIX.encode("utf-8")  # every atoll key and topic starts so


# -- the host as KadDHT sees it -----------------------------------------------------------------
def _wire(protocol_id: TProtocol) -> TProtocol:
    """The protocol id that goes on the wire for the id the library asked for."""
    return DHT_PROTOCOL if protocol_id == LIBRARY_PROTOCOL else protocol_id


def _reset_after_hello(error: BaseException) -> bool:
    """Whether ``error``, raised opening a stream, says that the peer answered the
    stream's multistream hello and then reset it while the protocol was being chosen
    (py-libp2p's client words it "protocol read failed"): only a live peer's process gets
    that far. A failed hello (a dead connection, a killed process) is not such a reset."""
    cause = error.__cause__
    return (
        isinstance(error, StreamFailure)
        and isinstance(cause, MultiselectClientError)
        and str(cause).startswith("protocol read failed")
    )


class _KadPeerstore:
    """The host's peerstore, except that ``get_protocols`` answers the routing table's one
    question, "is this peer an atoll DHT server?", and says no when it does not know."""

    def __init__(self, peerstore: IPeerStore) -> None:
        self._peerstore = peerstore

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peerstore, name)

    def get_protocols(self, peer_id: ID) -> list[str]:
        try:
            spoken = self._peerstore.get_protocols(peer_id)
        except PeerStoreError:  # never seen: the library would admit it unchecked
            spoken = []
        return [str(LIBRARY_PROTOCOL)] if str(DHT_PROTOCOL) in spoken else [_NOT_ATOLL_DHT]


class _KadHost:
    """The host handed to ``KadDHT``: /ipfs/kad/1.0.0 becomes :data:`DHT_PROTOCOL` on the
    wire; everything else is the real host's.

    Every stream of :data:`DHT_PROTOCOL` the library opens (a request of atoll's, a lookup
    query, a ping of the routing table) is bounded by ``rpc_timeout_s`` and tells
    ``liveness`` how the peer did: opened, heard; answered the stream's hello and then
    reset it while the protocol was chosen, tried once more at once, and reset again,
    refused
    (:meth:`~atoll.protocol.liveness.Liveness.refused`: skipped by the DHT for a while,
    still live elsewhere); refused outright, unreachable or timed out, failed (a
    :class:`~libp2p.host.exceptions.StreamFailure` goes to the library, which treats it as
    any failed stream). Opening a stream needs the peer's own answer (the protocol
    negotiation), so an opened stream proves the peer's process answers. In a lookup, a
    peer the DHT skips now (:meth:`~atoll.protocol.liveness.Liveness.skipped`) is refused
    at once. A stream of
    :data:`DHT_PROTOCOL` that a peer opens here marks it heard too.

    ``on_dht_stream`` hears of every peer that accepted a stream of :data:`DHT_PROTOCOL`.
    """

    def __init__(self, host: IHost, liveness: Liveness, rpc_timeout_s: float) -> None:
        self._host = host
        self._peerstore = _KadPeerstore(host.get_peerstore())
        self._liveness = liveness
        self._rpc_timeout_s = rpc_timeout_s
        self.on_dht_stream: Callable[[ID], None] | None = None

    def __getattr__(self, name: str) -> Any:
        # get_id, get_addrs, get_private_key, get_connected_peers, get_network, ...
        return getattr(self._host, name)

    def get_peerstore(self) -> _KadPeerstore:
        return self._peerstore

    async def new_stream(self, peer_id: ID, protocol_ids: Sequence[TProtocol]) -> INetStream:
        wire = [_wire(p) for p in protocol_ids]
        if DHT_PROTOCOL not in wire:
            return await self._host.new_stream(peer_id, wire)
        peer = str(peer_id)
        if _IN_LOOKUP.get() and self._liveness.skipped(peer, trio.current_time()):
            raise StreamFailure(f"peer {peer} is {_LEFT_OUT} for its hold")
        try:
            with trio.fail_after(self._rpc_timeout_s):
                try:
                    stream = await self._host.new_stream(peer_id, wire)
                except Exception as e:
                    if not _reset_after_hello(e):
                        raise
                    # a reset of one stream of a burst: a fresh stream mostly goes through
                    logger.debug("%s reset a DHT stream after its hello: trying again", peer)
                    stream = await self._host.new_stream(peer_id, wire)
        except trio.TooSlowError:
            reason = f"no DHT stream within {self._rpc_timeout_s:g} s"
            self._liveness.failed(peer, trio.current_time(), reason)
            raise StreamFailure(f"peer {peer}: {reason}") from None
        except Exception as e:
            reason = f"no DHT stream: {_describe(e)}"
            cause = e.__cause__
            logger.debug("%s: %s%s", peer, reason, f" ({_describe(cause)})" if cause else "")
            if _reset_after_hello(e):
                # the peer answered the stream's hello, then reset it (twice) while the
                # protocol was being chosen: it is there and talking (py-libp2p's yamux
                # resets a few streams of a burst), so the DHT skips it for a while, but
                # groups and connections keep it
                self._liveness.refused(peer, trio.current_time())
            else:
                self._liveness.failed(peer, trio.current_time(), reason)
            raise
        self._liveness.heard(peer, trio.current_time())
        if self.on_dht_stream is not None:
            self.on_dht_stream(peer_id)
        return stream

    def set_stream_handler(self, protocol_id: TProtocol, stream_handler: StreamHandlerFn) -> None:
        wire = _wire(protocol_id)
        if wire == DHT_PROTOCOL:
            stream_handler = self._hearing(stream_handler)
        self._host.set_stream_handler(wire, stream_handler)

    def _hearing(self, handler: StreamHandlerFn) -> StreamHandlerFn:
        """``handler``, after noting that the stream's peer is heard (it just opened a
        stream, negotiation and all)."""
        liveness = self._liveness

        async def handle(stream: INetStream) -> None:
            try:
                peer = str(stream.muxed_conn.peer_id)
            except AttributeError:  # a stream without a connection: nothing to note
                peer = ""
            if peer:
                liveness.heard(peer, trio.current_time())
            token = _SENDER.set(peer)
            try:
                await handler(stream)
            finally:
                _SENDER.reset(token)

        return handle

    def remove_stream_handler(self, protocol_id: TProtocol) -> None:
        self._host.remove_stream_handler(_wire(protocol_id))


# -- the record validator -------------------------------------------------------------------
class _RecordValidator(Validator):
    """libp2p's validator hook for ``/atoll/`` keys: atoll's record rules on the injected
    clock. Raising refuses the value (a PUT is reset; a read skips it)."""

    def __init__(self, verifier: RecordVerifier, clock: Clock, max_skew_s: float) -> None:
        self._verifier = verifier
        self._clock = clock
        self._max_skew_s = max_skew_s
        self._last: tuple[str, bytes, Record] | None = None  # what validate opened last

    def validate(self, key: str, value: bytes) -> None:
        record = decode_value(
            value,
            key=key,
            now=self._clock.wall(),
            verifier=self._verifier,
            max_skew_s=self._max_skew_s,
        )
        self._last = (key, value, record)

    def recall(self, key: str, value: bytes) -> Record | None:
        """The record ``value`` holds for ``key``: the one :meth:`validate` opened last
        when it is this one (the library's handler validates a value right before it
        keeps it), else opened now; None when it breaks a rule."""
        last = self._last
        if last is not None and last[0] == key and last[1] == value:
            return last[2]
        try:
            return decode_value(
                value,
                key=key,
                now=self._clock.wall(),
                verifier=self._verifier,
                max_skew_s=self._max_skew_s,
            )
        except RejectedRecord:
            return None

    def select(self, key: str, values: list[bytes]) -> int:
        return select_value(
            values,
            key=key,
            now=self._clock.wall(),
            verifier=self._verifier,
            max_skew_s=self._max_skew_s,
        )


# -- what the network may store here ----------------------------------------------------------
class _StoreGuard:
    """The gates of this node's two stores (see :mod:`atoll.dht.libp2p_internals`): every
    value and provider entry a peer sends passes its :class:`StoreLedger`, this node's own
    records pass untouched, and drops and refusals are logged (INFO, once a minute per
    peer and kind with a count, and at most
    :data:`~atoll.dht.storebound._NOTICE_BUDGET` lines a minute)."""

    def __init__(
        self,
        bounds: StoreBounds,
        *,
        own_peer: str,
        clock: Clock,
        max_skew_s: float,
        recall: Callable[[str, bytes], Record | None],
        takes_provider: Callable[[bytes, str], bool] = lambda key, peer: True,
        notices: _Notices | None = None,
    ) -> None:
        self.value_ledger: StoreLedger[bytes] = StoreLedger(bounds)
        self.provider_ledger: StoreLedger[tuple[bytes, str]] = StoreLedger(bounds)
        self._own = own_peer
        self._clock = clock
        self._provider_life_s = MAX_TTL_S + max_skew_s
        self._recall = recall
        self._takes_provider = takes_provider
        self._notices = notices if notices is not None else _Notices()

    def usage(self) -> StoreUsage:
        """The counts of both ledgers."""
        return StoreUsage(
            len(self.value_ledger),
            len(self.provider_ledger),
            self.value_ledger.usage(),
            self.provider_ledger.usage(),
        )

    def admit_value(self, key: bytes, value: bytes) -> tuple[list[bytes], str | None]:
        """The gate of a value a peer stores here (it passed the validator): the keys to
        drop first, and why it is refused (None: keep it)."""
        try:
            text = key.decode("utf-8")
            signer = parse_key(text).peer_id
        except (UnicodeDecodeError, CodecError):
            return [], "not a record key"
        if signer == self._own:
            return [], None  # this node's own record, put back by a peer: not counted
        record = self._recall(text, value)
        if record is None:
            return [], "not a valid record"
        admission = self.value_ledger.admit(key, signer, record.expires_at, self._clock.wall())
        self._tell("value", signer, admission)
        return list(admission.drops), None if admission.admitted else admission.reason

    def admit_provider(
        self, key: bytes, provider: PeerInfo
    ) -> tuple[list[tuple[bytes, str]], PeerInfo | None]:
        """The gate of a provider entry: the entries to drop first, and the entry to keep
        (at most :data:`~atoll.dht.records.MAX_ADDRS` addresses of at most
        :data:`~atoll.dht.records.MAX_ADDR_LEN` bytes), or None to refuse it. An entry
        lives as long as the longest record it may point to. One the library would not
        keep (``takes_provider`` says no: its topic is full) is refused uncounted."""
        peer = str(provider.peer_id)
        if peer == self._own:
            return [], provider
        addrs = [a for a in provider.addrs if len(a.to_bytes()) <= MAX_ADDR_LEN][:MAX_ADDRS]
        why = ""
        if not key.startswith(_KEY_PREFIX_BYTES):
            why = "not an atoll topic"
        elif not addrs:
            why = "no address of a sane length"
        elif not self._takes_provider(key, peer):
            why = "the topic has all the providers the library keeps"
        if why:
            self._tell("provider entry", peer, Admission(False, reason=why))
            return [], None
        now = self._clock.wall()
        admission = self.provider_ledger.admit((key, peer), peer, now + self._provider_life_s, now)
        self._tell("provider entry", peer, admission)
        kept = PeerInfo(provider.peer_id, addrs) if admission.admitted else None
        return list(admission.drops), kept

    def _tell(self, noun: str, peer: str, admission: Admission[Any]) -> None:
        """Log what ``admission`` did to peers' entries (rate-limited per peer)."""
        if admission.expired:
            logger.debug("DHT store: dropped %s", _count(len(admission.expired), f"expired {noun}"))
        victims: dict[str, int] = {}
        for _, victim in admission.evicted:
            victims[victim] = victims.get(victim, 0) + 1
        for victim, count in victims.items():
            self._say("dropped", noun, victim, count, f"oldest first; {admission.reason}")
        if not admission.admitted:
            self._say("refused", noun, peer, 1, admission.reason)

    def _say(self, verb: str, noun: str, peer: str, count: int, why: str) -> None:
        """One INFO line, unless one for ``verb``, ``noun`` and ``peer`` was logged within
        the last minute; its count covers the time since that one."""
        said = self._notices.due(f"{verb} {noun}", peer, count)
        if not said:
            return
        sender = _SENDER.get()
        withheld = self._notices.withheld()
        logger.info(
            "DHT store: %s %s of peer %s%s: %s%s",
            verb,
            _count(said, noun),
            peer,
            f" (sent by {sender})" if sender and sender != peer else "",
            why,
            f" ({withheld} more drops and refusals went unlogged: {_NOTICE_BUDGET} lines a"
            " minute at most)"
            if withheld
            else "",
        )


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural when ``n`` is not 1 ("1 value", "3 provider entries")."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") else f"{n} {noun}s"


# -- the adapter ------------------------------------------------------------------------------
class AtollDHT:
    """atoll's DHT on a running libp2p host; made by :meth:`start` only.

    Every node runs it in server mode: it answers DHT requests from atoll peers and keeps
    their records, so the swarm is its own DHT (py-libp2p servers also put client-mode
    nodes in their routing tables, which atoll does not want to rely on).
    """

    def __init__(
        self,
        host: IHost,
        kad: KadDHT,
        *,
        run_id: str | None,
        verifier: RecordVerifier,
        signer: RecordSigner,
        clock: Clock,
        timeout_s: float,
        rpc_timeout_s: float,
        max_skew_s: float,
        liveness: Liveness,
        nursery: trio.Nursery,
        kad_host: _KadHost | None = None,
        store_guard: _StoreGuard | None = None,
    ) -> None:
        self._host = host
        self._kad = kad
        self._run_id = run_id
        self._verifier = verifier
        self._signer = signer
        self._clock = clock
        self._timeout_s = timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._lookup_timeout_s = min(timeout_s, 2 * rpc_timeout_s)
        self._grace_s = min(_READ_GRACE_S, rpc_timeout_s / 4)
        self._max_skew_s = max_skew_s
        self._liveness = liveness
        self._nursery = nursery
        self._admitting: set[ID] = set()
        self._kad_host = kad_host
        self._store_guard = store_guard

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        host: IHost,
        *,
        run_id: str | None,
        verifier: RecordVerifier,
        signer: RecordSigner,
        clock: Clock,
        bootstrap: Sequence[str] = (),
        timeout_s: float = 10.0,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        liveness: Liveness | None = None,
        rpc_timeout_s: float | None = None,
        store_bounds: StoreBounds | None = None,
    ) -> AsyncIterator[AtollDHT]:
        """Run atoll's DHT on ``host`` (a started py-libp2p host) until the block exits.

        Registers the :data:`DHT_PROTOCOL` handler (server mode), starts the library's
        maintenance (routing-table refresh every 10 minutes) and, if ``bootstrap`` holds
        peer addresses (``/ip4/.../tcp/.../p2p/<id>``), calls :meth:`bootstrap` with them;
        how many answered is logged, and a node that reached none still starts (retrying
        is the caller's). ``verifier`` and ``clock`` check every record this node stores
        or reads; ``signer`` seals what it publishes. ``timeout_s`` bounds each network
        operation and ``rpc_timeout_s`` (by default ``min(3, timeout_s / 2)``, at most
        ``timeout_s``) each request to one peer (see the module docstring); ``max_skew_s``
        is the wall-clock skew allowed between peers (:mod:`atoll.dht.records`).
        ``liveness`` is the node's record of which peers answer, shared with its round
        drivers (a private one when None); the DHT notes in it, on ``trio.current_time()``,
        every peer that answered or failed, and does not ask suspected peers. ``run_id``
        None starts a run-agnostic DHT that serves and reads every run's records and
        publishes none (see the module docstring). ``store_bounds`` bounds what peers may
        make this node store (:class:`StoreBounds`; its defaults when None).

        Raises ``ConfigError`` for a malformed run id, timeout, skew, address, liveness or
        store bounds.
        An exception leaving the block comes out as raised, not wrapped in the exception
        groups of the nurseries inside.
        """
        if run_id is not None:
            try:
                check_run_id(run_id)
            except CodecError as e:
                raise ConfigError(str(e)) from None
        for name, value in (("timeout_s", timeout_s), ("max_skew_s", max_skew_s)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"AtollDHT {name} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0 or (name == "timeout_s" and value == 0):
                raise ConfigError(f"AtollDHT {name} must be finite and > 0, not {value}")
        if rpc_timeout_s is None:
            rpc_timeout_s = min(_MAX_RPC_TIMEOUT_S, timeout_s / 2)
        if isinstance(rpc_timeout_s, bool) or not isinstance(rpc_timeout_s, int | float):
            raise ConfigError(f"AtollDHT rpc_timeout_s must be a number, not {rpc_timeout_s!r}")
        if not 0 < rpc_timeout_s <= timeout_s:
            raise ConfigError(
                f"AtollDHT rpc_timeout_s must be > 0 and <= timeout_s ({timeout_s}),"
                f" not {rpc_timeout_s}"
            )
        if liveness is None:
            liveness = Liveness()
        elif not isinstance(liveness, Liveness):
            raise ConfigError(f"AtollDHT liveness must be a Liveness, not {liveness!r:.40}")
        if store_bounds is None:
            store_bounds = StoreBounds()
        elif not isinstance(store_bounds, StoreBounds):
            raise ConfigError(
                f"AtollDHT store_bounds must be StoreBounds, not {store_bounds!r:.40}"
            )
        _configure_logging()
        kad_host = _KadHost(host, liveness, float(rpc_timeout_s))
        records = _RecordValidator(verifier, clock, float(max_skew_s))
        validator = NamespacedValidator({NAMESPACE: records}, strict_validation=True)
        # the handler is registered here, through the proxy: DHT_PROTOCOL
        kad = KadDHT(
            cast(IHost, kad_host),
            DHTMode.SERVER,
            validator=validator,
            validator_changed=True,  # no pk/ipns fallbacks: /atoll/ keys only
            strict_validation=True,
        )
        # before any await: no peer's record is kept here unbounded
        guard = _StoreGuard(
            store_bounds,
            own_peer=str(host.get_id()),
            clock=clock,
            max_skew_s=float(max_skew_s),
            recall=records.recall,
            takes_provider=lambda key, peer: libp2p_internals.takes_provider(kad, key, peer),
        )
        libp2p_internals.bound_value_store(kad, guard.admit_value)
        libp2p_internals.bound_provider_store(kad, guard.admit_provider)
        # an exception of the block comes out of our nursery and the service's, wrapped
        # twice; a lone one is handed back as it was raised
        with unwrap_lone(keep_grouped=(trio.Cancelled,)):
            async with background_trio_service(kad), trio.open_nursery() as nursery:
                dht = cls(
                    host,
                    kad,
                    run_id=run_id,
                    verifier=verifier,
                    signer=signer,
                    clock=clock,
                    timeout_s=float(timeout_s),
                    rpc_timeout_s=float(rpc_timeout_s),
                    max_skew_s=float(max_skew_s),
                    liveness=liveness,
                    nursery=nursery,
                    kad_host=kad_host,
                    store_guard=guard,
                )
                kad_host.on_dht_stream = dht._admit_soon
                try:
                    logger.info(
                        "DHT %s up for %s",
                        dht.peer_id,
                        f"run {run_id[:12]}" if run_id is not None else "every run (serving only)",
                    )
                    if bootstrap:
                        await dht.bootstrap(bootstrap)
                    yield dht
                finally:
                    kad_host.on_dht_stream = None
                    # replaced, not removed: a stream still being negotiated looks its
                    # handler up after an await, and a removed one raised KeyError out of
                    # the library's multistream code (seen crashing a stopping node)
                    kad_host.set_stream_handler(LIBRARY_PROTOCOL, refuse_stream)
                    nursery.cancel_scope.cancel()

    async def probe(self, peer: str) -> bool:
        """Open (and close) one stream of :data:`DHT_PROTOCOL` to ``peer``, within
        ``rpc_timeout_s``: True when it answered. The liveness hears of the outcome either
        way. The peer's addresses must be in the host's peer store (its record put them
        there)."""
        try:
            peer_id = ID.from_base58(peer)
        except (ValueError, TypeError):
            return False
        if self._kad_host is None:
            return False
        try:
            stream = await self._kad_host.new_stream(peer_id, [LIBRARY_PROTOCOL])
        except Exception as e:  # refused, unreachable or silent: noted by the proxy
            logger.debug("probe of %s: %s", peer, _describe(e))
            return False
        with contextlib.suppress(Exception):  # it answered; the stream does not matter
            await stream.close()
        return True

    # -- what it is -------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        """This node's peer id (base58)."""
        return str(self._host.get_id())

    @property
    def value_store(self) -> Any:
        """The library's value store behind this DHT (read by :mod:`atoll.dht.status`)."""
        return libp2p_internals.value_store_of(self._kad)

    def store_usage(self) -> StoreUsage:
        """What peers of the network hold in this node's DHT stores now, this node's own
        records aside (bounded by :class:`StoreBounds`)."""
        if self._store_guard is None:
            return StoreUsage(0, 0, {}, {})
        return self._store_guard.usage()

    @property
    def run_id(self) -> str | None:
        """The run whose topics this node announces and searches; None for a run-agnostic
        (serving-only) DHT."""
        return self._run_id

    @property
    def liveness(self) -> Liveness:
        """Which peers answered or failed this node's requests (shared, if one was given
        to :meth:`start`); times on ``trio.current_time()``."""
        return self._liveness

    @property
    def rpc_timeout_s(self) -> float:
        """The bound of one request to one peer."""
        return self._rpc_timeout_s

    def routing_table_peers(self) -> list[str]:
        """The peer ids in the routing table (atoll DHT servers only), sorted."""
        return sorted(str(p) for p in libp2p_internals.routing_table_peer_ids(self._kad))

    # -- the API ----------------------------------------------------------------------------
    async def bootstrap(self, addrs: Sequence[str]) -> int:
        """Connect to the peers at ``addrs`` and fill the routing table from them.

        Each address (a multiaddr ending in ``/p2p/<id>``; this node's own is skipped) is
        dialed and asked to open a :data:`DHT_PROTOCOL` stream, within ``timeout_s``, all
        at once; a peer that accepts enters the routing table. Then one lookup of this
        node's own id (within ``timeout_s``) brings in the peers they know. Returns how
        many of ``addrs`` answered; failures are logged, not raised, and retrying with
        backoff is the caller's. Raises ``ConfigError`` on a malformed address.
        """
        infos: list[PeerInfo] = []
        for addr in addrs:
            info = parse_peer_addr(addr)
            if info.peer_id != self._host.get_id():
                infos.append(info)
        answered = 0

        async def join(info: PeerInfo) -> None:
            nonlocal answered
            if await self._join(info):
                answered += 1

        async with trio.open_nursery() as nursery:
            for info in infos:
                nursery.start_soon(join, info)
        if answered:
            await self._lookup(self._host.get_id().to_bytes(), self._timeout_s)
        logger.info(
            "DHT bootstrap: %d of %d peers answered; routing table holds %d",
            answered,
            len(infos),
            libp2p_internals.routing_table_size(self._kad),
        )
        return answered

    async def put(self, record: Record) -> None:
        """Publish ``record`` under its key: sealed by the signer, checked as its readers
        will check it, kept here and stored at the closest peers.

        Raises :class:`~atoll.dht.records.RejectedRecord` before any I/O when the record
        breaks a rule (expired or from the future on this clock, sealed by another peer
        than the record's, too large...); ``ConfigError`` when it is of another run (or
        this DHT is of none), or a newer record is already published here under its key
        (issue a fresh one); :class:`~atoll.protocol.errors.ExchangeTimeout` when
        ``timeout_s`` ran out before a quorum of the closest peers stored it (see the module
        docstring).
        """
        self._check_own_run(record)
        value = encode_value(record, self._signer)
        key = record.key()
        now = self._clock.wall()
        decode_value(value, key=key, now=now, verifier=self._verifier, max_skew_s=self._max_skew_s)
        key_bytes = key.encode("utf-8")
        held = libp2p_internals.local_value(self._kad, key_bytes)
        if held is not None and held != value:
            best = select_value(
                [value, held],
                key=key,
                now=now,
                verifier=self._verifier,
                max_skew_s=self._max_skew_s,
            )
            if best != 0:
                raise ConfigError(
                    f"a record issued at or after {record.issued_at} is already published"
                    f" under {key}; publish a newer one"
                )
        # kept here first: this node serves its own records even when no peer takes them.
        # The library would republish every locally put key each 22 h; atoll records live
        # minutes and their publisher issues fresh ones.
        libp2p_internals.keep_local_value(self._kad, key_bytes, value)

        async def store(peer: ID) -> Reply[bool]:
            since = trio.current_time()
            if await libp2p_internals.store_at_peer(self._kad, peer, key_bytes, value):
                return Reply(True)
            return self._nothing_from(peer, since)

        start = trio.current_time()
        peers = await self._closest(key)
        tally = await self._ask(
            peers, store, need=quorum.majority(len(peers)), deadline=start + self._timeout_s
        )
        stored = len(tally.values)
        if tally.timed_out:
            raise ExchangeTimeout(
                f"storing {key} took over {self._timeout_s} s: kept here and at {stored} of"
                f" {len(peers)} closest peers (a quorum is {tally.need})"
            )
        level = logging.DEBUG if tally.reached else logging.INFO
        logger.log(
            level,
            "put %s: kept here and at %d of %d closest peers, a quorum of %d%s (%.3f s)",
            key,
            stored,
            len(peers),
            tally.need,
            f"; {tally.pending} more under way" if tally.pending else "",
            trio.current_time() - start,
        )

    async def get(self, key: str) -> Record | None:
        """The newest valid record stored under ``key``, read from the network now.

        Asks the peers closest to ``key`` (and looks in this node's own store), validates
        every answer on the injected clock (seal, signer, key, expiry) and returns the
        newest valid one, or ``None`` when nobody had one. Never a cached answer. Done
        when every peer asked answered or failed, or a majority of them gave a valid
        record and a short grace passed (see the module docstring).

        Raises ``ConfigError`` when ``key`` is not a record key;
        :class:`~atoll.protocol.errors.ExchangeTimeout` when ``timeout_s`` ran out, or no
        peer asked answered, before any valid record was heard of;
        :class:`~atoll.protocol.errors.PeerUnavailable` when there was no peer to ask.
        """
        try:
            parse_key(key)
        except CodecError as e:
            raise ConfigError(f"not a record key: {e}") from None
        return await self._read(key)

    async def announce_ready(self, record: ReadyRecord) -> None:
        """Publish ``record`` (:meth:`put`) and announce this node as a provider of its
        ready topic, so that :meth:`find_ready` of the same fragment and slot finds it.

        Raises as :meth:`put` does, ``ConfigError`` when ``record`` is not a
        :class:`~atoll.dht.records.ReadyRecord` of this node, and
        :class:`~atoll.protocol.errors.ExchangeTimeout` when ``timeout_s`` ran out before
        a quorum of the closest peers took the announcement.
        """
        record = self._own_record(record, ReadyRecord, "announce_ready")
        await self.put(record)
        await self._provide(
            ready_topic(record.run_id, record.fragment, record.slot),
            f"ready for fragment {record.fragment} slot {record.slot}",
        )

    async def find_ready(self, fragment: int, slot: int, *, limit: int = 32) -> list[ReadyRecord]:
        """The valid ReadyRecords of the peers that announced ``fragment``'s sync ``slot``.

        Lists the providers of the ready topic (the closest peers to it are asked, and
        this node's own store), at most ``limit``; then fetches each one's record, from
        the provider itself first and from the DHT if that fails, 8 at a time, and keeps
        the valid ones. Sorted by peer id. A provider is only a candidate: its record
        decides.

        Raises ``ConfigError`` for a bad fragment, slot or limit; when no provider was
        found, :class:`~atoll.protocol.errors.ExchangeTimeout` if the provider lookup ran
        out of time or no peer asked answered, and
        :class:`~atoll.protocol.errors.PeerUnavailable` if there was no peer to ask.
        """
        return await self._find(
            ReadyRecord,
            "find_ready",
            limit,
            topic_of=lambda run_id: ready_topic(run_id, fragment, slot),
            key_of=lambda run_id, peer: ready_key(run_id, fragment, slot, peer),
            what=f"fragment {fragment} slot {slot}",
        )

    async def announce_attestation(self, record: AttestationRecord) -> None:
        """Publish ``record`` (:meth:`put`) and announce this node as a provider of the
        topic of its fragment and version, so that :meth:`find_attestations` finds it.

        Raises as :meth:`announce_ready` does.
        """
        record = self._own_record(record, AttestationRecord, "announce_attestation")
        await self.put(record)
        await self._provide(
            attest_topic(record.run_id, record.fragment, record.version),
            f"attestation of fragment {record.fragment} version {record.version}",
        )

    async def find_attestations(
        self, fragment: int, version: int, *, limit: int = 32
    ) -> list[AttestationRecord]:
        """The valid AttestationRecords of the peers that attested ``fragment`` at
        ``version`` (at most ``limit`` providers; the records' seals are checked, the
        attestations' own seals are the certificate check's to open). Sorted by peer id.

        Raises as :meth:`find_ready` does.
        """
        return await self._find(
            AttestationRecord,
            "find_attestations",
            limit,
            topic_of=lambda run_id: attest_topic(run_id, fragment, version),
            key_of=lambda run_id, peer: attest_key(run_id, fragment, version, peer),
            what=f"attestations of fragment {fragment} version {version}",
        )

    async def announce_evidence(self, record: EvidenceRecord) -> None:
        """Publish ``record`` (:meth:`put`) and announce this node as a provider of the
        run's evidence topic, so that :meth:`find_evidence` finds it.

        Raises as :meth:`announce_ready` does.
        """
        record = self._own_record(record, EvidenceRecord, "announce_evidence")
        await self.put(record)
        await self._provide(evidence_topic(record.run_id), "evidence of forged claims")

    async def find_evidence(self, *, limit: int = 32) -> list[EvidenceRecord]:
        """The valid EvidenceRecords of the peers that published evidence in this run (at
        most ``limit`` providers; the claims inside are the reader's to open). Sorted by
        peer id.

        Raises as :meth:`find_ready` does.
        """
        return await self._find(
            EvidenceRecord,
            "find_evidence",
            limit,
            topic_of=evidence_topic,
            key_of=evidence_key,
            what="evidence of forged claims",
        )

    async def sealed_peer_record(self, peer: str) -> bytes | None:
        """The sealed value of ``peer``'s newest valid PeerRecord as stored (its own
        signature on it, so it can be handed on as evidence): from this node's store,
        else asked of ``peer`` itself, else of the peers closest to its key. None when
        none is found."""
        key = peer_key(self._own_run("read records"), peer)
        key_bytes = key.encode("utf-8")
        held = libp2p_internals.local_value(self._kad, key_bytes)
        if held is not None and self._valid(key, held, "this node's store") is not None:
            return bytes(held)
        candidates = [ID.from_base58(peer)]
        with contextlib.suppress(RetryableError):
            candidates += [p for p in await self._closest(key) if p not in candidates]
        for holder in candidates[:4]:
            with trio.move_on_after(self._timeout_s):
                got = await self._value_of(holder, key_bytes)
                if got is not None and self._valid(key, got, f"peer {holder}") is not None:
                    return bytes(got)
        return None

    async def announce_peer(self, record: PeerRecord) -> None:
        """Publish ``record`` (:meth:`put`) and announce this node as a provider of its
        run's peers topic, so that :meth:`find_peers` finds it.

        A PeerRecord lives minutes (:data:`~atoll.dht.records.MAX_TTL_S` at most):
        announce a fresh one well before the last expires (at half its lifetime, say).

        Raises as :meth:`put` does, ``ConfigError`` when ``record`` is not a
        :class:`~atoll.dht.records.PeerRecord` of this node, and
        :class:`~atoll.protocol.errors.ExchangeTimeout` when ``timeout_s`` ran out before
        a quorum of the closest peers took the announcement.
        """
        record = self._own_record(record, PeerRecord, "announce_peer")
        await self.put(record)
        await self._provide(peers_topic(record.run_id), f"peer {record.peer_id}")

    async def find_peers(self, *, limit: int = 64) -> list[PeerRecord]:
        """The valid PeerRecords of the peers that announced themselves in this run.

        Lists the providers of the run's peers topic (the closest peers to it are asked,
        and this node's own store), at most ``limit``; then fetches each one's record, from
        the provider itself first and from the DHT if that fails, 8 at a time, and keeps
        the valid ones (this node's own too, once announced). Sorted by peer id. A provider
        is only a candidate: its record decides, so a peer that left drops out when its
        record expires.

        Raises ``ConfigError`` for a bad limit or a run-agnostic DHT; when no provider was
        found, :class:`~atoll.protocol.errors.ExchangeTimeout` if the provider lookup ran
        out of time or no peer asked answered, and
        :class:`~atoll.protocol.errors.PeerUnavailable` if there was no peer to ask.
        """
        return await self._find(
            PeerRecord,
            "find_peers",
            limit,
            topic_of=peers_topic,
            key_of=peer_key,
            what="of the run",
        )

    # -- inside -----------------------------------------------------------------------------
    def _own_run(self, doing: str) -> str:
        """This node's run id; ConfigError for a run-agnostic DHT, which cannot ``doing``."""
        if self._run_id is None:
            raise ConfigError(f"a run-agnostic DHT (run_id=None) serves records; it cannot {doing}")
        return self._run_id

    def _check_own_run(self, record: object) -> None:
        own = self._own_run("publish records")
        run_id = getattr(record, "run_id", None)
        if run_id != own:
            raise ConfigError(
                f"this DHT publishes records of run {own[:12]}, not of {run_id!r:.20}"
            )

    def _own_record(self, record: object, kind: type[_R], method: str) -> _R:
        """``record`` if it is a ``kind`` about this node (a node announces itself only),
        else ConfigError naming ``method``."""
        if not isinstance(record, kind):
            raise ConfigError(f"{method} needs a {kind.__name__}, not {type(record).__name__}")
        if record.peer_id != self.peer_id:
            raise ConfigError(f"a node announces itself, not peer {record.peer_id}")
        return record

    async def _provide(self, topic: str, what: str) -> None:
        """Announce this node as a provider of ``topic``: kept in its own provider store,
        told to the closest peers, done once a quorum of them took it (else ExchangeTimeout
        when ``timeout_s`` ran out first). ``what`` names the announcement in errors and
        logs."""
        topic_bytes = topic.encode("utf-8")
        # kept here too, and not put in providing_keys: the library would republish it
        # every 22 h, and atoll's announcements last as long as their records (a ready
        # topic is good for one sync); their publishers announce afresh
        libp2p_internals.add_local_provider(
            self._kad, topic_bytes, PeerInfo(self._host.get_id(), self._host.get_addrs())
        )

        async def tell(peer: ID) -> Reply[bool]:
            since = trio.current_time()
            if await libp2p_internals.send_add_provider(self._kad, peer, topic_bytes):
                return Reply(True)
            return self._nothing_from(peer, since)

        start = trio.current_time()
        peers = await self._closest(topic)
        tally = await self._ask(
            peers, tell, need=quorum.majority(len(peers)), deadline=start + self._timeout_s
        )
        told = len(tally.values)
        if tally.timed_out:
            raise ExchangeTimeout(
                f"announcing {what} took over {self._timeout_s} s"
                f" (told {told} of {len(peers)} closest peers, a quorum is {tally.need})"
            )
        if not told:
            logger.info("%s: no peer took the announcement (kept here)", what)
        elif not tally.reached:
            logger.info(
                "%s: told %d of %d closest peers, fewer than a quorum of %d",
                what,
                told,
                len(peers),
                tally.need,
            )

    async def _find(
        self,
        kind: type[_R],
        method: str,
        limit: int,
        *,
        topic_of: Callable[[str], str],
        key_of: Callable[[str, str], str],
        what: str,
    ) -> list[_R]:
        """The valid ``kind`` records of the providers of a topic (see :meth:`find_ready`).

        ``topic_of(run_id)`` is the topic, ``key_of(run_id, peer_id)`` a provider's record
        key; ``method`` and ``what`` name the search in errors and logs.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"{method} limit must be an int >= 1, not {limit!r}")
        run_id = self._own_run(f"search topics ({method})")
        try:
            topic = topic_of(run_id)
        except CodecError as e:
            raise ConfigError(str(e)) from None
        providers = (await self._providers(topic))[:limit]
        found: dict[str, _R] = {}
        limiter = trio.CapacityLimiter(_FETCH_CONCURRENCY)

        async def fetch(info: PeerInfo) -> None:
            async with limiter:
                record = await self._fetch(info, kind, lambda peer: key_of(run_id, peer))
            if record is not None:
                found[record.peer_id] = record

        with trio.move_on_after(self._timeout_s) as scope:
            async with trio.open_nursery() as nursery:
                for info in providers:
                    nursery.start_soon(fetch, info)
        if scope.cancelled_caught:
            logger.info(
                "%s %s: %d of %d providers' records fetched in %s s",
                method,
                what,
                len(found),
                len(providers),
                self._timeout_s,
            )
        return [found[p] for p in sorted(found)]

    def _admit_soon(self, peer_id: ID) -> None:
        """The peer accepted a stream of DHT_PROTOCOL: admit it to the routing table (in
        a task, so the library's stream goes on at once)."""
        if peer_id in self._admitting or libp2p_internals.in_routing_table(self._kad, peer_id):
            return
        self._admitting.add(peer_id)
        try:
            self._nursery.start_soon(self._admit, peer_id)
        except RuntimeError:  # the nursery is closed: shutting down
            self._admitting.discard(peer_id)

    async def _admit(self, peer_id: ID) -> None:
        try:
            # a full bucket pings its oldest peer first; bound it
            with trio.move_on_after(self._timeout_s):
                await libp2p_internals.admit_to_routing_table(self._kad, peer_id)
        finally:
            self._admitting.discard(peer_id)

    async def _join(self, info: PeerInfo) -> bool:
        """Dial one bootstrap peer and check that it serves DHT_PROTOCOL; admit it."""
        peer = str(info.peer_id)
        # the swarm refuses for a while to dial a peer whose addresses all failed; a
        # bootstrap, maybe of a peer that just came back, deserves a real try
        libp2p_internals.clear_dial_backoff(self._host, peer)
        with trio.move_on_after(self._timeout_s):
            try:
                await self._host.connect(info)
                stream = await self._host.new_stream(info.peer_id, [DHT_PROTOCOL])
            except Exception as e:
                logger.info("bootstrap peer %s did not answer: %s", peer, _describe(e))
                return False
            try:
                await stream.close()
            except Exception as e:  # the peer is there; the check stream does not matter
                logger.debug("closing the check stream to %s failed: %s", peer, _describe(e))
            admitted = await libp2p_internals.admit_to_routing_table(
                self._kad, PeerInfo(info.peer_id, info.addrs)
            )
            if not admitted:
                logger.info("bootstrap peer %s answered; its bucket is full", peer)
            return True
        logger.info("bootstrap peer %s: no answer within %s s", peer, self._timeout_s)
        return False

    async def _closest(self, key: str) -> list[ID]:
        """The (up to 20) peers closest to ``key`` in the network to ask now, this node
        excluded: an iterative FIND_NODE lookup of :func:`_lookup_target` of the key (see
        :meth:`_lookup`), less the suspected peers (all of them if every one is)."""
        closest = await self._lookup(_lookup_target(key), self._lookup_timeout_s)
        own_id = self._host.get_id()
        return quorum.without_skipped(
            [p for p in closest if p != own_id], self._liveness, trio.current_time()
        )

    async def _lookup(self, target: bytes, bound: float) -> list[ID]:
        """The library's iterative lookup of ``target``, that leaves out silent peers
        (:data:`_IN_LOOKUP`), within ``bound`` seconds; past that, the routing table's
        closest peers."""
        found: list[ID] = []
        token = _IN_LOOKUP.set(True)
        try:
            with trio.move_on_after(bound) as scope:
                found = await libp2p_internals.find_closest_peers(self._kad, target)
        finally:
            _IN_LOOKUP.reset(token)
        if scope.cancelled_caught:
            found = libp2p_internals.routing_table_closest(self._kad, target, _CLOSEST)
            logger.info(
                "a lookup took over %s s: asking the routing table's %d closest peers",
                bound,
                len(found),
            )
        return found

    async def _ask(
        self,
        peers: Sequence[ID],
        call: Callable[[ID], Awaitable[Reply[_T]]],
        *,
        need: int,
        deadline: float,
        grace_s: float = 0.0,
    ) -> Tally[ID, _T]:
        """:func:`atoll.dht.quorum.ask` with this DHT's liveness, bounds and nursery."""
        return await quorum.ask(
            peers,
            call,
            need=need,
            liveness=self._liveness,
            rpc_timeout_s=self._rpc_timeout_s,
            grace_s=grace_s,
            deadline=deadline,
            concurrency=_QUERY_CONCURRENCY,
            background=self._nursery,
        )

    def _nothing_from(self, peer: ID, since: float) -> Reply[Any]:
        """The reply of a request to ``peer`` that brought nothing back (the library's
        one-peer requests say False, None or [] for "refused", "had none" and "failed"
        alike): an answer when a stream to the peer opened since ``since`` and nothing
        failed after (:class:`_KadHost` notes both), else no answer."""
        name = str(peer)
        if self._liveness.silent(name):
            return Reply(answered=False, reason="unreachable")
        if self._liveness.refused_since(name, since):
            return Reply(answered=False, refused=True, reason="reset the DHT stream")
        heard = self._liveness.heard_at(name)
        if heard is not None and heard >= since:
            return Reply(None)
        return Reply(answered=False, reason="unreachable")

    def _valid(self, key: str, value: bytes, source: str) -> Record | None:
        """The record ``value`` holds for ``key`` if it passes every rule now, else None."""
        try:
            return decode_value(
                value,
                key=key,
                now=self._clock.wall(),
                verifier=self._verifier,
                max_skew_s=self._max_skew_s,
            )
        except RejectedRecord as e:
            # servers serve what they hold unvalidated (an expired record, say): normal
            # for "expired", a broken or hostile peer for the rest
            level = logging.DEBUG if e.rule == "expired" else logging.INFO
            logger.log(level, "%s held a refused value for %s: %s", source, key, e)
            return None

    async def _read(self, key: str) -> Record | None:
        """See :meth:`get`: this node's store and the closest peers, asked now; done when
        every one answered or failed, or a majority of them gave a valid record and
        :data:`_READ_GRACE_S` more passed."""
        key_bytes = key.encode("utf-8")
        best: Record | None = None

        def consider(record: Record | None) -> None:
            nonlocal best
            if record is not None and (best is None or is_newer(record, best)):
                best = record

        held = libp2p_internals.local_value(self._kad, key_bytes)
        if held is not None:
            consider(self._valid(key, held, "this node's store"))

        async def ask(peer: ID) -> Reply[Record]:
            since = trio.current_time()
            got = await libp2p_internals.value_from_peer(self._kad, peer, key_bytes)
            if got is None:
                return self._nothing_from(peer, since)
            return Reply(self._valid(key, got, f"peer {peer}"))

        start = trio.current_time()
        peers = await self._closest(key)
        tally = await self._ask(
            peers,
            ask,
            need=quorum.majority(len(peers)),
            deadline=start + self._timeout_s,
            grace_s=self._grace_s,
        )
        for _, record in tally.values:
            consider(record)
        if best is not None:
            return best
        if tally.timed_out:
            raise ExchangeTimeout(f"no valid record for {key} within {self._timeout_s} s")
        if not peers:
            raise PeerUnavailable(f"no DHT peer to ask for {key}: bootstrap first")
        if not tally.answered:
            raise ExchangeTimeout(
                f"no valid record for {key}: none of the {len(peers)} closest peers answered"
                f" within {self._rpc_timeout_s} s"
            )
        return None

    async def _providers(self, topic: str) -> list[PeerInfo]:
        """The providers of ``topic``: this node's provider store, and every closest peer
        asked now (never the library's cache of earlier answers), each within
        ``rpc_timeout_s``."""
        key_bytes = topic.encode("utf-8")
        found: dict[ID, PeerInfo] = {
            p.peer_id: p for p in libp2p_internals.local_providers(self._kad, key_bytes)
        }

        async def ask(peer: ID) -> Reply[list[PeerInfo]]:
            since = trio.current_time()
            providers = await libp2p_internals.providers_from_peer(self._kad, peer, key_bytes)
            if providers:
                return Reply(providers)
            nothing = self._nothing_from(peer, since)
            return Reply([]) if nothing.answered else nothing

        start = trio.current_time()
        peers = await self._closest(topic)
        tally = await self._ask(peers, ask, need=len(peers), deadline=start + self._timeout_s)
        for _, providers in tally.values:
            for info in providers:
                found.setdefault(info.peer_id, info)
        if not found:
            if tally.timed_out:
                raise ExchangeTimeout(f"no provider of {topic} within {self._timeout_s} s")
            if not peers:
                raise PeerUnavailable(f"no DHT peer to ask for {topic}: bootstrap first")
            if not tally.answered:
                raise ExchangeTimeout(
                    f"no provider of {topic}: none of the {len(peers)} closest peers answered"
                    f" within {self._rpc_timeout_s} s"
                )
        return list(found.values())

    async def _value_of(self, peer: ID, key_bytes: bytes) -> bytes | None:
        """The value ``peer`` holds under ``key_bytes``, asked within ``rpc_timeout_s`` (its
        liveness noted); None when it had none or did not answer."""

        async def ask(provider: ID) -> Reply[bytes]:
            since = trio.current_time()
            value = await libp2p_internals.value_from_peer(self._kad, provider, key_bytes)
            return Reply(value) if value is not None else self._nothing_from(provider, since)

        tally = await self._ask([peer], ask, need=1, deadline=math.inf)
        return tally.values[0][1] if tally.values else None

    async def _fetch(
        self, info: PeerInfo, kind: type[_R], key_of: Callable[[str], str]
    ) -> _R | None:
        """The valid ``kind`` record of provider ``info``, stored under ``key_of(peer_id)``:
        asked of the provider (which holds the record it published) within
        ``rpc_timeout_s`` unless it is suspected, else read from the DHT. None if there is
        none."""
        peer = str(info.peer_id)
        try:
            key = key_of(peer)
        except CodecError as e:  # a peer id atoll's keys cannot hold (an RSA key's, say)
            logger.info("provider %s cannot have a %s: %s", peer, kind.__name__, e)
            return None
        key_bytes = key.encode("utf-8")
        own = info.peer_id == self._host.get_id()
        if info.addrs and not own:
            self._host.get_peerstore().add_addrs(info.peer_id, info.addrs, _PROVIDER_ADDR_TTL_S)
        # the provider holds the record it published (this node's own: in its store)
        got: bytes | None = None
        if own:
            got = libp2p_internals.local_value(self._kad, key_bytes) or None
        elif not self._liveness.skipped(peer, trio.current_time()):
            got = await self._value_of(info.peer_id, key_bytes)
        record: Record | None = None
        if got is not None:
            record = self._valid(key, got, f"provider {peer}")
        if record is None and not own:
            try:
                record = await self._read(key)
            except RetryableError as e:
                logger.debug("no %s of provider %s: %s", kind.__name__, peer, e)
                return None
        return record if isinstance(record, kind) else None


# -- helpers --------------------------------------------------------------------------------
def _lookup_target(key: str) -> bytes:
    """Where ``key`` lives in the Kademlia key space, as a FIND_NODE target: the sha2-256
    multihash of the key's UTF-8 bytes (34 bytes).

    Not the key itself, as the library's own ``put_value``, ``get_value`` and ``provide``
    use: a py-libp2p server answers FIND_NODE only for a key that decodes as a multihash
    or is 2 to 50 bytes long, and resets the stream otherwise, so a lookup of a
    ``/atoll/v1/...`` key (52 to 128 bytes) never gets past the peers already known.
    Every atoll node stores and reads at the peers closest to this target.
    """
    return b"\x12\x20" + hashlib.sha256(key.encode("utf-8")).digest()


_KAD_LOGGERS = (
    "libp2p.kad_dht.kad_dht",
    "libp2p.kad_dht.value_store",
    "libp2p.kad_dht.provider_store",
    "libp2p.kad_dht.peer_routing",
)
_MAX_LOG_CHARS = 400  # the library logs whole refused values in hex (up to 9 KB a line)


class _KadLogFilter(logging.Filter):
    """Drops the warning py-libp2p's DHT server logs when a client ends its stream the
    normal way (its reader raises StreamEOF where it expects an empty read, so every
    request left a "Failed to read DHT message from stream: " line) and the one its lookup
    logs for each silent peer :class:`_KadHost` leaves out (expected, once per lookup), and
    clips long lines (a peer could otherwise fill the log with the hex of the values it
    gets refused)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            isinstance(record.msg, str)
            and record.msg.startswith("Failed to read DHT message from stream")
            and isinstance(record.args, tuple)
            and record.args
            and isinstance(record.args[0], StreamEOF)
        ):
            return False
        text = record.getMessage()
        if _LEFT_OUT in text or libp2p_internals.REFUSED_BY_BOUND in text:
            return False
        if len(text) > _MAX_LOG_CHARS:
            record.msg = text[: _MAX_LOG_CHARS - 3] + "..."
            record.args = None
        return True


def _configure_logging() -> None:
    """Install :class:`_KadLogFilter` on the library's DHT loggers (idempotent); their
    levels and handlers stay the node's to set."""
    for name in _KAD_LOGGERS:
        lg = logging.getLogger(name)
        if not any(isinstance(f, _KadLogFilter) for f in lg.filters):
            lg.addFilter(_KadLogFilter())


def _describe(error: BaseException) -> str:
    text = str(error)
    name = type(error).__name__
    return f"{name}: {text}" if text else name


async def refuse_stream(stream: INetStream) -> None:
    """The handler of a protocol this host no longer serves: reset the stream (shielded,
    bounded; errors of a connection already gone are ignored)."""
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + 5.0
        try:
            await stream.reset()
        except Exception as e:
            logger.debug("resetting a refused stream failed: %s", e)

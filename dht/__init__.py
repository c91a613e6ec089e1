"""atoll.dht: peer discovery over the libp2p Kademlia DHT (a sans-IO core and one adapter).

Map of the modules:

- ``keys``       the key schema: ``/atoll/v1/<run tag>/...`` record and topic keys, parsing
- ``records``    typed, sealed, expiring records (peer, ready, state, attestation) and
                 their rules
- ``directory``  one node's view of its run, built from records, on an injected clock
- ``storebound`` how much peers may make this node's DHT stores keep: the bounds, the
                 eviction ledger, and the limiter of its log lines (which reads the
                 monotonic clock unless handed one); ``kad``'s store gates apply them
- ``kad``        the network adapter: py-libp2p's Kademlia DHT under ``/atoll/kad/1.0.0``
                 (``AtollDHT``, trio); not re-exported here, so importing the package
                 loads no libp2p

Apart from ``kad``, nothing here opens a socket, imports libp2p or reads a clock: bytes
and time go in, records and views come out. The package imports :mod:`atoll.protocol`
only (and ``kad`` libp2p and trio); what it needs from elsewhere it declares as small
protocols that :mod:`atoll.security` implements and the node injects:
:class:`~atoll.dht.records.RecordSigner`, :class:`~atoll.dht.records.RecordVerifier` and
:class:`~atoll.dht.directory.Clock`.

Adapter notes
-------------
What the networking adapter (:mod:`atoll.dht.kad`, whose docstring adds what writing it
taught) has to know about py-libp2p 0.8.1's ``libp2p.kad_dht`` (read in its source,
``kad_dht.py``, ``value_store.py``, ``routing_table.py``, ``peer_routing.py``,
``provider_store.py``, ``common.py``):

- Put and get. ``await dht.put_value(key: str, value: bytes) -> None`` runs
  ``validator.validate(key, value)`` locally (an exception propagates), refuses to replace
  a local value unless ``validator.select(key, [new, old]) == 0``, stores locally, then
  sends PUT_VALUE to the closest peers (10 at a time, 10 s each); how many accepted is only
  logged. ``await dht.get_value(key: str, quorum=0) -> bytes | None`` returns a *local*
  hit at once and unvalidated; otherwise it asks the network, validates every answer,
  picks one with ``select`` and caches it locally for 24 h. So a second ``get_value`` of a
  key never sees a newer record: the adapter must drop the cached entry
  (``dht.value_store.remove(key.encode())``) or query peers itself, and must run
  :func:`~atoll.dht.records.decode_value` on whatever comes back. Keys are ``str``, sent
  as their UTF-8 bytes; Kademlia distance is taken on their sha256.
- Sizes. Serving peers refuse a serialized record over ``MAX_RECORD_SIZE`` (1 MiB) and
  any RPC over 4 MiB; GET_VALUE and GET_PROVIDERS keys over 128 bytes and ADD_PROVIDER
  keys over 80 are dropped. Hence atoll's 4 KiB records and the run *tag* in keys
  (:mod:`atoll.dht.keys` keeps record keys <= 128 and topic keys <= 80 bytes). The value
  store holds at most 50,000 entries (oldest evicted) and keeps each one 24 h
  (``DEFAULT_TTL``) whatever the value says: atoll's ``expires_at`` is enforced only by
  atoll's validator. A server answers GET_VALUE from its store *without* running the
  validator, so expired atoll records are still served; readers refuse them.
- Validator hook: yes. ``libp2p.records.validator.Validator`` has ``validate(key: str,
  value: bytes) -> None`` (raise to refuse) and ``select(key: str, values: list[bytes]) ->
  int`` (index of the best; on PUT the held value comes first and index 0 keeps it). A
  ``NamespacedValidator`` dispatches on the key's first segment, here ``atoll``:
  ``dht.register_validator("atoll", v)``. Pass ``strict_validation=True`` or keys outside
  registered namespaces are accepted unchecked (a ``BlankValidator``); the defaults also
  register ``pk`` and ``ipns``. The hook gets no time: the adapter's validator reads the
  injected clock and calls :func:`~atoll.dht.records.decode_value` and
  :func:`~atoll.dht.records.select_value`. Every PUT also wraps the value in a libp2p
  ``Record`` signed by the *storing* host ("libp2p-record:" + key + value), checked only
  when present: it says who stored a copy, not who wrote it, hence atoll's own seal.
- Protocol id. ``KadDHT(protocol_prefix=...)`` only stores the prefix (``validate_config``
  skips its /ipfs checks when it differs). Every stream uses the constant ``PROTOCOL_ID =
  "/ipfs/kad/1.0.0"`` of ``common.py``, imported by name into ``kad_dht.py`` (handler in
  ``__init__`` and ``switch_mode``), ``value_store.py`` (``_store_at_peer``,
  ``_get_from_peer``), ``peer_routing.py`` (``_query_peer_for_closest``) and
  ``provider_store.py`` (``_send_add_provider``, ``_get_providers_from_peer_with_closers``);
  ``routing_table.py`` reads ``common.PROTOCOL_ID`` at call time to admit only peers whose
  identify protocols list it (DHT servers).
- What to subclass or wrap. A ``Validator`` for the ``atoll`` namespace (above). For an
  atoll protocol id (``/atoll/kad/1.0.0``) either subclass ``KadDHT``, ``ValueStore``,
  ``PeerRouting`` and ``ProviderStore``, copying the five stream-opening methods and
  the handler registration above, or, with no
  library code copied, hand ``KadDHT`` a thin host proxy that maps the /ipfs id to the
  atoll one in ``new_stream``, ``set_stream_handler`` and ``remove_stream_handler``, and
  back in the peerstore's ``get_protocols`` (the routing-table check). Patching the
  module constants works too but is process-wide. Test that a peer speaking only
  ``/ipfs/kad/1.0.0`` never enters the routing table.
- Many writers, one key. A key holds a single value, so "who is ready for this slot" uses
  provider records: ``await dht.provide(topic)`` and ``await dht.find_providers(topic,
  count=20) -> list[PeerInfo]`` on the topic keys of :mod:`atoll.dht.keys` (they contain
  ``/``, so ``_encode_key`` sends them as UTF-8), then one ``get_value`` per provider's
  record key. Provider records live 48 h (republished every 22 h) and are not validated,
  so a provider is a candidate only; its record decides. A server accepts at most 10
  ADD_PROVIDER per peer per 10 s.
"""

from atoll.dht.directory import Clock, DirectorySummary, FragmentSummary, PeerDirectory
from atoll.dht.keys import (
    KEY_PREFIX,
    MAX_KEY_BYTES,
    MAX_TOPIC_BYTES,
    NAMESPACE,
    AttestKey,
    PeerKey,
    ReadyKey,
    RecordKey,
    StateKey,
    attest_key,
    attest_topic,
    parse_key,
    peer_key,
    peers_topic,
    ready_key,
    ready_topic,
    run_tag,
    state_key,
    state_topic,
)
from atoll.dht.records import (
    DEFAULT_MAX_SKEW_S,
    MAX_RECORD_BYTES,
    MAX_TTL_S,
    MAX_VALUE_BYTES,
    RECORD_DOMAIN,
    AttestationRecord,
    PeerRecord,
    ReadyRecord,
    Record,
    RecordSigner,
    RecordVerifier,
    RejectedRecord,
    StateRecord,
    check_record,
    decode_value,
    encode_value,
    is_newer,
    select_value,
    validate,
)

__all__ = [
    "DEFAULT_MAX_SKEW_S",
    "KEY_PREFIX",
    "MAX_KEY_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_TOPIC_BYTES",
    "MAX_TTL_S",
    "MAX_VALUE_BYTES",
    "NAMESPACE",
    "RECORD_DOMAIN",
    "AttestKey",
    "AttestationRecord",
    "Clock",
    "DirectorySummary",
    "FragmentSummary",
    "PeerDirectory",
    "PeerKey",
    "PeerRecord",
    "ReadyKey",
    "ReadyRecord",
    "Record",
    "RecordKey",
    "RecordSigner",
    "RecordVerifier",
    "RejectedRecord",
    "StateKey",
    "StateRecord",
    "attest_key",
    "attest_topic",
    "check_record",
    "decode_value",
    "encode_value",
    "is_newer",
    "parse_key",
    "peer_key",
    "peers_topic",
    "ready_key",
    "ready_topic",
    "run_tag",
    "select_value",
    "state_key",
    "state_topic",
    "validate",
]

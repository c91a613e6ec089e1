"""What peers may make a node's DHT store keep (atoll.dht.storebound, and atoll.dht.kad's
gates), without sockets: the eviction rule of :class:`~atoll.dht.storebound.StoreLedger`,
the gates that apply it to values and provider entries, their rate-limited log lines, and
the hooks that put the gates in front of a real (unstarted) py-libp2p ``KadDHT``'s
stores."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import multiaddr
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record as KadRecord
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from atoll.dht import libp2p_internals
from atoll.dht.kad import AtollDHT, _StoreGuard
from atoll.dht.keys import BASE58_ALPHABET, peer_key, ready_key, ready_topic
from atoll.dht.records import MAX_ADDRS, MAX_TTL_S, ReadyRecord, Record
from atoll.dht.storebound import (
    FAIR_SHARE,
    MAX_STORED,
    MAX_STORED_PER_PEER,
    StoreBounds,
    StoreLedger,
    _Notices,
)
from atoll.protocol.errors import ConfigError

RUN = "b0d5" * 16
NOW = 1_000_000.0
LATER = NOW + 300  # when the entries of these tests expire, unless said otherwise


def peer(name: str, i: int = 0) -> str:
    """A base58 peer id text for ``name`` and ``i`` (no real key behind it)."""
    return "Qm" + name + BASE58_ALPHABET[i % 58] + BASE58_ALPHABET[i // 58 % 58]


def ledger(total: int = 8, per_peer: int = 4, fair_share: int = 2) -> StoreLedger[str]:
    return StoreLedger(StoreBounds(total, per_peer, fair_share))


def fill(book: StoreLedger[str], who: str, n: int, *, expires_at: float = LATER) -> list[str]:
    """Admit ``n`` entries of ``who`` (named ``who/0``...), each admitted; their keys."""
    keys = [f"{who}/{book.held_by(who) + i}" for i in range(n)]
    for key in keys:
        assert book.admit(key, who, expires_at, NOW).admitted, key
    return keys


# -- the bounds -----------------------------------------------------------------------------------
def test_the_default_bounds_are_a_few_thousand_in_all_and_a_few_hundred_per_peer() -> None:
    bounds = StoreBounds()
    assert (bounds.total, bounds.per_peer, bounds.fair_share) == (
        MAX_STORED,
        MAX_STORED_PER_PEER,
        FAIR_SHARE,
    )
    assert 1000 <= bounds.total <= 10_000 and 100 <= bounds.per_peer <= 1000
    assert bounds.fair_share < bounds.per_peer < bounds.total


@pytest.mark.parametrize(
    "args",
    [(0, 1, 0), (4, 5, 1), (8, 0, 0), (8, 4, 4), (8, 4, -1), (8.0, 4, 1), (True, 1, 0)],
)
def test_bounds_that_make_no_sense_are_refused(args: tuple[Any, Any, Any]) -> None:
    with pytest.raises(ConfigError):
        StoreBounds(*args)


def test_start_refuses_store_bounds_of_another_type() -> None:
    """Checked before anything starts (no socket is opened)."""
    host = new_host(key_pair=create_new_key_pair())

    async def body() -> None:
        async with AtollDHT.start(
            host,
            run_id=RUN,
            verifier=None,  # type: ignore[arg-type]
            signer=None,  # type: ignore[arg-type]
            clock=FixedClock(),
            store_bounds=(8, 4, 2),  # type: ignore[arg-type]
        ):
            raise AssertionError("started")

    with pytest.raises(ConfigError, match="store_bounds"):
        trio.run(body)


# -- the ledger: the eviction rule ------------------------------------------------------------
def test_under_the_bounds_everything_is_kept_and_a_newer_record_takes_no_room() -> None:
    book = ledger()
    fill(book, "a", 4)
    fill(book, "b", 4)
    assert len(book) == 8
    again = book.admit("a/0", "a", LATER + 10, NOW)  # a newer record of a key held
    assert again.admitted and again.drops == ()
    assert len(book) == 8 and book.usage() == {"a": 4, "b": 4}


def test_a_peer_at_its_bound_evicts_its_own_oldest_first() -> None:
    book = ledger(total=100, per_peer=4)
    honest = fill(book, "honest", 3)
    flood = fill(book, "flood", 4)
    got = book.admit("flood/new", "flood", LATER, NOW)
    assert got.admitted and got.evicted == ((flood[0], "flood"),) and got.expired == ()
    assert "over its 4" in got.reason
    assert book.held_by("flood") == 4 and all(k in book for k in honest)
    # the key refreshed last is the newest: the next eviction takes the oldest other one
    assert book.admit(flood[1], "flood", LATER, NOW).drops == ()
    assert book.admit("flood/newer", "flood", LATER, NOW).evicted == ((flood[2], "flood"),)


def test_a_peer_at_its_bound_loses_its_expired_entries_before_a_live_one() -> None:
    book = ledger(total=100, per_peer=4)
    old = fill(book, "p", 2, expires_at=NOW - 1)
    live = fill(book, "p", 2)
    got = book.admit("p/new", "p", LATER, NOW)
    assert got.admitted and set(got.expired) == set(old) and got.evicted == ()
    assert all(k in book for k in live) and book.held_by("p") == 3


def test_at_the_total_the_expired_go_first_whoever_holds_them() -> None:
    book = ledger(total=6, per_peer=4, fair_share=1)
    stale = fill(book, "honest", 2, expires_at=NOW)  # expires_at reached: expired
    flood = fill(book, "flood", 4)
    got = book.admit("sybil/0", "sybil", LATER, NOW)
    assert got.admitted and set(got.expired) == set(stale) and got.evicted == ()
    assert all(k in book for k in flood)


def test_at_the_total_the_peer_holding_the_most_loses_its_oldest() -> None:
    book = ledger(total=8, per_peer=6, fair_share=2)
    honest = fill(book, "honest", 2)
    flood = fill(book, "flood", 6)
    for i in range(4):  # fresh identities, one entry each
        got = book.admit(f"sybil{i}/0", f"sybil{i}", LATER, NOW)
        assert got.admitted and got.evicted == ((flood[i], "flood"),), got
        assert "the most" in got.reason
    assert book.held_by("flood") == 2 and all(k in book for k in honest)
    assert len(book) == 8


def test_when_nobody_holds_over_its_fair_share_a_new_entry_is_refused() -> None:
    """Many fresh identities with a few entries each fill the free room, then are
    refused: what honest peers hold within their fair share stays."""
    book = ledger(total=8, per_peer=4, fair_share=2)
    honest = fill(book, "honest", 2)
    sybils = [key for i in range(3) for key in fill(book, f"sybil{i}", 2)]
    refused = book.admit("sybil9/0", "sybil9", LATER, NOW)
    assert not refused.admitted and refused.drops == ()
    assert "no peer holds over 2" in refused.reason
    assert all(k in book for k in honest) and len(book) == 8
    # a newer record of a key already held still passes at the total
    assert book.admit(honest[0], "honest", LATER + 60, NOW).admitted
    # and once the entries expired, there is room again (the newer record lives on)
    later = LATER + 1
    fresh = book.admit("honest/new", "honest", later + 300, later)
    assert fresh.admitted and set(fresh.expired) == {honest[1], *sybils}
    assert book.usage() == {"honest": 2} and honest[0] in book


def test_an_arriving_peer_tied_for_the_most_evicts_its_own() -> None:
    book = ledger(total=8, per_peer=6, fair_share=2)
    a = fill(book, "a", 4)
    b = fill(book, "b", 4)
    got = book.admit("a/new", "a", LATER, NOW)
    assert got.evicted == ((a[0], "a"),) and all(k in book for k in b)


def test_the_peer_that_reached_the_top_count_last_is_evicted_among_ties() -> None:
    book = ledger(total=8, per_peer=6, fair_share=2)
    fill(book, "early", 4)
    late = fill(book, "late", 4)
    got = book.admit("other/0", "other", LATER, NOW)
    assert got.evicted == ((late[0], "late"),)


def test_forget_stops_counting_an_entry() -> None:
    book = ledger()
    keys = fill(book, "a", 2)
    book.forget(keys[0])
    book.forget("never/held")
    assert book.usage() == {"a": 1} and keys[0] not in book
    book.forget(keys[1])
    assert book.usage() == {} and len(book) == 0


@st.composite
def arrivals(draw: st.DrawFn) -> list[tuple[int, int, int, int]]:
    """(peer, key, lifetime, clock step) of each arriving entry."""
    return draw(
        st.lists(
            st.tuples(
                st.integers(0, 6),
                st.integers(0, 40),
                st.integers(1, 50),
                st.integers(0, 3),
            ),
            max_size=200,
        )
    )


@settings(max_examples=150, deadline=None)
@given(arrivals(), st.integers(1, 12), st.integers(1, 12), st.integers(0, 11))
def test_the_bounds_hold_and_a_fair_share_is_never_evicted_for_another(
    seq: list[tuple[int, int, int, int]], total: int, per_peer: int, fair_share: int
) -> None:
    per_peer = min(per_peer, total)
    fair_share = min(fair_share, per_peer - 1)
    book: StoreLedger[str] = StoreLedger(StoreBounds(total, per_peer, fair_share))
    model: dict[str, tuple[str, float]] = {}  # key -> (peer, expires_at): what is kept
    now = 0.0
    for who, k, life, step in seq:
        now += step
        owner = f"p{who}"
        key = f"{owner}/{k}"  # a key names its peer, as atoll's do
        got = book.admit(key, owner, now + life, now)
        for gone in got.expired:
            assert model.pop(gone)[1] <= now  # only the expired are dropped as such
        for gone, victim in got.evicted:
            assert model.pop(gone)[0] == victim
            if victim != owner:  # evicted for another peer's entry: over its fair share
                held = sum(1 for o, _ in model.values() if o == victim) + 1
                assert held > fair_share
        if got.admitted:
            model[key] = (owner, now + life)
        assert len(book) == len(model) <= total
        counts: dict[str, int] = {}
        for o, _ in model.values():
            counts[o] = counts.get(o, 0) + 1
        assert book.usage() == counts
        assert all(n <= per_peer for n in counts.values())
        assert not got.admitted or key in book


# -- the rate-limited log lines ---------------------------------------------------------------
@dataclass
class FakeTime:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_notice_is_due_once_a_minute_per_peer_with_the_count_held_back() -> None:
    clock = FakeTime()
    notices = _Notices(60.0, now=clock)
    assert notices.due("refused value", "a") == 1
    assert notices.due("refused value", "a", 5) == 0
    assert notices.due("refused value", "b") == 1  # another peer
    assert notices.due("dropped value", "a") == 1  # another kind
    clock.t = 59.9
    assert notices.due("refused value", "a") == 0
    clock.t = 60.0
    assert notices.due("refused value", "a") == 7


def test_notices_say_a_bounded_number_of_lines_a_minute_for_all_peers_together() -> None:
    clock = FakeTime()
    notices = _Notices(60.0, budget=3, now=clock)
    said = [notices.due("refused value", f"sybil{i}") for i in range(10)]
    assert said == [1, 1, 1] + [0] * 7
    assert notices.withheld() == 7 and notices.withheld() == 0
    clock.t = 60.0
    assert notices.due("refused value", "sybil9", 2) == 2  # what was withheld is not owed
    assert len(notices._pending) == 0


def test_notices_remember_a_bounded_number_of_peers() -> None:
    clock = FakeTime()
    notices = _Notices(60.0, budget=1000, capacity=10, now=clock)
    for i in range(100):
        assert notices.due("refused value", f"p{i}") == 1
        assert len(notices._said) <= 10 and len(notices._pending) <= 10
    clock.t = 61.0
    assert notices.due("refused value", "p99") == 1


# -- the gates ---------------------------------------------------------------------------------
@dataclass
class FixedClock:
    t: float = NOW

    def wall(self) -> float:
        return self.t


OWN = peer("Mine")


def ready(who: str, slot: int, expires_at: float = LATER) -> ReadyRecord:
    return ReadyRecord(RUN, 1, slot, who, 1, "00" * 32, 1.0, NOW, NOW, expires_at)


def guard(
    bounds: StoreBounds, records: dict[tuple[str, bytes], Record], clock: FixedClock
) -> _StoreGuard:
    """A gate whose validator "opened" exactly ``records`` (key text, value) -> record."""
    return _StoreGuard(
        bounds,
        own_peer=OWN,
        clock=clock,
        max_skew_s=30.0,
        recall=lambda key, value: records.get((key, value)),
        notices=_Notices(60.0, now=FakeTime()),
    )


def offer(gate: _StoreGuard, records: dict[tuple[str, bytes], Record], record: Record) -> Any:
    """Hand the gate ``record`` as a peer's PUT_VALUE would."""
    key = record.key()
    value = f"sealed {key}".encode()
    records[(key, value)] = record
    return gate.admit_value(key.encode(), value)


def test_the_value_gate_counts_each_value_for_its_signer_and_drops_its_oldest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    records: dict[tuple[str, bytes], Record] = {}
    gate = guard(StoreBounds(6, 3, 1), records, FixedClock())
    flood, honest = peer("Fxxd"), peer("Honest")
    assert offer(gate, records, ready(honest, 1)) == ([], None)
    with caplog.at_level(logging.INFO, logger="atoll.dht.kad"):
        for slot in range(3):
            assert offer(gate, records, ready(flood, slot)) == ([], None)
        drop, refusal = offer(gate, records, ready(flood, 3))
        for slot in range(4, 10):
            offer(gate, records, ready(flood, slot))
    assert refusal is None and drop == [ready_key(RUN, 1, 0, flood).encode()]
    assert gate.usage().values_by_signer == {honest: 1, flood: 3}
    lines = [r.getMessage() for r in caplog.records if "DHT store" in r.getMessage()]
    assert len(lines) == 1, lines  # rate-limited: one line a minute per peer and kind
    assert f"dropped 1 value of peer {flood}" in lines[0] and "over its 3" in lines[0]


def test_the_value_gate_refuses_when_the_store_is_full_of_fair_shares(
    caplog: pytest.LogCaptureFixture,
) -> None:
    records: dict[tuple[str, bytes], Record] = {}
    gate = guard(StoreBounds(4, 3, 1), records, FixedClock())
    sybils = [peer("Sybi", i) for i in range(5)]
    for who in sybils[:4]:
        assert offer(gate, records, ready(who, 1)) == ([], None)
    with caplog.at_level(logging.INFO, logger="atoll.dht.kad"):
        drop, refusal = offer(gate, records, ready(sybils[4], 1))
    assert drop == [] and refusal is not None and "no peer holds over 1" in refusal
    assert f"refused 1 value of peer {sybils[4]}" in caplog.text
    assert gate.usage().values == 4


def test_this_nodes_own_records_pass_uncounted_and_odd_keys_are_refused() -> None:
    records: dict[tuple[str, bytes], Record] = {}
    gate = guard(StoreBounds(1, 1, 0), records, FixedClock())
    for slot in range(5):
        assert offer(gate, records, ready(OWN, slot)) == ([], None)
    assert gate.usage().values == 0
    assert gate.admit_value(b"/atoll/v1/nonsense", b"x")[1] == "not a record key"
    assert gate.admit_value(b"\xff\xfe", b"x")[1] == "not a record key"
    key = peer_key(RUN, peer("Unopened")).encode()
    assert gate.admit_value(key, b"never validated")[1] == "not a valid record"


def test_an_expired_value_is_dropped_before_a_live_one_is_evicted() -> None:
    records: dict[tuple[str, bytes], Record] = {}
    clock = FixedClock()
    gate = guard(StoreBounds(3, 3, 0), records, clock)
    honest = peer("Honest")
    short = ready(honest, 1, expires_at=NOW + 10)
    offer(gate, records, short)
    offer(gate, records, ready(honest, 2))
    offer(gate, records, ready(peer("Second"), 1))
    clock.t = NOW + 10
    drop, refusal = offer(gate, records, ready(peer("Third"), 1))
    assert refusal is None and drop == [short.key().encode()]


def provider(addrs: int = 1, *, relays: int = 0) -> PeerInfo:
    """A fresh peer with ``addrs`` addresses, each ``relays`` hops of /p2p-circuit long (2
    bytes a hop)."""
    pid = ID.from_pubkey(create_new_key_pair().public_key)
    hops = "/p2p-circuit" * relays
    return PeerInfo(
        pid, [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{4000 + i}{hops}") for i in range(addrs)]
    )


def test_the_provider_gate_bounds_entries_per_provider_and_clips_addresses() -> None:
    gate = guard(StoreBounds(8, 2, 1), {}, FixedClock())
    flood = provider(addrs=40)
    topics = [ready_topic(RUN, 2, slot).encode() for slot in range(3)]
    kept = [gate.admit_provider(t, flood) for t in topics]
    assert all(info is not None and len(info.addrs) == MAX_ADDRS for _, info in kept)
    assert [drop for drop, _ in kept] == [[], [], [(topics[0], str(flood.peer_id))]]
    assert gate.usage().providers_by_peer == {str(flood.peer_id): 2}
    # not an atoll topic, or no address of a sane length: not kept
    assert gate.admit_provider(b"/ipfs/some-cid", flood) == ([], None)
    assert gate.admit_provider(topics[0], provider(relays=140)) == ([], None)  # 288 bytes


def test_a_provider_entry_expires_when_any_record_it_may_point_to_has() -> None:
    clock = FixedClock()
    gate = guard(StoreBounds(1, 1, 0), {}, clock)
    first, second = provider(), provider()
    topic = ready_topic(RUN, 2, 1).encode()
    assert gate.admit_provider(topic, first)[1] is not None
    clock.t = NOW + MAX_TTL_S + 29  # within the skew: still live, and over a fair share of 0
    assert gate.admit_provider(topic, second)[0] == [(topic, str(first.peer_id))]
    clock.t = NOW + 2 * MAX_TTL_S + 60
    drop, kept = gate.admit_provider(topic, first)
    assert drop == [(topic, str(second.peer_id))] and kept is not None


def test_this_nodes_own_provider_entries_pass_as_they_are() -> None:
    me = provider(addrs=40)
    gate = _StoreGuard(
        StoreBounds(1, 1, 0),
        own_peer=str(me.peer_id),
        clock=FixedClock(),
        max_skew_s=30.0,
        recall=lambda key, value: None,
    )
    for slot in range(4):
        assert gate.admit_provider(ready_topic(RUN, 2, slot).encode(), me) == ([], me)
    assert gate.usage().providers == 0


# -- the hooks on a real KadDHT (unstarted: no sockets) ---------------------------------------
@pytest.fixture
def kad() -> KadDHT:
    return KadDHT(new_host(key_pair=create_new_key_pair()), DHTMode.SERVER)


def test_the_value_hook_drops_keeps_bare_records_and_refuses(kad: KadDHT) -> None:
    asked: list[bytes] = []
    verdicts: list[tuple[list[bytes], str | None]] = [([], None), ([b"k1"], "full")]

    def gate(key: bytes, value: bytes) -> tuple[list[bytes], str | None]:
        asked.append(key)
        return verdicts.pop(0)

    libp2p_internals.bound_value_store(kad, gate)
    libp2p_internals.keep_local_value(kad, b"own", b"mine")  # this node's put: no gate
    assert asked == []
    sent = KadRecord(key=b"k1", value=b"v1", author=b"a" * 100_000, signature=b"")
    kad.value_store.put_record(b"k1", sent)
    held = kad.value_store.get(b"k1")
    assert held is not None and held.value == b"v1" and held.author == b"" and held.timeReceived
    with pytest.raises(libp2p_internals.RefusedByBound, match="full"):
        kad.value_store.put_record(b"k2", KadRecord(key=b"k2", value=b"v2"))
    assert libp2p_internals.local_value(kad, b"k1") is None  # dropped, as the gate said
    assert libp2p_internals.local_value(kad, b"k2") is None  # refused
    assert libp2p_internals.local_value(kad, b"own") == b"mine"
    assert asked == [b"k1", b"k2"]


def test_the_provider_hook_drops_and_keeps_what_the_gate_says(kad: KadDHT) -> None:
    a, b = provider(), provider()
    verdicts: list[Any] = [([], a), ([(b"t1", str(a.peer_id))], None), ([], b)]
    libp2p_internals.bound_provider_store(kad, lambda key, info: verdicts.pop(0))
    libp2p_internals.add_local_provider(kad, b"t1", a)
    assert [p.peer_id for p in libp2p_internals.local_providers(kad, b"t1")] == [a.peer_id]
    kad.provider_store.add_provider(b"t2", b)  # refused, and a's entry under t1 dropped
    assert libp2p_internals.local_providers(kad, b"t1") == []
    assert libp2p_internals.local_providers(kad, b"t2") == []
    kad.provider_store.add_provider(b"t2", b)
    assert [p.peer_id for p in libp2p_internals.local_providers(kad, b"t2")] == [b.peer_id]


def test_a_topic_full_of_providers_takes_no_more_and_the_gate_counts_none(kad: KadDHT) -> None:
    topic = ready_topic(RUN, 2, 1).encode()
    first = [provider() for _ in range(20)]
    for info in first:
        libp2p_internals.add_local_provider(kad, topic, info)
    late = provider()
    assert not libp2p_internals.takes_provider(kad, topic, str(late.peer_id))
    assert libp2p_internals.takes_provider(kad, topic, str(first[0].peer_id))  # a renewal
    assert libp2p_internals.takes_provider(kad, b"another topic", str(late.peer_id))
    gate = _StoreGuard(
        StoreBounds(),
        own_peer=OWN,
        clock=FixedClock(),
        max_skew_s=30.0,
        recall=lambda key, value: None,
        takes_provider=lambda key, peer: libp2p_internals.takes_provider(kad, key, peer),
    )
    assert gate.admit_provider(topic, late) == ([], None)
    assert gate.admit_provider(topic, first[0])[1] is not None
    assert gate.usage().providers_by_peer == {str(first[0].peer_id): 1}

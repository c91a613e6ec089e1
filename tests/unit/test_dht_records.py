"""Tests of atoll.dht: the key schema, sealed expiring records and the peer directory.

Signatures here are a stand-in: an HMAC under a per-peer secret that the test verifier
knows. It has the shape of the real scheme (a seal names its signer, binds a domain, and
breaks when a byte changes), which is all the record rules depend on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from contextlib import AbstractContextManager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.dht.directory import PeerDirectory
from atoll.dht.keys import (
    BASE58_ALPHABET,
    KEY_PREFIX,
    MAX_FRAGMENT,
    MAX_KEY_BYTES,
    MAX_PEER_ID_LEN,
    MAX_SLOT,
    MAX_TOPIC_BYTES,
    AttestKey,
    PeerKey,
    ReadyKey,
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
    MAX_ADDR_LEN,
    MAX_ADDRS,
    MAX_RECORD_BYTES,
    MAX_TTL_S,
    MAX_VALUE_BYTES,
    RECORD_DOMAIN,
    AttestationRecord,
    PeerRecord,
    ReadyRecord,
    Record,
    RejectedRecord,
    StateRecord,
    check_record,
    decode_value,
    encode_value,
    select_value,
    validate,
)
from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.manifest import GroupSettings
from atoll.protocol.matchmaking import Declaration, JoinRequest, Matchmaker, Send, rank
from atoll.protocol.messages import Hello, encode_message, message_kind

FAST = settings(max_examples=50, deadline=None)

RUN = "3f" * 32
OTHER_RUN = "c0" * 32
ALICE = "12D3KooW" + "A" * 44
BOB = "12D3KooW" + "B" * 44
CAROL = "12D3KooW" + "C" * 44
MALLORY = "12D3KooW" + "M" * 44
T0 = 1_700_000_000.0
DIGEST = "ab" * 32

run_ids = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
peer_ids = st.text(alphabet=BASE58_ALPHABET, min_size=1, max_size=MAX_PEER_ID_LEN)
fragments = st.integers(0, MAX_FRAGMENT)
slots = st.integers(0, MAX_SLOT)


# -- test signatures and clock ----------------------------------------------------------------
def _secret(peer: str) -> bytes:
    return hashlib.sha256(b"test secret of " + peer.encode()).digest()


class FakeSigner:
    """Seals as ``peer``: [len][peer id][hmac(domain, payload)][payload]."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def seal(self, domain: str, payload: bytes) -> bytes:
        head = self.peer.encode()
        mac = hmac.new(_secret(self.peer), domain.encode() + b"\0" + payload, "sha256")
        return bytes([len(head)]) + head + mac.digest() + payload


class FakeVerifier:
    """Opens the seals of the peers it knows; refuses everything else with CodecError."""

    def __init__(self, peers: list[str], *, honour_max: bool = True) -> None:
        self.secrets = {p: _secret(p) for p in peers}
        self.honour_max = honour_max

    def open(self, data: bytes, *, domain: str, max_payload: int) -> tuple[bytes, str]:
        if not data:
            raise CodecError("empty seal")
        n = data[0]
        head, mac, payload = data[1 : 1 + n], data[1 + n : 33 + n], data[33 + n :]
        if self.honour_max and len(payload) > max_payload:
            raise CodecError("sealed payload too large")
        peer = head.decode("ascii", "replace")
        secret = self.secrets.get(peer)
        if secret is None:
            raise CodecError(f"unknown signer {peer!r}")
        good = hmac.new(secret, domain.encode() + b"\0" + payload, "sha256").digest()
        if not hmac.compare_digest(mac, good):
            raise CodecError("seal does not verify")
        return payload, peer


VERIFIER = FakeVerifier([ALICE, BOB, CAROL, MALLORY])


class FakeClock:
    """Wall time that moves only when told."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def wall(self) -> float:
        return self.now


# -- records ----------------------------------------------------------------------------------
def peer_record(peer: str = ALICE, **changes: object) -> PeerRecord:
    base = PeerRecord(
        peer_id=peer,
        run_id=RUN,
        addrs=("/ip4/203.0.113.7/tcp/4001", "/ip6/2001:db8::7/udp/4001/quic-v1"),
        agent="atoll/0.1.0",
        tokens_per_s=1234.5,
        versions=(3, 2),
        digests=(DIGEST, "cd" * 32),
        serving=True,
        issued_at=T0,
        expires_at=T0 + 300,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def ready_record(peer: str = ALICE, **changes: object) -> ReadyRecord:
    base = ReadyRecord(
        run_id=RUN,
        fragment=1,
        slot=9,
        peer_id=peer,
        version=4,
        digest=DIGEST,
        weight=2048.0,
        declared_at=T0,
        issued_at=T0,
        expires_at=T0 + 60,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def state_record(peer: str = ALICE, **changes: object) -> StateRecord:
    base = StateRecord(
        peer_id=peer,
        run_id=RUN,
        fragment=1,
        version=4,
        digest=DIGEST,
        issued_at=T0,
        expires_at=T0 + 120,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def refused(
    rule: str, match: str = ""
) -> AbstractContextManager[pytest.ExceptionInfo[RejectedRecord]]:
    """``pytest.raises`` for a RejectedRecord of ``rule`` (checked after the block)."""
    return pytest.raises(RejectedRecord, match=f"\\({rule}\\): .*{match}")


def roundtrip(record: Record, *, now: float = T0 + 1, key: str | None = None) -> Record:
    value = encode_value(record, FakeSigner(record.peer_id))
    return decode_value(value, key=record.key() if key is None else key, now=now, verifier=VERIFIER)


# =============================================================================================
# keys
# =============================================================================================
@FAST
@given(run_ids, peer_ids, fragments, slots)
def test_record_keys_round_trip(run_id: str, peer: str, fragment: int, slot: int) -> None:
    tag = run_tag(run_id)
    built = {
        peer_key(run_id, peer): PeerKey(tag, peer),
        ready_key(run_id, fragment, slot, peer): ReadyKey(tag, fragment, slot, peer),
        state_key(run_id, fragment, peer): StateKey(tag, fragment, peer),
    }
    for key, parsed in built.items():
        assert key.startswith(KEY_PREFIX + tag + "/")
        assert len(key.encode()) <= MAX_KEY_BYTES
        assert parse_key(key) == parsed
        assert parsed.key() == key


def test_the_longest_keys_fit_py_libp2p_limits() -> None:
    run_id, peer = "f" * 64, "z" * MAX_PEER_ID_LEN
    longest = ready_key(run_id, MAX_FRAGMENT, MAX_SLOT, peer)
    assert len(longest.encode()) <= MAX_KEY_BYTES
    assert len(state_key(run_id, MAX_FRAGMENT, peer).encode()) <= MAX_KEY_BYTES
    for topic in (
        peers_topic(run_id),
        ready_topic(run_id, MAX_FRAGMENT, MAX_SLOT),
        state_topic(run_id, MAX_FRAGMENT),
    ):
        assert len(topic.encode()) <= MAX_TOPIC_BYTES
        assert topic.startswith(KEY_PREFIX)


def test_runs_differ_in_every_key() -> None:
    assert run_tag(RUN) != run_tag(OTHER_RUN)
    assert peer_key(RUN, ALICE) != peer_key(OTHER_RUN, ALICE)
    assert ready_topic(RUN, 1, 9) != ready_topic(OTHER_RUN, 1, 9)


_TAG = run_tag(RUN)
_TAIL_CHARS = BASE58_ALPHABET + "0/+-_ .IlO\u0661\xe9"


@FAST
@given(st.text(alphabet=_TAIL_CHARS, max_size=90))
def test_a_key_has_one_spelling(tail: str) -> None:
    # near-misses of real keys: either refused, or spelled exactly as parse_key reads them
    for key in (KEY_PREFIX + _TAG + "/" + tail, KEY_PREFIX + tail):
        try:
            parsed = parse_key(key)
        except CodecError:
            continue
        assert parsed.key() == key


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (f"/ipfs/v1/{_TAG}/peer/{ALICE}", "does not start"),
        (f"/atoll/v2/{_TAG}/peer/{ALICE}", "does not start"),
        (f"{KEY_PREFIX}{_TAG.upper()}/peer/{ALICE}", "run tag"),
        (f"{KEY_PREFIX}{RUN}/peer/z", "run tag"),
        (f"{KEY_PREFIX}{_TAG}/peer/{ALICE}/", "not a record key"),
        (f"{KEY_PREFIX}{_TAG}/peer/", "peer id"),
        (f"{KEY_PREFIX}{_TAG}/peer/{ALICE}0", "peer id"),  # 0 is not base58
        (f"{KEY_PREFIX}{_TAG}/peer/{'z' * (MAX_PEER_ID_LEN + 1)}", "peer id"),
        (f"{KEY_PREFIX}{_TAG}/peers", "not a record key"),  # a topic
        (f"{KEY_PREFIX}{_TAG}/ready/1/9", "not a record key"),  # a topic
        (f"{KEY_PREFIX}{_TAG}/ready/01/9/{ALICE}", "leading zeros"),
        (f"{KEY_PREFIX}{_TAG}/ready/+1/9/{ALICE}", "leading zeros"),
        (f"{KEY_PREFIX}{_TAG}/ready/1/\u0661/{ALICE}", "leading zeros"),  # Arabic-Indic one
        (f"{KEY_PREFIX}{_TAG}/ready/1/{MAX_SLOT + 1}/{ALICE}", "slot"),
        (f"{KEY_PREFIX}{_TAG}/state/{MAX_FRAGMENT + 1}/{ALICE}", "fragment"),
        (f"{KEY_PREFIX}{_TAG}/state//{ALICE}", "leading zeros"),
        (f"{KEY_PREFIX}{_TAG}/other/{ALICE}", "not a record key"),
        (f"{KEY_PREFIX}{_TAG}/peer/{ALICE}" + "z" * 80, "over 128 bytes"),
    ],
)
def test_malformed_keys_are_refused(key: str, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        parse_key(key)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: peer_key(RUN.upper(), ALICE), "run id"),
        (lambda: peer_key(RUN[:-1], ALICE), "run id"),
        (lambda: peer_key(RUN, "Il0O"), "peer id"),
        (lambda: peer_key(RUN, ""), "peer id"),
        (lambda: ready_key(RUN, True, 9, ALICE), "fragment"),
        (lambda: ready_key(RUN, 1, -1, ALICE), "slot"),
        (lambda: state_key(RUN, MAX_FRAGMENT + 1, ALICE), "fragment"),
        (lambda: ready_topic(RUN, 1, MAX_SLOT + 1), "slot"),
        (lambda: parse_key(b"/atoll/v1/"), "is a str"),
    ],
)
def test_builders_refuse_bad_parts(build: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        build()  # type: ignore[operator]


# =============================================================================================
# records
# =============================================================================================
def test_record_kinds_are_in_the_dht_range() -> None:
    kinds = [message_kind(c) for c in (PeerRecord, ReadyRecord, StateRecord)]
    assert kinds == [100, 101, 102]


@FAST
@given(
    peer=peer_ids,
    run_id=run_ids,
    addrs=st.lists(
        st.text(alphabet="/abc0123456789.:-", max_size=MAX_ADDR_LEN - 1).map(lambda a: "/" + a),
        max_size=4,
    ),
    tokens=st.floats(0, 1e9),
    frags=st.lists(
        st.tuples(st.integers(0, 2**63 - 1), st.text(alphabet="0123456789abcdef", max_size=64)),
        max_size=8,
    ),
    serving=st.booleans(),
    issued=st.floats(0, 4e9),
    ttl=st.floats(0.001, MAX_TTL_S),
)
def test_peer_records_round_trip_through_a_sealed_value(
    peer: str,
    run_id: str,
    addrs: list[str],
    tokens: float,
    frags: list[tuple[int, str]],
    serving: bool,
    issued: float,
    ttl: float,
) -> None:
    expires = issued + ttl
    if not expires > issued:  # ttl lost to rounding at this magnitude
        return
    record = PeerRecord(
        peer_id=peer,
        run_id=run_id,
        addrs=tuple(addrs),
        agent="atoll/0.1.0",
        tokens_per_s=tokens,
        versions=tuple(v for v, _ in frags),
        digests=tuple(d for _, d in frags),
        serving=serving,
        issued_at=issued,
        expires_at=expires,
    )
    value = encode_value(record, FakeSigner(peer))
    assert len(value) <= MAX_VALUE_BYTES
    verifier = FakeVerifier([peer])
    assert decode_value(value, key=record.key(), now=issued, verifier=verifier) == record


@pytest.mark.parametrize("record", [ready_record(), state_record()], ids=lambda r: type(r).__name__)
def test_ready_and_state_records_round_trip(record: Record) -> None:
    assert roundtrip(record) == record


@pytest.mark.parametrize("reach", ["", "public", "private", "unknown"])
def test_a_peer_record_says_whether_it_can_be_dialed(reach: str) -> None:
    record = peer_record(reach=reach)
    assert roundtrip(record) == record


def test_a_peer_record_carries_its_trainers_step() -> None:
    assert roundtrip(peer_record(step=412)).step == 412
    assert roundtrip(peer_record()).step == -1  # not known
    with pytest.raises(RejectedRecord, match="step"):
        roundtrip(peer_record(step=-2))


def test_ready_records_carry_a_declaration() -> None:
    d = Declaration(RUN, 2, 11, BOB, 6, DIGEST, 99.5, T0 - 1)
    record = ReadyRecord.from_declaration(d, issued_at=T0, expires_at=T0 + 30)
    assert record.to_declaration() == d
    assert (record.issued_at, record.expires_at) == (T0, T0 + 30)
    assert record.key() == ready_key(RUN, 2, 11, BOB)
    assert roundtrip(record) == record


def test_validate_accepts_the_edges_of_time() -> None:
    record = peer_record(issued_at=T0, expires_at=T0 + MAX_TTL_S)
    validate(record, key=record.key(), now=T0 - 30, max_skew_s=30)  # 30 s ahead: allowed
    validate(record, key=record.key(), now=T0 + MAX_TTL_S - 0.001)  # last moment alive


@pytest.mark.parametrize(
    ("record", "now", "rule", "match"),
    [
        (peer_record(), T0 + 300, "expired", "expired 0.0 s ago"),
        (peer_record(), T0 + 900, "expired", "expired 600.0 s ago"),
        (peer_record(), T0 - 31, "future", "31.0 s ahead"),
        (peer_record(expires_at=T0 + MAX_TTL_S + 1), T0, "ttl", "lifetime 601.0 s"),
        (peer_record(expires_at=T0), T0, "ttl", "not after issued_at"),
        (peer_record(expires_at=T0 - 5), T0, "ttl", "not after issued_at"),
        (peer_record(versions=(1, 2, 3)), T0, "malformed", "3 versions but 2 digests"),
        (peer_record(versions=(-1, 2)), T0, "malformed", "negative"),
        (peer_record(tokens_per_s=-1.0), T0, "malformed", "negative"),
        (peer_record(tokens_per_s=float("nan")), T0, "malformed", "not finite"),
        (peer_record(issued_at=float("inf")), T0, "malformed", "not finite"),
        (peer_record(digests=("AB", "cd")), T0, "malformed", "lowercase hex"),
        (peer_record(addrs=("ip4/1.2.3.4",)), T0, "malformed", "multiaddr"),
        (peer_record(addrs=("/ip4/1.2.3.4 x",)), T0, "malformed", "multiaddr"),
        (peer_record(agent="atoll\x1b[31m"), T0, "malformed", "printable"),
        (peer_record(addrs=("/a",) * (MAX_ADDRS + 1)), T0, "malformed", "max_len 16"),
        (peer_record(run_id=RUN.upper()), T0, "malformed", "run id"),
        (peer_record(serving=1), T0, "malformed", "expected bool"),
        (ready_record(slot=MAX_SLOT + 1), T0, "malformed", "slot"),
        (ready_record(weight=-2.0), T0, "malformed", "weight"),
        (peer_record(reach="everywhere"), T0, "malformed", "reach"),
        (state_record(digest=""), T0, "malformed", "digest is empty"),
        (state_record(fragment=MAX_FRAGMENT + 1), T0, "malformed", "fragment"),
    ],
)
def test_every_rule_refuses_with_its_reason(
    record: Record, now: float, rule: str, match: str
) -> None:
    # every sample is Alice's, fragment 1, slot 9 (record.key() may refuse a bad field)
    key = {
        PeerRecord: peer_key(RUN, ALICE),
        ReadyRecord: ready_key(RUN, 1, 9, ALICE),
        StateRecord: state_key(RUN, 1, ALICE),
    }[type(record)]
    with refused(rule, match):
        validate(record, key=key, now=now)
    with refused(rule, match):
        check_record(record, now=now)


def test_oversize_records_are_refused_both_ways() -> None:
    big = peer_record(addrs=tuple("/" + "x" * (MAX_ADDR_LEN - 1) for _ in range(MAX_ADDRS)))
    with refused("size", f"over {MAX_RECORD_BYTES}"):
        encode_value(big, FakeSigner(ALICE))
    with refused("size", f"over {MAX_RECORD_BYTES}"):
        validate(big, key=big.key(), now=T0)
    # a hostile peer seals it anyway: the verifier refuses to open an oversize payload,
    # a value over the limit is refused before any crypto, and so is a payload that a lax
    # verifier let through
    sealed = FakeSigner(ALICE).seal(RECORD_DOMAIN, encode_message(big))
    with refused("seal", "too large"):
        decode_value(sealed, key=big.key(), now=T0, verifier=VERIFIER)
    huge = FakeSigner(ALICE).seal(RECORD_DOMAIN, b"\x00" * MAX_VALUE_BYTES)
    with refused("size", f"over {MAX_VALUE_BYTES}"):
        decode_value(huge, key=big.key(), now=T0, verifier=VERIFIER)
    small_enough = FakeSigner(ALICE).seal(RECORD_DOMAIN, b"\x00" * (MAX_RECORD_BYTES + 10))
    lax = FakeVerifier([ALICE], honour_max=False)
    with refused("size", f"over {MAX_RECORD_BYTES}"):
        decode_value(small_enough, key=big.key(), now=T0, verifier=lax)


@pytest.mark.parametrize(
    ("record", "key", "rule", "match"),
    [
        (peer_record(), peer_key(RUN, BOB), "key", f"the key names {BOB}"),
        (peer_record(), peer_key(OTHER_RUN, ALICE), "run", "key of run c0c0"),
        (peer_record(run_id=OTHER_RUN), peer_key(RUN, ALICE), "run", "is of run c0c0"),
        (peer_record(), state_key(RUN, 0, ALICE), "key", "cannot be stored"),
        (peer_record(), "/atoll/v1/nonsense", "key", "run tag"),
        (ready_record(), ready_key(RUN, 1, 10, ALICE), "key", "slot 9, the key for slot 10"),
        (ready_record(), ready_key(RUN, 2, 9, ALICE), "key", "fragment 1, the key 2"),
        (state_record(), state_key(RUN, 0, ALICE), "key", "fragment 1, the key 0"),
        (state_record(), ready_key(RUN, 1, 9, ALICE), "key", "cannot be stored"),
    ],
)
def test_a_record_must_match_its_key(record: Record, key: str, rule: str, match: str) -> None:
    with refused(rule, match):
        validate(record, key=key, now=T0)
    with refused(rule, match):
        roundtrip(record, key=key, now=T0)


def test_a_peer_publishes_for_itself_only() -> None:
    forged = encode_value(peer_record(ALICE), FakeSigner(MALLORY))  # sealed by Mallory
    with refused("signer", f"'{MALLORY}' sealed a record about '{ALICE}'"):
        decode_value(forged, key=peer_key(RUN, ALICE), now=T0, verifier=VERIFIER)


def test_broken_seals_are_refused() -> None:
    record = peer_record()
    value = encode_value(record, FakeSigner(ALICE))
    tampered = value[:-1] + bytes([value[-1] ^ 1])
    with refused("seal", "does not verify"):
        decode_value(tampered, key=record.key(), now=T0, verifier=VERIFIER)
    with refused("seal", "unknown signer"):
        decode_value(value, key=record.key(), now=T0, verifier=FakeVerifier([BOB]))
    # a seal made for another purpose does not open as a record
    other = FakeSigner(ALICE).seal("atoll/other/v1", encode_message(record))
    with refused("seal", "does not verify"):
        decode_value(other, key=record.key(), now=T0, verifier=VERIFIER)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xc1garbage", "not valid msgpack"),
        (encode_message(Hello(1, RUN, ALICE, "atoll/0.1.0")), "Hello is not a DHT record"),
    ],
)
def test_sealed_non_records_are_refused(payload: bytes, match: str) -> None:
    value = FakeSigner(ALICE).seal(RECORD_DOMAIN, payload)
    with refused("malformed", match):
        decode_value(value, key=peer_key(RUN, ALICE), now=T0, verifier=VERIFIER)


def test_values_and_clocks_of_the_wrong_type() -> None:
    with refused("malformed", "is bytes"):
        decode_value(bytearray(b"x"), key=peer_key(RUN, ALICE), now=T0, verifier=VERIFIER)  # type: ignore[arg-type]
    with refused("malformed", "not a DHT record"):
        check_record(Hello(1, RUN, ALICE, "a"), now=T0)  # type: ignore[arg-type]
    record = peer_record()
    for now, skew in ((float("nan"), 30.0), (T0, -1.0), (T0, float("inf"))):
        with pytest.raises(ConfigError):
            validate(record, key=record.key(), now=now, max_skew_s=skew)


def test_refusals_are_rejected_input() -> None:
    with pytest.raises(RejectedInput) as info:
        validate(peer_record(), key=peer_key(RUN, ALICE), now=T0 + 301)
    assert isinstance(info.value, RejectedRecord)
    assert info.value.rule == "expired"
    assert "expired" in info.value.reason


def test_select_keeps_the_newest_valid_value() -> None:
    seal = FakeSigner(ALICE).seal
    old = encode_value(peer_record(issued_at=T0, expires_at=T0 + 300), FakeSigner(ALICE))
    new = encode_value(peer_record(issued_at=T0 + 10, expires_at=T0 + 300), FakeSigner(ALICE))
    twin = encode_value(peer_record(issued_at=T0 + 10, agent="twin"), FakeSigner(ALICE))
    bad = seal(RECORD_DOMAIN, b"junk")
    key, now = peer_key(RUN, ALICE), T0 + 20

    def pick(values: list[bytes]) -> int:
        return select_value(values, key=key, now=now, verifier=VERIFIER)

    assert pick([old, new]) == 1
    assert pick([new, old]) == 0
    assert pick([new, twin]) == 0 and pick([twin, new]) == 0  # a tie keeps the held one
    assert pick([bad, old]) == 1
    with refused("malformed"):
        pick([bad, bad])
    with refused("expired"):
        select_value([old], key=key, now=T0 + 400, verifier=VERIFIER)


# =============================================================================================
# the directory
# =============================================================================================
def test_the_latest_issued_record_wins() -> None:
    clock = FakeClock(T0 + 5)
    directory = PeerDirectory(clock, run_id=RUN)
    first = peer_record(issued_at=T0, tokens_per_s=1.0)
    later = peer_record(issued_at=T0 + 2, tokens_per_s=2.0)
    assert directory.update(later)
    assert not directory.update(first)  # older: ignored
    assert not directory.update(dataclasses.replace(later, tokens_per_s=3.0))  # tie: kept
    assert directory.get(ALICE) == later
    assert directory.update(peer_record(issued_at=T0 + 4))
    assert directory.get(ALICE) == peer_record(issued_at=T0 + 4)
    assert len(directory) == 1


def test_records_expire_on_the_injected_clock() -> None:
    clock = FakeClock(T0)
    directory = PeerDirectory(clock, run_id=RUN)
    directory.update(peer_record(ALICE, expires_at=T0 + 10))
    directory.update(peer_record(BOB, expires_at=T0 + 20))
    directory.update(ready_record(ALICE, expires_at=T0 + 10))
    directory.update(state_record(BOB, expires_at=T0 + 20))
    assert [r.peer_id for r in directory.peers()] == [ALICE, BOB]
    clock.now = T0 + 10  # Alice's records end now: invisible at once, still held
    assert [r.peer_id for r in directory.peers()] == [BOB]
    assert directory.get(ALICE) is None
    assert directory.ready(1, 9) == []
    assert len(directory) == 4
    assert directory.expire() == 2
    assert len(directory) == 2
    # an expired record gives its place to any live one, even one issued earlier
    assert directory.update(peer_record(ALICE, issued_at=T0 + 9.5, expires_at=T0 + 50))
    clock.now = T0 + 20
    assert directory.expire() == 2
    assert [r.peer_id for r in directory.peers()] == [ALICE]
    assert directory.servers(1) == []


@pytest.mark.parametrize(
    ("record", "now", "rule"),
    [
        (peer_record(run_id=OTHER_RUN), T0, "run"),
        (ready_record(run_id=OTHER_RUN), T0, "run"),
        (peer_record(), T0 + 300, "expired"),
        (peer_record(issued_at=T0 + 100, expires_at=T0 + 200), T0, "future"),
        (peer_record(versions=()), T0, "malformed"),
    ],
)
def test_the_directory_refuses_what_it_must_not_hold(record: Record, now: float, rule: str) -> None:
    directory = PeerDirectory(FakeClock(now), run_id=RUN)
    with refused(rule):
        directory.update(record)
    assert len(directory) == 0


def test_the_directory_is_bounded() -> None:
    clock = FakeClock(T0)
    directory = PeerDirectory(clock, run_id=RUN, max_records=2)
    directory.update(peer_record(ALICE, expires_at=T0 + 10))
    directory.update(peer_record(BOB, expires_at=T0 + 100))
    assert directory.update(peer_record(BOB, issued_at=T0 + 1))  # same place: no room needed
    with refused("capacity"):
        directory.update(peer_record(CAROL))
    clock.now = T0 + 10  # Alice expired: her place is reclaimed on demand
    assert directory.update(peer_record(CAROL, issued_at=T0 + 10, expires_at=T0 + 60))
    assert [r.peer_id for r in directory.peers()] == [BOB, CAROL]
    assert len(directory) == 2


def test_bad_directory_settings_are_refused() -> None:
    for kwargs in ({"run_id": "run-a"}, {"run_id": RUN, "max_records": 0}):
        with pytest.raises(ConfigError):
            PeerDirectory(FakeClock(), **kwargs)
    with pytest.raises(ConfigError):
        PeerDirectory(FakeClock(), run_id=RUN, max_skew_s=float("nan"))


def test_ready_gives_declarations_the_matchmaker_takes() -> None:
    clock = FakeClock(T0)
    directory = PeerDirectory(clock, run_id=RUN)
    peers = [ALICE, BOB, CAROL]
    for i, peer in enumerate(peers):
        directory.update(ready_record(peer, weight=100.0 * (i + 1)))
    directory.update(ready_record(MALLORY, slot=10))  # another slot: not in the view
    view = directory.ready(1, 9)
    assert [d.peer_id for d in view] == peers
    assert all(isinstance(d, Declaration) for d in view)
    assert view[0] == ready_record(ALICE, weight=100.0).to_declaration()

    for me in view:
        matchmaker = Matchmaker(me, GroupSettings(min_quorum=2), now=0.0, timeout=15.0)
        actions = matchmaker.observe(view, now=0.0)
        lowest = min(view, key=rank)
        if me == lowest:
            assert matchmaker.state == "leading" and actions == []
        else:  # it found the others and asks the agreed leader to take it in
            assert matchmaker.leader == lowest.peer_id
            assert [a.to for a in actions if isinstance(a, Send)] == [lowest.peer_id]
            assert isinstance(actions[0], Send) and isinstance(actions[0].message, JoinRequest)


def test_servers_and_summary() -> None:
    clock = FakeClock(T0)
    directory = PeerDirectory(clock, run_id=RUN)
    directory.update(peer_record(ALICE, versions=(3, 2), tokens_per_s=100.0, serving=True))
    directory.update(peer_record(BOB, versions=(3, 1), tokens_per_s=50.0, serving=False))
    directory.update(peer_record(CAROL, versions=(2, 2), tokens_per_s=25.5, expires_at=T0 + 5))
    directory.update(state_record(ALICE, fragment=0, version=3))
    directory.update(state_record(BOB, fragment=0, version=3))
    directory.update(state_record(CAROL, fragment=0, version=4))
    directory.update(state_record(CAROL, fragment=5, version=1))
    servers = directory.servers(0)
    assert [(r.peer_id, r.version) for r in servers] == [(CAROL, 4), (ALICE, 3), (BOB, 3)]

    clock.now = T0 + 5  # Carol's PeerRecord ends; her StateRecords live on
    summary = directory.summary()
    assert (summary.run_id, summary.at, summary.peers, summary.serving) == (RUN, T0 + 5, 2, 1)
    assert summary.tokens_per_s == 150.0
    assert [(f.fragment, f.versions, f.servers) for f in summary.fragments] == [
        (0, ((3, 2),), 3),
        (1, ((2, 1), (1, 1)), 0),
        (5, (), 1),
    ]


# =============================================================================================
# attestation records (certified global states)
# =============================================================================================
def attestation_record(peer: str = ALICE, **changes: object) -> AttestationRecord:
    base = AttestationRecord(
        peer_id=peer,
        run_id=RUN,
        fragment=1,
        version=9,
        digest=DIGEST,
        attestation=b"\x01" * 120,
        issued_at=T0,
        expires_at=T0 + 600,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_attestation_keys_round_trip_and_fit() -> None:
    key = attest_key(RUN, 1, 9, ALICE)
    assert key == f"{KEY_PREFIX}{run_tag(RUN)}/cert/1/9/{ALICE}"
    assert parse_key(key) == AttestKey(run_tag(RUN), 1, 9, ALICE)
    longest = attest_key("f" * 64, MAX_FRAGMENT, MAX_SLOT, "z" * MAX_PEER_ID_LEN)
    assert len(longest.encode()) <= MAX_KEY_BYTES
    assert len(attest_topic("f" * 64, MAX_FRAGMENT, MAX_SLOT).encode()) <= MAX_TOPIC_BYTES
    with pytest.raises(CodecError):
        attest_key(RUN, 1, MAX_SLOT + 1, ALICE)


def test_attestation_records_round_trip_and_match_their_key() -> None:
    record = attestation_record()
    assert roundtrip(record) == record
    assert message_kind(AttestationRecord) == 103
    with refused("key", "version 9, the key for 10"):
        validate(record, key=attest_key(RUN, 1, 10, ALICE), now=T0)
    with refused("key", "fragment 1, the key 2"):
        validate(record, key=attest_key(RUN, 2, 9, ALICE), now=T0)
    with refused("key", f"the key names {BOB}"):
        validate(record, key=attest_key(RUN, 1, 9, BOB), now=T0)
    with refused("key", "cannot be stored"):
        validate(record, key=state_key(RUN, 1, ALICE), now=T0)


@pytest.mark.parametrize(
    ("changes", "rule", "match"),
    [
        ({"version": 0}, "malformed", "seed"),
        ({"attestation": b""}, "malformed", "empty"),
        ({"digest": ""}, "malformed", "empty"),
        ({"attestation": b"\x00" * (MAX_RECORD_BYTES + 1)}, "malformed", ""),
    ],
)
def test_bad_attestation_records_are_refused(
    changes: dict[str, object], rule: str, match: str
) -> None:
    with refused(rule, match):
        check_record(attestation_record(**changes), now=T0)

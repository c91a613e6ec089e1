"""Certified global states (atoll.protocol.certificate): attestations, certificates, the
beliefs a node keeps, and the rebase rule over them (a forged version is never fetched).

Signatures are real Ed25519 envelopes (:mod:`atoll.node.envelopes`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from atoll.dht.records import AttestationRecord, decode_value, encode_value
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier
from atoll.protocol import statesync as ss
from atoll.protocol import sync as fs
from atoll.protocol.certificate import (
    MAX_MEMBERS,
    Attestation,
    BadCertificate,
    CertifiedStates,
    assemble,
    check_certificate,
    open_attestation,
    seal_attestation,
)
from atoll.protocol.engine import EngineConfig, OuterEngine
from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.schedule import Schedule
from atoll.security.identity import Identity, generate

RUN = "ab" * 32
OTHER_RUN = "cd" * 32
D1 = "1" * 32
D0 = "0" * 32
HUGE = 10**6

IDS: dict[str, Identity] = {name: generate() for name in ("a", "b", "c", "liar", "s1", "s2")}
PEER = {name: ident.peer_id for name, ident in IDS.items()}
MEMBERS = tuple(sorted(PEER[n] for n in ("a", "b", "c")))
VERIFIER = EnvelopeVerifier()


def attestation(**changes: object) -> Attestation:
    base = Attestation(RUN, 0, 1, D1, D0, MEMBERS)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def sealed(name: str, att: Attestation | None = None) -> bytes:
    return seal_attestation(att or attestation(), EnvelopeSigner(IDS[name]))


def check(seals: list[bytes], **changes: object) -> object:
    kwargs: dict[str, object] = {
        "run_id": RUN,
        "fragment": 0,
        "version": 1,
        "digest": D1,
        "quorum": 2,
        "verifier": VERIFIER,
    }
    kwargs.update(changes)
    return check_certificate(seals, **kwargs)  # type: ignore[arg-type]


# -- one certificate ---------------------------------------------------------------------
def test_a_quorum_of_members_makes_a_valid_certificate() -> None:
    cert = check([sealed("a"), sealed("b")])
    assert cert.attestation == attestation()  # type: ignore[attr-defined]
    assert set(cert.signers) == {PEER["a"], PEER["b"]}  # type: ignore[attr-defined]
    check([sealed("a"), sealed("b"), sealed("c")], quorum=3)


def test_an_attestation_round_trips_through_its_seal() -> None:
    att, signer = open_attestation(sealed("c"), VERIFIER)
    assert att == attestation() and signer == PEER["c"]


@pytest.mark.parametrize(
    ("seals", "changes", "why"),
    [
        (lambda: [sealed("a")], {}, "fewer than the quorum"),
        (lambda: [sealed("a"), sealed("a")], {}, "signed twice"),
        (lambda: [sealed("a"), sealed("liar")], {}, "not a member"),
        (lambda: [sealed("a"), sealed("b", attestation(parent="2" * 32))], {}, "other content"),
        (lambda: [sealed("a"), sealed("b")], {"digest": "2" * 32}, "not fragment"),
        (lambda: [sealed("a"), sealed("b")], {"version": 2}, "not fragment"),
        (lambda: [sealed("a"), sealed("b")], {"fragment": 1}, "not fragment"),
        (lambda: [sealed("a"), sealed("b")], {"run_id": OTHER_RUN}, "of run"),
        (lambda: [sealed("a"), sealed("b")], {"quorum": 3}, "fewer than the quorum"),
        (lambda: [], {}, "no attestations"),
    ],
)
def test_bad_certificates_are_refused(seals: object, changes: dict[str, object], why: str) -> None:
    with pytest.raises(BadCertificate, match=why):
        check(seals(), **changes)  # type: ignore[operator]


def test_a_bad_signature_is_refused() -> None:
    good = sealed("b")
    forged = good[:-1] + bytes([good[-1] ^ 1])  # the signature's last byte
    with pytest.raises(BadCertificate, match="does not open"):
        check([sealed("a"), forged])


def test_a_tampered_payload_is_refused() -> None:
    # one member's seal, its payload's digest swapped for another of the same length
    good = sealed("b")
    tampered = good.replace(D1.encode(), ("3" * 32).encode())
    assert tampered != good
    with pytest.raises(BadCertificate):
        check([sealed("a"), tampered])


def test_a_seal_for_another_domain_never_opens_as_an_attestation() -> None:
    other = EnvelopeSigner(IDS["b"]).seal("atoll/dht/record/v1", attestation().payload())
    with pytest.raises(BadCertificate, match="does not open"):
        check([sealed("a"), other])


def test_a_signer_the_run_does_not_admit_is_refused() -> None:
    with pytest.raises(BadCertificate, match="not admitted"):
        check([sealed("a"), sealed("b")], admit=lambda peer: peer != PEER["b"])


def test_malformed_attestations_cannot_be_built() -> None:
    with pytest.raises(CodecError, match="sorted"):
        attestation(members=(MEMBERS[1], MEMBERS[0]))
    with pytest.raises(CodecError, match="seed"):
        attestation(version=0)
    with pytest.raises(CodecError, match="hex"):
        attestation(digest="XYZ")
    too_many = tuple(sorted(f"p{i:03d}" for i in range(MAX_MEMBERS + 1)))
    with pytest.raises(CodecError):
        attestation(members=too_many)


def test_assemble_finds_the_certificate_in_a_mixed_pile() -> None:
    liar_fake = sealed("liar", attestation(digest="9" * 32, members=(PEER["liar"],)))
    pile = [liar_fake, b"junk", sealed("a"), sealed("c"), sealed("a")]
    cert = assemble(pile, run_id=RUN, fragment=0, version=1, digest=D1, quorum=2, verifier=VERIFIER)
    assert cert is not None and set(cert.signers) == {PEER["a"], PEER["c"]}
    assert (
        assemble(
            pile, run_id=RUN, fragment=0, version=1, digest="9" * 32, quorum=2, verifier=VERIFIER
        )
        is None
    )


def test_an_attestation_record_fits_the_dht_with_the_most_members() -> None:
    members = tuple(sorted(generate().peer_id for _ in range(MAX_MEMBERS)))
    att = attestation(members=members)
    seal = seal_attestation(att, EnvelopeSigner(IDS["a"]))
    record = AttestationRecord(PEER["a"], RUN, 0, 1, D1, seal, 100.0, 700.0)
    value = encode_value(record, EnvelopeSigner(IDS["a"]))
    back = decode_value(value, key=record.key(), now=200.0, verifier=VERIFIER)
    assert back == record
    assert open_attestation(back.attestation, VERIFIER) == (att, PEER["a"])  # type: ignore[union-attr]


# -- beliefs -------------------------------------------------------------------------------
def beliefs(reported: list[tuple[str, int, int]] | None = None, **kw: object) -> CertifiedStates:
    sink = reported if reported is not None else []
    return CertifiedStates(
        RUN,
        quorum=2,
        verifier=VERIFIER,
        seeds=[D0],
        on_uncertified=lambda *claim: sink.append(claim),
        grace_s=30.0,
        **kw,  # type: ignore[arg-type]
    )


def test_the_seed_needs_no_certificate_and_another_version_0_is_not_believed() -> None:
    b = beliefs()
    assert b.believes(0, 0, D0)
    assert not b.believes(0, 0, "5" * 32)
    assert not b.believes(0, 1, D1)
    assert not b.believes(1, 0, D0)  # no seed known for fragment 1


def test_a_certificate_is_verified_once() -> None:
    b = beliefs()
    pile = [sealed("a"), sealed("b")]
    assert b.offer(0, 1, D1, pile, now=0.0) is not None
    assert b.believes(0, 1, D1) and b.top(0) == 1
    verified = b.verified
    assert b.offer(0, 1, D1, pile, now=1.0) is not None
    assert b.verified == verified  # held: nothing verified again
    # a failed pile is not verified twice either
    assert b.offer(0, 2, "4" * 32, [sealed("liar")], now=2.0) is None
    verified = b.verified
    b.offer(0, 2, "4" * 32, [sealed("liar")], now=9.0)
    assert b.verified == verified


def test_uncertified_declarations_are_ignored_and_reported_once() -> None:
    reported: list[tuple[str, int, int]] = []
    b = beliefs(reported)
    holdings = [("liar", HUGE, "f" * 32), ("a", 1, "2" * 32), ("b", 0, D0)]
    kept = b.believed(0, holdings, now=0.0, mine=(0, D0))
    assert kept == [("b", 0, D0)]
    # nobody is reported before the grace, however far ahead the claim: after a split
    # heals the other side may be versions ahead, its certificates not found yet
    assert reported == []
    b.believed(0, holdings, now=10.0, mine=(0, D0))
    assert reported == []
    b.believed(0, holdings, now=31.0, mine=(0, D0))
    assert reported == [("liar", 0, HUGE), ("a", 0, 1)]
    b.believed(0, holdings, now=99.0, mine=(0, D0))
    assert len(reported) == 2 and b.reported("liar") and not b.reported("b")


def test_an_uncertified_claim_shared_by_a_quorum_of_peers_is_not_reported() -> None:
    """Three peers (the quorum is 2) declare a state whose certificate this node cannot
    find: a swarm back from a cut, its lookups failing under load. They are ignored, not
    reported: that many could sign a certificate anyway. When only one declares it, its
    grace counts from when it was first seen."""
    reported: list[tuple[str, int, int]] = []
    b = beliefs(reported, max_lead=10)
    mine = (0, D0)
    swarm = [(p, 2, "5" * 32) for p in ("a", "b", "c")]
    assert b.believed(0, swarm, now=0.0, mine=mine) == []
    b.believed(0, swarm, now=31.0, mine=mine)
    assert reported == []
    b.believed(0, swarm[:1], now=32.0, mine=mine)  # alone with it, past its grace
    assert reported == [("a", 0, 2)]
    # shared or not, a claim past a whole run is reported at once
    b.believed(0, [("x", HUGE, "f" * 32), ("y", HUGE, "f" * 32)], now=33.0, mine=mine)
    assert ("x", 0, HUGE) in reported and ("y", 0, HUGE) in reported


def test_a_claim_further_ahead_than_a_whole_run_is_reported_at_once() -> None:
    """Within a run's number of syncs a claim waits out its grace (a healed split's other
    side); further ahead, no honest peer can be: reported on first sight."""
    reported: list[tuple[str, int, int]] = []
    b = beliefs(reported, max_lead=10)
    mine = (3, D1)
    b.believed(0, [("ahead", 14, "2" * 32), ("liar", HUGE, "f" * 32)], now=0.0, mine=mine)
    assert reported == [("liar", 0, HUGE)]  # 14 <= 3 + 1 + 10: waits for its grace
    b.believed(0, [("ahead", 14, "2" * 32), ("liar", HUGE, "f" * 32)], now=31.0, mine=mine)
    assert reported == [("liar", 0, HUGE), ("ahead", 0, 14)]
    b.believed(0, [("edge", 15, "3" * 32)], now=32.0, mine=mine)
    assert ("edge", 0, 15) in reported
    with pytest.raises(ConfigError):
        beliefs(max_lead=0)


def test_to_check_prefers_held_states_and_skips_what_cannot_lead() -> None:
    b = beliefs()
    holdings = [
        ("s1", HUGE, "f" * 32),
        ("a", 2, "2" * 32),
        ("b", 2, "2" * 32),
        ("c", 0, D0),  # behind this node
        ("s2", 3, "e" * 32),
    ]
    todo = b.to_check(0, holdings, now=0.0, mine=(1, D1), limit=2)
    assert todo == [(2, "2" * 32), (HUGE, "f" * 32)]
    b.offer(0, HUGE, "f" * 32, [], now=0.0)  # looked up in vain
    assert (HUGE, "f" * 32) not in b.to_check(0, holdings, now=1.0, mine=(1, D1))
    assert (HUGE, "f" * 32) in b.to_check(0, holdings, now=6.0, mine=(1, D1))


# -- the rule ------------------------------------------------------------------------------
def _engine() -> OuterEngine:
    return OuterEngine(EngineConfig(H=4, tau=1, codec="fp32"), Schedule(4, 1), [np.zeros(64)])


def _plan(holdings: list[tuple[str, int, str]], b: CertifiedStates) -> fs.Action:
    engine = _engine()
    b.seeds = [engine.digest(0)]
    sync = fs.FragmentSync(
        engine, 0, peer_id="me", run_id=RUN, believes=lambda v, d: b.believes(0, v, d)
    )
    sync.begin(np.ones(64, np.float32), 3)
    mine = (engine.version(0), engine.digest(0))
    return sync.plan(b.believed(0, holdings, now=0.0, mine=mine), wall_now=0.0)


def test_a_forged_huge_version_without_certificate_is_not_followed() -> None:
    forged = [("liar", HUGE, "f" * 32)]
    assert ss.leading_state(forged) == (HUGE, "f" * 32)  # the rule alone would follow it
    assert ss.leading_state(forged, believes=lambda v, d: False) is None
    action = _plan(forged, beliefs())
    assert isinstance(action, fs.FindGroup)  # stay: no fetch is attempted


@pytest.mark.parametrize("who", ["liar alone", "sybils not listed", "wrong run"])
def test_a_forged_version_with_a_fake_certificate_is_not_followed(who: str) -> None:
    if who == "liar alone":
        fake = attestation(version=HUGE, digest="f" * 32, members=(PEER["liar"],))
        pile = [sealed("liar", fake)]
    elif who == "sybils not listed":
        fake = attestation(version=HUGE, digest="f" * 32)  # members a, b, c
        pile = [sealed("s1", fake), sealed("s2", fake), sealed("liar", fake)]
    else:
        fake = attestation(run_id=OTHER_RUN, version=HUGE, digest="f" * 32)
        pile = [sealed("a", fake), sealed("b", fake)]
    b = beliefs()
    assert b.offer(0, HUGE, "f" * 32, pile, now=0.0) is None
    assert isinstance(_plan([("liar", HUGE, "f" * 32)], b), fs.FindGroup)


def test_a_certified_state_ahead_is_followed() -> None:
    b = beliefs()
    b.offer(0, 1, D1, [sealed("a"), sealed("b")], now=0.0)
    action = _plan([("a", 1, D1), ("liar", HUGE, "f" * 32)], b)
    assert isinstance(action, fs.FetchState)
    assert action.peer == "a" and action.target == (1, D1)


def test_a_committed_round_yields_this_members_attestation() -> None:
    from atoll.protocol import allreduce as ar
    from atoll.protocol import matchmaking as mm

    engine = _engine()
    parent = engine.digest(0)
    sync = fs.FragmentSync(engine, 0, peer_id="me", run_id=RUN)
    request = sync.begin(np.ones(64, np.float32), 3)
    sync.plan([], wall_now=0.0)
    sync.matched(mm.Formed(("you", "me"), "you", mm.RoundKey(RUN, 0, request.round)))
    sync.reduced(ar.Done(np.zeros(64, np.float32)))
    att = sync.attestation
    assert att is not None
    assert (att.version, att.digest, att.parent) == (1, engine.digest(0), parent)
    assert att.members == ("me", "you")

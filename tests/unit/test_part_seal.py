"""Sealed parts (atoll.protocol.partseal): a part a chunk owner refuses is proven to every
member, who strikes its sender on the proof, never on the owner's word.

Rounds run in the in-memory harness of the all-reduce tests, each member with a real
Ed25519 identity sealing its parts and opening the others' (atoll.node.envelopes).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier
from atoll.protocol.allreduce import Abort, AllReduceRound, Part, RoundSpec, Send
from atoll.protocol.checks import PartChecks
from atoll.protocol.errors import ConfigError
from atoll.protocol.messages import decode_message, encode_message
from atoll.protocol.partseal import PART_DOMAIN, Proof, judge, seal_part, seal_problem
from atoll.security.identity import Identity, generate
from tests.unit.test_allreduce import (
    KEY,
    PHASE,
    ROUND,
    Mutator,
    Net,
    _nan_payload,
    run_net,
)

N_MEMBERS = 5
NUMEL = 3000
IDS: list[Identity] = [generate() for _ in range(N_MEMBERS)]
SIGNERS = {i.peer_id: EnvelopeSigner(i) for i in IDS}
OPENER = EnvelopeVerifier()


CHECKS = PartChecks()


def _inputs(codec: str = "fp32") -> tuple[RoundSpec, list[bytes], list[float]]:
    members = tuple(i.peer_id for i in IDS)
    spec = RoundSpec(KEY, members, NUMEL, codec, checks=CHECKS, sealed=True)
    c = spec.make_codec()
    rng = np.random.default_rng(3)
    mu = rng.standard_normal(NUMEL)
    xs = (mu + 0.5 * rng.standard_normal((N_MEMBERS, NUMEL))).astype(np.float32)
    weights = [float(rng.integers(1000, 2000)) for _ in members]
    return spec, [c.encode(x) for x in xs], weights


def _sealed_net(spec: RoundSpec, payloads: list[bytes], weights: list[float], **kw: object) -> Net:
    net = Net(replace(spec, sealed=False), payloads, weights, **kw)  # type: ignore[arg-type]
    net.spec = spec
    net.machines = {
        m: AllReduceRound(
            spec,
            m,
            payloads[i],
            weights[i],
            now=0.0,
            phase_timeout=PHASE,
            round_timeout=ROUND,
            signer=SIGNERS[m],
            opener=OPENER,
        )
        for i, m in enumerate(spec.members)
    }
    return net


def _resealed(spec: RoundSpec, sender: str, chunk: int, change: object) -> Mutator:
    """``sender`` rewrites its part for ``chunk`` with ``change(part, (a, b))`` and seals
    the new payload with its own key: a hostile part with a valid seal."""

    def mutate(s: Send) -> list[Send]:
        p = s.message
        if not isinstance(p, Part) or p.chunk != chunk:
            return [s]
        bad: Part = change(p, spec.bounds()[chunk])  # type: ignore[operator]
        k = spec.key
        seal = seal_part(
            SIGNERS[sender], k.run_id, k.fragment, k.round, sender, chunk, bad.weight, bad.payload
        )
        return [Send(s.to, replace(bad, seal=seal))]

    return mutate


def test_an_honest_sealed_round_commits_and_costs_only_the_seals() -> None:
    spec, payloads, weights = _inputs()
    sealed = run_net(_sealed_net(spec, payloads, weights))
    plain = run_net(Net(replace(spec, sealed=False), payloads, weights))
    assert set(sealed.done()) == set(spec.members)
    a = next(iter(sealed.done().values()))
    assert a.tobytes() == next(iter(plain.done().values())).tobytes()


@pytest.mark.parametrize("verify_owners", [False, True])
def test_a_nan_part_to_one_owner_is_proven_to_every_member(verify_owners: bool) -> None:
    """The hostile member spoils only its part for chunk 0: only that owner sees it, and
    every other member convicts it from the proof in the owner's abort. With verified
    owners the spoiled part also breaks the sender's commitments; the sealed part still
    proves it bad."""
    spec, payloads, weights = _inputs("e3m0")
    spec = replace(spec, verify_owners=verify_owners)
    bad = spec.members[3]

    def nan(p: Part, ab: tuple[int, int]) -> Part:
        return replace(p, payload=_nan_payload("e3m0", ab[1] - ab[0]))

    net = run_net(_sealed_net(spec, payloads, weights, mutate={bad: _resealed(spec, bad, 0, nan)}))
    assert net.done() == {}
    caught = {spec.members[0]}  # the owner of chunk 0, and its verifier when verified
    if verify_owners:
        caught.add(spec.members[spec.verifiers()[0]])
    for m in spec.members:
        if m != bad:
            failed = net.failed()[m]
            assert failed.culprit == bad, failed
            assert (f"proven against {bad}" in failed.reason) == (m not in caught), failed


def test_a_part_over_the_group_norm_is_proven_with_the_chunks_parts() -> None:
    spec, payloads, weights = _inputs("fp32")
    bad = spec.members[2]
    c = spec.make_codec()

    def huge(p: Part, ab: tuple[int, int]) -> Part:
        return replace(p, payload=c.encode(c.decode(p.payload, ab[1] - ab[0]) * np.float32(1e3)))

    net = run_net(_sealed_net(spec, payloads, weights, mutate={bad: _resealed(spec, bad, 1, huge)}))
    for m in spec.members:
        if m != bad:
            failed = net.failed()[m]
            assert failed.culprit == bad, failed
            assert "norm" in failed.reason


def test_a_part_with_a_broken_seal_is_refused_but_proves_nothing_to_the_others() -> None:
    spec, payloads, weights = _inputs()
    bad = spec.members[1]

    def strip(s: Send) -> list[Send]:
        p = s.message
        if isinstance(p, Part) and p.chunk == 0:
            return [Send(s.to, replace(p, seal=p.seal[:-1] + bytes([p.seal[-1] ^ 1])))]
        return [s]

    net = run_net(_sealed_net(spec, payloads, weights, mutate={bad: strip}))
    owner = spec.members[0]
    assert net.failed()[owner].culprit == bad  # the owner checked the seal itself
    others = [net.failed()[m] for m in spec.members if m not in (owner, bad)]
    assert others and all(f.culprit is None for f in others)


def _honest_proof(spec: RoundSpec, payloads: list[bytes], weights: list[float]) -> Proof:
    c, k = spec.make_codec(), spec.key
    j = 0
    a, b = spec.bounds()[j]
    pieces = tuple(c.slice_payload(p, spec.numel, a, b) for p in payloads)
    seals = tuple(
        seal_part(SIGNERS[m], k.run_id, k.fragment, k.round, m, j, w, piece)
        for m, w, piece in zip(spec.members, weights, pieces, strict=True)
    )
    return Proof(j, tuple(weights), pieces, seals)


def _judge(spec: RoundSpec, proof: Proof, me: str) -> tuple[str | None, str]:
    k = spec.key
    return judge(
        proof,
        opener=OPENER,
        run_id=k.run_id,
        fragment=k.fragment,
        round_=k.round,
        members=spec.members,
        bounds=spec.bounds(),
        codec=spec.make_codec(),
        checks=spec.checks,
        caps=None,
        me=me,
    )


def test_a_doctored_proof_convicts_nobody() -> None:
    """A hostile owner cannot frame an honest member: honest parts pass, a payload swapped
    under a member's seal or a part sealed by the owner for another member prove nothing,
    and an incomplete set cannot run the group checks."""
    spec, payloads, weights = _inputs("fp32")
    me, owner, victim = spec.members[4], spec.members[0], spec.members[2]
    proof = _honest_proof(spec, payloads, weights)
    assert _judge(spec, proof, me)[0] is None
    k = spec.key
    c = spec.make_codec()
    a, b = spec.bounds()[0]
    huge = c.encode(c.decode(proof.payloads[2], b - a) * np.float32(1e3))
    swapped = replace(proof, payloads=(*proof.payloads[:2], huge, *proof.payloads[3:]))
    assert _judge(spec, swapped, me) == (
        None,
        f"the proof does not hold: the seal on the part of {victim} for chunk 0 is for "
        "another part",
    )
    framed = seal_part(SIGNERS[owner], k.run_id, k.fragment, k.round, victim, 0, weights[2], huge)
    forged = replace(swapped, seals=(*proof.seals[:2], framed, *proof.seals[3:]))
    convicted, why = _judge(spec, forged, me)
    assert convicted is None and f"sealed by {owner}" in why
    # the victim's own (honest) sealed part alone is no proof of anything
    alone = Proof(
        0,
        tuple(w if i == 2 else 0.0 for i, w in enumerate(weights)),
        tuple(p if i == 2 else b"" for i, p in enumerate(proof.payloads)),
        tuple(s if i == 2 else b"" for i, s in enumerate(proof.seals)),
    )
    assert _judge(spec, alone, me)[0] is None
    # a malformed proof is refused, not a crash
    assert _judge(spec, replace(proof, chunk=99), me) == (None, "a malformed proof")
    assert _judge(spec, replace(proof, seals=proof.seals[:2]), me) == (None, "a malformed proof")


def test_a_member_never_convicts_itself() -> None:
    spec, payloads, weights = _inputs("fp32")
    c = spec.make_codec()
    payloads[1] = c.encode(c.decode(payloads[1], NUMEL) * np.float32(1e3))
    proof = _honest_proof(spec, payloads, weights)
    assert _judge(spec, proof, spec.members[0])[0] == spec.members[1]
    assert _judge(spec, proof, spec.members[1])[0] is None


def test_seal_problem_names_what_is_wrong() -> None:
    k, sender = KEY, IDS[0].peer_id
    seal = seal_part(SIGNERS[sender], k.run_id, k.fragment, k.round, sender, 1, 5.0, b"abc")
    ok = (k.run_id, k.fragment, k.round, sender, 1, 5.0, b"abc")
    assert seal_problem(OPENER, seal, *ok) is None
    assert "carries no seal" in str(seal_problem(OPENER, b"", *ok))
    assert "does not open" in str(seal_problem(OPENER, b"\x01garbage", *ok))
    other = IDS[1].peer_id
    assert f"sealed by {sender}" in str(
        seal_problem(OPENER, seal, k.run_id, k.fragment, k.round, other, 1, 5.0, b"abc")
    )
    for changed in (
        (k.run_id, k.fragment, k.round, sender, 2, 5.0, b"abc"),  # another chunk
        (k.run_id, k.fragment, k.round + 1, sender, 1, 5.0, b"abc"),  # another round
        (k.run_id, k.fragment, k.round, sender, 1, 6.0, b"abc"),  # another weight
        (k.run_id, k.fragment, k.round, sender, 1, 5.0, b"abd"),  # another payload
    ):
        assert "for another part" in str(seal_problem(OPENER, seal, *changed))
    # a seal of another domain (an attestation's, say) never opens as a part's
    wrong = SIGNERS[sender].seal("atoll/attestation/v1", b"x")
    assert "does not open" in str(seal_problem(OPENER, wrong, *ok))
    assert PART_DOMAIN != "atoll/attestation/v1"


def test_a_sealed_round_needs_a_signer_and_an_opener() -> None:
    spec, payloads, weights = _inputs()
    with pytest.raises(ConfigError, match="signer and an opener"):
        AllReduceRound(
            spec,
            spec.members[0],
            payloads[0],
            weights[0],
            now=0.0,
            phase_timeout=1,
            round_timeout=2,
        )
    with pytest.raises(ConfigError, match="sealed must be a bool"):
        RoundSpec(KEY, spec.members, NUMEL, "fp32", sealed=1)  # type: ignore[arg-type]


def test_an_abort_with_its_proof_round_trips_on_the_wire() -> None:
    spec, payloads, weights = _inputs()
    proof = _honest_proof(spec, payloads, weights)
    k = spec.key
    full = Abort(
        k.run_id,
        k.fragment,
        k.round,
        spec.members[0],
        "x",
        0,
        proof.weights,
        proof.payloads,
        proof.seals,
    )
    assert decode_message(encode_message(full)) == full
    plain = Abort(k.run_id, k.fragment, k.round, spec.members[0], "x")
    assert len(encode_message(plain)) < 200  # the proof's fields stay off the wire


def test_two_different_sealed_parts_for_one_chunk_are_proven_to_every_member() -> None:
    """An equivocating member sends the owner of chunk 0 a second, different part with a
    valid seal of its own: the two seals convict it at every member."""
    spec, payloads, weights = _inputs("fp32")
    bad = spec.members[2]
    k = spec.key

    def twice(s: Send) -> list[Send]:
        p = s.message
        if not isinstance(p, Part) or p.chunk != 0:
            return [s]
        other = bytes([p.payload[0] ^ 0x10]) + p.payload[1:]
        seal = seal_part(SIGNERS[bad], k.run_id, k.fragment, k.round, bad, 0, p.weight, other)
        return [s, Send(s.to, replace(p, payload=other, seal=seal))]

    net = run_net(_sealed_net(spec, payloads, weights, mutate={bad: twice}))
    assert net.done() == {}
    owner = spec.members[0]
    for m in spec.members:
        if m != bad:
            failed = net.failed()[m]
            assert failed.culprit == bad, failed
            if m != owner:
                assert "two different parts for chunk 0" in failed.reason


def test_an_equivocation_proof_holds_only_with_two_different_seals_of_the_member() -> None:
    spec, payloads, weights = _inputs("fp32")
    me, victim = spec.members[4], spec.members[1]
    full = _honest_proof(spec, payloads, weights)
    one = Proof(
        0,
        tuple(w if i == 1 else 0.0 for i, w in enumerate(full.weights)),
        tuple(p if i == 1 else b"" for i, p in enumerate(full.payloads)),
        tuple(s if i == 1 else b"" for i, s in enumerate(full.seals)),
    )
    k = spec.key
    other = b"\x00" + full.payloads[1][1:]
    own = seal_part(SIGNERS[victim], k.run_id, k.fragment, k.round, victim, 0, weights[1], other)
    assert _judge(spec, replace(one, twin=(weights[1], other, own)), me)[0] == victim
    # the same part twice is no equivocation
    same = (weights[1], full.payloads[1], full.seals[1])
    assert _judge(spec, replace(one, twin=same), me)[0] is None
    # a second part sealed by someone else (the accuser) proves nothing
    framed = seal_part(SIGNERS[me], k.run_id, k.fragment, k.round, victim, 0, weights[1], other)
    assert _judge(spec, replace(one, twin=(weights[1], other, framed)), me)[0] is None
    # a twin needs exactly one member's part beside it
    assert _judge(spec, replace(full, twin=(weights[1], other, own)), me) == (
        None,
        "a malformed proof",
    )
    # and it travels on the wire
    msg = Abort(
        k.run_id,
        k.fragment,
        k.round,
        me,
        "x",
        0,
        one.weights,
        one.payloads,
        one.seals,
        weights[1],
        other,
        own,
    )
    assert decode_message(encode_message(msg)) == msg

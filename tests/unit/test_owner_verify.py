"""Verified chunk owners (RoundSpec.verify_owners): a hostile owner cannot make honest
members commit a wrong chunk, and a hostile verifier cannot either.

A small in-memory network drives N round machines with a fake clock: each message takes
a jittered latency (which reorders them), deadlines are ticked as time passes, and
hostile members are made with the machine's test hooks (``tamper_reduced``,
``tamper_verified``) or by rewriting what they send.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from atoll.protocol.allreduce import (
    Abort,
    Action,
    AllReduceRound,
    Done,
    Evidence,
    Failed,
    Message,
    Part,
    Reduced,
    RoundKey,
    RoundSpec,
    Send,
    Verified,
)
from atoll.protocol.checks import PartChecks
from atoll.protocol.engine import SyncRequest, average_requests
from atoll.protocol.errors import ConfigError
from atoll.protocol.messages import decode_message, encode_message
from atoll.protocol.reduce import Contribution, reduce_encoded
from atoll.protocol.robust import RobustRule

PHASE = 1.0
ROUND = 2.0
LATENCY = 0.01
KEY = RoundKey("run-v", 2, 9)

Mutator = Callable[[Send], list[Send]]


def make(
    n: int, numel: int = 1000, codec: str = "e3m0", seed: int = 0, **spec_kwargs: object
) -> tuple[RoundSpec, list[bytes], list[float]]:
    members = tuple(f"peer{i}" for i in range(n))
    spec = RoundSpec(KEY, members, numel, codec, verify_owners=True, **spec_kwargs)  # type: ignore[arg-type]
    c = spec.make_codec()
    rng = np.random.default_rng(seed)
    payloads = [c.encode(rng.standard_normal(numel).astype(np.float32)) for _ in members]
    weights = [float(rng.integers(1, 1000)) for _ in members]
    return spec, payloads, weights


def reference(spec: RoundSpec, payloads: list[bytes], weights: list[float]) -> np.ndarray:
    reqs = [
        SyncRequest(KEY.fragment, KEY.round, 0, 0, w, p, spec.numel)
        for p, w in zip(payloads, weights, strict=True)
    ]
    averaged, _ = average_requests(reqs, spec.make_codec())
    return averaged


class Net:
    """N machines, a fake clock and a jittered, reordering message queue."""

    def __init__(
        self,
        spec: RoundSpec,
        payloads: list[bytes],
        weights: list[float],
        *,
        seed: int = 0,
        hooks: dict[str, dict[str, Callable[[bytes], bytes]]] | None = None,
        mutate: dict[str, Mutator] | None = None,
        wire: bool = True,
    ) -> None:
        self.spec = spec
        self.now = 0.0
        self.rng = np.random.default_rng(seed)
        self.mutate = mutate or {}
        self.wire = wire  # every message through the wire codec, as a real transport does
        self.machines = {
            m: AllReduceRound(
                spec,
                m,
                payloads[i],
                weights[i],
                now=0.0,
                phase_timeout=PHASE,
                round_timeout=ROUND,
                **(hooks or {}).get(m, {}),  # type: ignore[arg-type]
            )
            for i, m in enumerate(spec.members)
        }
        self.results: dict[str, Done | Failed] = {}
        self.sent: list[tuple[str, str, Message]] = []
        self.lost: set[str] = set()
        self._queue: list[tuple[float, int, str, Message]] = []
        self._seq = 0

    def _handle(self, src: str, actions: list[Action]) -> None:
        for act in actions:
            if isinstance(act, Send):
                for s in self.mutate[src](act) if src in self.mutate else [act]:
                    msg = decode_message(encode_message(s.message)) if self.wire else s.message
                    assert isinstance(msg, Part | Reduced | Abort | Verified | Evidence)
                    self.sent.append((src, s.to, msg))
                    delay = LATENCY * (0.2 + 1.6 * float(self.rng.random()))
                    heapq.heappush(self._queue, (self.now + delay, self._seq, s.to, msg))
                    self._seq += 1
            else:
                assert src not in self.results, f"{src} ended twice"
                self.results[src] = act

    def run(self) -> Net:
        for m, machine in self.machines.items():
            if m not in self.lost:
                self._handle(m, machine.start())
        while True:
            live = [m for m in self.machines if m not in self.lost]
            times = [t for m in live if (t := self.machines[m].next_deadline) is not None]
            if self._queue:
                times.append(self._queue[0][0])
            if not times:
                break
            self.now = min(times)
            assert self.now <= ROUND + 1.0, "past every deadline"
            while self._queue and self._queue[0][0] <= self.now:
                _, _, to, msg = heapq.heappop(self._queue)
                if to not in self.lost:
                    self._handle(to, self.machines[to].receive(msg, now=self.now))
            for m in live:
                self._handle(m, self.machines[m].tick(self.now))
        for m in self.machines:
            if m not in self.lost:
                assert self.machines[m].state != "running", m
        return self

    def done(self) -> dict[str, np.ndarray]:
        return {m: r.averaged for m, r in self.results.items() if isinstance(r, Done)}

    def failed(self) -> dict[str, Failed]:
        return {m: r for m, r in self.results.items() if isinstance(r, Failed)}


def flip(payload: bytes) -> bytes:
    """A wrong chunk that still decodes: the last byte changed (e3m0 codes, no scale)."""
    return payload[:-1] + bytes([payload[-1] ^ 0x11])


# --------------------------------------------------------------------------------------
# honest rounds
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("seed", [0, 1])
def test_honest_rounds_commit_the_reference_bytes(n: int, seed: int) -> None:
    spec, payloads, weights = make(n, numel=700 + 37 * n, seed=seed)
    net = Net(spec, payloads, weights, seed=seed).run()
    assert not net.failed()
    ref = reference(spec, payloads, weights)
    assert set(net.done()) == set(spec.members)
    for got in net.done().values():
        assert np.array_equal(got, ref)


@pytest.mark.parametrize("codec", ["fp32", "int8", "e3m0-sr"])
@pytest.mark.parametrize(
    "robust", [RobustRule(), RobustRule("trimmed_mean", trim=0.2), RobustRule("centered_clip")]
)
def test_verification_reproduces_every_rule_and_codec(codec: str, robust: RobustRule) -> None:
    spec, payloads, weights = make(5, numel=900, codec=codec, robust=robust, checks=PartChecks())
    net = Net(spec, payloads, weights, seed=3).run()
    assert not net.failed(), net.failed()
    values = list(net.done().values())
    assert len(values) == 5 and all(np.array_equal(v, values[0]) for v in values)


def test_the_verifiers_are_a_derangement_that_moves_with_the_round() -> None:
    members = tuple(f"p{i}" for i in range(8))
    seen = set()
    for r in range(20):
        spec = RoundSpec(replace(KEY, round=r), members, 10, "fp32", verify_owners=True)
        v = spec.verifiers()
        assert sorted(v) == list(range(8))
        assert all(v[j] != j for j in range(8))
        seen.add(v)
    assert len(seen) > 10
    assert RoundSpec(KEY, ("a",), 10, "fp32", verify_owners=True).verifiers() == (0,)


def test_the_cost_is_one_more_copy_of_the_reduce_scatter() -> None:
    """Payload bytes per member: plain (M-1)/M twice; verified three times that share
    (each chunk's parts go to its verifier as well), plus digests and small messages."""
    n = 4
    spec, payloads, weights = make(n, numel=4096)
    plain = Net(replace(spec, verify_owners=False), payloads, weights).run()
    verified = Net(spec, payloads, weights).run()
    size = len(payloads[0])
    for m in spec.members:
        assert plain.machines[m].bytes_sent == 2 * (n - 1) * size // n
        assert verified.machines[m].bytes_sent == 3 * (n - 1) * size // n
    extra = [x for x in verified.sent if isinstance(x[2], Verified)]
    assert len(extra) == n * (n - 1)


def test_off_by_default_and_the_wire_unchanged() -> None:
    spec, payloads, weights = make(3)
    plain = replace(spec, verify_owners=False)
    assert RoundSpec(KEY, spec.members, 10, "fp32").verify_owners is False
    net = Net(plain, payloads, weights).run()
    assert all(not isinstance(msg, Verified | Evidence) for _, _, msg in net.sent)
    part = next(msg for _, _, msg in net.sent if isinstance(msg, Part))
    assert part.digests == ()
    # a verified-round message from a peer is ignored by an unverified round
    m = AllReduceRound(plain, "peer0", payloads[0], 1.0, now=0, phase_timeout=1, round_timeout=2)
    bogus = Verified(KEY.run_id, KEY.fragment, KEY.round, "peer1", 0, 1.0, b"x" * 32, ())
    assert m.receive(bogus, now=0.0) == []
    with pytest.raises(ConfigError):
        RoundSpec(KEY, spec.members, 10, "fp32", verify_owners=1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# a hostile owner
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_hostile_owner_is_caught_and_named(n: int, seed: int) -> None:
    spec, payloads, weights = make(n, seed=seed)
    bad = spec.members[seed % n]
    net = Net(spec, payloads, weights, seed=seed, hooks={bad: {"tamper_reduced": flip}}).run()
    assert set(net.done()) <= {bad}, "an honest member committed a tampered chunk"
    honest = [m for m in spec.members if m != bad]
    for m in honest:
        f = net.results[m]
        assert isinstance(f, Failed)
        assert f.culprit == bad, (m, f)


def test_an_owner_that_leaves_out_a_part_is_caught() -> None:
    """The owner reduces its chunk without one member's part but lists every digest."""
    n = 5
    spec, payloads, weights = make(n, seed=4)
    bad, j = "peer2", 2
    c = spec.make_codec()
    a, b = spec.bounds()[j]
    parts = [
        Contribution(c.slice_payload(p, spec.numel, a, b), w)
        for p, w in zip(payloads, weights, strict=True)
    ]
    without = reduce_encoded(parts[:1] + parts[2:], c, b - a)
    net = Net(spec, payloads, weights, hooks={bad: {"tamper_reduced": lambda _: without}}).run()
    assert set(net.done()) <= {bad}, "an honest member committed"
    assert {f.culprit for m, f in net.failed().items() if m != bad} == {bad}


def test_an_owner_that_lies_about_a_members_part_is_named_at_once() -> None:
    n = 4
    spec, payloads, weights = make(n, seed=5)
    bad = "peer1"

    def lie(s: Send) -> list[Send]:
        msg = s.message
        if isinstance(msg, Reduced):
            digests = list(msg.part_digests)
            digests[0] = bytes(32)  # peer0's part, replaced
            return [replace(s, message=replace(msg, part_digests=tuple(digests)))]
        return [s]

    net = Net(spec, payloads, weights, mutate={bad: lie}).run()
    assert set(net.done()) <= {bad}, "an honest member committed"
    f = net.results["peer0"]
    assert isinstance(f, Failed) and f.culprit == bad and "did not use" in f.reason


def test_an_owner_equivocating_between_members_cannot_make_anyone_commit_its_lie() -> None:
    """The owner sends the right chunk to its verifier and a wrong one to another member:
    the verifier confirms, but that member sees a chunk unlike the confirmed digest."""
    n = 5
    spec, payloads, weights = make(n, seed=6)
    bad = "peer0"
    victim = next(m for i, m in enumerate(spec.members) if i not in (0, spec.verifiers()[0]))

    def two_faced(s: Send) -> list[Send]:
        msg = s.message
        if isinstance(msg, Reduced) and s.to == victim:
            return [replace(s, message=replace(msg, payload=flip(msg.payload)))]
        return [s]

    net = Net(spec, payloads, weights, mutate={bad: two_faced}).run()
    ref = reference(spec, payloads, weights)
    assert victim not in net.done()
    for got in net.done().values():
        assert np.array_equal(got, ref)
    f = net.results[victim]
    assert isinstance(f, Failed) and f.culprit is None
    assert set(f.suspects) == {bad, spec.members[spec.verifiers()[0]]}


# --------------------------------------------------------------------------------------
# a hostile verifier
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_a_false_accusation_costs_the_round_and_names_the_verifier(n: int) -> None:
    spec, payloads, weights = make(n, seed=n)
    bad = spec.members[1]
    net = Net(spec, payloads, weights, seed=n, hooks={bad: {"tamper_verified": flip}}).run()
    assert set(net.done()) <= {bad}, "an honest member committed"
    for m in spec.members:
        if m != bad:
            f = net.results[m]
            assert isinstance(f, Failed) and f.culprit == bad, (m, f)


def test_a_verifier_forging_evidence_is_named() -> None:
    n = 4
    spec, payloads, weights = make(n, seed=7)
    bad = "peer3"
    j = spec.verifiers().index(3)

    def forge(s: Send) -> list[Send]:
        msg = s.message
        if isinstance(msg, Verified):
            return [replace(s, message=replace(msg, digest=bytes(32)))]
        if isinstance(msg, Evidence):
            payloads_ = list(msg.payloads)
            payloads_[0] = flip(payloads_[0])
            return [replace(s, message=replace(msg, payloads=tuple(payloads_)))]
        return [s]

    hooks = {bad: {"tamper_verified": flip}}  # so that it sends evidence of its own
    net = Net(spec, payloads, weights, hooks=hooks, mutate={bad: forge}).run()
    assert any(isinstance(msg, Evidence) and src == bad for src, _, msg in net.sent)
    assert set(net.done()) <= {bad}, "an honest member committed"
    owner = spec.members[j]
    for m in spec.members:
        if m != bad:
            f = net.results[m]
            assert isinstance(f, Failed) and f.culprit == bad, (m, owner, f)


def test_a_colluding_owner_and_verifier_are_the_limit() -> None:
    """Both checkers of one chunk lying together: the one case verification does not
    cover (docs/ALGORITHMS.md §5.3). Honest members then commit the tampered chunk."""
    n = 4
    spec, payloads, weights = make(n, seed=8)
    owner = spec.members[0]
    verifier = spec.members[spec.verifiers()[0]]
    hooks = {owner: {"tamper_reduced": flip}, verifier: {"tamper_verified": flip}}
    net = Net(spec, payloads, weights, hooks=hooks).run()
    ref = reference(spec, payloads, weights)
    assert net.done() and all(not np.array_equal(v, ref) for v in net.done().values())


def test_a_silent_verifier_times_the_round_out() -> None:
    n = 4
    spec, payloads, weights = make(n, seed=9)
    bad = "peer2"

    def mute(s: Send) -> list[Send]:
        return [] if isinstance(s.message, Verified) else [s]

    net = Net(spec, payloads, weights, mutate={bad: mute}).run()
    assert set(net.done()) <= {bad}, "an honest member committed"
    for m in spec.members:
        if m != bad:
            f = net.results[m]
            assert isinstance(f, Failed) and f.culprit is None and bad in f.missing, (m, f)
            assert f.reason.startswith("timeout")


def test_a_verdict_from_the_wrong_member_is_rejected() -> None:
    spec, payloads, weights = make(3)
    v = spec.verifiers()
    impostor = next(m for i, m in enumerate(spec.members) if i not in (0, v[0]))
    m0 = AllReduceRound(
        spec, "peer0", payloads[0], weights[0], now=0, phase_timeout=1, round_timeout=2
    )
    m0.start()
    msg = Verified(KEY.run_id, KEY.fragment, KEY.round, impostor, 0, 1.0, bytes(32), ())
    out = m0.receive(msg, now=0.1)
    assert isinstance(out[-1], Failed) and out[-1].culprit == impostor


# --------------------------------------------------------------------------------------
# hostile contributors
# --------------------------------------------------------------------------------------
def test_a_part_unlike_its_commitment_is_rejected() -> None:
    spec, payloads, weights = make(4, seed=10)
    bad = "peer1"

    def swap(s: Send) -> list[Send]:
        msg = s.message
        if isinstance(msg, Part) and s.to == "peer0":
            return [replace(s, message=replace(msg, payload=flip(msg.payload)))]
        return [s]

    net = Net(spec, payloads, weights, mutate={bad: swap}).run()
    assert set(net.done()) <= {bad}, "an honest member committed"
    f = net.results["peer0"]
    assert isinstance(f, Failed) and f.culprit == bad


def test_a_member_giving_owner_and_verifier_different_parts_commits_nobody() -> None:
    """peer1 gives chunk 0's verifier another part than its owner, with a commitment list
    that matches what the verifier sees: the two checkers disagree on the parts, nobody
    commits chunk 0, and nobody honest is named (the suspects include peer1)."""
    spec, payloads, weights = make(4, seed=11)
    bad, v0 = "peer1", spec.members[spec.verifiers()[0]]
    assert v0 != bad  # this seed's verifier of chunk 0 is another member
    c = spec.make_codec()
    a, b = spec.bounds()[0]
    other = flip(c.slice_payload(payloads[1], spec.numel, a, b))

    def two_parts(s: Send) -> list[Send]:
        msg = s.message
        if isinstance(msg, Part) and s.to == v0:
            digests = list(msg.digests)
            digests[0] = hashlib.sha256(other).digest()
            payload = other if msg.chunk == 0 else msg.payload
            return [replace(s, message=replace(msg, payload=payload, digests=tuple(digests)))]
        return [s]

    net = Net(spec, payloads, weights, mutate={bad: two_parts}).run()
    assert set(net.done()) <= {bad}, "nobody honest may commit chunk 0"
    for m, f in net.failed().items():
        if m != bad:
            assert f.culprit in (None, bad), (m, f)


def test_verification_keeps_every_member_bounded_by_the_round_deadline() -> None:
    spec, payloads, weights = make(6, seed=12)
    net = Net(spec, payloads, weights, seed=12)
    net.lost.add("peer4")  # never starts, never answers
    net.run()
    assert not net.done()
    for m, f in net.failed().items():
        assert "peer4" in f.missing or f.reason.startswith("aborted"), (m, f)

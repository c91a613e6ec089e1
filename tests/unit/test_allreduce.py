"""Tests of atoll.protocol.allreduce: one round's reduce-scatter + all-gather, faults included.

An in-memory harness drives N round machines with a fake clock: every message takes
``latency`` seconds (optionally jittered, which reorders them), deadlines are ticked as
time passes, and faults are injected deterministically: a peer that dies after its first
``m`` messages (the others told, or not: a silent peer), and hostile peers whose outgoing
messages are rewritten.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.allreduce import (
    Abort,
    Action,
    AllReduceRound,
    Done,
    Failed,
    Message,
    Part,
    Reduced,
    RoundKey,
    RoundSpec,
    Send,
    Validator,
)
from atoll.protocol.checks import PartChecks
from atoll.protocol.codecs import make_codec
from atoll.protocol.engine import SyncRequest, average_requests
from atoll.protocol.errors import CodecError, ConfigError, RejectedContribution, RejectedInput
from atoll.protocol.robust import RobustRule, aggregate

PHASE = 1.0
ROUND = 2.0
LATENCY = 0.01
KEY = RoundKey("run-a", 3, 17)

Mutator = Callable[[Send], list[Send]]


# --------------------------------------------------------------------------------------
# harness
# --------------------------------------------------------------------------------------
def make_inputs(
    n_members: int, numel: int, codec: str, seed: int = 0, block: int = 128
) -> tuple[RoundSpec, list[bytes], list[float]]:
    members = tuple(f"peer{i}" for i in range(n_members))
    spec = RoundSpec(KEY, members, numel, codec, codec_block=block)
    c = spec.make_codec()
    rng = np.random.default_rng(seed)
    payloads = [
        c.encode((rng.standard_normal(numel) * rng.uniform(0.1, 5)).astype(np.float32))
        for _ in members
    ]
    weights = [float(rng.integers(1, 10_000)) for _ in members]
    return spec, payloads, weights


def reference(spec: RoundSpec, payloads: list[bytes], weights: list[float]) -> np.ndarray:
    """engine.average_requests on the same payloads and weights, in member order."""
    c = spec.make_codec()
    if len(spec.members) == 1:
        return c.decode(payloads[0], spec.numel)  # a group of one applies its own delta
    reqs = [
        SyncRequest(KEY.fragment, KEY.round, 0, 0, w, p, spec.numel)
        for p, w in zip(payloads, weights, strict=True)
    ]
    averaged, _ = average_requests(reqs, c)
    return averaged


@dataclass
class Net:
    spec: RoundSpec
    payloads: list[bytes]
    weights: list[float]
    jitter_seed: int | None = None
    validators: dict[str, Validator] = field(default_factory=dict)
    caps: dict[str, dict[str, float]] = field(default_factory=dict)
    mutate: dict[str, Mutator] = field(default_factory=dict)
    now: float = 0.0
    machines: dict[str, AllReduceRound] = field(init=False)
    results: dict[str, Done | Failed] = field(init=False, default_factory=dict)
    ended_at: dict[str, float] = field(init=False, default_factory=dict)
    dead: set[str] = field(init=False, default_factory=set)
    silent: set[str] = field(init=False, default_factory=set)
    die_after: dict[str, tuple[int, bool]] = field(init=False, default_factory=dict)
    sent: dict[str, int] = field(init=False, default_factory=dict)
    _queue: list[tuple[float, int, str, str, Message | str]] = field(
        init=False, default_factory=list
    )
    _seq: int = field(init=False, default=0)
    _rng: np.random.Generator | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.machines = {
            m: AllReduceRound(
                self.spec,
                m,
                self.payloads[i],
                self.weights[i],
                now=0.0,
                phase_timeout=PHASE,
                round_timeout=ROUND,
                validator=self.validators.get(m),
                weight_caps=self.caps.get(m),
            )
            for i, m in enumerate(self.spec.members)
        }
        self.sent = dict.fromkeys(self.spec.members, 0)
        if self.jitter_seed is not None:
            self._rng = np.random.default_rng(self.jitter_seed)

    # -- faults ----------------------------------------------------------------------------
    def kill_after(self, peer: str, m: int, *, notify: bool = True) -> None:
        """``peer`` dies after sending ``m`` messages; the others are told when notify."""
        self.die_after[peer] = (m, notify)

    def make_silent(self, peer: str) -> None:
        """``peer`` never starts, never answers, and nobody is told."""
        self.silent.add(peer)

    # -- plumbing --------------------------------------------------------------------------
    def live(self) -> list[str]:
        return [m for m in self.spec.members if m not in self.dead and m not in self.silent]

    def _push(self, delay: float, kind: str, to: str, item: Message | str) -> None:
        heapq.heappush(self._queue, (self.now + delay, self._seq, kind, to, item))
        self._seq += 1

    def _delay(self) -> float:
        return LATENCY if self._rng is None else LATENCY * (0.5 + float(self._rng.random()))

    def _maybe_die(self, peer: str) -> bool:
        if peer in self.dead:
            return True
        if peer in self.die_after and self.sent[peer] >= self.die_after[peer][0]:
            self.dead.add(peer)
            if self.die_after[peer][1]:
                for other in self.spec.members:
                    if other != peer:
                        self._push(LATENCY, "lost", other, peer)
            return True
        return False

    def _handle(self, src: str, actions: list[Action]) -> None:
        for act in actions:
            if self._maybe_die(src):
                return
            if isinstance(act, Send):
                sends = self.mutate[src](act) if src in self.mutate else [act]
                for s in sends:
                    if self._maybe_die(src):
                        return
                    self.sent[src] += 1
                    self._push(self._delay(), "msg", s.to, s.message)
            else:
                assert src not in self.results, f"{src} ended twice"
                self.results[src] = act
                self.ended_at[src] = self.now
        self._maybe_die(src)

    def run(self) -> Net:
        for m in self.spec.members:
            if m not in self.silent and not self._maybe_die(m):
                self._handle(m, self.machines[m].start())
        while True:
            times = [t for m in self.live() if (t := self.machines[m].next_deadline) is not None]
            if self._queue:
                times.append(self._queue[0][0])
            if not times:
                break
            self.now = min(times)
            assert self.now <= ROUND + 1.0, "the harness ran past every deadline"
            while self._queue and self._queue[0][0] <= self.now:
                _, _, kind, to, item = heapq.heappop(self._queue)
                if to in self.dead or to in self.silent:
                    continue
                if kind == "msg":
                    assert not isinstance(item, str)
                    self._handle(to, self.machines[to].receive(item, now=self.now))
                else:
                    assert isinstance(item, str)
                    self._handle(to, self.machines[to].peer_lost(item, now=self.now))
            for m in self.live():
                self._handle(m, self.machines[m].tick(self.now))
                # a deadline that has come must have been enforced, or time stands still
                deadline = self.machines[m].next_deadline
                assert m not in self.live() or deadline is None or deadline > self.now, m
        return self

    # -- outcomes --------------------------------------------------------------------------
    def done(self) -> dict[str, np.ndarray]:
        return {m: r.averaged for m, r in self.results.items() if isinstance(r, Done)}

    def failed(self) -> dict[str, Failed]:
        return {m: r for m, r in self.results.items() if isinstance(r, Failed)}

    def check_invariants(self) -> None:
        """Every live member ended by the round deadline; Done members agree bit for bit."""
        for m in self.live():
            assert self.machines[m].state != "running", f"{m} still running"
            assert self.machines[m].next_deadline is None
            assert m in self.results, f"{m} ended without an action"
            assert self.ended_at[m] <= ROUND
            assert self.machines[m].state == (
                "done" if isinstance(self.results[m], Done) else "failed"
            )
        done = list(self.done().values())
        for a in done:
            assert a.dtype == np.float32 and a.shape == (self.spec.numel,)
            assert a.tobytes() == done[0].tobytes()


def run_net(net: Net) -> Net:
    net.run()
    net.check_invariants()
    return net


# --------------------------------------------------------------------------------------
# no fault: everyone done, bit-identical to the reference reduction
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["fp32", "e3m0", "int8", "bf16"])
@pytest.mark.parametrize(("members", "numel"), [(2, 1000), (3, 1000), (5, 3000), (4, 300)])
def test_no_fault_matches_reference(codec: str, members: int, numel: int) -> None:
    spec, payloads, weights = make_inputs(members, numel, codec, seed=members * numel)
    net = run_net(Net(spec, payloads, weights))
    expected = reference(spec, payloads, weights)
    done = net.done()
    assert set(done) == set(spec.members)
    for value in done.values():
        assert value.tobytes() == expected.tobytes()
    assert max(net.ended_at.values()) <= 3 * LATENCY


@pytest.mark.parametrize("codec", ["fp32", "e3m0", "int8"])
@pytest.mark.parametrize(("members", "numel"), [(3, 0), (4, 1), (6, 129), (5, 3)])
def test_empty_chunks(codec: str, members: int, numel: int) -> None:
    spec, payloads, weights = make_inputs(members, numel, codec)
    assert any(a == b for a, b in spec.bounds()) or (codec == "fp32" and numel >= members)
    net = run_net(Net(spec, payloads, weights))
    expected = reference(spec, payloads, weights)
    assert set(net.done()) == set(spec.members)
    for value in net.done().values():
        assert value.tobytes() == expected.tobytes()


@pytest.mark.parametrize("codec", ["fp32", "e3m0", "int8"])
def test_bytes_on_the_wire(codec: str) -> None:
    spec, payloads, weights = make_inputs(4, 1500, codec)
    net = run_net(Net(spec, payloads, weights))
    c = spec.make_codec()
    sizes = [c.encoded_size(b - a) for a, b in spec.bounds()]
    for i, m in enumerate(spec.members):
        machine = net.machines[m]
        others = sum(sizes) - sizes[i]
        assert machine.bytes_sent == others + 3 * sizes[i]  # parts out, my mean to 3 others
        assert machine.bytes_received == 3 * sizes[i] + others
    assert sum(sizes) == c.encoded_size(1500)  # the chunks cut the encoding exactly


def test_single_member_is_done_at_once() -> None:
    spec, payloads, weights = make_inputs(1, 500, "e3m0")
    r = AllReduceRound(
        spec, "peer0", payloads[0], weights[0], now=5.0, phase_timeout=1, round_timeout=1
    )
    actions = r.start()
    assert len(actions) == 1 and isinstance(actions[0], Done)
    np.testing.assert_array_equal(actions[0].averaged, spec.make_codec().decode(payloads[0], 500))
    assert r.state == "done" and r.next_deadline is None
    assert r.tick(100.0) == [] and r.bytes_sent == 0


def test_stochastic_codec_members_agree_and_reruns_repeat() -> None:
    spec, payloads, weights = make_inputs(3, 700, "e3m0-sr")
    first = run_net(Net(spec, payloads, weights)).done()
    again = run_net(Net(spec, payloads, weights)).done()
    assert len(first) == 3
    assert first["peer0"].tobytes() == again["peer2"].tobytes()


def test_reordered_delivery_still_matches_reference() -> None:
    spec, payloads, weights = make_inputs(5, 2000, "e3m0", seed=3)
    expected = reference(spec, payloads, weights)
    for seed in range(5):
        net = run_net(Net(spec, payloads, weights, jitter_seed=seed))
        assert len(net.done()) == 5
        assert all(v.tobytes() == expected.tobytes() for v in net.done().values())


# --------------------------------------------------------------------------------------
# a peer dies at every point of its sends
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
@pytest.mark.parametrize("victim", [0, 2, 3])
def test_peer_dies_after_every_number_of_messages(codec: str, victim: int) -> None:
    n = 4
    spec, payloads, weights = make_inputs(n, 1100, codec, seed=victim)
    expected = reference(spec, payloads, weights)
    k = spec.members[victim]
    total = 2 * (n - 1)  # its parts, then its reduced chunk to everyone
    for m in range(total + 1):
        net = Net(spec, payloads, weights)
        net.kill_after(k, m)
        run_net(net)
        done = net.done()
        done.pop(k, None)  # the dead peer's own view does not count
        for value in done.values():
            assert value.tobytes() == expected.tobytes()
        if m < total:
            # The owners it skipped never reduce, or some member misses its chunk: at most
            # the members that got its reduced chunk can finish.
            assert len(done) <= max(0, m - (n - 1)), (m, sorted(done))
            assert len(net.failed()) >= 1
        else:
            assert len(done) == n - 1, m  # it had sent everything: its loss changes nothing
        for f in net.failed().values():
            assert f.culprit is None


def test_a_round_reports_when_its_parts_were_in_and_when_it_was_done() -> None:
    spec, payloads, weights = make_inputs(4, 800, "e3m0")
    net = run_net(Net(spec, payloads, weights))
    for m in spec.members:
        parts_in, done = net.machines[m].timings
        assert parts_in is not None and done is not None
        assert 0 < parts_in <= done == pytest.approx(net.ended_at[m])
    failed = Net(spec, payloads, weights)
    failed.make_silent("peer1")
    run_net(failed)
    for m in failed.live():
        assert failed.machines[m].timings[1] is None  # never done: nothing to learn from


@pytest.mark.parametrize("sent", [0, 1, 3, 4])
def test_silent_peer_times_out(sent: int) -> None:
    spec, payloads, weights = make_inputs(4, 800, "e3m0")
    net = Net(spec, payloads, weights)
    if sent == 0:
        net.make_silent("peer1")
    else:
        net.kill_after("peer1", sent, notify=False)
    run_net(net)
    # Its 4th message is its reduced chunk to peer0, who can then commit; the rest cannot.
    assert set(net.done()) == ({"peer0"} if sent == 4 else set())
    assert set(net.failed()) >= {"peer0", "peer2", "peer3"} - set(net.done())
    timeouts = [f for m, f in net.failed().items() if m != "peer1" and "timeout" in f.reason]
    assert timeouts, net.failed()
    assert all(f.culprit is None for f in net.failed().values())
    if sent >= 3:  # its parts are out: the owners reduce and wait for its chunk until ROUND
        assert max(net.ended_at[m] for m in net.live()) == ROUND
    else:  # an owner misses its part and times out; its abort reaches the others at once
        ends = [net.ended_at[m] for m in net.live()]
        assert min(ends) == PHASE and max(ends) <= PHASE + LATENCY


# --------------------------------------------------------------------------------------
# hostile peers
# --------------------------------------------------------------------------------------
def _parts_only(change: Callable[[Part], Part]) -> Mutator:
    def mutate(s: Send) -> list[Send]:
        if isinstance(s.message, Part):
            return [Send(s.to, change(s.message))]
        return [s]

    return mutate


def _nan_payload(codec: str, n: int) -> bytes:
    c = make_codec(codec)
    good = c.encode(np.ones(n, np.float32))
    if codec == "fp32":
        return bytes(np.full(n, np.nan, "<f4").tobytes())
    if codec == "int8":
        return bytes(np.float32(np.nan).astype("<f4").tobytes()) + good[4:]
    return bytes(np.uint16(0x7FC0).astype("<u2").tobytes()) + good[2:]  # e3m0: NaN scale


PART_ATTACKS: dict[str, Callable[[str], Callable[[Part], Part]]] = {
    "nan-payload": lambda codec: (
        lambda p: replace(p, payload=_nan_payload(codec, _numel(p, codec)))
    ),
    "long-payload": lambda codec: lambda p: replace(p, payload=p.payload + b"\0"),
    "short-payload": lambda codec: lambda p: replace(p, payload=p.payload[:-1]),
    "weight-zero": lambda codec: lambda p: replace(p, weight=0.0),
    "weight-nan": lambda codec: lambda p: replace(p, weight=math.nan),
    "weight-negative": lambda codec: lambda p: replace(p, weight=-5.0),
    "weight-inf": lambda codec: lambda p: replace(p, weight=math.inf),
    "weight-bool": lambda codec: lambda p: replace(p, weight=True),
    "wrong-chunk": lambda codec: lambda p: replace(p, chunk=(p.chunk + 1) % 4),
}

_SPEC_NUMEL = 1000


def _numel(p: Part, codec: str) -> int:
    spec = RoundSpec(KEY, tuple(f"peer{i}" for i in range(4)), _SPEC_NUMEL, codec)
    a, b = spec.bounds()[p.chunk]
    return b - a


@pytest.mark.parametrize("codec", ["fp32", "e3m0", "int8"])
@pytest.mark.parametrize("attack", sorted(PART_ATTACKS))
def test_hostile_part_fails_every_honest_member(codec: str, attack: str) -> None:
    spec, payloads, weights = make_inputs(4, _SPEC_NUMEL, codec)
    bad = "peer2"
    net = Net(spec, payloads, weights, mutate={bad: _parts_only(PART_ATTACKS[attack](codec))})
    run_net(net)
    assert {m: r for m, r in net.done().items() if m != bad} == {}
    for m in ("peer0", "peer1", "peer3"):
        failed = net.failed()[m]
        assert failed.culprit == bad, (m, failed)
        assert net.ended_at[m] == LATENCY  # detected on arrival, not by a timeout


@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
def test_equivocation_is_caught_by_the_owner(codec: str) -> None:
    spec, payloads, weights = make_inputs(4, 900, codec)
    bad = "peer1"
    other = spec.make_codec().encode(np.full(900, 3.0, np.float32))
    bounds = spec.bounds()

    def twice(s: Send) -> list[Send]:
        if not isinstance(s.message, Part):
            return [s]
        a, b = bounds[s.message.chunk]
        alt = replace(s.message, payload=spec.make_codec().slice_payload(other, 900, a, b))
        return [s, Send(s.to, s.message), Send(s.to, alt)]  # a duplicate, then a different one

    net = run_net(Net(spec, payloads, weights, mutate={bad: twice}))
    for m in ("peer0", "peer2", "peer3"):
        assert net.failed()[m].culprit == bad
        assert "equivocation" in net.failed()[m].reason


def test_weights_told_differently_to_owners_fail_the_round() -> None:
    spec, payloads, weights = make_inputs(4, 900, "fp32")
    bad = "peer3"

    def lie(p: Part) -> Part:
        return replace(p, weight=p.weight * (p.chunk + 1))

    net = run_net(Net(spec, payloads, weights, mutate={bad: _parts_only(lie)}))
    assert net.done() == {}
    assert all("total weight" in f.reason or "aborted" in f.reason for f in net.failed().values())


@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
def test_reduced_for_a_chunk_it_does_not_own(codec: str) -> None:
    spec, payloads, weights = make_inputs(4, 1000, codec)
    bad = "peer0"
    a, b = spec.bounds()[2]
    forged = spec.make_codec().encode(np.zeros(b - a, np.float32))
    injected = False

    def inject(s: Send) -> list[Send]:
        nonlocal injected
        out = [s]
        if not injected:
            injected = True
            out += [
                Send(m, Reduced(KEY.run_id, KEY.fragment, KEY.round, bad, 2, 1.0, forged))
                for m in spec.members
                if m != bad
            ]
        return out

    net = run_net(Net(spec, payloads, weights, mutate={bad: inject}))
    assert {m for m in net.done() if m != bad} == set()
    for m in ("peer1", "peer2", "peer3"):
        assert net.failed()[m].culprit == bad
        assert "does not own" in net.failed()[m].reason


@pytest.mark.parametrize(
    "change",
    [
        lambda r: replace(r, payload=_nan_payload("fp32", len(r.payload) // 4)),
        lambda r: replace(r, payload=r.payload[:-4]),
        lambda r: replace(r, total_weight=math.nan),
        lambda r: replace(r, total_weight=0.0),
        lambda r: replace(r, chunk=99),
    ],
    ids=["nan", "short", "total-nan", "total-zero", "no-such-chunk"],
)
def test_hostile_owner_broadcast(change: Callable[[Reduced], Reduced]) -> None:
    spec, payloads, weights = make_inputs(3, 600, "fp32")
    bad = "peer1"

    def mutate(s: Send) -> list[Send]:
        if isinstance(s.message, Reduced):
            return [Send(s.to, change(s.message))]
        return [s]

    net = run_net(Net(spec, payloads, weights, mutate={bad: mutate}))
    assert {m for m in net.done() if m != bad} == set()
    for m in ("peer0", "peer2"):
        assert net.failed()[m].culprit == bad


def test_validator_rejection_names_the_sender() -> None:
    spec, payloads, weights = make_inputs(3, 600, "e3m0")
    seen: list[tuple[str, int]] = []

    def validator(part: Part, values: np.ndarray) -> None:
        seen.append((part.sender, values.size))
        assert values.dtype == np.float32
        if part.sender == "peer2":
            raise RejectedContribution("norm far above the group median")

    net = run_net(Net(spec, payloads, weights, validators={"peer0": validator}))
    assert net.done() == {}
    assert net.failed()["peer0"].culprit == "peer2"
    assert "median" in net.failed()["peer0"].reason
    a, b = spec.bounds()[0]
    assert ("peer1", b - a) in seen or ("peer2", b - a) in seen
    assert all(f.culprit in (None, "peer2") for f in net.failed().values())


# --------------------------------------------------------------------------------------
# robust aggregation and group checks at the owners
# --------------------------------------------------------------------------------------
def honest_inputs(
    n: int, numel: int, codec: str, seed: int = 0, **spec_kwargs: object
) -> tuple[RoundSpec, list[bytes], list[float], np.ndarray]:
    """Honest peers of similar scale and weight (the group checks' defaults pass them);
    also returns their fp32 deltas."""
    members = tuple(f"peer{i}" for i in range(n))
    spec = RoundSpec(KEY, members, numel, codec, **spec_kwargs)  # type: ignore[arg-type]
    c = spec.make_codec()
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal(numel)
    xs = (mu + 0.5 * rng.standard_normal((n, numel))).astype(np.float32)
    payloads = [c.encode(x) for x in xs]
    weights = [float(rng.integers(1000, 2000)) for _ in members]
    return spec, payloads, weights, xs


def chunkwise_reference(spec: RoundSpec, payloads: list[bytes], weights: list[float]) -> np.ndarray:
    """Each owner's rule on its chunk of the decoded parts, encoded once, decoded."""
    c = spec.make_codec()
    out = []
    for a, b in spec.bounds():
        parts = [c.decode(c.slice_payload(p, spec.numel, a, b), b - a) for p in payloads]
        mean = aggregate(parts, weights, spec.robust)
        out.append(c.decode(c.encode(mean), b - a))
    return np.concatenate(out)


def _scaled_parts(spec: RoundSpec, factor: float) -> Mutator:
    c = spec.make_codec()

    def change(p: Part) -> Part:
        a, b = spec.bounds()[p.chunk]
        return replace(p, payload=c.encode(c.decode(p.payload, b - a) * np.float32(factor)))

    return _parts_only(change)


RULES = [RobustRule("trimmed_mean"), RobustRule("centered_clip")]


@pytest.mark.parametrize("codec", ["fp32", "e3m0", "int8"])
@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
def test_robust_rule_members_agree_on_the_owners_bytes(
    codec: str, n: int, rule: RobustRule
) -> None:
    spec, payloads, weights, _ = honest_inputs(n, 2500, codec, seed=n, robust=rule)
    expected = chunkwise_reference(spec, payloads, weights)
    for jitter in (None, 1, 2):
        net = run_net(Net(spec, payloads, weights, jitter_seed=jitter))
        done = net.done()
        assert set(done) == set(spec.members)
        for value in done.values():
            assert value.tobytes() == expected.tobytes()


def test_default_spec_is_the_plain_mean_without_checks() -> None:
    spec, payloads, weights = make_inputs(4, 1000, "e3m0")
    assert spec.robust == RobustRule() and spec.checks is None
    assert chunkwise_reference(spec, payloads, weights).tobytes() == (
        reference(spec, payloads, weights).tobytes()
    )


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
def test_robust_rule_resists_scaled_parts(n: int, rule: RobustRule) -> None:
    spec, payloads, weights, xs = honest_inputs(n, 3000, "fp32", seed=n, robust=rule)
    bad = spec.members[1:][: rule.tolerates(n)]
    honest = [i for i, m in enumerate(spec.members) if m not in bad]
    hmean = np.average(xs[honest].astype(np.float64), axis=0, weights=np.take(weights, honest))
    spread = float(np.sqrt(np.mean([np.sum((xs[i] - hmean) ** 2) for i in honest])))
    mutate = {m: _scaled_parts(spec, 1e4) for m in bad}
    robust = run_net(Net(spec, payloads, weights, mutate=mutate)).done()
    plain_spec = replace(spec, robust=RobustRule())
    plain = run_net(Net(plain_spec, payloads, weights, mutate=mutate)).done()
    assert set(robust) == set(plain) == set(spec.members)
    assert np.linalg.norm(robust["peer0"] - hmean) < 3 * spread
    assert np.linalg.norm(plain["peer0"] - hmean) > 100 * spread


@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
def test_group_checks_reject_a_huge_part(codec: str) -> None:
    spec, payloads, weights, _ = honest_inputs(5, 3000, codec, checks=PartChecks())
    assert set(run_net(Net(spec, payloads, weights)).done()) == set(spec.members)
    bad = "peer3"
    net = run_net(Net(spec, payloads, weights, mutate={bad: _scaled_parts(spec, 1e3)}))
    assert net.done() == {}
    culprits = {m: f.culprit for m, f in net.failed().items() if m != bad}
    assert set(culprits.values()) <= {bad, None}
    assert bad in culprits.values()
    for m, culprit in culprits.items():
        if culprit == bad:
            assert "norm" in net.failed()[m].reason and bad in net.failed()[m].reason


def test_group_checks_reject_an_inflated_weight_at_every_owner() -> None:
    spec, payloads, weights, _ = honest_inputs(4, 2000, "e3m0", checks=PartChecks())
    bad = "peer1"
    inflate = _parts_only(lambda p: replace(p, weight=p.weight * 1000))
    net = run_net(Net(spec, payloads, weights, mutate={bad: inflate}))
    assert net.done() == {}
    for m in ("peer0", "peer2", "peer3"):
        # the weight is the same at every owner, so every owner that reduces names it
        assert net.failed()[m].culprit in (bad, None)
    assert sum(net.failed()[m].culprit == bad for m in ("peer0", "peer2", "peer3")) >= 1


def test_weight_caps_reject_the_peer_above_its_cap() -> None:
    spec, payloads, weights, _ = honest_inputs(3, 1000, "fp32")
    caps = {"peer0": {"peer2": weights[2] / 2}}
    net = run_net(Net(spec, payloads, weights, caps=caps))
    assert net.done() == {}
    assert net.failed()["peer0"].culprit == "peer2"
    assert "cap" in net.failed()["peer0"].reason
    ok = run_net(Net(spec, payloads, weights, caps={"peer0": {"peer2": weights[2]}}))
    assert set(ok.done()) == set(spec.members)


def test_the_runs_weight_cap_in_the_spec_refuses_an_inflated_part_in_a_pair() -> None:
    """The spec's cap holds at every owner, in a group too small for the group checks:
    a pair whose second member claims more than the cap fails, naming it."""
    spec, payloads, weights, _ = honest_inputs(2, 1000, "fp32")
    capped = replace(spec, weight_cap=max(weights) - 1.0)
    net = run_net(Net(capped, payloads, weights))
    assert net.done() == {}
    heavy = spec.members[weights.index(max(weights))]
    other = next(m for m in spec.members if m != heavy)
    assert net.failed()[other].culprit == heavy and "cap" in net.failed()[other].reason
    fits = replace(spec, weight_cap=max(weights))
    assert set(run_net(Net(fits, payloads, weights)).done()) == set(spec.members)
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ConfigError, match="weight_cap"):
            replace(spec, weight_cap=bad)


def test_an_owner_whose_own_part_fails_the_checks_blames_nobody() -> None:
    spec, payloads, weights, xs = honest_inputs(4, 2000, "fp32", checks=PartChecks())
    payloads[0] = spec.make_codec().encode(xs[0] * np.float32(1e3))
    net = run_net(Net(spec, payloads, weights))
    assert net.done() == {}
    assert net.failed()["peer0"].culprit is None
    assert all(f.culprit in (None, "peer0") for f in net.failed().values())
    assert any(f.culprit == "peer0" for f in net.failed().values())


def test_spec_rejects_a_bad_rule_or_checks() -> None:
    members = ("a", "b")
    with pytest.raises(ConfigError):
        RoundSpec(KEY, members, 10, "fp32", robust="trimmed_mean")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RoundSpec(KEY, members, 10, "fp32", checks=3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# the machine alone
# --------------------------------------------------------------------------------------
def _machine(
    me: str = "peer0", n: int = 3, numel: int = 400, codec: str = "fp32"
) -> tuple[AllReduceRound, RoundSpec, list[bytes], list[float]]:
    spec, payloads, weights = make_inputs(n, numel, codec)
    i = spec.members.index(me)
    r = AllReduceRound(
        spec, me, payloads[i], weights[i], now=10.0, phase_timeout=PHASE, round_timeout=ROUND
    )
    return r, spec, payloads, weights


def _part(
    spec: RoundSpec, payloads: list[bytes], weights: list[float], sender: int, chunk: int
) -> Part:
    a, b = spec.bounds()[chunk]
    piece = spec.make_codec().slice_payload(payloads[sender], spec.numel, a, b)
    k = spec.key
    return Part(k.run_id, k.fragment, k.round, spec.members[sender], chunk, weights[sender], piece)


def test_start_sends_one_slice_to_each_other_owner() -> None:
    r, spec, payloads, _ = _machine("peer1")
    actions = r.start()
    assert [a.to for a in actions if isinstance(a, Send)] == ["peer0", "peer2"]
    c = spec.make_codec()
    for a in actions:
        assert isinstance(a, Send) and isinstance(a.message, Part)
        lo, hi = spec.bounds()[a.message.chunk]
        assert a.message.payload == c.slice_payload(payloads[1], spec.numel, lo, hi)
        assert a.message.chunk == spec.members.index(a.to)
    with pytest.raises(ConfigError):
        r.start()


def test_ignored_messages_change_nothing() -> None:
    r, spec, payloads, weights = _machine()
    r.start()
    good = _part(spec, payloads, weights, 1, 0)
    ignored: list[Message] = [
        replace(good, round=KEY.round + 1),
        replace(good, run_id="other-run"),
        replace(good, fragment=KEY.fragment + 1),
        replace(good, sender="stranger"),
        replace(good, sender="peer0"),  # claims to be me
        replace(good, group="an-earlier-group"),  # the same version's round, another group
        Abort(KEY.run_id, KEY.fragment, KEY.round, "peer1", "no", group="an-earlier-group"),
        Abort("other-run", KEY.fragment, KEY.round, "peer1", "no"),
        Abort(KEY.run_id, KEY.fragment, KEY.round, "stranger", "no"),
    ]
    for msg in ignored:
        assert r.receive(msg, now=10.1) == []
    assert r.state == "running" and r.bytes_received == 0
    assert r.receive(good, now=10.1) == []  # accepted, still waiting for peer2's part
    assert r.receive(good, now=10.2) == []  # the same part again: ignored
    assert r.state == "running"


def test_abort_fails_and_is_forwarded_once() -> None:
    r, spec, payloads, weights = _machine(n=4)
    r.start()
    actions = r.receive(Abort(KEY.run_id, KEY.fragment, KEY.round, "peer2", "x" * 5000), now=10.5)
    assert isinstance(actions[-1], Failed) and "peer2" in actions[-1].reason
    assert actions[-1].culprit is None and len(actions[-1].reason) < 500
    sends = [a for a in actions if isinstance(a, Send)]
    assert sorted(s.to for s in sends) == ["peer1", "peer3"]
    assert all(isinstance(s.message, Abort) and s.message.sender == "peer0" for s in sends)
    again = Abort(KEY.run_id, KEY.fragment, KEY.round, "peer1", "y")
    assert r.receive(again, now=10.6) == [] and r.state == "failed"
    assert r.receive(_part(spec, payloads, weights, 1, 0), now=10.6) == []


def test_done_stays_done() -> None:
    spec, payloads, weights = make_inputs(2, 300, "fp32")
    net = run_net(Net(spec, payloads, weights))
    r = net.machines["peer0"]
    assert r.state == "done"
    assert r.receive(Abort(KEY.run_id, KEY.fragment, KEY.round, "peer1", "late"), now=0.5) == []
    assert r.peer_lost("peer1", now=0.5) == [] and r.tick(99.0) == []
    assert r.state == "done"


def test_deadlines() -> None:
    r, spec, payloads, weights = _machine()
    assert r.next_deadline == 10.0 + PHASE
    r.start()
    assert r.tick(10.0 + PHASE - 1e-9) == []
    r.receive(_part(spec, payloads, weights, 1, 0), now=10.2)
    r.receive(_part(spec, payloads, weights, 2, 0), now=10.3)  # my chunk reduced
    assert r.next_deadline == 10.0 + ROUND
    assert r.tick(10.0 + PHASE + 0.5) == []
    actions = r.tick(10.0 + ROUND)
    assert isinstance(actions[-1], Failed) and "timeout" in actions[-1].reason
    assert r.next_deadline is None


def test_late_message_times_out_first() -> None:
    r, spec, payloads, weights = _machine()
    r.start()
    actions = r.receive(_part(spec, payloads, weights, 1, 0), now=10.0 + PHASE)
    assert isinstance(actions[-1], Failed) and "timeout" in actions[-1].reason


def test_peer_lost_only_matters_while_needed() -> None:
    r, spec, payloads, weights = _machine(n=3)
    r.start()
    assert r.peer_lost("stranger", now=10.1) == [] and r.peer_lost("peer0", now=10.1) == []
    r.receive(_part(spec, payloads, weights, 1, 0), now=10.1)
    r.receive(_part(spec, payloads, weights, 2, 0), now=10.1)
    a, b = spec.bounds()[1]
    reduced = Reduced(
        KEY.run_id, KEY.fragment, KEY.round, "peer1", 1, math.fsum(weights),
        spec.make_codec().encode(np.zeros(b - a, np.float32)),
    )  # fmt: skip
    assert r.receive(reduced, now=10.2) == []
    assert r.peer_lost("peer1", now=10.3) == []  # it gave all we needed from it
    actions = r.peer_lost("peer2", now=10.3)  # we still need its reduced chunk
    assert isinstance(actions[-1], Failed) and "peer2" in actions[-1].reason
    assert [a.to for a in actions if isinstance(a, Send)] == ["peer1"]


def test_config_errors() -> None:
    spec, payloads, _ = make_inputs(3, 400, "e3m0")

    def make(spec: RoundSpec, me: str, payload: bytes, weight: float) -> AllReduceRound:
        return AllReduceRound(
            spec, me, payload, weight, now=0.0, phase_timeout=1.0, round_timeout=2.0
        )

    with pytest.raises(ConfigError):
        make(spec, "nobody", payloads[0], 1.0)
    with pytest.raises(ConfigError):
        make(spec, "peer0", payloads[0] + b"\0", 1.0)
    for w in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ConfigError):
            make(spec, "peer0", payloads[0], w)
    with pytest.raises(ConfigError):
        AllReduceRound(spec, "peer0", payloads[0], 1.0, now=0.0, phase_timeout=2, round_timeout=1)
    with pytest.raises(ConfigError):
        AllReduceRound(spec, "peer0", payloads[0], 1.0, now=0.0, phase_timeout=0, round_timeout=1)
    with pytest.raises(ConfigError):
        RoundSpec(KEY, (), 10, "fp32")
    with pytest.raises(ConfigError):
        RoundSpec(KEY, ("a", "a"), 10, "fp32")
    with pytest.raises(ConfigError):
        RoundSpec(KEY, ("a",), -1, "fp32")
    with pytest.raises(ConfigError):
        RoundSpec(KEY, ("a",), 10, "fp4")
    nan_own = _nan_payload("fp32", 400)
    fp = RoundSpec(KEY, ("a", "b"), 400, "fp32")
    with pytest.raises(CodecError):
        make(fp, "a", nan_own, 1.0)


def test_failed_reduction_names_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    # The weighted mean of finite inputs can overflow float32 only at the very edge of its
    # range; simulate it to check that the owner rolls back without blaming anyone.
    import atoll.protocol.allreduce as ar

    def overflow(*args: object, **kwargs: object) -> bytes:
        raise RejectedInput("the weighted mean overflowed float32")

    monkeypatch.setattr(ar, "reduce_encoded", overflow)
    spec, payloads, weights = make_inputs(3, 300, "fp32")
    net = run_net(Net(spec, payloads, weights))
    assert net.done() == {}
    for f in net.failed().values():
        assert f.culprit is None
    assert "overflowed" in net.failed()["peer0"].reason


# --------------------------------------------------------------------------------------
# property: any death point, any size; Done members agree, nobody runs past the deadline
# --------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    numel=st.integers(0, 3000),
    codec=st.sampled_from(["fp32", "e3m0", "int8"]),
    victim=st.integers(0, 5),
    death=st.one_of(st.none(), st.integers(0, 12)),
    notify=st.booleans(),
    jitter=st.one_of(st.none(), st.integers(0, 1000)),
    seed=st.integers(0, 2**16),
)
def test_any_death_point(
    n: int,
    numel: int,
    codec: str,
    victim: int,
    death: int | None,
    notify: bool,
    jitter: int | None,
    seed: int,
) -> None:
    spec, payloads, weights = make_inputs(n, numel, codec, seed=seed)
    net = Net(spec, payloads, weights, jitter_seed=jitter)
    k = spec.members[victim % n]
    if death is not None:
        net.kill_after(k, death, notify=notify)
    run_net(net)
    done = net.done()
    expected = reference(spec, payloads, weights)
    for value in done.values():  # a round only completes with every part in
        assert value.tobytes() == expected.tobytes()
    if death is None:
        assert set(done) == set(spec.members)
    elif death < n - 1 and k in net.dead:
        assert done == {}  # an owner never got its part, so nobody can finish

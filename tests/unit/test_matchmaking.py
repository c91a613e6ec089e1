"""Tests of atoll.protocol.matchmaking: who groups with whom for one fragment's slot.

An in-memory harness drives N matchmakers on a fake clock. Each peer starts (declares) at
its own time; its declaration becomes visible to each other peer after a random DHT
delay; messages take a small random latency (so they are reordered); a peer may die, after
which its messages are dropped and every other peer hears ``peer_lost`` once the messages
it sent before dying have arrived (as a closing connection delivers its buffer first).
Everything is seeded, so every run is reproducible.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.allreduce import RoundKey
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import GroupSettings
from atoll.protocol.matchmaking import (
    BEHIND,
    MAX_REDIRECTS,
    PAST_SLOT,
    Action,
    Alone,
    Declaration,
    Disband,
    Formed,
    GroupFormed,
    JoinAccept,
    JoinRequest,
    Matchmaker,
    Message,
    Redirect,
    Send,
    compat_key,
    out_of_slot_refusal,
    rank,
    step_order,
)

RUN = "run-a"
FRAG = 2
SLOT = 7
VERSION = 5
DIGEST = "ab" * 8
TIMEOUT = 15.0


def decl(
    peer: str,
    *,
    run_id: str = RUN,
    fragment: int = FRAG,
    slot: int = SLOT,
    version: int = VERSION,
    digest: str = DIGEST,
    weight: float = 100.0,
) -> Declaration:
    return Declaration(run_id, fragment, slot, peer, version, digest, weight, 0.0)


def by_rank(peers: Sequence[str]) -> list[str]:
    """``peers`` ordered by their rank under the default key (lowest = most senior)."""
    return sorted(peers, key=lambda p: rank(decl(p)))


def request(d: Declaration) -> JoinRequest:
    return JoinRequest(d.peer_id, d.run_id, d.fragment, d.slot, d.version, d.digest, d.weight)


def sends(actions: list[Action]) -> list[tuple[str, Message]]:
    return [(a.to, a.message) for a in actions if isinstance(a, Send)]


def outcome(actions: list[Action]) -> list[Formed | Alone]:
    return [a for a in actions if isinstance(a, Formed | Alone)]


# --------------------------------------------------------------------------------------
# harness
# --------------------------------------------------------------------------------------
@dataclass
class Swarm:
    """N matchmakers, a delayed partial DHT, jittered messages and peer deaths."""

    decls: list[Declaration]
    group: GroupSettings
    seed: int = 0
    starts: list[float] | None = None  # when each peer declares; default all at 0
    dht_delay: float = 0.0  # most seconds before a declaration is seen by a peer
    latency: tuple[float, float] = (0.005, 0.02)
    timeout: float = TIMEOUT
    deaths: dict[str, float] = field(default_factory=dict)
    lost_delay: float = 0.1  # > latency: peer_lost arrives after the dead peer's last words
    silences: dict[str, float] = field(default_factory=dict)  # peer -> when it goes silent
    answer_s: float | None = None  # the machines' bound on a silent leader

    machines: dict[str, Matchmaker] = field(init=False, default_factory=dict)
    results: dict[str, Formed | Alone] = field(init=False, default_factory=dict)
    ended_at: dict[str, float] = field(init=False, default_factory=dict)
    dead: set[str] = field(init=False, default_factory=set)
    now: float = field(init=False, default=0.0)
    _queue: list[tuple[float, int, str, str, object]] = field(init=False, default_factory=list)
    _seq: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.by_id = {d.peer_id: d for d in self.decls}
        starts = self.starts or [0.0] * len(self.decls)
        self.start_at = {d.peer_id: s for d, s in zip(self.decls, starts, strict=True)}
        # visible[viewer][owner]: when owner's declaration reaches viewer's DHT view
        self.visible: dict[str, dict[str, float]] = {}
        for viewer in self.by_id:
            self.visible[viewer] = {
                owner: self.start_at[owner] + self.rng.uniform(0.0, self.dht_delay)
                for owner in self.by_id
            }
        for peer, at in self.start_at.items():
            self._push(at, "start", peer, None)
            for owner, t in self.visible[peer].items():
                if t > at:
                    self._push(t, "view", peer, owner)
        for peer, at in self.deaths.items():
            self._push(at, "die", peer, None)
        for peer, at in self.silences.items():
            self._push(at, "silence", peer, None)

    def _push(self, at: float, kind: str, peer: str, item: object) -> None:
        heapq.heappush(self._queue, (at, self._seq, kind, peer, item))
        self._seq += 1

    def view(self, peer: str) -> list[Declaration]:
        return [self.by_id[o] for o, t in self.visible[peer].items() if t <= self.now]

    def _handle(self, peer: str, actions: list[Action]) -> None:
        for act in actions:
            if isinstance(act, Send):
                assert act.message.sender == peer
                self._push(self.now + self.rng.uniform(*self.latency), "msg", act.to, act.message)
            else:
                assert peer not in self.results, f"{peer} ended twice: {act}"
                self.results[peer] = act
                self.ended_at[peer] = self.now
        m = self.machines[peer]
        if m.next_deadline is not None:
            self._push(max(m.next_deadline, self.now), "tick", peer, None)

    def run(self) -> Swarm:
        steps = 0
        while self._queue:
            steps += 1
            assert steps < 200_000, "the harness does not converge"
            at, _, kind, peer, item = heapq.heappop(self._queue)
            self.now = at
            if peer in self.dead:
                continue
            if kind == "start":
                d = self.by_id[peer]
                self.machines[peer] = Matchmaker(
                    d, self.group, now=at, timeout=self.timeout, answer_s=self.answer_s
                )
                self._handle(peer, self.machines[peer].observe(self.view(peer), now=at))
                continue
            m = self.machines.get(peer)
            if m is None:
                continue  # not started yet: a message to it is lost
            if kind == "view":
                self._handle(peer, m.observe(self.view(peer), now=at))
            elif kind == "tick":
                self._handle(peer, m.tick(at))
            elif kind == "msg":
                assert isinstance(item, JoinRequest | JoinAccept | Redirect | GroupFormed | Disband)
                self._handle(peer, m.receive(item, now=at))
            elif kind == "lost":
                assert isinstance(item, str)
                self._handle(peer, m.peer_lost(item, now=at))
            elif kind == "silence":
                self.dead.add(peer)  # it neither hears nor says anything; nobody is told
            elif kind == "die":
                self.dead.add(peer)
                for other in self.by_id:
                    if other != peer:
                        self._push(at + self.lost_delay, "lost", other, peer)
        return self

    # -- outcomes --------------------------------------------------------------------------
    def formed(self) -> dict[str, Formed]:
        return {p: r for p, r in self.results.items() if isinstance(r, Formed)}

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Leader -> member list, from the leaders' own Formed."""
        return {p: f.members for p, f in self.formed().items() if f.leader == p}

    def alone(self) -> set[str]:
        return {p for p, r in self.results.items() if isinstance(r, Alone)}


def check_safety(sw: Swarm) -> None:
    """Agreement, disjointness, compatibility, sizes and termination."""
    g = sw.group
    formed = sw.formed()
    groups = sw.groups()
    for peer, f in formed.items():
        d = sw.by_id[peer]
        assert peer in f.members, (peer, f)
        assert f.leader == f.members[0]
        assert f.key == RoundKey(d.run_id, d.fragment, d.version, f.key.group)
        # one tag per list: the leader's own, and no other group's
        assert f.key.group and f.key.group == formed[f.leader].key.group
        assert g.min_quorum <= len(f.members) <= g.max_size, f
        assert list(f.members) == by_rank_of(sw, f.members)
        # the list came from its leader's single GroupFormed: identical everywhere
        assert groups.get(f.leader) == f.members, (peer, f, groups.get(f.leader))
        assert len({compat_key(sw.by_id[p]) for p in f.members}) == 1
    tags = [formed[leader].key.group for leader in groups]
    assert len(set(tags)) == len(tags), tags
    seen: set[str] = set()
    for members in groups.values():
        assert not seen & set(members), f"a peer in two groups: {seen & set(members)}"
        seen |= set(members)
    for peer, m in sw.machines.items():
        if peer in sw.dead:
            continue
        assert peer in sw.results, f"{peer} never ended ({m.state})"
        assert m.state in ("formed", "alone")
        assert m.next_deadline is None
        assert sw.ended_at[peer] <= sw.start_at[peer] + sw.timeout + 1e-9


def check_complete(sw: Swarm) -> None:
    """No race lost: every listed member formed with that very list."""
    for members in sw.groups().values():
        for p in members:
            assert p in sw.formed() and sw.formed()[p].members == members, (p, members)


def by_rank_of(sw: Swarm, peers: Sequence[str]) -> list[str]:
    return sorted(peers, key=lambda p: rank(sw.by_id[p]))


def peers(n: int, prefix: str = "p") -> list[str]:
    return [f"{prefix}{i:02d}" for i in range(n)]


# --------------------------------------------------------------------------------------
# the declaration, the order and the messages
# --------------------------------------------------------------------------------------
def test_rank_is_an_agreed_total_order_that_changes_per_slot() -> None:
    ids = peers(30)
    ranks = [rank(decl(p)) for p in ids]
    assert len(set(ranks)) == len(ids)  # no ties between different peers
    assert ranks == [rank(decl(p)) for p in ids]  # deterministic
    # version, digest, weight and clock do not move a peer in the order
    assert rank(decl("x", version=1, digest="ff", weight=3.0)) == rank(decl("x"))
    order = {slot: by_rank_of_slot(ids, slot) for slot in range(6)}
    assert len({tuple(o) for o in order.values()}) > 1  # leadership rotates
    assert rank(decl("x", run_id="run-b")) != rank(decl("x"))
    assert rank(decl("x", fragment=3)) != rank(decl("x"))


def by_rank_of_slot(ids: list[str], slot: int) -> list[str]:
    return sorted(ids, key=lambda p: rank(decl(p, slot=slot)))


def test_compat_key_names_everything_that_must_match() -> None:
    base = decl("x")
    assert compat_key(base) == (RUN, FRAG, SLOT, VERSION, DIGEST)
    assert compat_key(decl("y", weight=1.0)) == compat_key(base)
    for other in (
        decl("x", run_id="r2"),
        decl("x", fragment=0),
        decl("x", slot=8),
        decl("x", version=6),
        decl("x", digest="cd"),
    ):
        assert compat_key(other) != compat_key(base)


@pytest.mark.parametrize("cls", [JoinRequest, JoinAccept, Redirect, GroupFormed, Disband])
def test_messages_are_frozen_slotted_and_primitive(cls: type) -> None:
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen and hasattr(cls, "__slots__")
    allowed = {str, int, float, bool, bytes, tuple[str, ...]}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        assert hints[f.name] in allowed, (cls.__name__, f.name, hints[f.name])
    assert [f.name for f in dataclasses.fields(cls)][:6] == [
        "sender",
        "run_id",
        "fragment",
        "slot",
        "version",
        "digest",
    ]


def test_bad_arguments_are_config_errors() -> None:
    g = GroupSettings()
    with pytest.raises(ConfigError, match="peer_id"):
        Matchmaker(decl(""), g, now=0.0, timeout=1.0)
    with pytest.raises(ConfigError, match="slot"):
        Matchmaker(decl("x", slot=-1), g, now=0.0, timeout=1.0)
    with pytest.raises(ConfigError, match="weight"):
        Matchmaker(decl("x", weight=float("nan")), g, now=0.0, timeout=1.0)
    with pytest.raises(ConfigError, match="timeout"):
        Matchmaker(decl("x"), g, now=0.0, timeout=0.0)
    with pytest.raises(ConfigError, match="now"):
        Matchmaker(decl("x"), g, now=float("inf"), timeout=1.0)
    with pytest.raises(ConfigError, match="GroupSettings"):
        Matchmaker(decl("x"), object(), now=0.0, timeout=1.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# one machine, driven by hand
# --------------------------------------------------------------------------------------
def test_grace_window_takes_late_peers_then_closes() -> None:
    lead, a, b, c = by_rank(peers(4))
    g = GroupSettings(min_quorum=2, max_size=8, grace_s=2.0)
    m = Matchmaker(decl(lead), g, now=0.0, timeout=TIMEOUT)
    assert m.state == "searching" and m.next_deadline == 0.0
    assert m.observe([decl(lead), decl(a), decl(b)], now=0.0) == []
    assert m.state == "leading" and m.leader == lead
    assert m.next_deadline == 1.0  # no quorum yet: only its nudge, half the grace on
    accept = JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST)
    assert sends(m.receive(request(decl(a)), now=0.5)) == [(a, accept)]
    assert m.next_deadline == 1.0
    assert [to for to, _ in sends(m.tick(1.0))] == [b]  # b has not come: told who leads
    assert m.next_deadline == 2.5  # quorum at 0.5, grace 2 s
    assert sends(m.receive(request(decl(b)), now=2.0)) == [(b, accept)]  # within grace
    assert m.tick(2.4) == []
    out = m.tick(2.5)
    members = tuple(by_rank([lead, a, b]))
    assert members[0] == lead
    group = m.key.group  # the leader's tag of its list, one for every member
    assert len(group) == 32
    formed = GroupFormed(lead, RUN, FRAG, SLOT, VERSION, DIGEST, members, group=group)
    assert sends(out) == [(a, formed), (b, formed)]
    assert outcome(out) == [Formed(members, lead, RoundKey(RUN, FRAG, VERSION, group))]
    assert m.state == "formed" and m.members == members and m.next_deadline is None
    # after GroupFormed the group is final: a latecomer is turned away
    [(to, msg)] = sends(m.receive(request(decl(c)), now=3.0))
    assert to == c and isinstance(msg, Disband) and "closed" in msg.reason


def test_full_group_forms_at_once_without_waiting_for_grace() -> None:
    lead, a, b = by_rank(peers(3))
    m = Matchmaker(decl(lead), GroupSettings(2, 3, 60.0), now=0.0, timeout=TIMEOUT)
    m.tick(0.0)
    m.receive(request(decl(a)), now=0.1)
    out = m.receive(request(decl(b)), now=0.2)
    assert outcome(out) == [Formed(tuple(by_rank([lead, a, b])), lead, m.key)]


def test_a_grace_window_past_the_timeout_is_cut_short_by_it() -> None:
    lead, a = by_rank(peers(2))
    m = Matchmaker(decl(lead), GroupSettings(2, 8, 60.0), now=0.0, timeout=TIMEOUT)
    m.tick(0.0)
    m.receive(request(decl(a)), now=1.0)
    assert m.next_deadline == TIMEOUT
    assert m.tick(TIMEOUT - 0.001) == []
    out = m.tick(TIMEOUT)
    assert outcome(out) == [Formed(tuple(by_rank([lead, a])), lead, m.key)]


def test_follower_takes_the_list_verbatim_and_checks_it() -> None:
    lead, me, other = by_rank(peers(3))
    g = GroupSettings(2, 8, 1.0)
    m = Matchmaker(decl(me), g, now=0.0, timeout=TIMEOUT)
    out = m.observe([decl(lead), decl(me)], now=0.0)
    assert sends(out) == [(lead, request(decl(me)))]
    assert m.state == "searching" and m.leader == lead
    # a GroupFormed from a stranger is not ours
    assert m.receive(GroupFormed(other, RUN, FRAG, SLOT, VERSION, DIGEST, (me,)), now=0.1) == []
    m.receive(JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST), now=0.1)
    assert m.state == "following"
    members = tuple(by_rank([lead, me, other]))
    out = m.receive(GroupFormed(lead, RUN, FRAG, SLOT, VERSION, DIGEST, members), now=1.0)
    assert out == [Formed(members, lead, m.key)]


@pytest.mark.parametrize(
    "bad",
    [
        "missing-me",
        "leader-not-first",
        "unordered",
        "too-big",
    ],
)
def test_follower_refuses_a_bad_member_list(bad: str) -> None:
    lead, me, x, y = by_rank(peers(4))
    m = Matchmaker(decl(me), GroupSettings(2, 3, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(lead)], now=0.0)
    members = {
        "missing-me": (lead, x),
        "leader-not-first": (me, lead),
        "unordered": (lead, x, me),
        "too-big": (lead, me, x, y),
    }[bad]
    out = m.receive(GroupFormed(lead, RUN, FRAG, SLOT, VERSION, DIGEST, members), now=0.5)
    assert outcome(out) == []
    assert any(to == lead and isinstance(msg, Disband) for to, msg in sends(out))
    assert m.state == "leading"  # the bad leader is out; nobody else is known


def test_leader_steps_down_for_a_lower_peer_and_hands_over_its_followers() -> None:
    low, mid, f1, f2, late = by_rank(peers(5))
    m = Matchmaker(decl(mid), GroupSettings(3, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(mid)], now=0.0)
    m.receive(request(decl(f1)), now=0.1)
    m.receive(request(decl(f2)), now=0.2)
    assert m.state == "leading"
    out = m.observe([decl(low)], now=0.3)  # quorum reached at 0.2, grace not over
    hand = Redirect(mid, RUN, FRAG, SLOT, VERSION, DIGEST, low)
    assert sends(out) == [(f1, hand), (f2, hand), (low, request(decl(mid)))]
    assert m.state == "searching" and m.leader == low
    # a newcomer is held until our own request is answered, then redirected
    assert m.receive(request(decl(late)), now=0.35) == []
    out = m.receive(JoinAccept(low, RUN, FRAG, SLOT, VERSION, DIGEST), now=0.4)
    assert m.state == "following"
    assert sends(out) == [(late, Redirect(mid, RUN, FRAG, SLOT, VERSION, DIGEST, low))]


def test_a_request_from_below_is_a_nudge_a_leader_steps_down_to() -> None:
    """A leader that learns from a request that a lower-ranked peer is at the slot (that
    peer's nudge) steps down: it redirects its followers there and asks it. A peer
    already out of the slot for it is refused, as before."""
    low, me, f = by_rank(peers(3))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(me), decl(f)], now=0.0)
    m.receive(request(decl(f)), now=0.05)
    out = m.receive(request(decl(low)), now=0.1)
    assert [(to, type(msg)) for to, msg in sends(out)] == [(f, Redirect), (low, JoinRequest)]
    assert m.state == "searching" and m.leader == low
    n = Matchmaker(decl(me), GroupSettings(1, 8, 1.0), now=0.0, timeout=TIMEOUT)
    n.tick(0.0)
    n.receive(Disband(low, RUN, FRAG, SLOT, VERSION, DIGEST, "gave up"), now=0.05)
    out = n.receive(request(decl(low)), now=0.1)
    assert [type(msg) for _, msg in sends(out)] == [Disband]


def test_a_leader_nobody_joins_nudges_the_peers_it_sees_and_gets_their_group() -> None:
    """After a heal the lowest-ranked peer sees the others' declarations while the peer
    they follow has not seen its own: it leads alone. Half a grace window on it tells
    them (a request upward); their leader steps down, redirects its follower, and all
    three end in one group led by the lowest."""
    low, mid, high = by_rank(peers(3))
    g = GroupSettings(2, 3, 2.0)
    ms = {p: Matchmaker(decl(p), g, now=0.0, timeout=TIMEOUT) for p in (low, mid, high)}
    queue: list[tuple[str, Message]] = []
    queue += sends(ms[low].observe([decl(low), decl(mid), decl(high)], now=0.0))
    queue += sends(ms[mid].observe([decl(mid), decl(high)], now=0.0))  # low unseen
    queue += sends(ms[high].observe([decl(mid), decl(high)], now=0.0))
    now = 0.0
    while queue:
        to, msg = queue.pop(0)
        now += 0.01
        queue += sends(ms[to].receive(msg, now=now))
    assert ms[mid].state == "leading" and ms[low].state == "leading"  # two leaders
    assert ms[mid].next_deadline is not None and ms[mid].next_deadline > 1.0
    now = 1.0
    formed: dict[str, Formed] = {}
    queue += sends(ms[low].tick(now))  # the nudge
    assert {to for to, _ in queue} == {mid, high}
    while queue:
        to, msg = queue.pop(0)
        now += 0.01
        acts = ms[to].receive(msg, now=now)
        queue += sends(acts)
        formed.update((to, o) for o in outcome(acts) if isinstance(o, Formed))
    assert set(formed) == {low, mid, high}
    assert {o.members for o in formed.values()} == {tuple(by_rank([low, mid, high]))}


def test_foreign_declarations_and_messages_are_ignored() -> None:
    ids = by_rank(peers(3))
    me = ids[-1]
    m = Matchmaker(decl(me), GroupSettings(1, 8, 1.0), now=0.0, timeout=TIMEOUT)
    foreign = [
        decl(ids[0], digest="ee"),
        decl(ids[0], version=VERSION + 1),
        decl(ids[0], run_id="run-b"),
        decl(ids[1], slot=SLOT + 1),
    ]
    assert m.observe(foreign, now=0.0) == []
    assert m.state == "leading"  # nobody compatible ranks lower
    wrong = JoinRequest(ids[0], RUN, FRAG, SLOT, VERSION, "ee", 1.0)
    assert m.receive(wrong, now=0.1) == []


def test_redirect_chains_are_cut() -> None:
    ids = by_rank(peers(MAX_REDIRECTS + 3))
    me = ids[-1]
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    chain = ids[-2::-1]  # from just below me down to the lowest
    m.observe([decl(chain[0])], now=0.0)
    out: list[Action] = []
    for hop in range(MAX_REDIRECTS + 1):
        sender, hint = chain[hop], chain[hop + 1]
        assert m.leader == sender
        out = m.receive(Redirect(sender, RUN, FRAG, SLOT, VERSION, DIGEST, hint), now=0.1 * hop)
    assert m.state == "alone"
    assert isinstance(outcome(out)[0], Alone)


def test_redirect_that_does_not_go_down_excludes_the_redirector() -> None:
    low, mid, me = by_rank(peers(3))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(low)], now=0.0)
    out = m.receive(Redirect(low, RUN, FRAG, SLOT, VERSION, DIGEST, mid), now=0.1)  # mid > low
    assert sends(out) == [] and m.state == "leading"  # low is out; nobody else below me
    out = m.receive(Redirect("stranger", RUN, FRAG, SLOT, VERSION, DIGEST, ""), now=0.2)
    assert m.state == "leading"


def test_a_hint_we_know_is_stale_keeps_the_redirector_as_a_candidate() -> None:
    low, mid, me = by_rank(peers(3))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(low), decl(mid)], now=0.0)
    m.receive(Disband(low, RUN, FRAG, SLOT, VERSION, DIGEST, "slot closed"), now=0.1)
    assert m.leader == mid
    # mid steps down towards low, which it does not know to be closed yet: ask mid again
    out = m.receive(Redirect(mid, RUN, FRAG, SLOT, VERSION, DIGEST, low), now=0.2)
    assert sends(out) == [(mid, request(decl(me)))]


def test_an_accepted_follower_points_requesters_at_its_own_leader() -> None:
    low, lead, me, newcomer = by_rank(peers(4))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(lead)], now=0.0)
    m.receive(JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST), now=0.1)
    assert m.observe([decl(low), decl(lead)], now=0.2) == []  # committed: it stays
    out = m.receive(request(decl(newcomer)), now=0.3)
    assert sends(out) == [(newcomer, Redirect(me, RUN, FRAG, SLOT, VERSION, DIGEST, lead))]


def test_finished_peers_turn_requests_and_late_accepts_away() -> None:
    lead, me, other = by_rank(peers(3))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=1.0)
    m.observe([decl(lead)], now=0.0)
    assert isinstance(outcome(m.tick(1.0))[0], Alone)
    [(to, msg)] = sends(m.receive(request(decl(other)), now=1.1))
    assert to == other and isinstance(msg, Disband)
    [(to, msg)] = sends(m.receive(JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST), now=1.2))
    assert to == lead and isinstance(msg, Disband)
    assert m.observe([decl(other)], now=1.3) == [] and m.tick(2.0) == []


def test_no_quorum_disbands_followers_and_ends_alone_at_the_timeout() -> None:
    lead, f = by_rank(peers(2))
    g = GroupSettings(3, 8, 1.0)
    m = Matchmaker(decl(lead), g, now=0.0, timeout=TIMEOUT)
    m.tick(0.0)
    m.receive(request(decl(f)), now=1.0)
    assert m.next_deadline == TIMEOUT
    out = m.tick(TIMEOUT)
    assert [(to, type(msg)) for to, msg in sends(out)] == [(f, Disband)]
    assert isinstance(outcome(out)[0], Alone) and m.state == "alone"
    # the follower, disbanded with time left, looks again; with nobody left it leads
    fm = Matchmaker(decl(f), g, now=5.0, timeout=TIMEOUT)
    fm.observe([decl(lead)], now=5.0)
    fm.receive(JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST), now=5.1)
    fm.receive(Disband(lead, RUN, FRAG, SLOT, VERSION, DIGEST, "no quorum"), now=15.0)
    assert fm.state == "leading"
    assert isinstance(outcome(fm.tick(20.0))[0], Alone)


def test_a_peer_whose_every_peer_is_past_its_slot_stops_looking_at_once() -> None:
    """A node a slot behind (a joiner, a node back from a cut) asks the peers it knows;
    each answers that it already left the slot for a later version. Nobody can join it
    there, so it ends alone at once (and copies the newer state) rather than holding its
    trainer until the deadline."""
    a, b, me = by_rank(peers(3))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    [(to, _)] = sends(m.observe([decl(a), decl(b)], now=0.0))
    assert to == a
    past = f"{PAST_SLOT} {VERSION + 1}"
    first = Disband(a, RUN, FRAG, SLOT, VERSION, DIGEST, past, 84)
    [(to, _)] = sends(m.receive(first, now=0.1))
    assert to == b and m.state == "searching"  # one peer left that may still be here
    out = m.receive(Disband(b, RUN, FRAG, SLOT, VERSION, DIGEST, past, 86), now=0.2)
    [alone] = outcome(out)
    assert isinstance(alone, Alone) and alone.reason.startswith(BEHIND), alone
    assert alone.swarm_step == 86  # the median of the steps they stated: where they are
    assert m.state == "alone"


def test_a_peer_left_at_its_slot_waits_for_those_still_expected_or_still_there() -> None:
    """The early end needs every known peer past the slot and none expected: a peer that
    gave up for another reason, or a ready record of a peer not yet declared, keeps the
    deadline (a slower peer may still come)."""
    a, b, me = by_rank(peers(3))
    past = f"{PAST_SLOT} {VERSION + 1}"
    # one peer past the slot, the other out of it for another reason: still nobody to
    # wait for, so it ends at once too
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(a), decl(b)], now=0.0)
    m.receive(Disband(a, RUN, FRAG, SLOT, VERSION, DIGEST, "gave up"), now=0.1)
    assert m.state == "searching"
    out = m.receive(Disband(b, RUN, FRAG, SLOT, VERSION, DIGEST, past), now=0.2)
    assert [type(o) for o in outcome(out)] == [Alone]
    # every peer gave up without being past the slot: the deadline as before
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(a), decl(b)], now=0.0)
    m.receive(Disband(a, RUN, FRAG, SLOT, VERSION, DIGEST, "gave up"), now=0.1)
    assert (
        outcome(m.receive(Disband(b, RUN, FRAG, SLOT, VERSION, DIGEST, "gave up"), now=0.2)) == []
    )
    assert m.state == "leading"
    # a peer expected at the slot (its ready record) keeps it waiting
    a, me, b = by_rank(peers(3))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT, patience=5.0)
    m.observe([decl(a)], now=0.0)
    m.expect([b], now=0.0)
    assert outcome(m.receive(Disband(a, RUN, FRAG, SLOT, VERSION, DIGEST, past), now=0.1)) == []
    assert m.state == "leading"
    # and the late peer that does come forms the group with it
    out = m.receive(request(decl(b)), now=1.0)
    assert [type(o) for o in outcome(out)] == []
    assert [type(o) for o in outcome(m.tick(2.5))] == [Formed]


def test_leaving_followers_take_the_quorum_and_its_grace_with_them() -> None:
    lead, a, b = by_rank(peers(3))
    m = Matchmaker(decl(lead), GroupSettings(3, 8, 2.0), now=0.0, timeout=TIMEOUT)
    m.tick(0.0)
    m.receive(request(decl(a)), now=0.1)
    m.receive(request(decl(b)), now=0.2)
    assert m.next_deadline == 2.2
    assert m.receive(Disband(a, RUN, FRAG, SLOT, VERSION, DIGEST, "timed out"), now=0.3) == []
    assert m.next_deadline == TIMEOUT  # quorum lost: the grace window starts over
    m.receive(request(decl(a)), now=1.0)  # asking again is a new request: accepted
    assert m.next_deadline == 3.0
    assert m.peer_lost(b, now=1.1) == []
    assert m.next_deadline == TIMEOUT
    out = m.tick(TIMEOUT)
    assert [(to, type(msg)) for to, msg in sends(out)] == [(a, Disband)]
    assert isinstance(outcome(out)[0], Alone)


def test_accepted_follower_gives_up_when_its_leader_is_lost_or_silent() -> None:
    lead, me = by_rank(peers(2))
    g = GroupSettings(2, 8, 1.0)
    for how in ("lost", "silent"):
        m = Matchmaker(decl(me), g, now=0.0, timeout=TIMEOUT)
        m.observe([decl(lead)], now=0.0)
        m.receive(JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST), now=0.1)
        if how == "lost":
            out = m.peer_lost(lead, now=1.0)
            assert sends(out) == []
        else:
            assert m.tick(TIMEOUT - 0.01) == []
            out = m.tick(TIMEOUT)
            assert [(to, type(msg)) for to, msg in sends(out)] == [(lead, Disband)]
        assert isinstance(outcome(out)[0], Alone) and m.state == "alone"


def test_waiting_follower_tries_the_next_leader_when_its_target_is_lost() -> None:
    low, mid, me = by_rank(peers(3))
    m = Matchmaker(decl(me), GroupSettings(2, 8, 1.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(low), decl(mid)], now=0.0)
    assert m.leader == low
    out = m.peer_lost(low, now=0.5)
    assert sends(out) == [(mid, request(decl(me)))]


def test_min_quorum_one_lone_peer_forms_a_group_of_one_after_grace() -> None:
    m = Matchmaker(decl("solo"), GroupSettings(1, 8, 2.0), now=10.0, timeout=TIMEOUT)
    assert m.observe([decl("solo")], now=10.0) == []
    assert m.next_deadline == 12.0
    out = m.tick(12.0)
    assert out == [Formed(("solo",), "solo", RoundKey(RUN, FRAG, VERSION, m.key.group))]


# --------------------------------------------------------------------------------------
# swarms
# --------------------------------------------------------------------------------------
def test_full_visibility_forms_one_group_led_by_the_lowest_rank() -> None:
    ids = peers(6)
    sw = Swarm([decl(p) for p in ids], GroupSettings(2, 8, 1.0), seed=1).run()
    check_safety(sw)
    check_complete(sw)
    members = tuple(by_rank(ids))
    assert sw.groups() == {members[0]: members}
    assert all(f.members == members and f.leader == members[0] for f in sw.formed().values())
    assert len(sw.formed()) == len(ids)


def test_more_peers_than_max_size_split_into_disjoint_groups() -> None:
    for seed in range(4):
        ids = peers(11)
        g = GroupSettings(2, 3, 0.5)
        sw = Swarm([decl(p) for p in ids], g, seed=seed).run()
        check_safety(sw)
        check_complete(sw)
        assert set(sw.results) == set(ids)
        assert all(len(m) <= 3 for m in sw.groups().values())
        assert len(sw.alone()) <= g.min_quorum - 1, sw.alone()


def test_staggered_arrivals_with_a_slow_dht_still_agree() -> None:
    ids = peers(8)
    rng = random.Random(5)
    starts = [rng.uniform(0.0, 3.0) for _ in ids]
    g = GroupSettings(2, 8, 1.0)
    sw = Swarm([decl(p) for p in ids], g, seed=5, starts=starts, dht_delay=2.0).run()
    check_safety(sw)
    check_complete(sw)
    assert len(sw.formed()) >= 2


def test_incompatible_state_never_shares_a_group() -> None:
    ids = peers(12)
    variants = [
        {},
        {"digest": "cd" * 8},
        {"version": VERSION + 1},
        {"run_id": "run-b"},
    ]
    decls = [decl(p, **variants[i % 4]) for i, p in enumerate(ids)]  # type: ignore[arg-type]
    sw = Swarm(decls, GroupSettings(2, 8, 0.5), seed=3).run()
    check_safety(sw)
    check_complete(sw)
    by_key: dict[tuple[object, ...], set[str]] = {}
    for d in decls:
        by_key.setdefault(compat_key(d), set()).add(d.peer_id)
    assert {frozenset(m) for m in sw.groups().values()} == {frozenset(s) for s in by_key.values()}


def test_quorum_not_reached_leaves_everyone_alone_by_the_timeout() -> None:
    ids = peers(2)
    sw = Swarm([decl(p) for p in ids], GroupSettings(3, 8, 1.0), seed=2).run()
    check_safety(sw)
    assert sw.alone() == set(ids)
    assert all(t <= TIMEOUT for t in sw.ended_at.values())


def test_min_quorum_one_alone_in_a_swarm() -> None:
    sw = Swarm([decl("solo")], GroupSettings(1, 8, 2.0)).run()
    group = sw.machines["solo"].key.group
    assert sw.results == {"solo": Formed(("solo",), "solo", RoundKey(RUN, FRAG, VERSION, group))}
    assert sw.ended_at["solo"] == 2.0


def test_latecomer_within_grace_joins_one_after_the_group_formed_does_not() -> None:
    lead, a, b, c = by_rank(peers(4))
    g = GroupSettings(2, 8, 2.0)
    # a is there from the start (quorum at ~0.01), b comes within grace, c after it closed
    starts = {lead: 0.0, a: 0.0, b: 1.0, c: 4.0}
    decls = [decl(p) for p in (lead, a, b, c)]
    sw = Swarm(decls, g, seed=0, starts=[starts[d.peer_id] for d in decls]).run()
    check_safety(sw)
    check_complete(sw)
    assert sw.groups() == {lead: tuple(by_rank([lead, a, b]))}
    assert sw.alone() == {c}


def test_leader_dying_before_groupformed_never_hangs_its_followers() -> None:
    ids = by_rank(peers(4))
    g = GroupSettings(2, 8, 2.0)
    # accepted followers of a lost leader give up for the slot
    sw = Swarm([decl(p) for p in ids], g, seed=4, deaths={ids[0]: 0.5}).run()
    check_safety(sw)
    assert sw.alone() == set(ids[1:])
    assert all(sw.ended_at[p] < TIMEOUT for p in ids[1:])
    # a leader that dies before answering: the waiting peers form without it
    sw = Swarm([decl(p) for p in ids], g, seed=4, deaths={ids[0]: 0.001}).run()
    check_safety(sw)
    check_complete(sw)
    assert sw.groups() == {ids[1]: tuple(ids[1:])}


# --------------------------------------------------------------------------------------
# property: agreement and termination under random views, delays and deaths
# --------------------------------------------------------------------------------------
@st.composite
def scenarios(draw: st.DrawFn) -> Swarm:
    n = draw(st.integers(1, 10))
    max_size = draw(st.integers(2, 5))
    min_quorum = draw(st.integers(1, max_size))
    grace = draw(st.sampled_from([0.0, 0.3, 1.0, 3.0]))
    timeout = draw(st.sampled_from([2.0, 5.0, 10.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    digests = draw(st.integers(1, 2))
    decls = [decl(p, digest=f"d{rng.randrange(digests)}") for p in peers(n)]
    starts = [rng.uniform(0.0, draw(st.sampled_from([0.0, 1.0, 4.0]))) for _ in decls]
    n_dead = draw(st.integers(0, min(2, n)))
    deaths = {p: rng.uniform(0.0, timeout) for p in rng.sample(peers(n), n_dead)}
    return Swarm(
        decls,
        GroupSettings(min_quorum, max_size, grace),
        seed=seed,
        starts=starts,
        dht_delay=draw(st.sampled_from([0.0, 0.5, 3.0])),
        latency=(0.001, draw(st.sampled_from([0.01, 0.2, 1.0]))),
        lost_delay=1.5,
        timeout=timeout,
        deaths=deaths,
    )


@settings(max_examples=50, deadline=None)
@given(scenarios())
def test_property_agreement_and_termination(sw: Swarm) -> None:
    sw.run()
    check_safety(sw)
    # a listed member that did not form with the list lost a race to a deadline or died;
    # it never formed elsewhere (check_safety) and ended alone
    for members in sw.groups().values():
        for p in members:
            assert p in sw.dead or p in sw.formed() or p in sw.alone()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 10),
    max_size=st.integers(2, 5),
    quorum=st.integers(1, 5),
    grace=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
    dht_delay=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_benign_swarms_leave_nobody_behind(
    n: int, max_size: int, quorum: int, grace: float, dht_delay: float, seed: int
) -> None:
    """No deaths, short delays, a generous timeout: no race is lost, and per compatible
    set fewer than min_quorum peers end alone (they could not have made a quorum)."""
    min_quorum = min(quorum, max_size)
    rng = random.Random(seed)
    decls = [decl(p, digest=f"d{rng.randrange(2)}") for p in peers(n)]
    starts = [rng.uniform(0.0, 1.0) for _ in decls]
    sw = Swarm(
        decls,
        GroupSettings(min_quorum, max_size, grace),
        seed=seed,
        starts=starts,
        dht_delay=dht_delay,
        latency=(0.001, 0.05),
        timeout=10.0,
    ).run()
    check_safety(sw)
    check_complete(sw)
    alone: dict[tuple[object, ...], int] = {}
    for p in sw.alone():
        k = compat_key(sw.by_id[p])
        alone[k] = alone.get(k, 0) + 1
    assert all(c < min_quorum for c in alone.values()), (alone, min_quorum)


# --------------------------------------------------------------------------------------
# silent leaders
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("at", [0.0, 0.3, 1.5])
def test_a_silent_leader_is_dropped_and_the_others_form_in_time(at: float) -> None:
    """The lowest-ranked peer goes silent (before anything, after accepting members, or
    mid-grace): nobody is told, yet the others form a group without it, long before the
    matchmaking timeout, and it is named as silent by those that waited for it."""
    ids = by_rank(peers(5))
    g = GroupSettings(2, 8, 2.0)
    sw = Swarm(
        [decl(p) for p in ids], g, seed=3, silences={ids[0]: at}, answer_s=1.0, timeout=30.0
    ).run()
    check_safety(sw)
    rest = set(ids[1:])
    assert rest <= set(sw.formed()), sw.results
    members = {sw.formed()[p].members for p in rest}
    assert len(members) == 1 and set(next(iter(members))) == rest
    # bounded by the silence bound plus the grace window, not by the 30 s timeout
    assert max(sw.ended_at[p] for p in rest) <= at + 1.5 * 1.0 + g.grace_s + 1.0
    assert all(ids[0] in sw.machines[p].silent for p in rest)


def test_without_a_bound_a_silent_leader_costs_the_whole_timeout() -> None:
    """The same silence with no ``answer_s``: the others wait until their timeout (the
    behaviour the bound exists for)."""
    ids = by_rank(peers(4))
    sw = Swarm(
        [decl(p) for p in ids],
        GroupSettings(2, 8, 2.0),
        seed=3,
        silences={ids[0]: 0.0},
        timeout=30.0,
    ).run()
    check_safety(sw)
    assert min(sw.ended_at[p] for p in ids[1:]) >= 30.0 - 1e-9


def test_a_live_leader_keeps_its_followers_past_the_silence_bound() -> None:
    """A long grace window (longer than ``answer_s``): the leader's keepalives hold its
    followers, so nobody leaves a live leader and one group of everybody forms."""
    ids = by_rank(peers(4))
    sw = Swarm(
        [decl(p) for p in ids],
        GroupSettings(4, 8, 5.0),
        seed=1,
        answer_s=0.5,
        starts=[0.0, 0.0, 0.0, 3.0],
        timeout=30.0,
    ).run()
    check_safety(sw)
    check_complete(sw)
    assert set(sw.groups()) == {ids[0]}
    assert all(not m.silent for m in sw.machines.values())


def test_answer_s_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        Matchmaker(decl("x"), GroupSettings(), now=0.0, timeout=1.0, answer_s=0.0)


# --------------------------------------------------------------------------------------
# patience: a peer that arrives early waits for the peers expected at the slot
# --------------------------------------------------------------------------------------
def test_an_expected_peer_extends_the_deadline_once_by_the_patience() -> None:
    lead, a = by_rank(peers(2))
    m = Matchmaker(decl(lead), GroupSettings(2, 8, 1.0), now=0.0, timeout=6.0, patience=6.0)
    m.observe([decl(lead)], now=0.0)
    assert m.deadline == 6.0 and not m.extended
    m.expect([lead], now=1.0)  # itself: not a reason to wait
    assert m.deadline == 6.0
    m.expect([a], now=1.0)
    assert m.deadline == 12.0 and m.extended and m.next_deadline == 12.0
    m.expect([a], now=2.0)  # once only
    assert m.deadline == 12.0
    # the expected peer arrives after the plain timeout and the group forms with it
    assert m.tick(7.0) == []
    m.observe([decl(lead), decl(a)], now=8.0)
    out = m.receive(request(decl(a)), now=8.0)
    assert sends(out) == [(a, JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST))]
    out = m.tick(9.0)  # quorum at 8, grace 1
    assert outcome(out) == [Formed(tuple(by_rank([lead, a])), lead, m.key)]


def test_a_group_held_open_ahead_waits_for_its_expected_peers_until_the_sync() -> None:
    """A leader forming ahead of its sync has its quorum and its grace is over, but a
    peer expected at the slot is not in yet: it waits for that peer (which lands in
    the group), and forms at once when told the sync began; the deadline still holds."""
    lead, a, late = by_rank(peers(3))
    g = GroupSettings(2, 8, 1.0)
    m = Matchmaker(decl(lead), g, now=0.0, timeout=6.0)
    m.observe([decl(lead), decl(a)], now=0.0)
    m.receive(request(decl(a)), now=0.0)
    assert outcome(m.hold_open([lead, a, late], now=0.5)) == []  # itself and a: no wait
    assert outcome(m.tick(2.0)) == []  # quorum at 0, grace 1: held open for `late`
    m.observe([decl(lead), decl(a), decl(late)], now=2.5)
    out = m.receive(request(decl(late)), now=2.5)  # the last one in: formed at once
    assert outcome(out) == [Formed(tuple(by_rank([lead, a, late])), lead, m.key)]
    # the sync begins before the late peer comes: formed with those in
    n = Matchmaker(decl(lead), g, now=0.0, timeout=6.0)
    n.observe([decl(lead), decl(a)], now=0.0)
    n.receive(request(decl(a)), now=0.0)
    n.hold_open([late], now=0.5)
    assert outcome(n.tick(3.0)) == []
    out = n.hold_open((), now=3.5)
    assert outcome(out) == [Formed(tuple(by_rank([lead, a])), lead, n.key)]
    # nobody tells it: the deadline forms it
    o = Matchmaker(decl(lead), g, now=0.0, timeout=6.0)
    o.observe([decl(lead), decl(a)], now=0.0)
    o.receive(request(decl(a)), now=0.0)
    o.hold_open([late], now=0.5)
    assert outcome(o.tick(5.9)) == []
    assert outcome(o.tick(6.0)) == [Formed(tuple(by_rank([lead, a])), lead, o.key)]


def test_a_leader_gives_a_peer_due_at_the_slot_a_second_grace() -> None:
    """The leader has its quorum at 0 (grace 1 s), but a peer due at the slot (its record)
    has not declared: it forms at 2 s instead of 1 s, and at once when the peer joins
    meanwhile (having declared, it is still waited for until its request comes). With no
    peer due the usual grace holds."""
    lead, a, late = by_rank(peers(3))
    g = GroupSettings(2, 8, 1.0)
    m = Matchmaker(decl(lead), g, now=0.0, timeout=6.0, patience=6.0)
    m.observe([decl(lead), decl(a)], now=0.0)
    m.receive(request(decl(a)), now=0.0)
    m.expect([late], now=0.2)
    assert m.next_deadline == 2.0 and outcome(m.tick(1.5)) == []
    assert outcome(m.tick(2.0)) == [Formed(tuple(by_rank([lead, a])), lead, m.key)]
    n = Matchmaker(decl(lead), g, now=0.0, timeout=6.0, patience=6.0)
    n.observe([decl(lead), decl(a)], now=0.0)
    n.receive(request(decl(a)), now=0.0)
    n.expect([late], now=0.2)
    n.observe([decl(lead), decl(a), decl(late)], now=1.5)
    n.expect([], now=1.5)  # it declared: its request is what the leader waits for now
    assert outcome(n.tick(1.6)) == []
    out = n.receive(request(decl(late)), now=1.7)
    assert outcome(out) == [Formed(tuple(by_rank([lead, a, late])), lead, n.key)]
    o = Matchmaker(decl(lead), g, now=0.0, timeout=6.0, patience=6.0)
    o.observe([decl(lead), decl(a)], now=0.0)
    o.receive(request(decl(a)), now=0.0)
    o.expect([], now=0.2)
    assert outcome(o.tick(1.0)) == [Formed(tuple(by_rank([lead, a])), lead, o.key)]


def test_formed_names_the_step_at_which_the_others_started_the_sync() -> None:
    """A leader's Formed carries the median (low) of its members' stated steps, a
    follower's its leader's step; -1 when nobody stated one."""
    lead, a, b = by_rank(peers(3))
    m = Matchmaker(decl(lead), GroupSettings(2, 3, 1.0), now=0.0, timeout=6.0)
    m.observe([decl(lead), decl(a), decl(b)], now=0.0)
    m.receive(dataclasses.replace(request(decl(a)), step=26), now=0.1)
    out = m.receive(dataclasses.replace(request(decl(b)), step=24), now=0.2)
    assert [f.met_at for f in outcome(out) if isinstance(f, Formed)] == [24]
    f = Matchmaker(decl(a), GroupSettings(2, 3, 1.0), now=0.0, timeout=6.0)
    f.observe([decl(lead), decl(a)], now=0.0)
    f.receive(JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST, step=30), now=0.1)
    members = tuple(by_rank([lead, a]))
    out = f.receive(GroupFormed(lead, RUN, FRAG, SLOT, VERSION, DIGEST, members), now=0.2)
    assert outcome(out) == [Formed(members, lead, RoundKey(RUN, FRAG, VERSION), met_at=30)]
    n = Matchmaker(decl(lead), GroupSettings(2, 2, 1.0), now=0.0, timeout=6.0)
    n.observe([decl(lead), decl(a)], now=0.0)
    out = n.receive(request(decl(a)), now=0.1)
    assert [f.met_at for f in outcome(out) if isinstance(f, Formed)] == [-1]


def test_a_peer_already_known_or_out_of_the_slot_extends_nothing() -> None:
    lead, a = by_rank(peers(2))
    m = Matchmaker(decl(lead), GroupSettings(2, 8, 1.0), now=0.0, timeout=6.0, patience=6.0)
    m.observe([decl(lead), decl(a)], now=0.0)
    m.expect([a], now=0.5)  # it declared already: its request is what the leader waits for
    assert not m.extended
    out = m.tick(6.0)
    assert outcome(out) == [Alone("timeout: 1 of the 2 peers of the quorum")]
    # without patience nothing moves either
    n = Matchmaker(decl(lead), GroupSettings(2, 8, 1.0), now=0.0, timeout=6.0)
    n.expect([a], now=0.5)
    assert n.deadline == 6.0 and not n.extended


def test_a_follower_of_a_live_leader_waits_for_it_past_its_own_timeout() -> None:
    """The follower started 4 s before its leader: its timeout would end it while the
    leader still gathers; once accepted it waits for the leader's word instead."""
    lead, a = by_rank(peers(2))
    f = Matchmaker(decl(a), GroupSettings(2, 8, 1.0), now=0.0, timeout=6.0, patience=6.0)
    out = f.observe([decl(a), decl(lead)], now=4.0)
    assert sends(out) == [(lead, request(decl(a)))]
    f.receive(JoinAccept(lead, RUN, FRAG, SLOT, VERSION, DIGEST), now=4.1)
    assert f.state == "following" and f.deadline == 12.0
    assert f.tick(6.0) == []
    members = tuple(by_rank([lead, a]))
    out = f.receive(GroupFormed(lead, RUN, FRAG, SLOT, VERSION, DIGEST, members), now=7.0)
    assert outcome(out) == [Formed(members, lead, RoundKey(RUN, FRAG, VERSION))]


def test_patience_must_be_finite_and_not_negative() -> None:
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError):
            Matchmaker(decl("x"), GroupSettings(), now=0.0, timeout=1.0, patience=bad)


def test_a_leader_that_withdraws_tells_its_followers_and_ends_alone_withdrawn() -> None:
    lead, a, b = by_rank(peers(3))
    m = Matchmaker(decl(lead), GroupSettings(3, 8, 1.0), now=0.0, timeout=6.0)
    m.observe([decl(lead), decl(a), decl(b)], now=0.0)
    m.receive(request(decl(a)), now=0.5)  # accepted; the quorum of 3 is not reached
    assert m.state == "leading"
    out = m.withdraw("the swarm follows another copy", now=1.0)
    reason = "withdrawn: the swarm follows another copy"
    assert outcome(out) == [Alone(reason, withdrawn=True)]
    assert sends(out) == [(a, Disband(lead, RUN, FRAG, SLOT, VERSION, DIGEST, reason))]
    assert m.state == "alone"
    assert m.withdraw("again", now=2.0) == []  # final: nothing more


def test_a_follower_that_withdraws_tells_its_leader_and_a_formed_peer_stays_formed() -> None:
    lead, a = by_rank(peers(2))
    f = Matchmaker(decl(a), GroupSettings(2, 8, 1.0), now=0.0, timeout=6.0)
    out = f.observe([decl(lead), decl(a)], now=0.0)
    assert sends(out) == [(lead, request(decl(a)))]
    out = f.withdraw("lost", now=0.5)
    assert sends(out) == [(lead, Disband(a, RUN, FRAG, SLOT, VERSION, DIGEST, "withdrawn: lost"))]
    assert outcome(out) == [Alone("withdrawn: lost", withdrawn=True)]
    # a leader whose group is formed does not withdraw from it
    m = Matchmaker(decl(lead), GroupSettings(2, 2, 1.0), now=0.0, timeout=6.0)
    m.observe([decl(lead), decl(a)], now=0.0)
    out = m.receive(request(decl(a)), now=0.5)
    assert [type(x) for x in outcome(out)] == [Formed]
    assert m.withdraw("lost", now=1.0) == [] and m.state == "formed"


# --------------------------------------------------------------------------------------
# in step: a groupmate's inner step must be in phase and near this peer's
# --------------------------------------------------------------------------------------
H_STEPS = 12
LAG = 4 * H_STEPS


def _stepped(peer: str, step: int, *, now: float = 0.0) -> Matchmaker:
    return Matchmaker(
        dataclasses.replace(decl(peer), step=step),
        GroupSettings(min_quorum=2, max_size=4, grace_s=0.0),
        now=now,
        timeout=TIMEOUT,
        step_period=H_STEPS,
        max_step_lag=LAG,
    )


def _pair(leader_first: bool = True) -> tuple[str, str]:
    """Two peers, the slot's leader first; the leader also comes first in the step order
    (its step stands) when ``leader_first``, else the follower does."""
    pairs = [by_rank([f"p-{i}", f"p-{j}"]) for i in range(8) for j in range(i + 1, 8)]
    return next(
        (low, high)
        for low, high in pairs
        if (step_order(RUN, low) < step_order(RUN, high)) == leader_first
    )


def _run_pair(
    leader_step: int, follower_step: int, *, leader_first: bool = True
) -> tuple[list[Action], list[Action]]:
    """A leader and a follower (by rank) exchange messages until neither sends; both are
    then driven to their deadline. The outcomes of each."""
    low, high = _pair(leader_first)
    machines = {low: _stepped(low, leader_step), high: _stepped(high, follower_step)}
    results: dict[str, list[Action]] = {low: [], high: []}
    queue: list[tuple[str, Message]] = []
    for peer, m in machines.items():
        other = high if peer == low else low
        acts = m.observe([decl(other)], now=0.0)
        results[peer] += acts
        queue += sends(acts)
    now = 0.0
    while queue:
        to, msg = queue.pop(0)
        now += 0.01
        acts = machines[to].receive(msg, now=now)
        results[to] += acts
        queue += sends(acts)
    for peer, m in machines.items():
        acts = m.tick(TIMEOUT + 1)
        results[peer] += acts
    return results[low], results[high]


def test_a_requester_in_step_joins() -> None:
    lead, follow = _run_pair(480, 480 - H_STEPS)
    assert [type(o) for o in outcome(lead)] == [Formed]
    assert [type(o) for o in outcome(follow)] == [Formed]


@pytest.mark.parametrize(
    ("follower_step", "why"),
    [(0, "steps from"), (480 - 5 * H_STEPS, "steps from"), (474, "out of phase")],
)
def test_a_requester_out_of_step_is_refused_and_told_the_leaders_step(
    follower_step: int, why: str
) -> None:
    lead, follow = _run_pair(480, follower_step)
    (done,) = outcome(follow)
    assert isinstance(done, Alone)
    assert done.swarm_step == 480
    assert done.reason.startswith("out of step with 1 peer(s) whose step stands, at step 480")
    refusals = [m for _, m in sends(lead) if isinstance(m, Disband)]
    assert refusals and why in refusals[0].reason and refusals[0].step == 480
    assert not any(isinstance(m, JoinAccept) for _, m in sends(lead))
    (led,) = outcome(lead)
    assert isinstance(led, Alone) and led.swarm_step == -1  # its own step stands


def test_a_leader_that_refuses_a_requester_first_in_step_order_moves_itself() -> None:
    """Which of two peers out of step moves is the step order's choice, not the slot's:
    the leader refuses a requester that comes before it in that order, and it is the
    leader that ends alone with the requester's step (the requester stays where it is).
    With the slot deciding, two peers meeting at every fragment each moved to the other's
    step within one period."""
    lead, follow = _run_pair(480, 120, leader_first=False)
    refusals = [m for _, m in sends(lead) if isinstance(m, Disband)]
    assert refusals and refusals[0].reason.startswith("out of step")
    (led,) = outcome(lead)
    assert isinstance(led, Alone) and led.swarm_step == 120
    assert led.reason.startswith("out of step with 1 peer(s) whose step stands, at step 120")
    (done,) = outcome(follow)
    assert isinstance(done, Alone) and done.swarm_step == -1


def test_a_follower_drops_a_leader_out_of_step() -> None:
    low, high = _pair()
    follower = _stepped(high, 480)
    asked = sends(follower.observe([decl(low)], now=0.0))
    assert [(to, type(m)) for to, m in asked] == [(low, JoinRequest)]
    accept = JoinAccept(low, RUN, FRAG, SLOT, VERSION, DIGEST, 0)
    out = follower.receive(accept, now=0.1)
    left = [m for to, m in sends(out) if to == low and isinstance(m, Disband)]
    assert left and left[0].reason.startswith("out of step") and left[0].step == 480
    assert follower.state == "leading"  # it looks again: nobody else, so it leads alone
    (done,) = outcome(follower.tick(TIMEOUT + 1))  # the leader's step stands: it moves
    assert isinstance(done, Alone) and done.swarm_step == 0


def _refusal(me: str, my_step: int, requester: str, step: object) -> str | None:
    return out_of_slot_refusal(
        RUN, me, my_step, requester, step, step_period=H_STEPS, max_step_lag=LAG
    )


def test_a_request_out_of_step_is_refused_without_a_slot_by_the_first_in_step_order() -> None:
    """Two peers out of step that never sync a fragment at the same time: a request that
    reaches a peer not at its slot is refused by the one whose step stands (the first in
    the step order, the same for every fragment and slot), never by the other; a step
    within the lag plus a period (the receiver's step is its trainer's, not a sync
    start) is held as usual."""
    first, second = sorted(["p-a", "p-b"], key=lambda p: step_order(RUN, p))
    why = _refusal(first, 480, second, 480 - LAG - H_STEPS - 1)
    assert why is not None and why.startswith("out of step") and "61 steps from 480" in why
    assert _refusal(second, 480, first, 480 - LAG - H_STEPS - 1) is None
    assert _refusal(first, 480, second, 480 + LAG + H_STEPS) is None  # in step enough
    assert _refusal(first, 480, second, 480 - LAG) is None
    assert _refusal(first, 480, second, 900) is not None  # ahead or behind alike
    for step in (-1, None, True, 2.5, "600"):  # a step not said, or not a step
        assert _refusal(first, 480, second, step) is None
    assert _refusal(first, -1, second, 900) is None  # this peer has no step yet
    assert out_of_slot_refusal(RUN, first, 480, second, 900, step_period=0, max_step_lag=0) is None


def test_a_requester_refused_without_a_slot_ends_alone_with_that_step() -> None:
    """The Disband of a peer not at the slot, out of step, counts as a leader's refusal:
    the requester looks again, leads alone, and ends with the refuser's step to move to."""
    low, high = _pair()  # the slot leader (the one asked) comes first in the step order
    requester = _stepped(high, 133)
    asked = sends(requester.observe([decl(low)], now=0.0))
    assert [(to, type(m)) for to, m in asked] == [(low, JoinRequest)]
    why = _refusal(low, 20, high, 133)
    assert why is not None and _refusal(high, 133, low, 20) is None
    refusal = Disband(low, RUN, FRAG, SLOT, VERSION, DIGEST, why, 20, 133)
    requester.receive(refusal, now=0.1)
    (done,) = outcome(requester.tick(TIMEOUT + 1))
    assert isinstance(done, Alone) and done.swarm_step == 20
    assert done.reason.startswith("out of step with 1 peer(s) whose step stands, at step 20")


def test_steps_are_not_checked_when_a_peer_does_not_say() -> None:
    _, follow = _run_pair(-1, 3)
    assert [type(o) for o in outcome(follow)] == [Formed]
    _, follow = _run_pair(480, -1)
    assert [type(o) for o in outcome(follow)] == [Formed]


# --------------------------------------------------------------------------------------
# a slot tried again: the earlier attempt's messages do not steer the later one
# --------------------------------------------------------------------------------------
def test_a_follower_ignores_answers_meant_for_its_earlier_attempt_at_the_slot() -> None:
    """A peer whose round at this slot failed declares it again at a later sync step
    (the version did not move). The leader's answers to its first attempt (a "slot
    closed" Disband, a GroupFormed naming it) still arrive; they name the step of that
    attempt (``for_step``) and are ignored, so the peer neither drops the leader nor runs
    the old list. The answers to this attempt, which name its step, count."""
    low, high = by_rank(["p-a", "p-b"])
    follower = _stepped(high, 492)
    asked = sends(follower.observe([decl(low)], now=0.0))
    assert [(to, type(m)) for to, m in asked] == [(low, JoinRequest)]
    assert asked[0][1].step == 492  # type: ignore[union-attr]
    members = tuple(by_rank([low, high]))
    old = dict(for_step=480)
    closed = "slot closed: the group has formed"
    stale = [
        Disband(low, RUN, FRAG, SLOT, VERSION, DIGEST, closed, 480, **old),
        GroupFormed(low, RUN, FRAG, SLOT, VERSION, DIGEST, members, group="old-group", **old),
        JoinAccept(low, RUN, FRAG, SLOT, VERSION, DIGEST, 480, **old),
    ]
    for msg in stale:
        assert follower.receive(msg, now=0.1) == []
        assert follower.state == "searching" and follower.leader == low
    accept = JoinAccept(low, RUN, FRAG, SLOT, VERSION, DIGEST, 492, 492)
    assert follower.receive(accept, now=0.2) == []
    assert follower.state == "following"
    formed = GroupFormed(low, RUN, FRAG, SLOT, VERSION, DIGEST, members, 492, "new-group")
    (done,) = outcome(follower.receive(formed, now=0.3))
    assert isinstance(done, Formed) and done.key.group == "new-group"


def test_a_leader_answers_with_the_requesters_step_and_ignores_its_stale_leaving() -> None:
    """The leader names each requester's step in its answers (so that an answer reaching
    the requester's next attempt is ignored there), and a follower's Disband meant for
    the leader's earlier attempt does not take the follower out of this one."""
    low, high = by_rank(["p-a", "p-b"])
    leader = Matchmaker(
        dataclasses.replace(decl(low), step=492),
        GroupSettings(min_quorum=2, max_size=4, grace_s=5.0),
        now=0.0,
        timeout=TIMEOUT,
        step_period=H_STEPS,
        max_step_lag=LAG,
    )
    leader.observe([decl(high)], now=0.0)
    assert leader.state == "leading"
    joined = dataclasses.replace(request(decl(high)), step=492)
    [(to, accept)] = sends(leader.receive(joined, now=0.1))
    assert to == high and isinstance(accept, JoinAccept) and accept.for_step == 492
    bye = Disband(high, RUN, FRAG, SLOT, VERSION, DIGEST, "gave up", 480, for_step=480)
    leader.receive(bye, now=0.2)  # from the follower's earlier attempt, to ours
    [(to, formed)] = sends(leader.tick(5.1))
    assert isinstance(formed, GroupFormed) and formed.members == tuple(by_rank([low, high]))
    assert formed.for_step == 492 and formed.group == leader.key.group != ""


def test_two_attempts_at_one_slot_by_the_same_members_name_two_groups() -> None:
    """The leader's tag of its list mixes in its attempt (nonce, step, declaration
    time): a second attempt by the same members runs another round key."""
    low, high = by_rank(["p-a", "p-b"])
    tags = []
    for step, nonce in ((480, "a1"), (492, "b2")):
        leader = Matchmaker(
            dataclasses.replace(decl(low), step=step),
            GroupSettings(min_quorum=2, max_size=2, grace_s=0.0),
            now=0.0,
            timeout=TIMEOUT,
            nonce=nonce,
        )
        leader.observe([decl(high)], now=0.0)
        (done,) = outcome(leader.receive(request(decl(high)), now=0.1))
        assert isinstance(done, Formed)
        tags.append(done.key.group)
    assert len(set(tags)) == 2 and all(len(t) == 32 for t in tags)


def _reach_leader(lead: str, private: set[str]) -> Matchmaker:
    m = Matchmaker(
        decl(lead),
        GroupSettings(min_quorum=2, max_size=8, grace_s=5.0),
        now=0.0,
        timeout=TIMEOUT,
        private=lambda p: p in private,
    )
    return m


def test_a_leader_takes_at_most_one_peer_behind_a_nat() -> None:
    """Two peers behind NATs cannot dial each other: a public leader takes the first one
    and refuses the second (unreachable); public peers still join."""
    lead, a, b, c = by_rank(peers(4))
    m = _reach_leader(lead, {a, b})
    m.observe([decl(lead), decl(a), decl(b), decl(c)], now=0.0)
    assert m.state == "leading"
    assert [type(x) for _, x in sends(m.receive(request(decl(a)), now=0.1))] == [JoinAccept]
    [(to, refusal)] = sends(m.receive(request(decl(b)), now=0.2))
    assert to == b and isinstance(refusal, Disband)
    assert refusal.reason == f"unreachable: you and {a} are both behind a NAT"
    assert [type(x) for _, x in sends(m.receive(request(decl(c)), now=0.3))] == [JoinAccept]
    [formed] = outcome(m.tick(10.0))
    assert isinstance(formed, Formed) and set(formed.members) == {lead, a, c}


def test_a_leader_behind_a_nat_takes_only_public_peers() -> None:
    lead, a, b = by_rank(peers(3))
    m = _reach_leader(lead, {lead, a})
    m.observe([decl(lead), decl(a), decl(b)], now=0.0)
    [(_, refusal)] = sends(m.receive(request(decl(a)), now=0.1))
    assert isinstance(refusal, Disband) and "you and I are both behind a NAT" in refusal.reason
    assert [type(x) for _, x in sends(m.receive(request(decl(b)), now=0.2))] == [JoinAccept]
    [formed] = outcome(m.tick(10.0))
    assert isinstance(formed, Formed) and set(formed.members) == {lead, b}


def test_without_reach_every_peer_is_taken_as_before() -> None:
    lead, a, b = by_rank(peers(3))
    m = Matchmaker(decl(lead), GroupSettings(2, 8, 5.0), now=0.0, timeout=TIMEOUT)
    m.observe([decl(lead), decl(a), decl(b)], now=0.0)
    for p in (a, b):
        assert [type(x) for _, x in sends(m.receive(request(decl(p)), now=0.1))] == [JoinAccept]

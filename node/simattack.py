"""Hostile replicas in the simulator: the trust protections measured without a network.

The live attack benchmark (``bench/attacks.py``) runs node processes, so which groups
form, and so the final eval loss, changes from run to run by several percent: more than
the effect it is meant to measure. Here the same protections run in one process and are
deterministic, so an attack run differs from its honest-only run only by the attack:

- every round is the real :class:`~atoll.protocol.sync.FragmentSync` of each replica
  (with the run's :class:`~atoll.protocol.manifest.RobustSettings`, the attacker's
  :data:`~atoll.protocol.sync.Tamper`, the run's weight cap and the caps of the last
  round's members) and the real :class:`~atoll.protocol.allreduce.AllReduceRound` of each
  member, parts sealed with an Ed25519 identity per replica when checks are on, messages
  delivered in order in memory (:func:`run_in_memory`);
- the attacks are those of :mod:`atoll.node.net.attacks`: a tampered contribution, a NaN
  or equivocating part on the wire (:func:`~atoll.node.net.attacks.hostile_parts`), a
  hostile chunk owner. ``forge`` acts on state records, not on rounds, and is measured
  by the live benchmark only;
- each honest replica keeps its own :class:`~atoll.protocol.strikes.Strikes` on a clock
  of ``step_s`` simulated seconds per inner step, strikes the culprit a failed round
  names as the swarm's syncer does, and a round that failed on a proven fault is sought
  once more without the banned member (:meth:`FragmentSync.regroup`). A peer banned by
  any honest replica is left out of later groups until the ban ends;
- late replicas (replicas 1 to ``late``, never hostile) each miss every slot with
  probability ``late_prob``, drawn from the seed; at their next sync they are a version
  behind, copy the state and offer their Δ there at the late weight, or drop it
  (``keep_late`` off): what ``bench/latework.py`` compares.

The group of a slot is every replica nobody has banned (matchmaking is not simulated),
in replica order; replica 0 is honest and its global model is the one evaluated; the
attackers are the last replicas.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier
from atoll.node.net.attacks import Attack, hostile_parts, nan_prefix
from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import sync as fs
from atoll.protocol.engine import OuterEngine
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import RobustSettings
from atoll.protocol.reduce import allreduce_bytes_per_peer
from atoll.protocol.streaming import SyncOutcome
from atoll.protocol.strikes import Strikes, reason_of_failure, self_accused
from atoll.security.identity import Identity

__all__ = ["AttackStats", "HostileRounds", "run_in_memory"]

log = logging.getLogger(__name__)

RUN_ID = "simulated"
_TIMEOUT_S = 60.0  # the machines' deadlines; nothing here ever waits for them


def run_in_memory(
    machines: Mapping[str, ar.AllReduceRound],
    outgoing: Mapping[str, Callable[[ar.Send], list[ar.Send]]] | None = None,
) -> dict[str, ar.Done | ar.Failed]:
    """Run one round's started machines to their end, delivering every message in the
    order it was sent (``outgoing[peer]`` rewrites what ``peer`` sends: an attacker on
    the wire). Every member ends: a member that sends nothing more and waits for nothing
    is done or failed, else the queue still holds what it waits for."""
    out = dict(outgoing or {})
    results: dict[str, ar.Done | ar.Failed] = {}
    queue: collections.deque[tuple[str, ar.Message]] = collections.deque()

    def handle(src: str, actions: list[ar.Action]) -> None:
        for act in actions:
            if isinstance(act, ar.Send):
                for s in out[src](act) if src in out else [act]:
                    queue.append((s.to, s.message))
            elif src not in results:
                results[src] = act

    for peer, machine in machines.items():
        handle(peer, machine.start())
    while queue:
        to, msg = queue.popleft()
        if to in machines and machines[to].state == "running":
            handle(to, machines[to].receive(msg, now=0.0))
    for peer, machine in machines.items():  # a member still waiting gets its deadline
        if peer not in results:
            handle(peer, machine.tick(_TIMEOUT_S * 2))
    missing = [p for p in machines if p not in results]
    if missing:
        raise ConfigError(f"members {missing} never ended their round")
    return results


@dataclass
class AttackStats:
    """What the attack did, counted over the run (in :attr:`SimResult.attack`)."""

    attack: str
    attackers: int
    rounds: int = 0
    """rounds run (a slot's group formed again after a fault counts twice)"""
    honest_applied: int = 0
    """rounds applied, summed over the honest replicas"""
    honest_disrupted: int = 0
    """rounds failed, summed over the honest replicas (a round sought again and then
    applied counts once in each)"""
    sought_again: int = 0
    """slots whose group formed again without the member whose fault failed the round"""
    applied_with_attacker: int = 0
    """rounds the honest replicas applied with an attacker in the group (replica 0's)"""
    bans: dict[str, list[int]] = field(default_factory=dict)
    """per attacker: the steps at which every honest replica had banned it"""
    rounds_until_banned: dict[str, int] = field(default_factory=dict)
    """per attacker: its rounds (groups it was in) until every honest replica first
    banned it; absent when it never was"""
    late_missed: int = 0
    """slots a late replica missed"""
    late_kept: int = 0
    """syncs of a late replica that copied the newer state and offered their Δ there"""
    late_dropped: int = 0
    """syncs of a late replica that copied the newer state and dropped their Δ"""
    fetch_bytes: int = 0
    """bytes of fragment states copied by replicas behind (rebases), all replicas"""
    round_bytes: int = 0
    """bytes the members of every round sent (a bandwidth-optimal all-reduce of the
    encoded Δ each, as the reference exchange counts; a verified owner's extra copy
    not counted), all replicas"""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class HostileRounds:
    """The rounds of a simulated swarm with ``attackers`` hostile replicas (the last
    ones) and the protections of ``robust``; :meth:`run` runs one slot of one fragment.
    ``weight_cap`` is the run's (:func:`~atoll.protocol.sync.weight_cap`); ``step_s``
    the simulated seconds per inner step (the strikes' clock, so bans end)."""

    def __init__(
        self,
        engines: list[OuterEngine],
        robust: RobustSettings,
        attack: Attack | None,
        attackers: int,
        *,
        weight_cap: float,
        step_s: float = 1.0,
        late: int = 0,
        late_prob: float = 0.0,
        keep_late: bool = True,
        late_weight: float = fs.LATE_WEIGHT,
        seed: int = 0,
    ) -> None:
        n = len(engines)
        if not 0 <= late < n - attackers:
            raise ConfigError(f"late must be in [0, {n - attackers}) (replica 0 is never late)")
        if not 0.0 <= late_prob <= 1.0:
            raise ConfigError(f"late_prob must be in [0, 1], not {late_prob!r}")
        if not 0 <= attackers < n:
            raise ConfigError(f"attackers must be in [0, {n}) (replica 0 stays honest)")
        if attackers and attack is None:
            raise ConfigError("attackers need an attack")
        if attack is not None and attack.forges:
            raise ConfigError("forge acts on state records, not rounds: not simulated")
        if not (math.isfinite(step_s) and step_s > 0):
            raise ConfigError(f"step_s must be finite and > 0, not {step_s!r}")
        self.engines = engines
        self.robust = robust
        self.attack = attack if attackers else None
        self.weight_cap = weight_cap
        self.step_s = step_s
        self.now = 0.0
        identities = [_identity(seed, m) for m in range(n)]  # the same ids in every run
        self.ids = [i.peer_id for i in identities]
        self.hostile = set(self.ids[n - attackers :])
        self.late = set(self.ids[1 : 1 + late])
        self.late_prob = late_prob
        self.keep_late = keep_late
        self.late_weight = late_weight
        self.draws = random.Random(seed)
        self.sealed = robust.checks
        self.signers = {i.peer_id: EnvelopeSigner(i) for i in identities}
        self.opener = EnvelopeVerifier()
        # every replica strikes and regroups as a node's syncer does (an attacker's
        # syncer is honest), but only the honest replicas' bans keep a peer out
        self.strikes = {p: Strikes(clock=lambda: self.now) for p in self.ids}
        self.honest = [self.strikes[p] for p in self.ids if p not in self.hostile]
        self.tampers = {p: self.attack.tamper for p in self.hostile if self.attack is not None}
        self._made: dict[int, tuple[int, frozenset[str]]] = {}  # as the syncer's _made
        self.stats = AttackStats(attack.name if attack else "", attackers)
        self.stats.bans = {p: [] for p in sorted(self.hostile)}
        self._rounds_of = dict.fromkeys(self.hostile, 0)
        self._was_banned = dict.fromkeys(self.hostile, False)

    def syncs(self, fragment: int) -> list[fs.FragmentSync]:
        """A fresh sync of ``fragment`` for every replica."""
        return [
            fs.FragmentSync(
                eng,
                fragment,
                peer_id=peer,
                run_id=RUN_ID,
                robust=self.robust.to_rule(),
                checks=self.robust.to_checks(),
                tamper=self.tampers.get(peer),
                verify_owners=self.robust.verify_owners,
                sealed=self.sealed,
                weight_cap=self.weight_cap,
                keep_late=self.keep_late,
                late_weight=self.late_weight,
            )
            for eng, peer in zip(self.engines, self.ids, strict=True)
        ]

    def _banned_by_anyone(self, peer: str) -> bool:
        return any(s.banned(peer) for s in self.honest)

    def _note_bans(self, step: int) -> None:
        for p in sorted(self.hostile):
            every = all(s.banned(p) for s in self.honest)
            if every and not self._was_banned[p]:
                self.stats.bans[p].append(step)
                self.stats.rounds_until_banned.setdefault(p, self._rounds_of[p])
            self._was_banned[p] = every

    def run(self, fragment: int, syncs: list[fs.FragmentSync], step: int) -> SyncOutcome:
        """Run the slot of ``syncs`` (begun at ``step``) to its end; replica 0's outcome."""
        self.now = step * self.step_s
        self._note_bans(step)  # bans that ended since the last slot
        done: dict[str, fs.SyncDone] = {}
        by_peer = dict(zip(self.ids, syncs, strict=True))
        # the records a node would read in the DHT: every replica nobody bans declares
        # its state, and a replica behind it copies it first (a returning peer rebases)
        holdings = [
            (p, eng.version(fragment), eng.digest(fragment))
            for p, eng in zip(self.ids, self.engines, strict=True)
            if not self._banned_by_anyone(p)
        ]
        for peer, sync in by_peer.items():
            act = sync.plan(holdings, wall_now=self.now)
            fetched = False
            while isinstance(act, fs.FetchState):
                donor = self.engines[self.ids.index(act.peer)]
                state = donor.export_fragment(fragment, step)
                self.stats.fetch_bytes += len(state.encode())
                act = sync.fetched(state)
                fetched = True
            if fetched and peer in self.late:
                if isinstance(act, fs.SyncDone):
                    self.stats.late_dropped += 1
                else:
                    self.stats.late_kept += 1
            if isinstance(act, fs.SyncDone):
                done[peer] = act
        for p in [p for p in self.ids if p in self.late]:  # drawn in replica order
            if self.draws.random() < self.late_prob and p not in done:
                self.stats.late_missed += 1
                done[p] = _done(by_peer[p].matched(mm.Alone("late: missed the slot")))
        seekers = [p for p in self.ids if p not in done]
        attempt = 0
        while seekers:
            for p in [p for p in seekers if self._banned_by_anyone(p)]:
                done[p] = _done(by_peer[p].matched(mm.Alone("banned by a peer")))
            rounds = collections.Counter(_round(by_peer[p]) for p in seekers if p not in done)
            common = rounds.most_common(1)[0][0] if rounds else -1
            for p in [p for p in seekers if p not in done and _round(by_peer[p]) != common]:
                done[p] = _done(by_peer[p].matched(mm.Alone("out of step with the group")))
            seekers = [p for p in seekers if p not in done]
            if len(seekers) < 2:
                for p in seekers:
                    done[p] = _done(by_peer[p].matched(mm.Alone("nobody else came")))
                break
            seekers = self._attempt(fragment, by_peer, seekers, attempt, done, step)
            attempt += 1
        first = done[self.ids[0]]
        return SyncOutcome(fragment, first.step, first.applied, first.round, first.reason)

    def _attempt(
        self,
        fragment: int,
        by_peer: dict[str, fs.FragmentSync],
        members: list[str],
        attempt: int,
        done: dict[str, fs.SyncDone],
        step: int,
    ) -> list[str]:
        """One group of ``members`` for the slot; returns the members that seek the slot
        again (a round failed on a fault they proved)."""
        request = by_peer[members[0]].request
        assert request is not None
        key = ar.RoundKey(RUN_ID, fragment, request.round, f"g{attempt}")
        formed = mm.Formed(tuple(members), members[0], key)
        caps = self._recent_caps(fragment, request.round)
        rounds: dict[str, fs.RunRound] = {}
        for p in members:
            act = by_peer[p].matched(formed, weight_cap=caps.get(p, math.inf))
            if isinstance(act, fs.SyncDone):
                done[p] = act
            else:
                assert isinstance(act, fs.RunRound), act
                rounds[p] = act
        codec = self.engines[0].codec
        machines = {
            p: ar.AllReduceRound(
                r.spec,
                p,
                r.payload,
                r.weight,
                now=0.0,
                phase_timeout=_TIMEOUT_S,
                round_timeout=_TIMEOUT_S,
                weight_caps=caps,
                tamper_reduced=(
                    self.attack.tamper_reduced(codec)
                    if p in self.hostile and self.attack is not None
                    else None
                ),
                signer=self.signers[p] if self.sealed else None,
                opener=self.opener if self.sealed else None,
            )
            for p, r in rounds.items()
        }
        wire = self.attack if self.attack is not None and self.attack.on_the_wire else None
        outgoing = {
            p: _on_the_wire(wire, nan_prefix(codec.name), self.signers[p] if self.sealed else None)
            for p in self.hostile
            if wire is not None
        }
        results = run_in_memory(machines, outgoing)
        self.stats.rounds += 1
        size = codec.encoded_size(request.numel)
        self.stats.round_bytes += len(machines) * allreduce_bytes_per_peer(size, len(machines))
        for p in self.hostile & set(machines):
            self._rounds_of[p] += 1
        again: list[str] = []
        committed: set[str] = set()
        for p, result in results.items():
            sync = by_peer[p]
            honest = p not in self.hostile
            if isinstance(result, ar.Done):
                committed.add(p)
                if honest:
                    self.stats.honest_applied += 1
            else:
                if honest:
                    self.stats.honest_disrupted += 1
                culprit = result.culprit or self_accused(result.reason)
                if culprit and culprit != p:
                    self.strikes[p].strike(culprit, reason_of_failure(result.reason))
                if culprit and self.strikes[p].banned(culprit) and sync.may_regroup:
                    sync.regroup(self.now)
                    again.append(p)
                    continue
            done[p] = _done(sync.reduced(result))
        if self.ids[0] in committed:
            self._made[fragment] = (request.round + 1, frozenset(committed))
            if set(machines) & self.hostile:
                self.stats.applied_with_attacker += 1
        if again:
            self.stats.sought_again += 1
        self._note_bans(step)
        return again

    def _recent_caps(self, fragment: int, version: int) -> dict[str, float]:
        """The caps of the members of the round that made ``version`` (as the syncer's)."""
        made = self._made.get(fragment)
        if made is None or made[0] != version:
            return {}
        cap = fs.recent_member_cap(self.weight_cap)
        return {} if math.isinf(cap) else dict.fromkeys(made[1], cap)


def _identity(seed: int, replica: int) -> Identity:
    """Replica ``replica``'s Ed25519 identity, derived from ``seed`` (which member
    verifies which chunk follows the peer ids, so runs repeat only with the same ids)."""
    key = hashlib.sha256(f"atoll-sim-{seed}-{replica}".encode()).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(key))


def _round(sync: fs.FragmentSync) -> int:
    request = sync.request
    assert request is not None
    return request.round


def _done(act: fs.Action) -> fs.SyncDone:
    if not isinstance(act, fs.SyncDone):
        raise ConfigError(f"a simulated sync expected to end, got {act!r}")
    return act


def _on_the_wire(
    attack: Attack | None, prefix: bytes, signer: EnvelopeSigner | None
) -> Callable[[ar.Send], list[ar.Send]]:
    def rewrite(send: ar.Send) -> list[ar.Send]:
        msg = send.message
        if attack is None or not isinstance(msg, ar.Part):
            return [send]
        return [ar.Send(send.to, m) for m in hostile_parts(attack, msg, prefix, signer)]

    return rewrite

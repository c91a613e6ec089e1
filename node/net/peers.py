"""Who else trains in this run: the live peers' records, read from the DHT.

:class:`PeerTracker` keeps the newest :class:`~atoll.dht.records.PeerRecord` of every peer
of the run that has not expired, and what follows from them for a sync:

- :meth:`PeerTracker.holdings`: ``(peer, version, digest)`` of a fragment, the input of
  the rule for which state the swarm follows (:mod:`atoll.protocol.statesync`): only the
  states the node believes (:attr:`PeerTracker.beliefs`, a
  :class:`~atoll.protocol.certificate.CertifiedStates`: the seed or a certified state);
  :meth:`PeerTracker.declared` gives every declaration, believed or not (what a
  certificate lookup starts from);
- :meth:`PeerTracker.group_settings`: the manifest's group settings for the peers that
  answer now and still train (see below): the most members capped at them, so a leader
  closes its group as soon as every one has joined instead of waiting out the grace
  window, and the quorum raised to a majority of them, so that two disjoint groups never
  apply one slot;
- :meth:`PeerTracker.watch`: refresh from the DHT every ``every_s``;
  :meth:`PeerTracker.wait_for`: wait until N other peers appeared (``--wait-peers``).

Records expire by the injected wall clock (records carry wall-clock stamps); the
addresses of a record go to the transport's peer store for as long as it lives.

Who counts. A record lives minutes, a link can drop in a second. A peer with a live record
counts only while it answers: the node's :class:`~atoll.protocol.liveness.Liveness`
(shared with the DHT and the round drivers) says which peers failed a request since they
were last heard, and those are left out (:meth:`PeerTracker.responsive`) until they answer
or send something again. So are the peers the node banned (:attr:`PeerTracker.banned`, the
node's :class:`~atoll.protocol.strikes.Strikes`): a banned peer's state is not followed,
it is not expected at a slot and it does not count toward group sizes and majorities.

The majority rule. With ``n`` responsive peers (this one included) and a manifest quorum
of at least 2, a group needs ``n // 2 + 1`` members when that many fit in ``max_size``.
Two groups of one slot then always share a member, and a member is in one group per slot,
so one slot is never applied twice with different averages while peers agree on ``n``
(a healthy swarm). A side of a split network counts only the peers it still reaches:
each side that holds the manifest's quorum keeps committing, and the sides' copies are
reconciled by the rebase rule when they meet again (docs/DESIGN.md). A swarm larger than
twice ``max_size`` cannot hold a majority in one group and falls back to the manifest's
quorum (several groups per slot, reconciled the same way). A manifest quorum of 1 (a lone
peer applies its own round) is left as it is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import trio

from atoll.dht.records import PeerRecord
from atoll.protocol.certificate import CertifiedStates
from atoll.protocol.errors import AtollError, PeerUnavailable
from atoll.protocol.liveness import Liveness
from atoll.protocol.manifest import GroupSettings
from atoll.protocol.sync import Holding, holdings_of

__all__ = ["JoinFailed", "PeerDirectory", "PeerTracker"]

logger = logging.getLogger(__name__)


class JoinFailed(PeerUnavailable):
    """No ``--join`` address let this node into the swarm, or too few peers appeared; the
    message says why."""


class PeerDirectory(Protocol):
    """What the tracker needs of the DHT: the run's peer records."""

    async def find_peers(self) -> list[PeerRecord]: ...


class AddressBook(Protocol):
    """Where the tracker puts the addresses it learns (the host's peer store)."""

    def add_addrs(self, peer_id: str, addrs: Sequence[str], *, ttl_s: float) -> None: ...


class PeerTracker:
    """The live peers of the run (see the module docstring)."""

    def __init__(
        self,
        me: str,
        group: GroupSettings,
        *,
        directory: PeerDirectory,
        wall: Callable[[], float],
        addresses: AddressBook | None = None,
        liveness: Liveness | None = None,
        beliefs: CertifiedStates | None = None,
        clock: Callable[[], float] = trio.current_time,
        banned: Callable[[str], bool] | None = None,
    ) -> None:
        self.me = me
        self.own_reach = ""
        """this node's reachability, once its dial-back check ended (see :meth:`private`)"""
        self.banned = banned
        """whether a peer is banned now (None: nobody is)"""
        self.beliefs = beliefs
        """which declared states may be followed (None: every one, as before certificates)"""
        self.clock = clock
        """the monotonic clock of :attr:`beliefs`' grace and retry times"""
        self.liveness = liveness if liveness is not None else Liveness()
        """who answers (shared with the DHT and the round drivers)"""
        self.group = group
        self.directory = directory
        self.wall = wall
        self.addresses = addresses
        self.live: dict[str, PeerRecord] = {}
        """peers of the run with a live record, this peer excluded"""
        self.seen: set[str] = set()
        """every peer of the run heard of (records or declarations)"""

    def note(self, records: Sequence[PeerRecord]) -> None:
        """Take in peer records of the run: newer ones replace older, expired ones go."""
        now = self.wall()
        for r in records:
            held = self.live.get(r.peer_id)
            if r.peer_id != self.me and (held is None or r.issued_at >= held.issued_at):
                self.live[r.peer_id] = r
                self.seen.add(r.peer_id)
                if self.addresses is not None:
                    self.addresses.add_addrs(r.peer_id, r.addrs, ttl_s=r.expires_at - now)
        self.live = {p: r for p, r in self.live.items() if r.expires_at > now}

    def saw(self, peer_id: str) -> None:
        """Count a peer heard of elsewhere (a declaration of a slot)."""
        if peer_id != self.me:
            self.seen.add(peer_id)

    def declared(self, fragment: int) -> list[Holding]:
        """``(peer, version, digest)`` of ``fragment`` from the live records of the
        responsive peers (a state held only across a split cannot be copied, and its
        holders are not the swarm this node trains with until they answer again), believed
        or not."""
        records = (self.live[p] for p in self.responsive())
        return holdings_of(fragment, [(r.peer_id, r.versions, r.digests) for r in records])

    def holdings(self, fragment: int, mine: tuple[int, str] | None = None) -> list[Holding]:
        """:meth:`declared` states that this node believes (see :meth:`believed`)."""
        return self.believed(fragment, self.declared(fragment), mine)

    def believed(
        self, fragment: int, holdings: Sequence[Holding], mine: tuple[int, str] | None = None
    ) -> list[Holding]:
        """``holdings`` of ``fragment`` whose state :attr:`beliefs` believes (all without
        beliefs); ``mine``, this node's own state, is believed. A declaration left out is
        logged once per peer, and its declarer reported (``on_uncertified``) once its
        claim is past the grace or out of reach."""
        if self.beliefs is None:
            return list(holdings)
        return self.beliefs.believed(fragment, holdings, now=self.clock(), mine=mine)

    def responsive(self) -> list[str]:
        """The peers with a live record that have not failed a request since they were
        last heard, and are not banned."""
        banned = self.banned
        return [
            p
            for p in self.live
            if not self.liveness.silent(p) and (banned is None or not banned(p))
        ]

    async def probe_silent(self, probe: Callable[[str], Awaitable[bool]]) -> list[str]:
        """Probe, at once, every peer with a live record that is silent (``probe(peer)``
        answers True when the peer answered; it tells the liveness either way). Returns the
        peers that came back. The hold does not delay a probe: it keeps requests of rounds
        and lookups away from a silent peer, while a probe costs one bounded dial in the
        background, so a healed link is noticed within one probe period instead of up to
        the longest hold. Without this, a side of a healed split might wait for the other
        to contact it first."""
        due = [p for p in self.live if self.liveness.silent(p)]
        back: list[str] = []

        async def one(peer: str) -> None:
            if await probe(peer):
                back.append(peer)

        async with trio.open_nursery() as nursery:
            for peer in due:
                nursery.start_soon(one, peer)
        if back:
            logger.info("peers answering again: %s", ", ".join(p[-6:] for p in back))
        return back

    async def watch_silent(self, probe: Callable[[str], Awaitable[bool]], every_s: float) -> None:
        """:meth:`probe_silent` every ``every_s`` seconds, forever."""
        while True:
            await self.probe_silent(probe)
            await trio.sleep(every_s)

    def private(self, peer: str) -> bool:
        """Whether ``peer`` (this node included, by :attr:`own_reach`) cannot be dialed:
        its record says ``private`` (behind a NAT or a firewall)."""
        if peer == self.me:
            return self.own_reach == "private"
        record = self.live.get(peer)
        return record is not None and record.reach == "private"

    def trainers(self) -> list[str]:
        """The responsive peers still training (a node that settles at the end of its run
        holds its copy but joins no more groups)."""
        return [p for p in self.responsive() if self.live[p].training]

    def swarm_step(self) -> int:
        """The lower median of the steps the trainers' live records state (-1 when none
        states one): where a node that resumes or joins starts, when it is ahead of its
        own step. One peer can move it only within the others' steps."""
        steps = sorted(s for p in self.trainers() if (s := self.live[p].step) >= 0)
        return steps[(len(steps) - 1) // 2] if steps else -1

    def expected(self, fragment: int, version: int) -> list[str]:
        """The trainers whose record shows them due at ``fragment``'s slot of ``version``:
        they hold that version (this node's copy, or another one they will rebase from
        onto this node's, which the rebase rule already chose), or an earlier one (they
        rebase onto it before their round and join it, a peer far behind with its mean
        drift per missed version: :mod:`atoll.protocol.sync`). A node that arrives at the
        slot first waits for them (matchmaking's patience). A peer back from a cut or a
        split is several versions behind; when only the version before counted, the
        others closed the slot's group seconds before it came, and it chased the swarm one
        version behind for a period or two."""
        due = []
        for p in self.trainers():
            r = self.live[p]
            if fragment < len(r.versions) and r.versions[fragment] <= version:
                due.append(p)
        return due

    def group_settings(self) -> GroupSettings:
        """The group settings for the responsive peers (see the module docstring): the
        most members capped at them, the quorum raised to their majority."""
        group = self.group
        if not self.live:
            return group
        n = 1 + len(self.trainers())
        size = max(group.min_quorum, min(group.max_size, n))
        quorum = group.min_quorum
        if quorum >= 2 and n // 2 + 1 <= size:
            quorum = max(quorum, n // 2 + 1)
        return dataclasses.replace(group, min_quorum=quorum, max_size=size)

    async def refresh(self) -> bool:
        """Read the run's records once; False when the DHT did not answer."""
        try:
            self.note(await self.directory.find_peers())
        except AtollError as e:
            logger.debug("find_peers: %s", e)
            return False
        return True

    async def watch(self, every_s: float) -> None:
        """Refresh from the DHT every ``every_s`` seconds, forever."""
        while True:
            await self.refresh()
            await trio.sleep(every_s)

    async def wait_for(self, n: int, timeout_s: float, *, poll_s: float = 0.5) -> None:
        """Wait until ``n`` other peers of the run have published records; JoinFailed
        after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while True:
                await self.refresh()
                if len(self.live) >= n:
                    logger.info("%d peers of the run are here; training starts", len(self.live))
                    return
                await trio.sleep(poll_s)
        raise JoinFailed(
            f"only {len(self.live)} of the {n} peers waited for appeared in {timeout_s} s"
        )

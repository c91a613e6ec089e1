"""The swarm worker: the network process of a node that trains with other peers.

:func:`swarm_worker` plugs into :class:`~atoll.node.net.bridge.NetworkBridge` like the
loopback worker, but its exchange is the swarm. It composes, in one trio loop, parts that
each do one job:

- one libp2p host (:func:`~atoll.node.net.host.open_host`, Noise and yamux only) and
  atoll's Kademlia DHT on it (:class:`~atoll.dht.kad.AtollDHT`), joined through the
  ``--join`` addresses (:func:`~atoll.node.net.join.join_swarm` says why a join failed);
- the :class:`~atoll.protocol.engine.OuterEngine` over the fragments in shared memory;
- a :class:`~atoll.node.net.rounds.Mailbox` routing peers' messages to the rounds;
- :class:`~atoll.node.net.peers.PeerTracker`: the live peers' records;
- :class:`~atoll.node.net.syncer.Syncer`: every sync of a fragment, as the sans-IO
  :class:`~atoll.protocol.sync.FragmentSync` decides it (matchmaking, all-reduce, commit
  or roll back, rebase), and the answers to peers' state requests;
- :class:`~atoll.node.net.publisher.RecordPublisher`: this peer's record in the DHT;
- certified states: :class:`~atoll.protocol.certificate.CertifiedStates` (the tracker's
  beliefs: the seed digests computed at start, the manifest's quorum, the DHT's
  verifier) and :class:`~atoll.node.net.publisher.AttestationPublisher` (this member's
  attestation of each committed round, sealed with its identity, in the DHT);
  :attr:`_Node.on_uncertified` hears of peers that declare a state no certificate
  vouches for (counted in :attr:`_Node.uncertified`, and struck);
- strikes and bans (:class:`~atoll.protocol.strikes.Strikes`): the syncer strikes the
  culprit of a failed round, :meth:`_Node._uncertified` a declaration of an uncertified
  state (``forged`` when it is more than one version past everything believed, else a
  weak ``uncertified``); banned peers are not grouped with, followed or counted;
  :class:`~atoll.node.net.publisher.EvidenceExchange` publishes the signed record of a
  banned forger and judges the others' evidence;
- reachability: the ``--join`` peers are asked to dial this node back once it joined
  (:mod:`~atoll.node.net.dialback`); the verdict is logged in one line and posted in
  the status (``reach``, shown on the status line); this node answers the same
  question for others;
- attack injection for benchmarks and tests (``attack``,
  :mod:`atoll.node.net.attacks`): the syncer's tamper, a transport that tampers with
  parts as they leave, a forged record;
- :class:`~atoll.node.net.tally.SyncTally` and the :class:`~atoll.node.net.status.
  NodeStatus` sent to the trainer every second (:func:`~atoll.node.net.bridge.post_status`).

One sync of fragment ``p`` started at inner step ``t``: the trainer's local copy is in
shared memory; the syncer runs the machine (see :mod:`atoll.protocol.sync`); a committed
round or a rebase writes the new global copy back to shared memory; the outcome goes to
the trainer. The rendezvous of a round is the fragment's *version*, not a step count:
peers of different speeds that hold the same global copy meet at the same slot, and a peer
that missed a round rebases and meets the others at the next version.

At start, before reporting ready, a peer catches up: it reads the peers' records and
rebases every fragment whose leading state is not its own, and tells the trainer the
inner step to start from (``start_step``), so that a late joiner's slots line up with the
swarm's.
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import trio

from atoll.dht.kad import AtollDHT
from atoll.dht.records import PeerRecord
from atoll.dht.status import serve_status
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier, SystemClock
from atoll.node.net.ahead import AHEAD_S, Ahead
from atoll.node.net.attacks import Attack, HostileTransport, forged_versions, parse_attack
from atoll.node.net.bridge import (
    Settled,
    SharedFragments,
    SyncOutcome,
    post_hold,
    post_status,
    serve,
)
from atoll.node.net.certwatch import watch_certificates
from atoll.node.net.dialback import ask_dialback, listen_ports, serve_dialback
from atoll.node.net.faults import parse_fault
from atoll.node.net.host import AGENT, AtollHost, HostConfig, open_host
from atoll.node.net.join import JoinFailed, join_swarm
from atoll.node.net.peers import PeerTracker
from atoll.node.net.publisher import (
    RECORD_TTL_S,
    AttestationPublisher,
    EvidenceExchange,
    RecordPublisher,
)
from atoll.node.net.rounds import Mailbox
from atoll.node.net.settle import SettleView, settle_verdict
from atoll.node.net.status import NodeStatus
from atoll.node.net.syncer import MAX_STEP_LAG_SYNCS, FaultHook, Syncer
from atoll.node.net.tally import SyncTally
from atoll.node.settings import load_membership
from atoll.node.snapshot import EnginePart, write_engine_file
from atoll.protocol import matchmaking as mm
from atoll.protocol.certificate import CertifiedStates, open_attestation
from atoll.protocol.codecs import make_codec
from atoll.protocol.deadlines import MEASURED, DeadlineRule
from atoll.protocol.engine import OuterEngine
from atoll.protocol.errors import AtollError, ConfigError
from atoll.protocol.liveness import Liveness
from atoll.protocol.manifest import RunManifest
from atoll.protocol.reachability import DialBackReply
from atoll.protocol.reachability import verdict as reachability_verdict
from atoll.protocol.schedule import Schedule
from atoll.protocol.strikes import Strikes
from atoll.protocol.sync import weight_cap
from atoll.security.identity import load_or_create

__all__ = ["JoinFailed", "join_swarm", "swarm_worker"]

MAX_DIALBACK_ASKED = 3
"""``--join`` peers asked to dial this node back at start"""
DIALBACK_TIMEOUT_S = 20.0
"""the bound of each dial-back exchange (the server's dials included)"""

logger = logging.getLogger(__name__)

_STATUS_EVERY_S = 1.0
_PEERS_EVERY_S = 5.0  # how often the live peers of the run are read from the DHT
_PROBE_EVERY_S = 2.0  # how often silent peers are probed
_CERTIFY_EVERY_S = 2.0  # how often the certificates of unbelieved declared states are sought
_RATE_EVERY_S = 5.0  # tokens/s is measured over this window


class _Node:
    """One node's network side: the parts of the module docstring, wired together."""

    def __init__(
        self,
        shared: SharedFragments,
        outbox: Connection,
        manifest: RunManifest,
        host: AtollHost,
        dht: AtollDHT,
        engine: OuterEngine,
        *,
        poll_s: float,
        fault: FaultHook | None,
        background: trio.Nursery,
        liveness: Liveness,
        signer: EnvelopeSigner,
        verifier: EnvelopeVerifier,
        attack: Attack | None = None,
        ahead_s: float = AHEAD_S,
        weight_cap: float = math.inf,
        deadline_rule: DeadlineRule | None = MEASURED,
    ) -> None:
        self.attack = attack
        """this node's attack (benchmarks and tests; None: an honest node)"""
        self.verifier = verifier
        self.shared = shared
        self.outbox = outbox
        self.host = host
        self.dht = dht
        self.engine = engine
        self.run_id = manifest.run_id()
        self.clock = SystemClock()
        self.tally = SyncTally()
        timeouts = manifest.timeouts
        self.uncertified: Counter[str] = Counter()
        """per peer: declarations of states no certificate vouched for"""
        self.on_uncertified: Callable[[str, int, int], None] | None = None
        """``(peer, fragment, version)``, after the count and the strike"""
        self.strikes = Strikes(clock=trio.current_time)
        """who this node struck and banned (see protocol/strikes.py)"""
        self.beliefs = CertifiedStates(
            self.run_id,
            quorum=manifest.group.min_quorum,
            verifier=verifier,
            # version 0 is the manifest's seed: the copy the trainer wrote at start
            seeds=[engine.digest(p) if engine.version(p) == 0 else "" for p in range(len(shared))],
            on_uncertified=self._uncertified,
            # a round's members publish their attestations within about one round
            grace_s=timeouts.matchmaking_s + timeouts.round_s,
            # more syncs of a fragment than a whole run has: no split's work, a forgery
            max_lead=max(1, -(-manifest.total_steps // manifest.H)),
        )
        self.peers = PeerTracker(
            host.peer_id,
            manifest.group,
            directory=dht,
            wall=self.clock.wall,
            addresses=host,
            liveness=liveness,
            beliefs=self.beliefs,
            banned=self.strikes.banned,
        )
        self.attester = AttestationPublisher(
            dht, signer, peer_id=host.peer_id, wall=self.clock.wall, held=self._held
        )
        self.mailbox = Mailbox(
            host,
            on_request=self._on_request,
            hold_s=manifest.timeouts.round_s,
            liveness=liveness,
            passed=self._passed,
            out_of_step=self._out_of_step,
        )
        self.syncer = Syncer(
            transport=(
                HostileTransport(host, attack, manifest.codec, signer)
                if attack is not None and attack.on_the_wire
                else host
            ),
            mailbox=self.mailbox,
            board=dht,
            engine=engine,
            peers=self.peers,
            run_id=self.run_id,
            timeouts=manifest.timeouts,
            wall=self.clock.wall,
            poll_s=poll_s,
            on_change=self._changed,
            fault=fault,
            background=background,
            attestations=dht,
            attest=self.attester.submit,
            attested=self.attester.sealed_for,
            robust=manifest.robust,
            strikes=self.strikes,
            tamper=attack.tamper if attack is not None else None,
            signer=signer,
            opener=verifier,
            tamper_reduced=(
                attack.tamper_reduced(make_codec(manifest.codec, block=manifest.codec_block))
                if attack is not None
                else None
            ),
            # a node ahead of its peers waits for them at the slot (NetworkBridge.wait)
            on_hold=functools.partial(post_hold, outbox),
            weight_cap=weight_cap,
            deadline_rule=deadline_rule,
            # no fresh connection (Node.probe's): an absent peer may still be in a round
            # with this node on another fragment
            probe=dht.probe,
        )
        self.evidence = EvidenceExchange(
            dht,
            peer_id=host.peer_id,
            run_id=self.run_id,
            wall=self.clock.wall,
            verifier=verifier,
            strikes=self.strikes,
            beliefs=self.beliefs,
            held=self._held,
            sealed_of=dht.sealed_peer_record,
            attestations=dht,
        )
        self.strikes.on_ban = self.evidence.on_ban
        lead = min(ahead_s, timeouts.matchmaking_s / 2)
        self.ahead = (
            Ahead(engine.schedule, self.syncer.prepare, trio.current_time, lead_s=lead)
            if lead > 0
            else None
        )
        """forms each fragment's group shortly before its sync (None: off)"""
        self._changes = 0  # commits and imports so far: a record is due after each
        self.training = True
        self.reach = ""  # whether peers can dial this node: its dial-back check says
        """False once the trainer stopped (published in the record)"""
        self.publisher = RecordPublisher(dht, self._record, self._mark)
        self.status = NodeStatus(peer_id=host.peer_id, run_id=self.run_id)
        self.seen_tokens = 0
        self.tokens_per_s = 0.0
        self._rate_mark = (trio.current_time(), 0)

    # -- syncs -----------------------------------------------------------------------------
    async def _on_request(self, sender: str, msg: object) -> None:
        await self.syncer.serve_request(sender, msg)

    def _changed(self, p: int, how: str) -> None:
        """A commit or an import changed fragment ``p``'s global copy (engine lock held)."""
        self.shared.global_(p)[:] = self.engine.global_params(p)
        self._changes += 1
        self.tally.changed(p, self.engine.version(p), self.engine.digest(p), how)

    def reached(self, reach: str) -> None:
        """This node's dial-back check ended with ``reach``: its record says so (the
        next publication is due) and so does its status."""
        if reach != self.reach:
            self.reach = reach
            self.peers.own_reach = reach
            self._changes += 1
        self.post(reach=reach)

    def _uncertified(self, peer: str, p: int, version: int) -> None:
        self.uncertified[peer] += 1
        # reported once its grace passed without a certificate: more than one version past
        # everything believed is no honest commit (forged); else an honest member of a
        # round short of its quorum may hold it until its next rebase (weak)
        reach = max(self.beliefs.top(p), self.engine.version(p)) + 1
        reason = "forged" if version > reach else "uncertified"
        self.strikes.strike(peer, reason, f"declares fragment {p} version {version} uncertified")
        if self.on_uncertified is not None:
            self.on_uncertified(peer, p, version)

    def _held(self, p: int) -> tuple[int, str]:
        """Fragment ``p``'s version and digest as held now (cached since its change)."""
        return self.engine.version(p), self.engine.digest(p)

    async def handle(self, p: int, step: int, tokens: int) -> SyncOutcome:
        """One sync of fragment ``p`` started at ``step`` (the bridge's handler)."""
        async with self.syncer.lock:
            if tokens > self.seen_tokens:
                self.engine.add_tokens(tokens - self.seen_tokens)
                self.seen_tokens = tokens
        report = await self.syncer.sync(p, self.shared.local(p), step)
        done = report.done
        self.tally.record(report, self.engine.version(p))
        if done.rebased and done.state_step is not None:
            # the donors' median step now, before the outcome on the same pipe: the trainer
            # may jump there. Not the highest step ever heard: one peer's counter ahead of
            # the others' by whole periods would make every later jump skip syncs that the
            # rest of the swarm still holds
            self.post(swarm_step=done.state_step)
        elif done.swarm_step is not None:
            # its peers refused it as out of step: the trainer moves to their step, back
            # or forth (before the outcome, on the same pipe)
            self.post(swarm_step=done.swarm_step)
        met_at = report.met_at if done.round_status == "applied" else -1
        return SyncOutcome(p, step, done.applied, done.round, done.reason, met_at)

    async def catch_up(self) -> int:
        """Rebase every fragment that the peers' records show behind; the step to start
        at: the swarm's (the median step its trainers' records state), or the step of a
        copied state when that is later (the trainer takes it only when it is ahead of
        its own, a checkpoint's)."""
        if not await self.peers.refresh():
            logger.info("no peer records yet: starting from the manifest's seed")
            return 0
        start = self.peers.swarm_step()
        for done in await self.syncer.catch_up_all():
            self.tally.caught_up()
            if done.state_step is not None:
                start = max(start, done.state_step)
        return max(start, 0)

    async def probe(self, peer: str) -> bool:
        """Ask a silent peer whether it answers again, on a fresh connection (an old one
        may sit in TCP back-off long after the link healed)."""
        await self.host.forget_peer(peer)
        return await self.dht.probe(peer)

    def note_step(self, step: int, moved: bool = False) -> None:
        """The trainer's current step: handed to the peers that copy a state from here,
        and the clock of the groups formed ahead of syncs. ``moved``: the trainer jumped
        or moved there (:meth:`~atoll.node.net.syncer.Syncer.moved`)."""
        if moved:
            self.syncer.moved(step)
        self.syncer.step = max(self.syncer.step, step)
        if self.ahead is not None and self.training:
            self.syncer.passed(step)
            self.ahead.note(step)

    async def settle(self, timeout_s: float) -> Settled:
        """At the end of a run: rebase every fragment whose copy is not the one the
        peers that answer follow, until all of them hold this node's copy of every
        fragment and none still trains (or ``timeout_s`` passes).

        The node first publishes that it no longer trains (it stops counting toward
        quorums). Nodes that finish together all run this, so they end on one global
        copy; when to stop is :func:`~atoll.node.net.settle.settle_verdict`'s rule.
        """
        start = trio.current_time()
        deadline = start + timeout_s
        patience = self.syncer.timeouts.matchmaking_s + self.syncer.timeouts.round_s
        self.training = False
        self.syncer.drop_ahead("the trainer stopped")
        await self.publisher.publish_once()
        rebased = 0
        while True:
            at_end = trio.current_time() >= deadline
            with trio.move_on_at(deadline):
                await self.peers.refresh()
                for p in range(len(self.shared)):
                    done = await self.syncer.catch_up(p)
                    if done.rebased:
                        rebased += 1
                        self.tally.caught_up()
            published = await self.publisher.publish_if_changed()
            with trio.move_on_at(deadline):  # the peers of its last rounds may need them
                await self.attester.publish_due()
            verdict = settle_verdict(
                self._settle_view(published, rebased),
                waited_s=trio.current_time() - start,
                patience_s=patience,
                at_end=at_end,
            )
            if verdict is not None:
                return verdict
            await trio.sleep(max(0.0, min(1.0, deadline - trio.current_time())))

    def _settle_view(self, published: bool, rebased: int) -> SettleView:
        answering = self.peers.responsive()
        gone = [
            p
            for p, r in self.peers.live.items()
            if p not in answering and not r.training and not self.beliefs.reported(p)
        ]
        return SettleView(
            published=published,
            known=len(self.peers.live),
            answering=len(answering),
            differ=tuple(self._disagreeing()),
            training=tuple(p for p in answering if self.peers.live[p].training),
            gone_agree=len(gone) if gone and not self._disagreeing(gone) else 0,
            rebased=rebased,
            pending=tuple(sorted({*self.syncer.uncertified(), *self.attester.unpublished()})),
        )

    def _disagreeing(self, peers: list[str] | None = None) -> list[str]:
        """The peers (by default the responsive ones) whose record shows another copy of
        some fragment."""
        mine = [(self.engine.version(p), self.engine.digest(p)) for p in range(len(self.shared))]
        out = []
        for peer in self.peers.responsive() if peers is None else peers:
            if self.beliefs.reported(peer):  # its word on its copy is not taken
                continue
            r = self.peers.live[peer]
            theirs = list(zip(r.versions, r.digests, strict=False))
            if theirs != mine:
                out.append(peer)
        return out

    def _passed(self, fragment: int, slot: int) -> tuple[int, int] | None:
        """This node's version of ``fragment`` and its trainer's step when it is past
        ``slot`` (a slot is a version: a node that applied or copied a later one will not
        match at it), else None."""
        if not 0 <= fragment < len(self.shared):
            return None
        version = self.engine.version(fragment)
        return (version, self.syncer.step) if version > slot else None

    def _out_of_step(self, sender: str, request: mm.JoinRequest) -> tuple[str, int] | None:
        """Whether to refuse ``sender``'s join request, for a slot this node is not at
        now, as out of step (:func:`~atoll.protocol.matchmaking.out_of_slot_refusal`):
        the reason and this node's trainer step, or None. Only while the trainer runs:
        a node that settles or has not started has no step to stand by."""
        if not self.training or self.syncer.step <= 0:
            return None
        why = mm.out_of_slot_refusal(
            self.run_id,
            self.host.peer_id,
            self.syncer.step,
            sender,
            request.step,
            step_period=self.engine.config.H,
            max_step_lag=MAX_STEP_LAG_SYNCS * self.engine.config.H,
        )
        return None if why is None else (why, self.syncer.step)

    # -- the record and the status --------------------------------------------------------
    def _versions(self) -> tuple[int, ...]:
        return tuple(self.engine.version(p) for p in range(len(self.shared)))

    def _mark(self) -> tuple[int, ...]:
        """What a published record must reflect: the versions, the count of changes (a
        rebase may keep the version and change the copy) and the trainer's step to the
        period (a node that resumes or joins starts at the swarm's step: its record may
        not be a whole period behind while the trainer trains alone)."""
        return (*self._versions(), self._changes, self.syncer.step // self.engine.config.H)

    async def snapshot(self, path: str) -> Callable[[], dict[str, Any]]:
        """The bridge's snapshot handler: copy the engine's state under its lock (with
        the seals of the certificates of the states held, so that a resumed node can
        show them again); the writer it returns writes the copy to ``path``."""
        async with self.syncer.lock:
            state = self.engine.state_dict()
            held = [
                (p, self.engine.version(p), self.engine.digest(p)) for p in range(len(self.shared))
            ]
            # the trainer's status says what the copy holds (a stopped node reports it)
            self.post()
        seals = [[base64.b64encode(s).decode() for s in self.beliefs.seals(*h)] for h in held]
        own = [self.attester.sealed_for(*h) for h in held]
        mine = ["" if s is None else base64.b64encode(s).decode() for s in own]

        def write() -> dict[str, Any]:
            meta = write_engine_file(path, state)
            meta["seals"] = seals
            meta["own_seals"] = mine
            return meta

        return write

    def restore_seals(self, seals: Sequence[Sequence[str]], own: Sequence[str] = ()) -> int:
        """Offer the certificate seals a checkpoint kept for the states now held (its
        own attestations among them, which are published again); how many fragments'
        states they certify again."""
        certified = 0
        for p in range(len(self.shared)):
            sealed = list(seals[p]) if p < len(seals) else []
            mine = own[p] if p < len(own) else ""
            try:
                raw = [base64.b64decode(s, validate=True) for s in sealed if s]
                own_raw = base64.b64decode(mine, validate=True) if mine else b""
            except (ValueError, TypeError):
                logger.warning("fragment %d: the checkpoint's seals do not decode; ignored", p)
                continue
            version, digest = self.engine.version(p), self.engine.digest(p)
            if own_raw:
                try:
                    att, signer = open_attestation(own_raw, self.verifier)
                except AtollError as e:
                    logger.warning("fragment %d: the checkpoint's own seal: %s", p, e)
                else:
                    if signer == self.host.peer_id and (att.fragment, att.version, att.digest) == (
                        p,
                        version,
                        digest,
                    ):
                        self.attester.restore(att, own_raw)
                        raw.append(own_raw)
                        # a member of the round that made it: its weight is capped as such
                        self.syncer.remember_made(p, att.version, att.members)
            if raw and self.beliefs.offer(p, version, digest, raw, now=trio.current_time()):
                certified += 1
        return certified

    async def leave(self, timeout_s: float = 1.5) -> None:
        """The trainer stopped: say so in the DHT (``training=False``), within
        ``timeout_s``, so that no peer counts on this node for a group or waits for it."""
        self.training = False
        self.syncer.drop_ahead("the node leaves")
        with trio.move_on_after(timeout_s) as scope:
            await self.publisher.publish_once()
        if scope.cancelled_caught:
            logger.info("leaving: the last record was not stored within %.1f s", timeout_s)

    async def _record(self) -> PeerRecord:
        def build() -> PeerRecord:
            now = self.clock.wall()
            versions = self._versions()
            digests = tuple(self.engine.digest(p) for p in range(len(self.shared)))
            if self.attack is not None and self.attack.forges:
                versions, digests = forged_versions(len(versions), len(digests[0]))
            return PeerRecord(
                self.host.peer_id,
                self.run_id,
                tuple(a.rsplit("/p2p/", 1)[0] for a in self.host.addrs)[:8],
                AGENT,
                float(self.tokens_per_s),
                versions,
                digests,
                True,
                now,
                now + RECORD_TTL_S,
                self.training,
                self.reach,
                self.syncer.step,
            )

        return await self.syncer.engine_call(build)

    def post(self, **changes: object) -> None:
        """Send the current status to the trainer, with ``changes`` made first."""
        now = trio.current_time()
        t0, tok0 = self._rate_mark
        if now - t0 >= _RATE_EVERY_S:
            self.tokens_per_s = (self.seen_tokens - tok0) / (now - t0)
            self._rate_mark = (now, self.seen_tokens)
        sent, received = self.host.bytes_sent, self.host.bytes_received
        self.status = self.status.updated(
            {
                **self.tally.fields(),
                "peers_seen": len(self.peers.seen),
                "dht_peers": len(self.dht.routing_table_peers()),
                "peers_live": len(self.peers.responsive()),
                "suspicions": self.peers.liveness.suspicions,
                "dht_skips": self.peers.liveness.skips,
                "fallbacks": self.syncer.fallbacks,
                "bytes_per_peer": {
                    peer: (sent.get(peer, 0), received.get(peer, 0)) for peer in list(sent)[:64]
                },
                "bytes_up": sum(sent.values()),
                "bytes_down": sum(received.values()),
                "versions": self._versions(),
                "banned": self.strikes.banned_peers(),
                "strikes": self.strikes.total,
                "bans": self.strikes.bans_total,
                **changes,
            }
        )
        post_status(self.outbox, self.status)

    async def report(self) -> None:
        """The status to the trainer every :data:`_STATUS_EVERY_S`, forever."""
        while True:
            self.post()
            await trio.sleep(_STATUS_EVERY_S)


async def _check_reachability(
    node: _Node, host: AtollHost, joins: Sequence[str], timeout_s: float
) -> None:
    """Ask the ``--join`` peers to dial this node back (:mod:`~atoll.node.net.dialback`);
    log the verdict in one line and post it in the status (``reach``)."""
    ports = listen_ports(host.addrs)
    replies: list[DialBackReply] = []
    arrived: list[float] = []
    for addr in joins[:MAX_DIALBACK_ASKED]:
        try:
            replies.append(await ask_dialback(host.libp2p_host, addr, ports, timeout_s=timeout_s))
            arrived.append(time.time())
        except AtollError as e:
            logger.info("reachability: %s", e)
    found = reachability_verdict(replies, local_wall_s=arrived)
    (logger.warning if found.reach == "private" else logger.info)("%s", found.line())
    node.reached(found.reach)


async def swarm_worker(
    shared: SharedFragments,
    inbox: Connection,
    outbox: Connection,
    *,
    manifest: RunManifest,
    identity_file: str,
    join: Sequence[str] = (),
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    join_timeout_s: float = 60.0,
    dht_timeout_s: float = 10.0,
    poll_s: float = 0.5,
    seed: int = 0,
    wait_peers: int = 0,
    fault: str = "",
    cert_file: str = "",
    attack: str = "",
    resume: EnginePart | None = None,
    ahead_s: float = AHEAD_S,
    tokens_per_step: int = 0,
    fixed_deadlines: bool = False,
) -> None:
    """The network process of a swarm node (see the module docstring).

    ``shared`` holds the initial global copies (written by the trainer). Before reporting
    ready it joins the swarm and catches up; the status then carries ``start_step``,
    ``peer_id`` and ``addrs``. ``fault`` is a test's fault injection
    (:func:`~atoll.node.net.faults.parse_fault`), ``attack`` a benchmark's or test's
    attack injection (:func:`~atoll.node.net.attacks.parse_attack`). ``resume`` is the
    engine part of the checkpoint the trainer resumed from (:mod:`atoll.node.snapshot`):
    the global copies, outer momentum and versions the node held when it stopped, and
    the certificate seals it kept. ``ahead_s``: how long before the trainer reaches a
    fragment's sync its group starts forming (:mod:`atoll.node.net.ahead`; at most half
    the matchmaking timeout; 0: never ahead). ``tokens_per_step``: the tokens of one
    inner step of the run's batch, which bounds every contribution's token weight
    (:func:`~atoll.protocol.sync.weight_cap`; 0: unbounded). ``fixed_deadlines``: every
    round waits the manifest's ``part_s`` and ``round_s`` instead of deadlines measured
    from the fragment's past rounds (:mod:`atoll.protocol.deadlines`).
    """
    if manifest.aggregation != "mean":
        raise ConfigError(
            f"aggregation {manifest.aggregation!r} runs in the simulator only; the swarm "
            "averages with 'mean'"
        )
    fault_hook = parse_fault(fault)
    hostile = parse_attack(attack)
    if hostile is not None:
        logger.warning("attack injection: this node runs the attack %r", attack)
    identity = load_or_create(identity_file)
    config = manifest.engine_config()
    engine = OuterEngine(
        config,
        Schedule(config.H, len(shared)),
        [shared.global_(p).copy() for p in range(len(shared))],
        seed=seed,
    )
    seals: list[list[str]] = []
    own_seals: list[str] = []
    if resume is not None:
        state, seals, own_seals = resume
        engine.load_state_dict(state)
        for p in range(len(shared)):
            shared.global_(p)[:] = engine.global_params(p)
        logger.info(
            "engine state resumed: versions %s", [engine.version(p) for p in range(len(shared))]
        )
    run_id = manifest.run_id()
    liveness = Liveness()
    host_config = HostConfig(listen=tuple(listen), dial_timeout_s=manifest.timeouts.dial_s)
    membership, certificate = load_membership(manifest, cert_file)  # atoll.node.settings
    signer = EnvelopeSigner(identity, certificate)
    verifier = EnvelopeVerifier(membership)  # records and attestations: members only
    async with (
        open_host(
            identity, run_id, host_config, membership=membership, certificate=certificate
        ) as host,
        AtollDHT.start(
            host.libp2p_host,
            run_id=run_id,
            verifier=verifier,
            signer=signer,
            clock=SystemClock(),
            timeout_s=dht_timeout_s,
            liveness=liveness,
        ) as dht,
        trio.open_nursery() as nursery,
    ):
        serve_status(host.libp2p_host, dht.value_store)
        serve_dialback(host.libp2p_host, wall=SystemClock().wall)
        node = _Node(
            shared,
            outbox,
            manifest,
            host,
            dht,
            engine,
            poll_s=poll_s,
            fault=fault_hook,
            background=nursery,
            liveness=liveness,
            signer=signer,
            verifier=verifier,
            attack=hostile,
            ahead_s=ahead_s,
            weight_cap=weight_cap(config.H, tokens_per_step),
            deadline_rule=None if fixed_deadlines else MEASURED,
        )
        if seals or own_seals:
            certified = node.restore_seals(seals, own_seals)
            logger.info("the checkpoint's seals certify %d fragment states again", certified)
        nursery.start_soon(node.mailbox.run)

        def on_suspect(peer: str, failures: int) -> None:
            # twice silent in a row: its connections may sit in TCP back-off after the
            # link heals; the next contact dials afresh
            if failures >= 2:
                nursery.start_soon(host.forget_peer, peer)

        liveness.on_suspect = on_suspect
        joined = await join_swarm(
            host, dht, join, timeout_s=join_timeout_s, dial_s=manifest.timeouts.dial_s
        )
        # the DHT's readers and writers start once the node is in: before, their lookups
        # could only dial the --join addresses (and py-libp2p logs every failed one)
        nursery.start_soon(node.evidence.run)
        nursery.start_soon(node.attester.run)
        await node.publisher.publish_once()
        if wait_peers:
            await node.peers.wait_for(wait_peers, join_timeout_s)
        start_step = await node.catch_up() if joined else 0
        node.syncer.step = start_step
        node.post(start_step=start_step, addrs=tuple(host.addrs), joined=joined)
        if join:
            nursery.start_soon(_check_reachability, node, host, join, DIALBACK_TIMEOUT_S)
        nursery.start_soon(node.publisher.run)
        nursery.start_soon(node.peers.watch, _PEERS_EVERY_S)
        nursery.start_soon(node.peers.watch_silent, node.probe, _PROBE_EVERY_S)
        nursery.start_soon(watch_certificates, node.syncer, len(shared), _CERTIFY_EVERY_S)
        nursery.start_soon(node.report)
        await serve(inbox, outbox, node.handle, node.settle, node.note_step, node.snapshot)
        await node.leave()
        node.post()
        nursery.cancel_scope.cancel()

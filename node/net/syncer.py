"""The driver of fragment syncs: carries out :class:`~atoll.protocol.sync.FragmentSync`'s
actions over the round drivers.

:class:`Syncer` holds what every sync of a node needs (its transport and mailbox, the
board of ready peers, the outer engine and the lock around it, the live peers, the
timeouts) and runs one sync at a time per fragment:

=========================  ===========================================================
the machine says           the driver does
=========================  ===========================================================
``FindGroup``              :func:`~atoll.node.net.rounds.run_matchmaking` at the slot
``RunRound``               :func:`~atoll.node.net.rounds.run_allreduce` in the group
``FetchState``             :func:`~atoll.node.net.rounds.fetch_pieces` from its holders
``SyncDone``               returns it
=========================  ===========================================================

Every event that makes the engine work (encode, outer step, import, digest) runs in a
worker thread under :attr:`Syncer.lock`, one engine call at a time, and is never
abandoned half-way (``trio.to_thread.run_sync`` waits for the thread). A driver that is
cancelled, or fails for a reason the machine did not foresee, aborts the sync: the
machine rolls it back exactly once.

Certified states. When the tracker holds beliefs
(:attr:`~atoll.node.net.peers.PeerTracker.beliefs`), each sync (and catch-up) first
looks up the certificates of the declared states that could change its choice
(:meth:`Syncer.certify`: the most held first, at most a few, a failed one not again for a
few seconds), and the machine follows believed states only. Each state is looked up in
the attestation board and, at the same time, asked of up to :data:`MAX_ASKED` responsive
peers that declare it (:func:`~atoll.node.net.rounds.ask_attestations`): its holders are
mostly the members that made it and keep their own attestation, and they answer as soon
as a link is up, while a DHT lookup may take many seconds to find records after a split
heals. Every source gets the answer bound (a peer that lets it pass is not asked again for
:data:`ASK_BACKOFF_S`); whatever comes back is checked seal by seal
(:meth:`~atoll.protocol.certificate.CertifiedStates.offer`), so a peer that answers with
forged or foreign seals makes nothing believed. The syncer answers such requests with
this node's own attestation of the state (``attested``) and the seals of a certificate
it checked (:meth:`Syncer.serve_request`). After a committed round the machine's
attestation goes to ``attest`` (the node seals and publishes it,
:class:`~atoll.node.net.publisher.AttestationPublisher`).

A version nobody can follow. A committed state needs the attestations of at least the
group quorum of its round's members before anyone else believes it. When a member goes
silent between the commit and its attestation (a pair's other member froze, say), the
others of its round may be too few to sign, and the rest of the swarm, one version
behind, can neither follow this node nor meet it at its slot. So after a committed round
of a group with no spare signer (no more members than the quorum: a pair, mostly), the
syncer keeps the state from before the round (:class:`_Unsure`: a second copy of one
fragment's state) until the new state is certified or replaced. Once it has gone
uncertified for :data:`FALL_BACK_AFTER_S`, its members are asked for their attestations;
when those that answer are fewer than the quorum needs, the fragment falls back to the
kept state (:meth:`Syncer.fall_back_if_uncertifiable`): the round is as if it had
failed, and this node meets the others at the earlier slot again. The trainer keeps
what it learned; only the shared global copy goes back. A member that settled and left
published its attestation first, so the board still holds it: the fall-back waits for
a board lookup that answered (one that ran out of time, on a busy machine or while the
DHT still dials the member that left, proves nothing), up to :data:`FALL_BACK_LATEST_S`.

Strikes and bans. With :attr:`Syncer.strikes` (the node's
:class:`~atoll.protocol.strikes.Strikes`), a round that failed naming a culprit strikes it
(``part``, or ``equivocation`` when the round says so; also a peer whose own abort
names its own part), matchmaking leaves banned peers
out, and the declarations a slot showed of banned peers are not followed.
:attr:`Syncer.tamper` is attack injection (benchmarks and tests): see
:class:`~atoll.protocol.sync.FragmentSync`.

State copies. A rebase copies the certified state from up to three of its holders at
once, piece by piece (:class:`~atoll.protocol.statefetch.StateFetch`, each piece checked
against its hash as it arrives; a donor silent for the answer bound is dropped and its
pieces asked of another, the whole copy bounded by ``round_s``). A donor whose piece or
piece list fails its check is struck (``state``). The syncer serves its own states the
same way: the encoding and piece hashes of a state are computed once, off the event
loop, and kept for the next joiners while the engine holds that state
(:data:`MAX_SOURCES` fragments at most). It also serves the state each fragment held
before its last applied round (one copy per fragment): a certificate reaches a joiner a
few seconds after the round it certifies, and in a swarm whose fragments move on every
few seconds the holders were often one round further by the time the joiner asked.
A node behind copies the state its next sync would rebase onto ahead of that sync
(:meth:`Syncer.prefetch`, asked by the certificate watcher): the sync imports the copy at
once, and the group formed ahead of it is formed at the copied state's slot.

Groups formed ahead. Matchmaking needs nothing of the trainer's Δ: the slot, version and
digest are the fragment's global copy, which does not change between two of its syncs,
and the step is the schedule's. :meth:`Syncer.prepare` (the node calls it a few seconds
before the trainer reaches a fragment's sync, :mod:`atoll.node.net.ahead`) runs that
matchmaking in the background, and the sync that follows takes its group instead of
forming one: a sync then costs the exchange alone, its announce, lookups, joins and group
list hidden behind training. The group is used only when the sync declares exactly what
was prepared (slot, version, digest and step; a sync that rebases onto the state copied
ahead declares it right after the import); otherwise (the sync rebased first, say)
this node tells the group's other members that it leaves it (an
:class:`~atoll.protocol.allreduce.Abort` of the round, which ends their round at once
rather than at its part deadline). A prepared matchmaking that ended alone before the
sync began is tried again by the sync; one still running is waited for.

It depends only on the seams of :mod:`atoll.node.net.seam`, so the same driver runs a
node's syncs over libp2p and a test's over :mod:`atoll.node.net.memory` under a fake
clock. It also answers peers' state requests (:meth:`Syncer.serve_request`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import trio

from atoll.node.net.peers import PeerTracker
from atoll.node.net.publisher import AttestationBoard
from atoll.node.net.rounds import (
    Mailbox,
    RoundTraffic,
    ask_attestations,
    fetch_pieces,
    run_allreduce,
    run_matchmaking,
    serve_attestations,
    serve_pieces,
    serve_state,
)
from atoll.node.net.seam import ReadyBoard, RoundTransport
from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import statefetch as sf
from atoll.protocol import statepieces as sp
from atoll.protocol import statesync as ss
from atoll.protocol import sync as fs
from atoll.protocol.certificate import (
    MAX_REPLY_SEALS,
    Attestation,
    AttestationRequest,
    AttestationSigner,
    AttestationVerifier,
)
from atoll.protocol.deadlines import DeadlineRule, RoundDeadlines
from atoll.protocol.engine import OuterEngine
from atoll.protocol.errors import AtollError
from atoll.protocol.held import Held, HeldPeers
from atoll.protocol.manifest import RobustSettings, Timeouts
from atoll.protocol.punctuality import Punctuality
from atoll.protocol.strikes import Strikes, reason_of_failure, self_accused

__all__ = [
    "ASK_BACKOFF_S",
    "MAX_ASKED",
    "MAX_SOURCES",
    "FaultHook",
    "Offload",
    "SyncReport",
    "Syncer",
    "answer_bound",
    "inline",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

CERTIFY_IN_SYNC_S = 0.5
"""how long a sync waits for certificate lookups before it plans or commits (the lookups
of states not found by then go on in the background watch; a sync that started late for
them would miss its group)"""

MAX_STEP_LAG_SYNCS = 4
"""How far apart (in H, the steps between two syncs of a fragment) the inner steps of two
groupmates may be: the peers of a swarm stay within about one sync interval of each other
(holds and jumps keep them there; a split's sides drift apart by their speed difference),
so a peer further away than this holds a schedule, learning rate and data position that
are not the swarm's (the matchmaker's "In step")."""
READY_TTL_SLACK_S = 10.0
"""a ready record lives 2 x matchmaking_s plus this"""

Offload = Callable[..., Awaitable[Any]]
"""``await offload(fn, *args)`` runs ``fn(*args)`` off the event loop and returns its result."""

REGULAR_ROUNDS = 4
"""A fragment's round uses measured deadlines only when every other member took part in
one of its last this many applied rounds here (else the manifest's). With one, a busy
three-node swarm whose slowest node sat out rounds waited out the manifest's 40 s when
a member froze; with four, a split shorter than four rounds of the fragment leaves the
other side among the last rounds' members (a heal's first round may run out at the
measured floor)."""

IN_TOUCH_S = 30.0
"""How long before a fragment's last applied round a peer must have been in unbroken
contact to count as regular without having taken part in the fragment's rounds
(:meth:`Syncer._regular`)."""

FALL_BACK_AFTER_S = 10.0
"""How long this node's committed state of a fragment may go uncertified, while fewer of
its round's members than the quorum still answer, before the fragment falls back to the
state before the round (a member's attestation goes out within a second or two of the
commit, so a state still uncertified this long after has lost a signer)"""

FALL_BACK_LATEST_S = 30.0
"""How long an uncertified state may wait for a board lookup that answers before the
fragment falls back anyway (the DHT may be unreachable for longer than a sync can wait)"""

MAX_ASKED = 4
"""Most peers asked directly for the attestations of one state per lookup."""

ASK_BACKOFF_S = 30.0
"""How long a peer that left an attestation request unanswered (within the answer bound)
is not asked again: a silent declarer of a state costs a sync one answer bound now and
then, not every time."""

MAX_SOURCES = 2
"""Most fragments whose served encoding (8 bytes per value) a node keeps for joiners."""

Attested = Callable[[int, int, str], bytes | None]
"""``(fragment, version, digest) -> this node's sealed attestation of it, or None``."""

FaultHook = Callable[[int, int, int], Callable[[str], None] | None]
"""``(fragment, slot, members) -> checkpoint or None``: fault injection for a round (tests)."""


def answer_bound(timeouts: Timeouts) -> float:
    """How long matchmaking waits for a silent leader: a quarter of its timeout, between
    1 and 5 s (a leader on a 40 ms link answers in well under a second, a busy one in a
    few)."""
    return max(1.0, min(5.0, timeouts.matchmaking_s / 4))


async def inline(fn: Callable[..., T], *args: Any) -> T:
    """An :data:`Offload` that runs ``fn`` in the event loop (after a checkpoint)."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


def _culprit(failed: ar.Failed) -> str | None:
    """The peer a failed round names as its cause: the one whose input this node
    rejected, or one whose own abort names its own part."""
    return failed.culprit or self_accused(failed.reason)


@dataclass(slots=True)
class SyncReport:
    """A finished sync and what its round moved (for the node's status)."""

    done: fs.SyncDone
    seconds: float
    traffic: RoundTraffic | None = None
    """set when an all-reduce ran"""
    ahead: bool = False
    """its group was formed ahead of the sync (:meth:`Syncer.prepare`)"""
    met_at: int = -1
    """the step at which the last group formed for this sync started it, as its other
    members stated (:attr:`~atoll.protocol.matchmaking.Formed.met_at`); -1: none formed"""


@dataclass(frozen=True, slots=True)
class _Unsure:
    """A fragment's committed state that is not certified yet, and the state before it."""

    attestation: Attestation
    """this node's attestation of the committed state (version, digest, members)"""
    before: ss.FragmentState
    """the fragment's state before the round, to fall back to"""
    since: float
    """when the round committed (trio's clock)"""


@dataclass(slots=True)
class _Ahead:
    """A matchmaking run ahead of fragment ``p``'s sync at ``step``."""

    step: int
    declaration: mm.Declaration
    seen: dict[str, tuple[int, str]] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)
    found: mm.Formed | mm.Alone | None = None
    ended_at: float = 0.0
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    hold_until: float | None = None
    """while its matchmaking waits with patience for peers due at the slot: until when"""
    started: trio.Event = field(default_factory=trio.Event)
    """set when the sync takes the group (or it is dropped): until then a leader holds
    the group open for the peers due at the slot"""
    dropped: bool = False
    """dropped already (:meth:`Syncer._drop_ahead`): its members were told once"""


@dataclass(slots=True)
class _Copied:
    """A fragment's state copied ahead of its sync (:meth:`Syncer.prefetch`)."""

    target: tuple[int, str]
    """its (version, digest), certified"""
    state: ss.FragmentState
    at_step: int
    """this node's inner step when the copy ended (the donors' step then is
    ``state.step``)"""


class Syncer:
    """Runs the syncs of one node (see the module docstring)."""

    def __init__(
        self,
        *,
        transport: RoundTransport,
        mailbox: Mailbox,
        board: ReadyBoard,
        engine: OuterEngine,
        peers: PeerTracker,
        run_id: str,
        timeouts: Timeouts,
        wall: Callable[[], float],
        poll_s: float = 0.5,
        on_change: fs.OnChange | None = None,
        fault: FaultHook | None = None,
        background: trio.Nursery | None = None,
        offload: Offload | None = None,
        attestations: AttestationBoard | None = None,
        attest: Callable[[Attestation], None] | None = None,
        robust: RobustSettings | None = None,
        strikes: Strikes | None = None,
        tamper: fs.Tamper | None = None,
        attested: Attested | None = None,
        signer: AttestationSigner | None = None,
        opener: AttestationVerifier | None = None,
        tamper_reduced: Callable[[bytes], bytes] | None = None,
        on_hold: Callable[[int, float], None] | None = None,
        weight_cap: float = math.inf,
        probe: Callable[[str], Awaitable[bool]] | None = None,
        deadline_rule: DeadlineRule | None = None,
    ) -> None:
        self.deadline_rule = deadline_rule
        """how a round's phase and round deadlines follow the fragment's past rounds
        (None: the manifest's fixed ``part_s`` and ``round_s``)"""
        self._deadlines: dict[int, RoundDeadlines] = {}
        self.probe = probe
        """asks a peer whether it answers (the liveness hears of the outcome): a peer due
        at a slot that never declared there is probed once the matchmaking ends, so that a
        killed peer, whose record outlives it, stops counting toward group sizes and
        quorums within seconds instead of when its record expires"""
        self._probing: set[str] = set()
        self.weight_cap = weight_cap
        """the largest token weight of any member's part (:func:`~atoll.protocol.sync.
        weight_cap`; ``inf``: none)"""
        self.signer = signer
        self.opener = opener
        """seal this node's parts and open the others' (both set: rounds with part checks
        are sealed, so a refused part is proven to every member)"""
        self.tamper_reduced = tamper_reduced
        """attack injection: this node as a hostile chunk owner (the attack benchmark)"""
        self.strikes = strikes
        """the node's strike ledger (None: nobody is struck or banned)"""
        self.tamper = tamper
        """attack injection: what this node sends instead of its contribution (tests)"""
        self.robust = robust if robust is not None else RobustSettings()
        """how chunk owners check and combine parts (the manifest's ``[robust]`` table)"""
        self.transport = transport
        self.mailbox = mailbox
        self.board = board
        self.engine = engine
        self.peers = peers
        self.run_id = run_id
        self.timeouts = timeouts
        self.wall = wall
        self.poll_s = poll_s
        self.on_change = on_change
        self.fault = fault
        self.background = background
        """a long-lived nursery where a round's last sends finish (see run_allreduce)"""
        self.offload: Offload = offload if offload is not None else trio.to_thread.run_sync
        """how engine work leaves the event loop (a worker thread; tests under a fake clock
        run it inline, since a clock that jumps while a thread works fires every timeout)"""
        self.attestations = attestations
        """where certificates are looked up (None: no lookups)"""
        self.attest = attest
        """called with this member's attestation after each committed round"""
        self.attested = attested
        """this node's own sealed attestation of a state, handed to peers that ask
        (:meth:`~atoll.node.net.publisher.AttestationPublisher.sealed_for`)"""
        self._asking: set[tuple[str, int, int, str]] = set()
        """(peer, fragment, version, digest) asked now: one request of each at a time"""
        self._looking: set[tuple[int, int, str]] = set()
        """(fragment, version, digest) looked up in the background while matching"""
        self._unanswered: dict[str, float] = {}
        """peers that left a request unanswered -> when they may be asked again"""
        self.lock = trio.Lock()
        """one engine call at a time"""
        self._sources: dict[int, sp.PieceSource] = {}
        """fragment -> the encoding served to joiners (newest last)"""
        self._previous: dict[int, tuple[tuple[int, str], ss.FragmentState]] = {}
        """fragment -> its (version, digest) and state before its last applied round
        (served to joiners too)"""
        self._source_lock = trio.Lock()
        self.step = 0
        """the newest inner step this node reported (handed to peers that copy a state)"""
        self.on_hold = on_hold
        """told ``(fragment, seconds)`` while a sync waits with patience for peers due at
        its slot, and ``(fragment, 0)`` when its matchmaking ends (the trainer waits
        meanwhile; see :func:`~atoll.node.net.rounds.run_matchmaking`)"""
        self._ahead: dict[int, _Ahead] = {}
        """fragment -> its matchmaking run ahead of its next sync (:meth:`prepare`)"""
        self._syncing: set[int] = set()
        """fragments with a sync in flight"""
        self._regulars: dict[int, collections.deque[tuple[float, frozenset[str]]]] = {}
        """fragment -> the members of its last applied rounds here (measured deadlines
        apply to rounds of these peers only)"""
        self.punctuality = Punctuality()
        """the peers due at slots that missed them lately (not waited for past the grace)"""
        self._made: dict[int, tuple[int, frozenset[str]]] = {}
        """per fragment: the version this node's last applied round made, and its members
        (their weights in the next round at that version are capped tighter)"""
        self._unsure: dict[int, _Unsure] = {}
        """fragment -> its committed state not yet certified, and the state before it"""
        self.fallbacks = 0
        """how many times a fragment fell back from a state nobody could certify"""
        self.held = HeldPeers()
        """where the peers said their trainers are held (:mod:`atoll.protocol.held`)"""
        self._steps: dict[str, int] = {}
        """peer -> the highest step it stated (declarations, matchmaking messages) at any
        slot seen here, or that a state copied from it carried: how far its trainer got
        at least"""
        self._holding: dict[int, object] = {}
        """fragment -> a token of its trainer hold in force (the peers are told of it
        once it lasts)"""
        self._told: set[int] = set()
        """fragments whose hold the peers were told of (they hear of its end too)"""
        self._copied: dict[int, _Copied] = {}
        """fragment -> the state its next sync would rebase onto, copied ahead of it
        (:meth:`prefetch`)"""
        self._copying: dict[int, tuple[tuple[int, str], trio.Event]] = {}
        """fragment -> the state being copied ahead of its sync, set when the copy ends"""
        self._fetching: dict[tuple[int, int, str], trio.Event] = {}
        """(fragment, version, digest) -> set when the copy of that state under way ends"""

    async def engine_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` (engine work) in a thread under :attr:`lock`."""
        async with self.lock:
            result: T = await self.offload(fn, *args)
        return result

    def _machine(self, p: int) -> fs.FragmentSync:
        beliefs = self.peers.beliefs
        return fs.FragmentSync(
            self.engine,
            p,
            peer_id=self.transport.peer_id,
            run_id=self.run_id,
            on_change=self.on_change,
            believes=None if beliefs is None else functools.partial(beliefs.believes, p),
            robust=self.robust.to_rule(),
            checks=self.robust.to_checks(),
            tamper=self.tamper,
            verify_owners=self.robust.verify_owners,
            sealed=self.sealed,
            weight_cap=self.weight_cap,
        )

    @property
    def sealed(self) -> bool:
        """Whether this node's rounds seal their parts: with part checks on (the
        manifest's ``[robust] checks``) and a signer and opener to do it, as every node of
        a run has."""
        return self.robust.checks and self.signer is not None and self.opener is not None

    def _banned(self, peer: str) -> bool:
        return self.strikes is not None and self.strikes.banned(peer)

    def _mine(self, p: int) -> tuple[int, str]:
        return self.engine.version(p), self.engine.digest(p)

    async def certify(
        self, p: int, extra: list[fs.Holding] | None = None, *, within: float | None = None
    ) -> tuple[int, str]:
        """Look up the certificates of the declared states of ``p`` that could change
        this node's choice, in the board and from the peers that declare them (see the
        module docstring); returns this node's own state. ``within``: give up on what is
        not found by then (a sync must not start late for it: the background watch,
        :mod:`atoll.node.net.certwatch`, keeps looking). Outside a sync, first settles
        this node's own uncertified state (:meth:`fall_back_if_uncertifiable`)."""
        if p not in self._syncing:
            await self.fall_back_if_uncertifiable(p)
        mine = await self.engine_call(self._mine, p)
        beliefs = self.peers.beliefs
        if beliefs is None:
            return mine
        declared = [*self.peers.declared(p), *(extra or [])]
        todo = beliefs.to_check(p, declared, now=trio.current_time(), mine=mine)
        if not todo:
            return mine
        # all states at once, each source within one answer bound: a state left without a
        # certificate is tried again after the beliefs' retry time
        if within is None or self.background is None:
            await self._certify_all(p, todo, declared)
            return mine
        # the lookups run to their own bounds in the background (a peer that does not
        # answer is then remembered as such); the sync waits for them only ``within``
        done = trio.Event()

        async def run() -> None:
            try:
                await self._certify_all(p, todo, declared)
            finally:
                done.set()

        self.background.start_soon(run)
        with trio.move_on_after(within):
            await done.wait()
        return mine

    async def fall_back_if_uncertifiable(self, p: int) -> bool:
        """Fall back from fragment ``p``'s committed state when nobody can certify it (see
        the module docstring); whether it fell back. Forgets the kept state once the
        committed one is believed or replaced."""
        unsure = self._unsure.get(p)
        beliefs = self.peers.beliefs
        if unsure is None or beliefs is None:
            return False
        att = unsure.attestation
        state = (att.version, att.digest)
        mine = await self.engine_call(self._mine, p)
        if mine != state or beliefs.believes(p, *state):
            self._unsure.pop(p, None)
            return False
        now = trio.current_time()
        if now - unsure.since < FALL_BACK_AFTER_S or p in self._syncing or p in self._ahead:
            return False
        # its members are asked for their attestations (and the board looked at): one
        # that does not answer within the bound cannot sign it either
        own = self.attested(p, *state) if self.attested is not None else None
        seals = [own] if own is not None else []
        bound = answer_bound(self.timeouts)
        board = await self._certify_state(p, *state, self._signers(att), bound, seals)
        if beliefs.believes(p, *state):
            self._unsure.pop(p, None)
            return False
        if len(self._signers(att)) + 1 >= beliefs.quorum:
            return False  # enough of the round's members answer: their attestations may come
        if not board and now - unsure.since < FALL_BACK_LATEST_S:
            # the board did not answer in time: a member that left published its
            # attestation there before it went, so look again at the next turn
            logger.info(
                "fragment %d: version %d still uncertified; the board did not answer"
                " within %.1f s: looking again before falling back",
                p,
                state[0],
                bound,
            )
            return False
        if p in self._syncing or p in self._ahead:  # began meanwhile: at the next turn
            return False
        fell = await self.engine_call(self._fall_back, p, unsure, trio.current_time())
        self._unsure.pop(p, None)
        return fell

    def uncertified(self) -> list[int]:
        """The fragments whose committed state this node keeps a fall-back for: not
        certified yet, and a lost signer would send them back (see the module
        docstring)."""
        return sorted(self._unsure)

    def _signers(self, att: Attestation) -> list[str]:
        """The members of ``att``'s round other than this node that may still sign it:
        neither silent nor left an attestation request unanswered lately."""
        me = self.transport.peer_id
        liveness = self.peers.liveness
        now = trio.current_time()
        return [
            m for m in att.members if m != me and not liveness.silent(m) and self._may_ask(m, now)
        ]

    def _fall_back(self, p: int, unsure: _Unsure, now: float) -> bool:
        """Put fragment ``p`` back to the state before its uncertified round (engine
        lock held, off the event loop: ``now`` is trio's clock), unless it changed
        meanwhile."""
        att = unsure.attestation
        if not fs.fall_back(self.engine, p, unsure.before, (att.version, att.digest)):
            return False
        self.fallbacks += 1
        logger.warning(
            "fragment %d: version %d (%s) is still uncertified %.0f s after its round, and"
            " too few of its members answer to sign it (%s): back to version %d",
            p,
            att.version,
            att.digest[:12],
            now - unsure.since,
            ", ".join(m for m in att.members if m != self.transport.peer_id) or "none",
            unsure.before.version,
        )
        if self.on_change is not None:
            self.on_change(p, "fall back")
        return True

    def _held_before(self, p: int) -> tuple[tuple[int, str], ss.FragmentState]:
        """Fragment ``p``'s (version, digest) and a copy of its state, before a round
        changes it (engine lock held)."""
        return self._mine(p), self._kept(p)

    def _kept(self, p: int) -> ss.FragmentState:
        """A copy of fragment ``p``'s state that later rounds do not change (engine lock
        held)."""
        state = self.engine.export_fragment(p, self.step)
        return dataclasses.replace(state, momentum=state.momentum.copy())

    def _certify_soon(self, p: int, holdings: list[fs.Holding], mine: tuple[int, str]) -> None:
        """Look up, in the background, the certificates of the states in ``holdings``
        that could change this node's choice and are not being looked up already."""
        beliefs = self.peers.beliefs
        if beliefs is None or self.background is None:
            return
        todo = [
            s
            for s in beliefs.to_check(p, holdings, now=trio.current_time(), mine=mine)
            if (p, *s) not in self._looking
        ]
        if not todo:
            return
        keys = [(p, *s) for s in todo]
        self._looking.update(keys)

        async def run() -> None:
            try:
                await self._certify_all(p, todo, holdings)
            finally:
                self._looking.difference_update(keys)

        self.background.start_soon(run)

    async def _certify_all(
        self, p: int, todo: Sequence[tuple[int, str]], declared: list[fs.Holding]
    ) -> None:
        bound = answer_bound(self.timeouts)
        async with trio.open_nursery() as nursery:
            for version, digest in todo:
                holders = self._holders(declared, version, digest)
                nursery.start_soon(self._certify_state, p, version, digest, holders, bound)

    def _may_ask(self, peer: str, now: float) -> bool:
        """Whether ``peer`` may be asked for attestations: it left none unanswered within
        the last :data:`ASK_BACKOFF_S`, or it went silent and answers again since (a cut
        or split that healed: its answers are what the rebase after the heal waits for)."""
        until = self._unanswered.get(peer)
        if until is None or until <= now:
            return True
        back = self.peers.liveness.returned_at(peer)
        return back is not None and back >= until - ASK_BACKOFF_S

    def _holders(self, declared: list[fs.Holding], version: int, digest: str) -> list[str]:
        """Up to :data:`MAX_ASKED` responsive peers, in random order, that declare
        ``(version, digest)``: not this node, not a banned or silent one, nor one that
        left a request unanswered within the last :data:`ASK_BACKOFF_S`."""
        me = self.transport.peer_id
        liveness = self.peers.liveness
        now = trio.current_time()
        holders = sorted(
            {
                peer
                for peer, v, d in declared
                if (v, d) == (version, digest)
                and peer != me
                and not self._banned(peer)
                and not liveness.silent(peer)
                and self._may_ask(peer, now)
            }
        )
        random.shuffle(holders)  # a crowd of liars does not always take every turn
        return holders[:MAX_ASKED]

    async def _certify_state(
        self,
        p: int,
        version: int,
        digest: str,
        holders: list[str],
        bound: float,
        seals: Sequence[bytes] = (),
    ) -> bool:
        """The board's and ``holders``' attestations of one state (with ``seals``, held
        already), offered to the beliefs as they come; the rest are called off once a
        certificate is found. Whether the board answered within ``bound`` (or a
        certificate was found before it did)."""
        beliefs = self.peers.beliefs
        assert beliefs is not None
        seals = list(seals)
        board = [self.attestations is None]

        def got(more: Sequence[bytes]) -> None:
            seals.extend(more)
            if beliefs.offer(p, version, digest, seals, now=trio.current_time()) is not None:
                board[0] = True
                nursery.cancel_scope.cancel()

        def answered(more: Sequence[bytes]) -> None:
            board[0] = True
            got(more)

        async with trio.open_nursery() as nursery:
            if self.attestations is not None:
                nursery.start_soon(self._look_up, p, version, digest, bound, answered)
            for peer in holders:
                nursery.start_soon(self._ask, peer, p, version, digest, bound, got)
        beliefs.offer(p, version, digest, seals, now=trio.current_time())
        return board[0]

    async def _look_up(
        self,
        p: int,
        version: int,
        digest: str,
        bound: float,
        got: Callable[[Sequence[bytes]], None],
    ) -> None:
        assert self.attestations is not None
        with trio.move_on_after(bound):
            try:
                records = await self.attestations.find_attestations(p, version)
            except AtollError as e:
                logger.debug("fragment %d version %d: no attestations: %s", p, version, e)
                return
            got([r.attestation for r in records if (r.version, r.digest) == (version, digest)])

    async def _ask(
        self,
        peer: str,
        p: int,
        version: int,
        digest: str,
        bound: float,
        got: Callable[[Sequence[bytes]], None],
    ) -> None:
        key = (peer, p, version, digest)
        if key in self._asking:  # another lookup is asking it already
            return
        self._asking.add(key)
        try:
            seals = await ask_attestations(
                self.transport,
                self.mailbox,
                peer,
                self.run_id,
                p,
                version,
                digest,
                timeout_s=bound,
            )
        except AtollError as e:
            logger.debug("fragment %d version %d: %s sent no attestations: %s", p, version, peer, e)
            now = trio.current_time()
            self._unanswered = {q: t for q, t in self._unanswered.items() if t > now}
            self._unanswered[peer] = now + ASK_BACKOFF_S
            return
        finally:
            self._asking.discard(key)
        got(seals)

    def _attested(self, machine: fs.FragmentSync) -> None:
        if machine.attestation is not None and self.attest is not None:
            self.attest(machine.attestation)

    # -- a sync ------------------------------------------------------------------------------
    async def sync(self, p: int, local: np.ndarray, step: int) -> SyncReport:
        """One sync of fragment ``p`` from the trainer's ``local`` copy at ``step``."""
        t0 = trio.current_time()
        self.step = max(self.step, step)
        machine = self._machine(p)
        report = SyncReport(fs.SyncDone(p, step, False, -1, "", "none"), 0.0)
        await self.fall_back_if_uncertifiable(p)
        self._syncing.add(p)
        ahead = self._ahead.pop(p, None)
        try:
            await self.engine_call(machine.begin, local, step)
            mine = await self.certify(p, within=CERTIFY_IN_SYNC_S)
            holdings = self.peers.holdings(p, mine)
            plan = functools.partial(machine.plan, holdings, wall_now=self.wall())
            action = await self.engine_call(plan)
            if ahead is not None and (unfit := self._unfit(ahead, action, step)):
                self._drop_ahead(p, ahead, unfit)
                ahead = None
            elif ahead is not None:
                ahead.step = step
            report.done = await self._drive(machine, action, report, ahead=ahead, t0=t0)
        except BaseException as e:
            if ahead is not None:
                self._drop_ahead(p, ahead, "its sync was cancelled")
            await self._abort(machine, e)
            raise
        finally:
            self._syncing.discard(p)
            self._forget_copied(p)
            self._attested(machine)
        report.seconds = round(trio.current_time() - t0, 3)
        return report

    async def catch_up(self, p: int) -> fs.SyncDone:
        """Copy fragment ``p``'s leading state when the live records show it is not this
        node's (a node that starts); a SyncDone with ``rebased`` set when it did."""
        machine = self._machine(p)
        mark = p not in self._syncing  # a copy ahead (prefetch) leaves the fragment alone
        self._syncing.add(p)
        try:
            mine = await self.certify(p)
            holdings = self.peers.holdings(p, mine)
            action = await self.engine_call(machine.catch_up, holdings, self.step)
            return await self._drive(machine, action, None)
        except BaseException as e:
            await self._abort(machine, e)
            raise
        finally:
            if mark:
                self._syncing.discard(p)

    async def catch_up_all(self, patience_s: float | None = None) -> list[fs.SyncDone]:
        """:meth:`catch_up` every fragment (the peers' records read first); the syncs that
        rebased, in order.

        A swarm may move a fragment on just before this node looks: its records then
        declare a version whose members have not published their attestations yet, and
        the version before it is no longer declared by anyone. While a responsive peer
        declares a newer version of a fragment than this node holds, it looks again
        once a second, for at most ``patience_s`` (by default two lookup retry periods
        and an answer bound: a failed lookup is repeated only after the retry period).
        A claim that never gets its certificate costs this wait once, not the run.
        """
        if patience_s is None:
            beliefs = self.peers.beliefs
            retry = beliefs.retry_s if beliefs is not None else 1.0
            patience_s = 2 * retry + answer_bound(self.timeouts)
        deadline = trio.current_time() + patience_s
        rebased: list[fs.SyncDone] = []
        todo = list(range(self.engine.num_fragments))
        while True:
            for p in todo:
                done = await self.catch_up(p)
                if done.rebased:
                    rebased.append(done)
            todo = [p for p in todo if await self._declared_ahead(p)]
            if not todo or trio.current_time() >= deadline:
                if todo:
                    logger.info(
                        "fragments %s: peers declare newer versions not certified within %.0f s;"
                        " the syncs catch up later",
                        todo,
                        patience_s,
                    )
                return rebased
            await trio.sleep(min(1.0, max(0.0, deadline - trio.current_time())))
            await self.peers.refresh()

    async def _declared_ahead(self, p: int) -> bool:
        """Whether a responsive peer declares a newer version of ``p`` than this node's."""
        version, _ = await self.engine_call(self._mine, p)
        return any(v > version for _, v, _ in self.peers.declared(p))

    async def _abort(self, machine: fs.FragmentSync, error: BaseException) -> None:
        """Roll ``machine`` back after its driver failed or was cancelled: shielded, so a
        cancelled driver still waits its turn at the engine (a quick skip)."""
        reason = (
            "cancelled" if isinstance(error, trio.Cancelled) else f"{type(error).__name__}: {error}"
        )
        with trio.CancelScope(shield=True):
            async with self.lock:
                machine.abort(reason)

    async def _drive(
        self,
        machine: fs.FragmentSync,
        action: fs.Action,
        report: SyncReport | None,
        *,
        ahead: _Ahead | None = None,
        t0: float = 0.0,
    ) -> fs.SyncDone:
        seen: dict[str, tuple[int, str]] = {}
        while True:
            if isinstance(action, fs.SyncDone):
                return action
            if isinstance(action, fs.FindGroup):
                if ahead is not None and (unfit := self._unfit(ahead, action, ahead.step)):
                    self._drop_ahead(machine.fragment, ahead, unfit)  # after a rebase
                    ahead = None
                found = await self._ahead_group(ahead, seen, t0) if ahead is not None else None
                if report is not None and found is not None:
                    report.ahead = True
                ahead = None  # the first FindGroup only
                if found is None:
                    found = await self._find_group(
                        machine, action.declaration, seen, only_if_present=action.only_if_present
                    )
                if report is not None and isinstance(found, mm.Formed):
                    report.met_at = found.met_at
                holdings = await self._holdings(machine.fragment, seen)
                own_cap = self._recent_caps(machine).get(self.transport.peer_id, math.inf)
                matched = functools.partial(machine.matched, weight_cap=own_cap)
                action = await self.engine_call(matched, found, holdings)
                self._log_slot(action, machine, seen)
            elif isinstance(action, fs.RunRound):
                traffic = RoundTraffic()
                phase_s, round_s = self.round_deadlines(machine.fragment, action.spec.members)
                began = trio.current_time()
                result = await run_allreduce(
                    self.transport,
                    self.mailbox,
                    action.spec,
                    action.payload,
                    action.weight,
                    phase_timeout_s=phase_s,
                    round_timeout_s=round_s,
                    traffic=traffic,
                    checkpoint=self._checkpoint(action.spec),
                    background=self.background,
                    liveness=self.peers.liveness,
                    signer=self.signer,
                    opener=self.opener,
                    tamper_reduced=self.tamper_reduced,
                    weight_caps=self._recent_caps(machine),
                )
                if report is not None:
                    report.traffic = traffic
                self._measured(machine.fragment, result, traffic, phase_s, round_s)
                if isinstance(result, ar.Done):
                    regular = self._regulars.setdefault(
                        machine.fragment, collections.deque(maxlen=REGULAR_ROUNDS)
                    )
                    regular.append((trio.current_time(), frozenset(action.spec.members)))
                if isinstance(result, ar.Failed) and self.strikes is not None:
                    self._strike(action.spec.key, result)
                    banned = self._banned_member(action.spec.members, result)
                    if banned is not None and machine.may_regroup:
                        logger.info(
                            "fragment %d slot %d: the round failed on banned member %s's "
                            "fault; seeking the slot's group again without it",
                            machine.fragment,
                            action.spec.key.round,
                            banned[-6:],
                        )
                        action = await self.engine_call(machine.regroup, self.wall())
                        continue
                holdings = await self._holdings(machine.fragment, seen)
                members = action.spec.members
                action_round = action.spec.key.round
                held = None
                if isinstance(result, ar.Done):
                    held = await self.engine_call(self._held_before, machine.fragment)
                action = await self.engine_call(machine.reduced, result, holdings)
                if machine.round_status == "applied":
                    self.remember_made(machine.fragment, action_round + 1, members)
                if held is not None and machine.round_status == "applied":
                    self._previous[machine.fragment] = held
                    beliefs = self.peers.beliefs
                    if (
                        beliefs is not None
                        and len(members) <= beliefs.quorum
                        and machine.attestation is not None
                    ):  # no spare signer: one lost before it attests leaves no certificate
                        self._unsure[machine.fragment] = _Unsure(
                            machine.attestation, held[1], trio.current_time()
                        )
                self._log_slot(action, machine, seen, took=trio.current_time() - began)
            else:
                action = await self._fetch(machine, action)

    # -- deadlines -------------------------------------------------------------------------
    def round_deadlines(self, p: int, members: Sequence[str] | None = None) -> tuple[float, float]:
        """The phase and round deadlines of fragment ``p``'s next all-reduce: measured
        from its past rounds (:mod:`atoll.protocol.deadlines`) when :attr:`deadline_rule`
        is set, else the manifest's ``part_s`` and ``round_s``. With the round's
        ``members``: the manifest's too when one of them is not *regular* here
        (:meth:`_regular`): a healed split's other side, a node back from a cut or a
        restart, whose sync may start seconds apart from the others' and whose first
        rounds run beside the state copies of the catch-up, which the measured rounds
        never saw. After a 3|1 and a 2|2 heal in the faults benchmark, first rounds of all
        four ran out at the measured 3 s floor so, the sides never having seen each other
        go silent."""
        fixed = self.timeouts.part_s, self.timeouts.round_s
        if self.deadline_rule is None:
            return fixed
        if members is not None:
            me = self.transport.peer_id
            if any(m != me and not self._regular(p, m) for m in members):
                return fixed
        tracker = self._deadlines.get(p)
        if tracker is None:
            tracker = RoundDeadlines(
                self.timeouts.part_s, self.timeouts.round_s, self.deadline_rule
            )
            self._deadlines[p] = tracker
        return tracker.current()

    def _regular(self, p: int, peer: str) -> bool:
        """Whether ``peer``'s rounds of fragment ``p`` are like those measured here: it
        took part in the fragment's last :data:`REGULAR_ROUNDS` applied rounds here since
        it last answered again after a silence; or this node has been in unbroken touch
        with it (:meth:`Liveness.in_touch_since`) from at least :data:`IN_TOUCH_S` seconds
        before the fragment's last applied round here until after it. The second case is
        a slow peer that kept falling behind and copying states (under load, a node of
        three that sat out every round): had it counted as back from a split, its first
        round with a member that froze would have waited out the manifest's deadlines."""
        liveness = self.peers.liveness
        back = liveness.returned_at(peer) if liveness is not None else None
        rounds = self._regulars.get(p, ())
        if any(peer in members and (back is None or at >= back) for at, members in rounds):
            return True
        if liveness is None or not rounds:
            return False
        since, heard = liveness.in_touch_since(peer), liveness.heard_at(peer)
        last = rounds[-1][0]
        return since is not None and heard is not None and since + IN_TOUCH_S <= last <= heard

    def _measured(
        self,
        p: int,
        result: ar.Done | ar.Failed,
        traffic: RoundTraffic,
        phase_s: float,
        round_s: float,
    ) -> None:
        """Teach fragment ``p``'s deadlines what its round took, or that it ran out."""
        tracker = self._deadlines.get(p)
        if tracker is None:
            return
        if isinstance(result, ar.Done):
            tracker.done(traffic.parts_in_s, traffic.done_s)
        elif result.missing:  # a deadline ran out (a silent member, or a slow link)
            tracker.timed_out(phase_s, round_s, parts_in=traffic.parts_in_s is not None)
            if min(phase_s, round_s) < min(self.timeouts.part_s, self.timeouts.round_s):
                logger.info(
                    "fragment %d: the round ran out at its measured deadline (%.1f s phase,"
                    " %.1f s round); the next deadlines are wider until a round ends well",
                    p,
                    phase_s,
                    round_s,
                )

    # -- groups formed ahead of a sync ---------------------------------------------------------
    def prepare(self, p: int, step: int) -> bool:
        """Start forming the group of fragment ``p``'s sync at ``step`` now, in the
        background (see the module docstring); False when nothing was started (one runs or
        ran for that step already, a sync of ``p`` is in flight, or there is no
        background nursery). A matchmaking prepared for another step is dropped, unless it
        declared the slot and state this sync declares (the trainer jumped or moved on the
        way to it): the sync at ``step`` then takes that group. Dropping it would end the
        round its members formed with this node at that slot, which they may not form
        again in time (after a cut, the returning node so cost its peers one fragment's
        round and missed the next one itself)."""
        old = self._ahead.get(p)
        if self.background is None or p in self._syncing or (old is not None and old.step == step):
            return False
        version, digest = self._declares(p)
        if old is not None:
            same = (old.declaration.slot, old.declaration.version, old.declaration.digest)
            live = not old.done.is_set() or isinstance(old.found, mm.Formed)
            if same == (version, version, digest) and live:
                logger.debug("fragment %d: the group formed ahead moves to step %d", p, step)
                old.step = step
                return False
            self._drop_ahead(p, old, "another sync step is due")
        me = mm.Declaration(
            self.run_id, p, version, self.transport.peer_id, version, digest, 0.0, self.wall(), step
        )
        ahead = _Ahead(step, me)
        self._ahead[p] = ahead
        self.background.start_soon(self._run_ahead, p, ahead)
        return True

    def passed(self, step: int) -> None:
        """The trainer is at ``step``: drop the groups formed ahead for syncs it went past
        without starting them (it jumped), telling their members at once. Two steps of
        margin: a sync's start reaches this process before the trainer's next notes."""
        for p, ahead in list(self._ahead.items()):
            if ahead.step + 2 < step:
                self._drop_ahead(p, ahead, "the trainer went past its sync step")

    def drop_ahead(self, why: str) -> None:
        """Drop every group formed ahead (the trainer stopped: no sync will take them),
        telling their members at once."""
        for p, ahead in list(self._ahead.items()):
            self._drop_ahead(p, ahead, why)

    def prepared(self, p: int) -> int | None:
        """The step of the sync of ``p`` whose group is being (or was) formed ahead."""
        ahead = self._ahead.get(p)
        return None if ahead is None else ahead.step

    async def _run_ahead(self, p: int, ahead: _Ahead) -> None:
        with ahead.scope:
            try:
                # the machine is idle: the declaration made ahead is checked against the
                # swarm's copy on its own (a lost copy leaves the slot at once, and the
                # sync's own plan then copies the winner instead of waiting out this
                # matchmaking's patience), and nothing is held
                ahead.found = await self._find_group(
                    self._machine(p),
                    ahead.declaration,
                    ahead.seen,
                    hold=functools.partial(self._hold_ahead, ahead),
                    open_until=ahead.started,
                )
            finally:
                ahead.ended_at = trio.current_time()
                ahead.done.set()

    def _hold_ahead(self, ahead: _Ahead, seconds: float) -> None:
        """Matchmaking ahead waits with patience (``seconds`` > 0) or stopped (0): noted,
        and passed to the trainer only once the sync takes the group (it is not held
        before its sync step). A stop after the sync took the group lets the trainer go
        at once (the peers it waited for are held elsewhere, or matchmaking ended)."""
        held = ahead.hold_until is not None
        ahead.hold_until = trio.current_time() + seconds if seconds > 0 else None
        if seconds <= 0 and held and ahead.started.is_set():
            self._hold(ahead.declaration.fragment, 0.0)

    def _unfit(self, ahead: _Ahead, action: fs.Action, step: int) -> str:
        """Why the sync's first action does not take what ``ahead`` prepared ("" when it
        does): the reason its members are told. A rebase onto the state copied ahead,
        which the group was formed at, takes it (the sync looks for a group at that
        state right after the import)."""
        d = ahead.declaration
        if isinstance(action, fs.FetchState):
            kept = self._copied.get(d.fragment)
            if kept is not None and kept.target == action.target == (d.version, d.digest):
                return ""
        if not isinstance(action, fs.FindGroup):
            return "its sync did not look for a group (it was behind or alone)"
        if action.only_if_present:
            return "its sync only joins a group already there"
        # a sync at another step than the one foreseen (the trainer landed behind the
        # swarm, or the pace was misread) takes the group all the same when it declares
        # the same slot and state, as :meth:`prepare` lets the group follow its node:
        # dropping it failed its members' round for nothing (a busy three-node swarm
        # lost one round in ten so)
        if mm.compat_key(ahead.declaration) != mm.compat_key(action.declaration):
            if ahead.step != step:
                return f"its sync came at step {step}, not {ahead.step}, with another state"
            return "its sync declared another state"
        return ""

    async def _ahead_group(
        self, ahead: _Ahead, seen: dict[str, tuple[int, str]], t0: float
    ) -> mm.Formed | mm.Alone | None:
        """The group ``ahead`` formed (waiting for its matchmaking, which is bounded by
        its own deadline), or None when the sync should look again itself: it ended
        alone before the sync began. While it waits with patience the trainer is held, as
        a sync's own matchmaking holds it."""
        p = ahead.declaration.fragment
        ahead.started.set()  # a leader holding the group open forms it now
        held = self.on_hold is not None and ahead.hold_until is not None
        if held:
            assert ahead.hold_until is not None
            self._hold(p, max(0.0, ahead.hold_until - trio.current_time()))
        try:
            await ahead.done.wait()
        finally:
            if held:
                self._hold(p, 0.0)
        seen.update(ahead.seen)
        found = ahead.found
        if found is None or (isinstance(found, mm.Alone) and ahead.ended_at < t0):
            return None
        return found

    def _drop_ahead(self, p: int, ahead: _Ahead, why: str) -> None:
        """Stop ``ahead``'s matchmaking; when it formed a group, tell the other members that
        this node leaves it (their round fails at once instead of at its deadline)."""
        if self._ahead.get(p) is ahead:
            del self._ahead[p]
        if ahead.dropped:  # a sync that dropped it and then failed: told once is enough
            return
        ahead.dropped = True
        ahead.started.set()
        ahead.scope.cancel()
        found = ahead.found
        if not isinstance(found, mm.Formed) or self.background is None:
            return
        me = self.transport.peer_id
        d = ahead.declaration
        logger.info("fragment %d: leaving the group formed ahead at slot %d: %s", p, d.slot, why)
        abort = ar.Abort.carrying(found.key, me, f"left the group formed ahead: {why}")
        for peer in found.members:
            if peer != me:
                self.background.start_soon(self._send_quietly, peer, abort)

    async def _send_quietly(self, peer: str, msg: object) -> None:
        try:
            await self.transport.send(peer, msg)
        except AtollError as e:
            logger.debug("telling %s failed: %s", peer, e)

    def remember_made(self, fragment: int, version: int, members: Iterable[str]) -> None:
        """This node applied the round of ``members`` that made ``fragment``'s
        ``version``: in the next round at that version their weights, this node's own
        among them, are capped by :func:`~atoll.protocol.sync.recent_member_cap`. A node
        resumed from a checkpoint says it again from its own attestation of the state it
        holds: its groupmates of that round cap its weight by the same rule, and a weight
        it did not clip would fail every round it joins."""
        self._made[fragment] = (int(version), frozenset(members))

    def _recent_caps(self, machine: fs.FragmentSync) -> dict[str, float]:
        """The weight caps of the members of the round that made the version ``machine``'s
        sync starts from, when this node applied that round (see
        :func:`~atoll.protocol.sync.recent_member_cap`); empty otherwise."""
        made = self._made.get(machine.fragment)
        request = machine.request
        if made is None or request is None or made[0] != request.round:
            return {}
        cap = fs.recent_member_cap(self.weight_cap)
        return {} if math.isinf(cap) else dict.fromkeys(made[1], cap)

    def _banned_member(self, members: Sequence[str], failed: ar.Failed) -> str | None:
        """The member of a failed round whose fault failed it and whom this node has
        banned now (on the proof its abort carried), or None."""
        culprit = _culprit(failed)
        me = self.transport.peer_id
        if culprit and culprit != me and culprit in members and self._banned(culprit):
            return culprit
        return None

    def _strike(self, key: ar.RoundKey, failed: ar.Failed) -> None:
        """Strike the culprit of a failed round: the peer whose part this node rejected,
        or one whose own abort names its own part (see :mod:`atoll.protocol.strikes`)."""
        assert self.strikes is not None
        culprit = _culprit(failed)
        if culprit and culprit != self.transport.peer_id:
            self.strikes.strike(
                culprit,
                reason_of_failure(failed.reason),
                f"fragment {key.fragment} round {key.round}: {failed.reason[:200]}",
            )

    async def _find_group(
        self,
        machine: fs.FragmentSync,
        me: mm.Declaration,
        seen: dict[str, tuple[int, str]],
        *,
        only_if_present: bool = False,
        hold: Callable[[float], None] | None = None,
        open_until: trio.Event | None = None,
    ) -> mm.Formed | mm.Alone:
        """Matchmaking for ``me``'s slot. ``only_if_present`` (a slot the sync moved to
        after a rebase, see :class:`~atoll.protocol.sync.FindGroup`): no patience and no
        hold of the trainer, and the node leaves the slot when nobody else has declared
        it within the answer bound. ``hold``: instead of :attr:`on_hold` (a group formed
        ahead of the sync, whose trainer is not held before its sync step).
        ``open_until``: a group formed ahead of the sync (see
        :func:`~atoll.node.net.rounds.run_matchmaking`); ``me`` was declared before the
        sync began and the machine is idle, so the check for a lost copy compares ``me``
        itself."""

        def on_view(decls: list[mm.Declaration]) -> None:
            for d in decls:
                if d.peer_id != self.transport.peer_id:
                    seen[d.peer_id] = (d.version, d.digest)
                    self.peers.saw(d.peer_id)
                    self._saw_step(d.peer_id, d.step)

        def outdated() -> str | None:
            # the certificates known now; the states not believed yet are looked up in
            # the background (once at a time), so a view costs no round trip
            mine = (me.version, me.digest)
            known = self._known(me.fragment, seen)
            self._certify_soon(me.fragment, known, mine)
            believed = self.peers.believed(me.fragment, known, mine)
            ahead = open_until is not None  # declared before the sync: compare ``me``
            lead = machine.outdated(believed, declared=mine if ahead else None)
            if lead is None:
                return None
            return f"the swarm follows version {lead[0]} ({lead[1][:12]}), not this one"

        matchmaking_s = self.timeouts.matchmaking_s
        if hold is None and self.on_hold is not None and not only_if_present:
            hold = functools.partial(self._hold, me.fragment)

        def comes_later(peer: str) -> str | None:
            if self.held.elsewhere(peer, me.fragment, now=trio.current_time()):
                return "held at another fragment's slot"
            step = self._steps.get(peer, -1)
            if 0 <= me.step <= step:
                return f"at step {step} already"
            return None

        found = await run_matchmaking(
            self.transport,
            self.mailbox,
            self.board,
            me,
            self.peers.group_settings,
            timeout_s=matchmaking_s,
            ttl_s=2 * matchmaking_s + READY_TTL_SLACK_S,
            wall=self.wall,
            poll_s=self.poll_s,
            view=on_view,
            background=self.background,
            answer_s=answer_bound(self.timeouts),
            liveness=self.peers.liveness,
            patience_s=0.0 if only_if_present else matchmaking_s,
            expected=None
            if only_if_present
            else functools.partial(self._expected_in_time, me.fragment, me.version),
            banned=self._banned if self.strikes is not None else None,
            outdated=outdated,
            hold=hold,
            alone_unless_seen_s=answer_bound(self.timeouts) if only_if_present else None,
            open_until=open_until,
            comes_later=comes_later,
            stated=self._saw_step,
            step_period=self.engine.config.H,
            max_step_lag=MAX_STEP_LAG_SYNCS * self.engine.config.H,
            private=self.peers.private,
        )
        came = found.members if isinstance(found, mm.Formed) else ()
        self._probe_absent(me, seen, came)
        if isinstance(found, mm.Formed) and not only_if_present:
            self._note_punctuality(me, found.members)
        return found

    def _expected_in_time(self, fragment: int, version: int) -> list[str]:
        """The peers due at ``fragment``'s slot of ``version`` that a leader waits for
        and a trainer is held for: the late ones left out (see
        :mod:`~atoll.protocol.punctuality`)."""
        return self.punctuality.keep(
            fragment, self.peers.expected(fragment, version), self.peers.liveness.returned_at
        )

    def _note_punctuality(self, me: mm.Declaration, members: Sequence[str]) -> None:
        """The group of ``me``'s slot formed with ``members``: a peer due there that is
        not among them missed it."""
        due = [p for p in self.peers.expected(me.fragment, me.version) if p != me.peer_id]
        ended = self.punctuality.ended(
            me.fragment,
            due,
            members,
            now=trio.current_time(),
            returned_at=self.peers.liveness.returned_at,
        )
        for peer in ended:
            logger.info(
                "fragment %d slot %d: peer %s missed the fragment's last %d slots though due "
                "there; not waited for past the grace window until it comes in time",
                me.fragment,
                me.slot,
                peer[-6:],
                self.punctuality.late_after,
            )

    def _saw_step(self, peer: str, step: int) -> None:
        """``peer`` stated ``step`` (at some slot): its trainer got at least that far."""
        if step > self._steps.get(peer, -1):
            self._steps[peer] = step

    def _probe_absent(
        self, me: mm.Declaration, seen: dict[str, tuple[int, str]], came: tuple[str, ...] = ()
    ) -> None:
        """Probe, in the background, the peers due at ``me``'s slot that never declared
        there (see :attr:`probe`), each once at a time. The members of the group formed,
        ``came``, came to the slot whether this node saw their declarations or not (a
        leader's invitation can outrun the view): they are not probed."""
        if self.probe is None or self.background is None:
            return
        absent = [
            p
            for p in self.peers.expected(me.fragment, me.version)
            if p not in seen and p not in came and p != me.peer_id and p not in self._probing
        ]
        for peer in absent:
            self._probing.add(peer)
            self.background.start_soon(self._probe_one, peer)

    async def _probe_one(self, peer: str) -> None:
        assert self.probe is not None
        try:
            if not await self.probe(peer):
                logger.info("peer %s was due at a slot, never came, and does not answer", peer)
        finally:
            self._probing.discard(peer)

    async def _fetch(self, machine: fs.FragmentSync, action: fs.FetchState) -> fs.Action:
        """Copy the state from up to three of its holders at once (see the module
        docstring), or take the copy made ahead of the sync (:meth:`prefetch`)."""
        p, target = action.fragment, action.target
        copied = await self._take_copied(p, target)
        if copied is not None:
            logger.info("fragment %d: version %d was copied ahead of its sync", p, target[0])
            return await self.engine_call(machine.fetched, copied)
        donors = [d for d in (action.peers or (action.peer,)) if not self._banned(d)]
        got = await self._copy(p, target, action.numel, donors)
        if isinstance(got, str):
            return machine.fetch_failed(got, everyone=True)
        return await self.engine_call(machine.fetched, got)

    async def _copy(
        self, p: int, target: tuple[int, str], numel: int, donors: list[str]
    ) -> ss.FragmentState | str:
        """The state ``target`` of ``p`` copied from ``donors`` (or why not); strikes the
        donors caught sending what fails its check.

        One copy of a state at a time: the donors' pieces are routed by the state they
        belong to, so a second copy of the same state took the first one's pieces and
        left it to run out its bound (at the end of a run, a copy made ahead started
        beside the settle's own copy of the same state, and the settle failed after
        40 s). A second caller waits for the first copy to end, then copies."""
        key = (p, *target)
        while (running := self._fetching.get(key)) is not None:
            await running.wait()
        ended = self._fetching[key] = trio.Event()
        try:
            return await self._copy_once(p, target, numel, donors)
        finally:
            del self._fetching[key]
            ended.set()

    async def _copy_once(
        self, p: int, target: tuple[int, str], numel: int, donors: list[str]
    ) -> ss.FragmentState | str:
        try:
            fetch = sf.StateFetch(
                me=self.transport.peer_id,
                run_id=self.run_id,
                fragment=p,
                target=target,
                numel=numel,
                donors=donors,
                timeout_s=answer_bound(self.timeouts),
            )
        except AtollError as e:
            return str(e)
        liveness = self.peers.liveness
        outcome = await fetch_pieces(
            self.transport,
            self.mailbox,
            fetch,
            timeout_s=self.timeouts.round_s,
            liveness=liveness,
        )
        now = trio.current_time()
        for drop in fetch.dropped:
            if drop.hostile and self.strikes is not None:
                self.strikes.strike(
                    drop.peer, "state", f"fragment {p} version {target[0]}: {drop.reason}"
                )
            elif drop.silent:
                liveness.failed(drop.peer, now, f"a state request timed out: {drop.reason}")
        if isinstance(outcome, sf.GaveUp):
            return outcome.reason
        for donor in outcome.donors:  # their trainers got that far (the donors' median)
            self._saw_step(donor, outcome.state.step)
        logger.info(
            "fragment %d: copied version %d from %s",
            p,
            target[0],
            ", ".join(d[-6:] for d in outcome.donors) or "nobody",
        )
        return outcome.state

    # -- copies made ahead of a sync ------------------------------------------------------
    async def prefetch(self, p: int) -> bool:
        """Copy now the state that fragment ``p``'s next sync would rebase onto, when it
        is not this node's (a node back from a cut or a split, one version behind or
        more); whether a copy was made. The sync then imports it at once and offers its
        Δ at the swarm's slot, in time for the group that forms there.

        Without it, a node behind copies at its own sync step, which is the moment the
        other nodes' next round of that fragment forms: over a 50 Mbit/s link the copy
        ended just after their group closed, and the node chased the swarm one version
        behind for two or three periods. The copy is taken only for the certified state
        the rebase rule picks now (:func:`~atoll.protocol.sync.rebase_target`), one per
        fragment, and dropped once the rule picks another state; the engine is not
        touched (the trainer's copy is only ever changed by a sync's outcome). The
        certificate watcher (:mod:`atoll.node.net.certwatch`) asks for it every few
        seconds, right after its lookups."""
        beliefs = self.peers.beliefs
        if beliefs is None or p in self._syncing or p in self._copying:
            return False
        mine, numel = await self.engine_call(self._mine_and_size, p)
        believes = functools.partial(beliefs.believes, p)
        plan = fs.rebase_target(
            self.transport.peer_id, mine, self.peers.holdings(p, mine), believes=believes
        )
        kept = self._copied.get(p)
        if kept is not None and (plan is None or kept.target != plan[0]):
            del self._copied[p]  # the rule keeps this node's state, or moved on
            kept = None
        if plan is None or kept is not None:  # nothing to copy, or copied already
            return False
        target, holders = plan
        donors = [d for d in holders if not self._banned(d)]
        done = trio.Event()
        self._copying[p] = (target, done)
        try:
            got = await self._copy(p, target, numel, donors)
        finally:
            del self._copying[p]
            done.set()
        if isinstance(got, str):
            logger.info("fragment %d: copying version %d ahead failed: %s", p, target[0], got)
            return False
        self._copied[p] = _Copied(target, got, self.step)
        return True

    def moved(self, step: int) -> None:
        """The trainer jumped or moved to ``step``, the swarm's step as it learnt it: the
        copies made ahead count from there. A copy's step is the donors' step at the copy
        plus the steps trained since; a jump counted as trained steps made the state's
        step a jump too far, and the trainer jumped again, and again (a faults run saw a
        node 180 steps ahead of its swarm within a minute, then the others follow it)."""
        for p, kept in list(self._copied.items()):
            self._copied[p] = _Copied(kept.target, dataclasses.replace(kept.state, step=step), step)

    def copied(self, p: int) -> tuple[int, str] | None:
        """The (version, digest) of fragment ``p``'s state copied ahead of its sync, or
        None."""
        kept = self._copied.get(p)
        return None if kept is None else kept.target

    def _mine_and_size(self, p: int) -> tuple[tuple[int, str], int]:
        return self._mine(p), int(self.engine.global_params(p).size)

    async def _take_copied(self, p: int, target: tuple[int, str]) -> ss.FragmentState | None:
        """The copy of ``target`` made ahead of ``p``'s sync (waiting for one under way),
        its step moved on by the steps this node trained since (the donors trained as
        many meanwhile: the trainer may jump to it); None when there is none."""
        copying = self._copying.get(p)
        if copying is not None and copying[0] == target:
            with trio.move_on_after(self.timeouts.round_s):  # the copy's own bound
                await copying[1].wait()
        kept = self._copied.get(p)
        if kept is None or kept.target != target:
            return None
        del self._copied[p]
        step = kept.state.step + max(0, self.step - kept.at_step)
        return dataclasses.replace(kept.state, step=step)

    def _declares(self, p: int) -> tuple[int, str]:
        """The state fragment ``p``'s next sync declares: this node's, or the one copied
        ahead for it (the sync imports it first)."""
        mine = self._mine(p)
        kept = self._copied.get(p)
        if kept is None or kept.target[0] < mine[0] or kept.target == mine:
            return mine
        return kept.target

    def _forget_copied(self, p: int) -> None:
        """Drop the copy made ahead for ``p`` once the engine holds its version or a
        newer one (after a sync: it either imported it or moved past it)."""
        kept = self._copied.get(p)
        if kept is not None and kept.target[0] <= self.engine.version(p):
            del self._copied[p]

    async def _holdings(self, p: int, seen: dict[str, tuple[int, str]]) -> list[fs.Holding]:
        """The live records' holdings of ``p``, updated by what the slot's declarations
        showed (newer news of the same peers), the believed ones only (a declaration
        names a version as freely as a record does). Certificates are looked up first
        (:meth:`certify`): after a split heals, this is where the side off the leading
        copy learns that it is certified, and rebases. In a healthy swarm there is
        nothing to look up here (the group's members hold this node's state)."""
        holdings = self._known(p, seen)
        mine = await self.certify(p, holdings, within=CERTIFY_IN_SYNC_S)
        return self.peers.believed(p, holdings, mine)

    def _known(self, p: int, seen: dict[str, tuple[int, str]]) -> list[fs.Holding]:
        """The live records' holdings of ``p`` updated by the slot's declarations
        ``seen``, believed or not. A declaration counts over its peer's record when it is
        at least as new: a slot's ready records stay in the DHT after the slot's round,
        while the peer's record moves on to the version the round made."""
        live = {peer: (peer, v, d) for peer, v, d in self.peers.declared(p)}
        for peer, (v, d) in seen.items():
            if not self._banned(peer) and (peer not in live or v >= live[peer][1]):
                live[peer] = (peer, v, d)
        return list(live.values())

    def _checkpoint(self, spec: ar.RoundSpec) -> Callable[[str], None] | None:
        if self.fault is None:
            return None
        return self.fault(spec.key.fragment, spec.key.round, len(spec.members))

    def _log_slot(
        self,
        action: fs.Action,
        machine: fs.FragmentSync,
        seen: dict[str, tuple[int, str]],
        *,
        took: float | None = None,
    ) -> None:
        """After a round (or none): its outcome, the slot's declarations and, once
        applied, the group's members and how long the round took (``took``: from the
        group's forming to the commit, the all-reduce and the apply; the benchmarks read
        this line, and a heal's recovery counts only the rounds whose groups formed after
        it)."""
        if isinstance(action, fs.RunRound) or machine.round_status == "none":
            return  # no round ended yet (a round to run, or a slot left for another copy)
        request = machine.request
        reason = machine.round_reason
        members = machine.members if not reason else ()
        logger.info(
            "fragment %d slot %d: %s; the slot's declarations: %s%s%s",
            machine.fragment,
            request.round if request is not None else -1,
            reason or "applied",
            ", ".join(f"{peer[-6:]} v{v} {d[:6]}" for peer, (v, d) in seen.items()) or "none",
            f"; members: {', '.join(p[-6:] for p in members)}" if members else "",
            f"; round {took:.2f} s" if members and took is not None else "",
        )

    # -- held trainers -----------------------------------------------------------------------
    def _hold(self, p: int, seconds: float) -> None:
        """Pass a hold of fragment ``p``'s sync to the trainer (:attr:`on_hold`): held for
        at most ``seconds`` (> 0), or let go (0). A hold that lasts past the grace window
        is told to the peers of the run, and so is its end (:mod:`atoll.protocol.held`):
        a peer waiting at another fragment's slot for this one then lets its own trainer
        go instead of waiting on a node that waits on it."""
        if self.on_hold is not None:
            self.on_hold(p, seconds)
        if seconds > 0:
            token = object()
            self._holding[p] = token
            if self.background is not None:
                until = trio.current_time() + seconds
                self.background.start_soon(self._tell_held, p, token, until)
            return
        self._holding.pop(p, None)
        if p in self._told and self.background is not None:
            self._told.discard(p)
            self.background.start_soon(self._tell, p, 0.0)

    async def _tell_held(self, p: int, token: object, until: float) -> None:
        await trio.sleep(self.peers.group.grace_s)
        if self._holding.get(p) is token:
            self._told.add(p)
            await self._tell(p, max(0.0, until - trio.current_time()))

    async def _tell(self, p: int, seconds: float) -> None:
        """Tell every trainer of the run that answers where this node's trainer is held
        (best effort, each send bounded by the transport)."""
        msg = Held(self.transport.peer_id, self.run_id, p, seconds)

        async def one(peer: str) -> None:
            try:
                await self.transport.send(peer, msg)
            except AtollError as e:
                logger.debug("telling %s of a hold failed: %s", peer, e)

        async with trio.open_nursery() as nursery:
            for peer in self.peers.trainers():
                nursery.start_soon(one, peer)

    # -- serving -----------------------------------------------------------------------------
    async def serve_request(self, sender: str, msg: object) -> None:
        """Answer a peer's :class:`~atoll.protocol.statesync.StateRequest` or
        :class:`~atoll.protocol.certificate.AttestationRequest` (the mailbox's handler of
        messages no round takes)."""
        if isinstance(msg, AttestationRequest):
            await serve_attestations(self.transport, sender, msg, self._seals_of(msg))
            return
        if isinstance(msg, Held):
            if msg.run_id == self.run_id and msg.fragment < self.engine.num_fragments:
                self.held.note(msg, now=trio.current_time())
            return
        if isinstance(msg, sp.StateIndexRequest | sp.StatePieceRequest):
            source = await self._source(msg.run_id, msg.fragment, msg.version, msg.digest)
            await serve_pieces(self.transport, sender, msg, source, step=self.step)
            return
        if not isinstance(msg, ss.StateRequest):
            logger.info("peer %s sent an unexpected %s", sender, type(msg).__name__)
            return
        if msg.run_id != self.run_id or not 0 <= msg.fragment < self.engine.num_fragments:
            await serve_state(self.transport, sender, msg, None, "no such run or fragment")
            return
        state = await self.engine_call(self.engine.export_fragment, msg.fragment, self.step)
        await serve_state(self.transport, sender, msg, state)

    async def _source(
        self, run_id: str, p: int, version: int, digest: str
    ) -> sp.PieceSource | None:
        """What this node serves of fragment ``p``'s state ``(version, digest)``: its
        encoding and piece hashes, made once (off the event loop) and kept while the
        engine holds that state; None when it holds another."""
        if run_id != self.run_id or not 0 <= p < self.engine.num_fragments:
            return None
        async with self._source_lock:
            mine = await self.engine_call(self._mine, p)
            previous = self._previous.get(p)
            served = [mine] if previous is None else [mine, previous[0]]
            source = self._sources.get(p)
            if source is not None and not any(source.holds(*s) for s in served):
                del self._sources[p]  # the engine moved on: the old encoding is not served
                source = None
            if (version, digest) not in served:
                return None
            if source is None or not source.holds(version, digest):
                if (version, digest) == mine:
                    state = await self.engine_call(self.engine.export_fragment, p, self.step)
                else:  # the state before the last round, kept for joiners one round late
                    assert previous is not None
                    state = previous[1]
                source = await self.offload(sp.PieceSource.of, state)
                if not source.holds(version, digest):  # cannot happen: the engine's own
                    logger.warning("fragment %d: the served state's digest differs", p)
                    return None
                self._sources.pop(p, None)
                self._sources[p] = source
                while len(self._sources) > MAX_SOURCES:
                    del self._sources[next(iter(self._sources))]
            else:  # newest last
                self._sources[p] = self._sources.pop(p)
            return source

    def _seals_of(self, request: AttestationRequest) -> list[bytes]:
        """The seals this node holds of exactly the requested state: its own attestation,
        then those of a certificate it checked; none for another run or an unknown state."""
        if request.run_id != self.run_id:
            return []
        state = (request.fragment, request.version, request.digest)
        seals: list[bytes] = []
        own = self.attested(*state) if self.attested is not None else None
        if own is not None:
            seals.append(own)
        beliefs = self.peers.beliefs
        if beliefs is not None:
            seals.extend(s for s in beliefs.seals(*state) if s not in seals)
        return seals[:MAX_REPLY_SEALS]

"""One fragment sync, owned by one object: a sans-IO machine over the outer engine.

A sync of fragment ``p`` (Streaming DiLoCo, arXiv 2501.18512; docs/ALGORITHMS.md §2) starts
when the trainer hands over its local copy and ends with one decision: the group's
averaged pseudo-gradient was applied (*committed*), or nothing was applied (*rolled
back*), possibly followed by a copy of the state the swarm follows (*rebased*).
:class:`FragmentSync` is that decision's only owner: it is the one caller of the
engine's :meth:`~atoll.protocol.engine.OuterEngine.deliver`,
:meth:`~atoll.protocol.engine.OuterEngine.skip` and
:meth:`~atoll.protocol.engine.OuterEngine.import_fragment` in the whole code base.

Like :class:`~atoll.protocol.allreduce.AllReduceRound`, it takes events and returns
actions; a driver carries the actions out (the swarm: matchmaking over the DHT, the
all-reduce over libp2p, a state fetch; a test: the same over an in-memory transport)::

    declared ──► rebasing ──(imported: Δ taken again)──┐
        │           │ (no holder served it)            │
        │           ▼                                  ▼
        └─────► matching ──► reducing ──► committed ─┐
                    │            │                   ├──► rebasing ──► done
                    └────────────┴──────► rolled back┘        (or done at once)

1. :meth:`FragmentSync.begin` encodes Δp against the global copy (the engine's
   ``begin``); the sync is *declared* at slot = the fragment's version.
2. :meth:`FragmentSync.plan` takes what the swarm holds (``(peer, version, digest)``
   triples from the peers' records): when :func:`~atoll.protocol.statesync.should_rebase`
   says the swarm follows another state, the answer is :class:`FetchState` (copy it);
   else :class:`FindGroup` with this peer's
   :class:`~atoll.protocol.matchmaking.Declaration`. A state copied here one version
   ahead of this peer's does not end the sync: the peer keeps its Δ (the same
   pseudo-gradient, taken against the copy it trained from) and offers it at the new
   version, a contribution one round stale, as Decoupled DiLoCo merges late updates
   (arXiv 2604.21428; docs/ALGORITHMS.md §4.3), at :data:`LATE_WEIGHT` of its token
   weight (a stale Δ at full weight cost loss in the simulator). A peer one version
   behind is most often one that rebased at its previous sync: the swarm's next round of
   the fragment starts as its own sync starts, and ending the sync at the rebase would
   make it miss that round, and every later one the same way (a peer that rebases at
   every sync and never averages again). A peer further behind (up to
   :data:`MAX_STALENESS` versions: one that was cut off or on the losing side of a split
   for a few rounds) is met the same way when its sync starts with the swarm's: it joins
   the swarm's round at once with its Δ, whose token weight is :data:`LATE_WEIGHT`
   divided by the number of versions it missed (a staleness discount, as Decoupled
   DiLoCo discounts late updates). A peer further behind still (a cut or a split of many
   rounds) joins the same way, but what it offers is its drift over the missed versions
   divided by their number, the mean per version, at the same discount: its work counts
   for little, yet it is in the swarm's round at once instead of copying the state,
   dropping Δ and meeting the fragment a whole period later (after a 60 s cut the cut
   node, 8 versions behind on one fragment, missed that fragment's next round so, and
   the fragment had no round of all four for 32 s).
3. :meth:`FragmentSync.matched` with the matchmaking outcome: :class:`RunRound` for a
   formed group, or a roll back when alone. While matching, the driver asks
   :meth:`FragmentSync.outdated` whether the state this sync declared lost to another
   one (after a split heals, the losing side learns it while it waits at its slot); it
   then withdraws from the slot, and when the winner is at most :data:`MAX_STALENESS`
   versions ahead this sync copies it and offers its Δ at the winner's slot, once, as in
   step 2. At a winner of the same version the swarm's group is forming as this peer
   learns of it. At a newer winner that depends on when it learns: a lone side two
   versions behind learns it as the swarm's sync of the slot begins (their group is
   forming now), but a side that lost the race for its own slot learns it when the winners
   commit that slot, and the winners' next sync of the fragment comes a whole period
   later. Waiting there holds the trainer out of step with the swarm and misses the
   winners all the same, so the new slot is declared ``only_if_present``: joined when
   another peer is already there, else the sync ends rebased (the Δ is dropped) and the
   peer meets the swarm at its next regular sync of the fragment.
4. :meth:`FragmentSync.reduced` with the all-reduce outcome: Done is delivered (commit),
   Failed rolled back; a delivery the engine refuses is a roll back too. A round that
   failed on a member's proven fault (a refused part, a wrong chunk: its proof travels
   in the abort, so every member bans the culprit) may instead go back to matching
   once (:meth:`FragmentSync.regroup`): the others do the same, and the slot's group
   forms again without the culprit.
5. After the round, the holdings seen meanwhile decide whether to rebase
   (:class:`FetchState`, naming every holder: the driver copies from several at once,
   :meth:`FragmentSync.fetched` imports a state at least as new as the target,
   :meth:`FragmentSync.fetch_failed` gives up, or moves on to the next holder for a
   driver that asked one) or to finish (:class:`SyncDone`).

Certified states. With ``believes`` (``(version, digest) -> bool``, a node's
:class:`~atoll.protocol.certificate.CertifiedStates`), the rebase rule follows only
believed states (:func:`~atoll.protocol.statesync.should_rebase`): a declared version
without a certificate is never fetched. After a committed round of a formed group,
:attr:`FragmentSync.attestation` is what this member signs and publishes: the new
version and digest, the parent digest the round started from and the sorted members.

Token weights. A contribution is weighted by the tokens its peer trained on since the
fragment's last applied round, which only the peer itself counts. ``weight_cap`` (see
:func:`weight_cap`) bounds what any peer may claim: the tokens of ``MAX_STALENESS + 1``
periods of H inner steps of the run's batch, the most that a Δ this machine still offers
(at most :data:`MAX_STALENESS` rounds missed) can stand for. This peer clips its own
weight to it (a peer that sat out many rounds counts as that many periods at most), and
the round's spec carries it, so that every chunk owner refuses a part above it and
names the sender (:mod:`~atoll.protocol.allreduce`), in a group of any size: the group
check (``weight_factor`` times the median) needs three parts or more. A tighter cap
follows from what a node saw: a member of the round that made the version a round starts
from committed that round, which reset its count, and its schedule brings the next sync
of the fragment H steps later, so it trained about one period since
(:func:`recent_member_cap`: :data:`RECENT_PERIODS` periods, room for a landing behind
that trains up to τ steps again and a start skipped as met already). The driver passes
it to :meth:`FragmentSync.matched` for this peer's own weight (clipped before any attack
injection) and to the round for every member it saw in that round. Every member of that
round applied it (rounds are atomic) and clips its own weight by the same rule, so an
honest member never offers more than the others enforce, whatever it trained since (a
sync held across a cut, rounds failed at the same slot since).

Late work. ``keep_late`` (default on) is what step 2 describes: a sync that copies a
newer state before its round offers its Δ there, its token weight multiplied by
``late_weight`` (:data:`LATE_WEIGHT`) divided by the versions it missed. Off, the copy
ends the sync and the Δ is dropped (the plain rebase); the simulator turns it off, and
sets the weight, to measure what keeping the work is worth (``bench/latework.py``).

Attack injection. ``tamper`` (benchmarks and tests only, None in a real node) sees the
round's spec, this peer's encoded Δ and its weight in :meth:`FragmentSync.matched` and
returns what the peer sends instead (:mod:`atoll.node.net.attacks`): the engine keeps the
honest request, only the round's input changes.

The first error is latched: :meth:`FragmentSync.abort` (a cancelled driver, an
unexpected failure) rolls the sync back exactly once and every later event returns the
same :class:`SyncDone`. A committed round is never undone by a later abort.

Nothing here reads a clock or does IO: wall time (the declaration's stamp) is passed in.
The engine's calls are CPU work (encode, outer step, hash): a driver runs the events that
make them off its event loop, one engine call at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np

from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import statesync as ss
from atoll.protocol.certificate import MAX_MEMBERS, Attestation
from atoll.protocol.checks import PartChecks
from atoll.protocol.engine import OuterEngine, SyncRequest
from atoll.protocol.errors import AtollError, ConfigError
from atoll.protocol.robust import RobustRule

__all__ = [
    "LATE_WEIGHT",
    "MAX_STALENESS",
    "RECENT_PERIODS",
    "Action",
    "FetchState",
    "FindGroup",
    "FragmentSync",
    "Holding",
    "Phase",
    "RoundStatus",
    "RunRound",
    "SyncDone",
    "Tamper",
    "fall_back",
    "holdings_of",
    "rebase_target",
    "recent_member_cap",
    "weight_cap",
]

log = logging.getLogger(__name__)

Holding: TypeAlias = tuple[str, int, str]
"""``(peer, version, digest)`` of one fragment, as a peer's record or declaration shows it."""

Phase: TypeAlias = Literal["idle", "declared", "rebasing", "matching", "reducing", "done"]

MAX_STALENESS = 4
"""Most versions a peer may have missed and still offer its whole Δ at the swarm's copy
when it rebases before its round; further behind, it offers its mean drift per missed
version (see the module docstring). After a withdrawal from its slot, a copy further
ahead than this ends the sync."""

LATE_WEIGHT = 0.25
"""The share of its token weight a Δ keeps when it is offered one version after the one
it was taken against (``k`` versions after: ``LATE_WEIGHT / k``). In the simulator, with
three of eight replicas each missing a quarter or half of their slots, a late Δ at its
full weight cost 0.5-1.5% of eval loss against a run without late replicas, and at a
quarter 0.1-0.7% (``bench/latework.py``, docs/BENCHMARKS.md)."""

RoundStatus: TypeAlias = Literal["none", "applied", "failed", "alone", "cancelled"]
"""How the sync's round ended: ``none`` when there was no round (the peer rebased before
looking for a group, or a catch-up), ``cancelled`` when the sync was aborted."""


# -- actions -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FindGroup:
    """Find this sync's group: publish ``declaration`` and run matchmaking for its slot.

    ``only_if_present``: the slot is one the peer moved to in the middle of its sync (it
    copied a newer copy after withdrawing from its own slot): join it only when another
    peer has declared it already, else give up at once (see the module docstring)."""

    declaration: mm.Declaration
    only_if_present: bool = False


@dataclass(frozen=True, slots=True)
class RunRound:
    """Run the all-reduce of a formed group with this peer's encoded Δ and weight."""

    spec: ar.RoundSpec
    payload: bytes
    weight: float


@dataclass(frozen=True, slots=True)
class FetchState:
    """Copy fragment ``fragment``'s state ``target`` (version, digest) from ``peer``, or
    from several of ``peers`` at once (every holder not tried yet, ``peer`` first: a
    multi-source copy, :mod:`atoll.protocol.statefetch`)."""

    fragment: int
    peer: str
    target: tuple[int, str]
    numel: int
    peers: tuple[str, ...] = field(default=(), compare=False)
    """left out of equality: the same copy, whichever holders the driver may use"""


@dataclass(frozen=True, slots=True)
class SyncDone:
    """How the sync ended; the driver reports it to the trainer.

    ``applied`` means the fragment's global copy changed (a committed round or a rebase):
    the trainer merges the new copy into its local one.
    """

    fragment: int
    step: int
    applied: bool
    round: int
    """the version Δ was taken against (-1 for a catch-up)"""
    reason: str
    """empty for a committed round; ``alone: ...``, ``failed: ...``, ``rebased to version
    N``, ``cancelled: ...`` otherwise"""
    round_status: RoundStatus
    rebased: bool = False
    state_step: int | None = None
    """the inner step of the peer whose state was copied (rebases only)"""
    members: tuple[str, ...] = ()
    """the group of the round, leader first (empty when no group formed)"""
    swarm_step: int | None = None
    """when the peers of the slot refused this one as out of step
    (:data:`~atoll.protocol.matchmaking.OUT_OF_STEP`): their step, where the trainer
    belongs; None otherwise"""


Action: TypeAlias = FindGroup | RunRound | FetchState | SyncDone
Tamper: TypeAlias = Callable[[ar.RoundSpec, bytes, float], tuple[bytes, float]]
"""``(spec, payload, weight) -> (payload, weight)``: what a hostile peer sends in a round
instead of its encoded Δ and weight (attack injection for benchmarks and tests)."""
OnChange: TypeAlias = Callable[[int, str], None]
"""Called with ``(fragment, how)`` after the global copy changed: ``how`` is
``"slot/leader"`` for a committed round, ``"rebase"`` for an imported state."""


class FragmentSync:
    """One sync of one fragment (see the module docstring).

    ``on_change`` is called right after the engine's global copy of the fragment changed
    (a commit or an import), so the driver can publish it (shared memory, records).
    """

    def __init__(
        self,
        engine: OuterEngine,
        fragment: int,
        *,
        peer_id: str,
        run_id: str,
        on_change: OnChange | None = None,
        believes: ss.Believes | None = None,
        robust: RobustRule | None = None,
        checks: PartChecks | None = None,
        tamper: Tamper | None = None,
        verify_owners: bool = False,
        sealed: bool = False,
        weight_cap: float = math.inf,
        keep_late: bool = True,
        late_weight: float = LATE_WEIGHT,
    ) -> None:
        if not 0 <= fragment < engine.num_fragments:
            raise ConfigError(f"no fragment {fragment} (there are {engine.num_fragments})")
        self.engine = engine
        self.fragment = fragment
        self.peer_id = peer_id
        self.run_id = run_id
        self._on_change = on_change
        self._believes = believes
        self._robust = robust if robust is not None else RobustRule()
        self._checks = checks
        self._verify_owners = verify_owners
        self._sealed = sealed
        self._weight_cap = float(weight_cap)
        self._tamper = tamper
        self._keep_late = keep_late
        if not (math.isfinite(late_weight) and 0 < late_weight <= 1):
            raise ConfigError(f"late_weight must be in (0, 1], not {late_weight!r}")
        self._late_weight = float(late_weight)
        self._attestation: Attestation | None = None
        self._phase: Phase = "idle"
        self._request: SyncRequest | None = None
        self._digest = ""
        self._step = 0
        self._status: RoundStatus = "none"
        self._reason = ""
        self._members: tuple[str, ...] = ()
        self._committed = False
        self._holders: list[str] = []
        self._target: tuple[int, str] | None = None
        self._after_round = False
        self._done: SyncDone | None = None
        self._wall = 0.0
        self._local: np.ndarray | None = None  # the trainer's copy, to take Δ again
        self._rebased: tuple[int, int] | None = None  # (version, server step) of a rebase
        self._withdrawn = ""  # why matchmaking left the slot for a winning copy, if it did
        self._swarm_step: int | None = None  # the step of peers that refused ours
        self._discount = 1.0  # of Δ's token weight, offered versions after it was taken
        self._regrouped = False  # the slot was sought once more after a member's fault

    # -- queries ---------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def request(self) -> SyncRequest | None:
        """The contribution this sync declared (None before :meth:`begin` and in a catch-up)."""
        return self._request

    @property
    def digest(self) -> str:
        """The digest of the global copy Δ was taken against (set by :meth:`plan`)."""
        return self._digest

    @property
    def members(self) -> tuple[str, ...]:
        """The group's members once matched (empty before, and when alone)."""
        return self._members

    @property
    def round_status(self) -> RoundStatus:
        """How this sync's round ended (``none`` while no round has ended)."""
        return self._status

    @property
    def round_reason(self) -> str:
        """Why the round was not applied (empty while none failed or when it was)."""
        return self._reason

    @property
    def attestation(self) -> Attestation | None:
        """What this member attests after a committed round of a formed group (None
        otherwise, and for a group over :data:`~atoll.protocol.certificate.MAX_MEMBERS`)."""
        return self._attestation

    @property
    def result(self) -> SyncDone | None:
        """The final action once the sync is done."""
        return self._done

    # -- events ----------------------------------------------------------------------------
    def begin(self, local: np.ndarray, step: int) -> SyncRequest:
        """Encode Δ of ``local`` against the global copy (the engine's ``begin``)."""
        self._expect("idle")
        self._step = int(step)
        self._local = np.array(local, dtype=np.float32, copy=True).reshape(-1)
        self._request = self.engine.begin(self.fragment, local, step)
        self._phase = "declared"
        return self._request

    def plan(self, holdings: Iterable[Holding], *, wall_now: float) -> Action:
        """Rebase first when ``holdings`` show the swarm follows another state; else
        find a group. ``wall_now`` stamps the declaration (informative only)."""
        if self._done is not None:
            return self._done
        self._expect("declared")
        request = self._request
        assert request is not None
        self._wall = wall_now
        self._digest = self.engine.digest(self.fragment)
        rebase = self._rebase_plan(holdings)
        if rebase is not None:
            return rebase
        return self._find_group(request, wall_now)

    def catch_up(self, holdings: Iterable[Holding], step: int = 0) -> Action:
        """A rebase without a sync in flight (a node that starts or restarts): fetch the
        swarm's state when ``holdings`` show it is not this peer's, else done."""
        self._expect("idle")
        self._step = int(step)
        self._phase = "declared"
        self._after_round = True  # nothing to fall back to when no holder serves it
        rebase = self._rebase_plan(holdings)
        return rebase if rebase is not None else self._finish()

    def matched(
        self,
        found: mm.Formed | mm.Alone,
        holdings: Iterable[Holding] = (),
        *,
        weight_cap: float = math.inf,
    ) -> Action:
        """The matchmaking outcome: run the round of a formed group, or roll back.
        ``weight_cap``: a tighter bound on this peer's own weight in this round than the
        run's (:func:`recent_member_cap` when it made the version the round starts
        from)."""
        if self._done is not None:
            return self._done
        self._expect("matching")
        request = self._request
        assert request is not None
        if isinstance(found, mm.Alone):
            if found.swarm_step >= 0:
                self._swarm_step = found.swarm_step
            if found.withdrawn and self._rebased is None and not self._withdrawn:
                rebase = self._rebase_plan(holdings, at_most=request.round + MAX_STALENESS)
                if rebase is not None:  # no round ran: Δ is offered again at the winner
                    log.info("fragment %d: %s", self.fragment, found.reason)
                    self._withdrawn = f"alone: {found.reason}"
                    return rebase
            return self._roll_back("alone", f"alone: {found.reason}", holdings)
        if self.peer_id not in found.members:
            return self._roll_back("failed", "failed: a group without this peer", holdings)
        self._members = found.members
        self._phase = "reducing"
        codec = self.engine.config
        spec = ar.RoundSpec(
            ar.RoundKey(self.run_id, self.fragment, request.round, found.key.group),
            found.members,
            request.numel,
            codec.codec,
            codec.codec_block,
            robust=self._robust,
            checks=self._checks,
            verify_owners=self._verify_owners,
            sealed=self._sealed,
            weight_cap=self._weight_cap,
        )
        weight = min(request.weight * self._discount, self._weight_cap, weight_cap)
        if self._tamper is not None:
            return RunRound(spec, *self._tamper(spec, request.payload, weight))
        return RunRound(spec, request.payload, weight)

    @property
    def may_regroup(self) -> bool:
        """Whether :meth:`regroup` may be called now: a round is under way and the slot
        was not sought again in this sync yet."""
        return self._done is None and self._phase == "reducing" and not self._regrouped

    def regroup(self, wall_now: float) -> FindGroup:
        """Seek the slot's group once more, after the round failed on a member's proven
        fault (the driver's strikes banned it): the round's other members saw the same
        proof in its abort and seek the slot again too, so the group forms anew without
        the culprit instead of losing the round (a NaN part or a hostile owner would
        otherwise cost every member the round). Nothing was applied; Δ and its weight are
        offered as before. Once per sync, and the slot is joined only when another peer
        is there (:attr:`FindGroup.only_if_present`): a member that did not see the proof
        rolled back and does not come."""
        if not self.may_regroup:
            raise ConfigError(
                f"fragment {self.fragment}: regroup in phase {self._phase!r} "
                f"(expected reducing, once per sync)"
            )
        request = self._request
        assert request is not None
        self._regrouped = True
        self._members = ()
        return self._find_group(request, wall_now, only_if_present=True)

    def reduced(self, result: ar.Done | ar.Failed, holdings: Iterable[Holding] = ()) -> Action:
        """The all-reduce outcome: deliver Done (commit) or roll back Failed.

        An in-process exchange (the simulator, a loopback worker) may call this straight
        after :meth:`begin`: its group is formed without matchmaking.
        """
        if self._done is not None:
            return self._done
        self._expect("reducing", "declared")
        request = self._request
        assert request is not None
        if isinstance(result, ar.Failed):
            return self._roll_back("failed", f"failed: {result.reason}", holdings)
        try:
            self.engine.deliver(self.fragment, result.averaged, request.round)
        except AtollError as e:
            return self._roll_back("failed", f"failed: {e}", holdings)
        self._committed = True
        self._status = "applied"
        members = self._members
        if members and self._digest and len(members) <= MAX_MEMBERS:
            try:
                self._attestation = Attestation(
                    self.run_id,
                    self.fragment,
                    self.engine.version(self.fragment),
                    self.engine.digest(self.fragment),
                    self._digest,
                    tuple(sorted(members)),
                )
            except AtollError as e:  # a member id no attestation can carry: none
                log.info("fragment %d: no attestation of the round: %s", self.fragment, e)
        self._changed(f"{request.round}/{members[0]}" if members else f"{request.round}/local")
        return self._next_after_round(holdings)

    def fetched(self, state: ss.FragmentState) -> Action:
        """A holder served the fragment's state: import it when it is at least the target
        version, else try the next holder."""
        if self._done is not None:
            return self._done
        self._expect("rebasing")
        assert self._target is not None
        peer = self._holders[0]
        if state.version < self._target[0]:
            log.info("peer %s served fragment %d at an older version", peer, self.fragment)
            return self.fetch_failed("an older version")
        old = self.engine.global_params(self.fragment).copy() if not self._after_round else None
        try:
            self.engine.import_fragment(self.fragment, state)  # skips a pending Δ first
        except AtollError as e:
            return self.fetch_failed(f"its state does not fit: {e}")
        self._changed("rebase")
        version = self.engine.version(self.fragment)
        log.info(
            "fragment %d rebased to version %d (%s) from %s",
            self.fragment,
            version,
            state.digest(),
            peer,
        )
        self._rebased = (version, state.step)
        request = self._request
        if (
            self._keep_late
            and not self._after_round
            and self._local is not None
            and request is not None
            and request.round <= version
            and (version <= request.round + MAX_STALENESS or not self._withdrawn)
        ):
            # before the round, on a losing copy of the same version or behind: offer Δ
            # at the new copy (see the module docstring): new + (local − old) is as far
            # from the new copy as the local copy was from the old one. Further behind
            # than MAX_STALENESS, the drift of all the missed versions is offered as its
            # mean per version (local − old) / missed, at the same discount
            missed = version - request.round
            self._discount = 1.0 if missed < 1 else self._late_weight / missed
            assert old is not None
            drift = self._local - old
            if missed > MAX_STALENESS:
                drift = drift / np.float32(missed)
            shifted = self.engine.global_params(self.fragment) + drift
            self._target = None
            self._holders = []
            self._request = self.engine.begin(self.fragment, shifted, self._step)
            self._digest = self.engine.digest(self.fragment)
            # after a withdrawal, a newer slot's round may have no one coming to it now
            newer = bool(self._withdrawn) and version > request.round
            return self._find_group(self._request, self._wall, only_if_present=newer)
        return self._finish(
            applied=True,
            reason=f"rebased to version {version}",
            rebased=True,
            state_step=state.step,
        )

    def fetch_failed(self, reason: str, *, everyone: bool = False) -> Action:
        """The current holder did not serve the state: the next one, or give up.
        ``everyone``: the fetch tried every holder (a multi-source copy), give up now."""
        if self._done is not None:
            return self._done
        self._expect("rebasing")
        who = "its holders" if everyone else self._holders[0]
        log.info("fetching fragment %d from %s failed: %s", self.fragment, who, reason)
        if everyone:
            self._holders.clear()
        else:
            self._holders.pop(0)
        if self._holders:
            return self._fetch_next()
        self._target = None
        if self._after_round:
            return self._finish()
        if self._withdrawn:  # the slot was left for a copy nobody served: no round
            return self._roll_back("alone", f"{self._withdrawn}; no holder served it", ())
        # a rebase before the round that nobody served: look for a group as planned
        request = self._request
        assert request is not None
        self._phase = "declared"
        return self._find_group(request, self._wall)

    def abort(self, reason: str) -> SyncDone:
        """Roll the sync back (once) and end it: a cancelled driver, an unexpected error.

        The first call decides; later calls, and every later event, return the same
        result. A round already committed stays committed.
        """
        if self._done is not None:
            return self._done
        if self._committed:
            return self._finish()
        self._skip(f"cancelled: {reason}")
        self._status = "cancelled"
        self._reason = f"cancelled: {reason}"
        return self._finish()

    # -- internals ---------------------------------------------------------------------------
    def _expect(self, *phases: Phase) -> None:
        if self._phase not in phases:
            raise ConfigError(
                f"fragment {self.fragment}: sync event in phase {self._phase!r} "
                f"(expected {' or '.join(phases)})"
            )

    def _find_group(
        self, request: SyncRequest, wall_now: float, *, only_if_present: bool = False
    ) -> FindGroup:
        self._wall = wall_now
        self._phase = "matching"
        return FindGroup(
            mm.Declaration(
                self.run_id,
                self.fragment,
                request.round,  # the slot: peers holding one global copy meet there
                self.peer_id,
                request.round,
                self._digest,
                request.weight,
                wall_now,
                request.step,
            ),
            only_if_present,
        )

    def outdated(
        self, holdings: Iterable[Holding], *, declared: tuple[int, str] | None = None
    ) -> tuple[int, str] | None:
        """While matching: the leading state of ``holdings`` when it is not the one this
        sync declared (the rebase rule would copy it), else None. A pure query: the
        driver polls it during matchmaking and withdraws from the slot when it answers
        (a split's losing side learns it lost while it waits at its slot). ``declared``:
        the (version, digest) of a declaration made before the sync began (a group
        formed ahead of it), asked in any phase."""
        if declared is not None:
            mine = declared
        else:
            request = self._request
            if self._phase != "matching" or request is None:
                return None
            mine = (request.round, self._digest)
        others = [h for h in holdings if h[0] != self.peer_id]
        if not others or not ss.should_rebase(self.peer_id, mine, others, believes=self._believes):
            return None
        return ss.leading_state(
            [*others, (self.peer_id, *mine)], believes=ss.believing_own(self._believes, mine)
        )

    def _rebase_plan(
        self, holdings: Iterable[Holding], *, at_most: int | None = None
    ) -> FetchState | None:
        """A FetchState from the first holder of the leading state when this peer does not
        hold it (:func:`~atoll.protocol.statesync.should_rebase`), else None; with
        ``at_most``, only a leading state of at most that version."""
        holdings = list(holdings)
        if not any(h[0] != self.peer_id for h in holdings):
            return None  # nobody to follow (and no hash of the state needed to know it)
        mine = (self.engine.version(self.fragment), self.engine.digest(self.fragment))
        copy = rebase_target(self.peer_id, mine, holdings, believes=self._believes)
        if copy is None:
            return None
        target, holders = copy
        if at_most is not None and target[0] > at_most:
            return None
        self._target = target
        self._holders = holders
        return self._fetch_next()

    def _fetch_next(self) -> FetchState:
        assert self._target is not None
        self._phase = "rebasing"
        return FetchState(
            self.fragment,
            self._holders[0],
            self._target,
            int(self.engine.global_params(self.fragment).size),
            tuple(self._holders),
        )

    def _roll_back(self, status: RoundStatus, reason: str, holdings: Iterable[Holding]) -> Action:
        self._skip(reason)
        self._status = status
        self._reason = reason
        return self._next_after_round(holdings)

    def _skip(self, reason: str) -> None:
        if self._request is not None and not self._committed:
            self.engine.skip(self.fragment, reason)

    def _next_after_round(self, holdings: Iterable[Holding]) -> Action:
        self._after_round = True
        rebase = self._rebase_plan(holdings)
        return rebase if rebase is not None else self._finish()

    def _changed(self, how: str) -> None:
        if self._on_change is not None:
            self._on_change(self.fragment, how)

    def _finish(
        self,
        *,
        applied: bool | None = None,
        reason: str | None = None,
        rebased: bool = False,
        state_step: int | None = None,
    ) -> SyncDone:
        request = self._request
        self._phase = "done"
        if self._rebased is not None and not rebased:
            # a rebase before the round, then the round: both are reported
            rebased, state_step = True, self._rebased[1]
            how = "applied" if self._committed else self._reason
            reason = f"rebased to version {self._rebased[0]}, then {how}"
            applied = True  # the global copy changed, whatever the round did
        self._done = SyncDone(
            fragment=self.fragment,
            step=self._step,
            applied=self._committed if applied is None else applied,
            round=request.round if request is not None else -1,
            reason=self._reason if reason is None else reason,
            round_status=self._status,
            rebased=rebased,
            state_step=state_step,
            members=self._members,
            swarm_step=self._swarm_step,
        )
        return self._done


def fall_back(
    engine: OuterEngine, fragment: int, before: ss.FragmentState, committed: tuple[int, str]
) -> bool:
    """Put ``fragment`` back to ``before``, its state ahead of a committed round whose
    certificate nobody can complete (a member went silent before attesting it), when the
    engine still holds that round's ``committed`` (version, digest); whether it did.

    The round then counts as failed for this node: it meets its peers at the earlier
    slot again (the driver decides when:
    :meth:`~atoll.node.net.syncer.Syncer.fall_back_if_uncertifiable`).
    """
    if (engine.version(fragment), engine.digest(fragment)) != committed:
        return False
    engine.import_fragment(fragment, before)
    return True


def rebase_target(
    peer_id: str,
    mine: tuple[int, str],
    holdings: Iterable[Holding],
    *,
    believes: Callable[[int, str], bool] | None = None,
) -> tuple[tuple[int, str], list[str]] | None:
    """The ``(version, digest)`` a peer holding ``mine`` would copy from ``holdings``
    (:func:`~atoll.protocol.statesync.should_rebase`, believed states only with
    ``believes``) and the other peers that declare it, in order; None when it keeps its
    own. The rule of a sync's rebase, also asked by a driver that copies the state ahead
    of the sync."""
    others = [h for h in holdings if h[0] != peer_id]
    if not others or not ss.should_rebase(peer_id, mine, others, believes=believes):
        return None
    own = ss.believing_own(believes, mine)
    target = ss.leading_state([*others, (peer_id, *mine)], believes=own)
    assert target is not None
    holders = list(dict.fromkeys(peer for peer, v, d in others if (v, d) == target))
    return (target, holders) if holders else None


RECENT_PERIODS = 3
"""A member of the round that made a version may claim the tokens of this many periods in
the next round at that version (see "Token weights" above)."""


def recent_member_cap(cap: float) -> float:
    """The largest weight a member of the round that made the current version may claim,
    from the run's :func:`weight_cap` ``cap`` (``inf`` stays ``inf``)."""
    return cap * RECENT_PERIODS / (MAX_STALENESS + 1)


def weight_cap(H: int, tokens_per_step: int) -> float:
    """The largest token weight a contribution may carry in a run of period ``H`` whose
    inner step trains on ``tokens_per_step`` tokens (``inf`` when that is not known, 0)."""
    if tokens_per_step <= 0:
        return math.inf
    return float((MAX_STALENESS + 1) * H * tokens_per_step)


def holdings_of(
    fragment: int, records: Sequence[tuple[str, Sequence[int], Sequence[str]]]
) -> list[Holding]:
    """``(peer, version, digest)`` of ``fragment`` from ``(peer, versions, digests)`` rows
    (peer records), skipping rows that do not cover the fragment or have no digest."""
    return [
        (peer, versions[fragment], digests[fragment])
        for peer, versions, digests in records
        if len(versions) > fragment and len(digests) > fragment and digests[fragment]
    ]

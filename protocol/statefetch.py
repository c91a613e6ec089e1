"""A multi-source copy of one fragment's state: which donor sends which pieces, when.

A joiner (or a node the swarm moved past) copies a certified ``(version, digest)`` of a
fragment from the peers that declare it. The certificate vouches for the bytes, not for
whoever sends them (docs/DESIGN.md, "Certified global state"), and the digest is a
two-level hash (:func:`~atoll.protocol.statesync.state_digest`), so the copy is cut into
pieces and fetched from several donors at once, as BitTorrent fetches a torrent's pieces
from a swarm (BEP 3), each piece checked as it arrives:

1. The donors are ranked by ``sha256(requester | donor)`` (:func:`donor_order`): each
   requester has its own order, so many joiners spread over the donors instead of all
   landing on the first. The first ``max_donors`` (3) are asked for the piece list
   (:class:`~atoll.protocol.statepieces.StateIndexRequest`); the rest wait as spares.
2. A donor's index is checked against the certified digest
   (:func:`~atoll.protocol.statepieces.check_index`). From then on it is *ready*: it gets
   requests for runs of at most ``per_request`` pieces, at most ``window`` requests in
   flight, the next pieces nobody has (a faster donor therefore serves more; runs are
   shorter for a small state, so that all donors get a share).
3. Each piece is checked against its hash. A donor whose index or piece fails its check
   is dropped as *hostile* (:attr:`StateFetch.dropped`, for the node's strike ledger); a
   donor that refuses, whose send failed, or from which nothing arrived for
   ``timeout_s`` while it owed something is dropped as *unavailable* (it may serve
   later). The last donor standing is never dropped for slowness (a slow copy is better
   than none; the driver's overall bound ends it). A dropped donor's outstanding pieces
   go back to the front of the queue and a spare takes its place.
4. The copy is :class:`Finished` when every piece is verified (its inner step: the median
   of the ready donors' steps, so one liar among three cannot make the joiner jump), or
   :class:`GaveUp` when no donor is left.

It matches the round drivers' machine shape (``next_deadline``, ``tick``, ``receive``,
``peer_lost``; :func:`atoll.node.net.rounds.fetch_pieces` drives it). Sans-IO: the
clock is passed in, nothing here does IO. The pieces are written in place into one
buffer of the encoding's size; the state is decoded from it once at the end.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from atoll.protocol import statepieces as sp
from atoll.protocol import statesync as ss
from atoll.protocol.errors import CodecError, ConfigError

__all__ = [
    "Action",
    "Dropped",
    "Finished",
    "GaveUp",
    "Send",
    "StateFetch",
    "donor_order",
]

log = logging.getLogger(__name__)

MAX_DONORS = 3
WINDOW = 2
"""requests in flight per donor (each of up to :data:`~atoll.protocol.statepieces.
MAX_PIECES_PER_REQUEST` pieces): within the mailbox's bound of requests per peer"""


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to ``to``."""

    to: str
    message: object


@dataclass(frozen=True, slots=True)
class Finished:
    """Every piece verified: the copied state (its ``step`` the donors' median)."""

    state: ss.FragmentState
    donors: tuple[str, ...]
    """the donors that served at least one verified piece"""


@dataclass(frozen=True, slots=True)
class GaveUp:
    """No donor is left to serve the missing pieces."""

    reason: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """A donor left out of the copy: ``hostile`` when it sent what failed a check."""

    peer: str
    hostile: bool
    reason: str
    silent: bool = False
    """dropped because nothing came from it within the timeout (a failed request)"""


Action: TypeAlias = Send | Finished | GaveUp


def donor_order(me: str, donors: Sequence[str]) -> list[str]:
    """``donors`` (deduplicated, ``me`` left out) ranked by ``sha256(me | donor)``: a
    deterministic order of each requester's own, so requesters spread over donors."""

    def rank(peer: str) -> bytes:
        return hashlib.sha256(f"{me}|{peer}".encode("utf-8", "surrogatepass")).digest()

    return sorted({d for d in donors if d != me}, key=rank)


@dataclass(slots=True)
class _Donor:
    peer: str
    since: float  # the last time it made progress (or was asked, while it owed nothing)
    ready: bool = False
    step: int = 0
    requests: deque[list[int]] = field(default_factory=deque)  # outstanding pieces
    served: int = 0

    def owes(self) -> bool:
        return not self.ready or bool(self.requests)


class StateFetch:
    """The copy of ``target`` (version, digest) of ``fragment`` (``numel`` values) from
    ``donors`` (see the module docstring). Start it with :meth:`start`."""

    def __init__(
        self,
        *,
        me: str,
        run_id: str,
        fragment: int,
        target: tuple[int, str],
        numel: int,
        donors: Sequence[str],
        timeout_s: float,
        max_donors: int = MAX_DONORS,
        window: int = WINDOW,
        per_request: int = sp.MAX_PIECES_PER_REQUEST,
    ) -> None:
        if max_donors < 1 or window < 1 or not 1 <= per_request <= sp.MAX_PIECES_PER_REQUEST:
            raise ConfigError("max_donors and window must be >= 1, per_request 1..4")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, not {timeout_s}")
        self.me = me
        self.run_id = run_id
        self.fragment = fragment
        self.target = target
        self.numel = numel
        self.timeout_s = timeout_s
        self.max_donors = max_donors
        self.window = window
        self.total = ss.state_bytes(numel)
        self.count = ss.pieces_in(self.total)
        self.per_request = min(per_request, -(-self.count // (max_donors * window)))
        """runs short enough that the first donor to answer cannot take every piece of
        a small state before the others are ready"""
        if self.count > sp.MAX_PIECES:
            raise ConfigError(f"a state of {self.count} pieces is over {sp.MAX_PIECES}")
        self._spares = deque(donor_order(me, donors))
        self._active: dict[str, _Donor] = {}
        self._hashes: list[bytes] | None = None
        self._todo: deque[int] = deque(range(self.count))  # pieces nobody is asked for
        self._owner: dict[int, str] = {}  # outstanding piece -> donor asked for it
        self._buf = bytearray(self.total)
        self._verified = 0
        self._served: dict[str, int] = {}
        self._steps: list[int] = []
        self._outcome: Finished | GaveUp | None = None
        self.dropped: list[Dropped] = []
        """every donor left out, in order (the driver strikes the hostile ones)"""

    # -- queries -----------------------------------------------------------------------------
    @property
    def outcome(self) -> Finished | GaveUp | None:
        return self._outcome

    @property
    def verified(self) -> int:
        """Pieces verified so far."""
        return self._verified

    @property
    def next_deadline(self) -> float | None:
        """When the earliest donor that owes something runs out of time (None: none does)."""
        times = [d.since + self.timeout_s for d in self._active.values() if d.owes()]
        return min(times) if times else None

    # -- events ------------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        """Ask the first donors for the piece list."""
        return self._refill(now)

    def receive(self, msg: object, *, now: float) -> list[Action]:
        """A message from a donor (its ``sender`` is the authenticated peer)."""
        if self._outcome is not None:
            return []
        peer = getattr(msg, "sender", None)
        donor = self._active.get(peer) if isinstance(peer, str) else None
        if donor is None:
            return []  # a dropped donor's late reply, or nobody asked
        if isinstance(msg, sp.StateIndex):
            return self._index(donor, msg, now)
        if isinstance(msg, sp.StatePiece):
            return self._piece(donor, msg, now)
        return []

    def peer_lost(self, peer: str, *, now: float) -> list[Action]:
        """A send to ``peer`` failed."""
        if self._outcome is not None or peer not in self._active:
            return []
        return self._drop(peer, False, "unreachable", now)

    def tick(self, now: float) -> list[Action]:
        """Drop the donors that owe something and sent nothing for ``timeout_s``."""
        if self._outcome is not None:
            return []
        actions: list[Action] = []
        for donor in list(self._active.values()):
            if not donor.owes() or now < donor.since + self.timeout_s:
                continue
            if len(self._active) == 1 and not self._spares:
                donor.since = now  # the last donor standing: slow beats nothing
                continue
            actions += self._drop(
                donor.peer, False, f"nothing for {self.timeout_s:g} s", now, silent=True
            )
        return actions

    # -- internals -----------------------------------------------------------------------------
    def _index(self, donor: _Donor, msg: sp.StateIndex, now: float) -> list[Action]:
        if donor.ready:
            return []
        if msg.total == 0:
            return self._drop(donor.peer, False, f"refused: {msg.reason or 'no reason'}", now)
        try:
            hashes = sp.check_index(msg, self.target, self.numel)
        except CodecError as e:
            return self._drop(donor.peer, True, f"bad index: {e}", now)
        if self._hashes is None:
            self._hashes = hashes
        donor.ready = True
        donor.step = msg.step
        donor.since = now
        return self._refill(now)

    def _piece(self, donor: _Donor, msg: sp.StatePiece, now: float) -> list[Action]:
        i = msg.index
        if self._owner.get(i) != donor.peer:
            return []  # not asked of it (a duplicate, or reassigned)
        if not msg.payload:
            return self._drop(donor.peer, False, f"refused: {msg.reason or 'no reason'}", now)
        assert self._hashes is not None
        start = i * ss.PIECE_BYTES
        size = min(ss.PIECE_BYTES, self.total - start)
        if (msg.version, msg.digest) != self.target or len(msg.payload) != size:
            return self._drop(donor.peer, True, f"piece {i} is of another state or size", now)
        if hashlib.sha256(msg.payload).digest() != self._hashes[i]:
            return self._drop(donor.peer, True, f"piece {i} does not match its hash", now)
        self._buf[start : start + size] = msg.payload
        self._verified += 1
        del self._owner[i]
        donor.since = now
        donor.served += 1
        for request in donor.requests:
            if i in request:
                request.remove(i)
                break
        while donor.requests and not donor.requests[0]:
            donor.requests.popleft()
        if self._verified == self.count:
            return self._finish()
        return self._refill(now)

    def _drop(
        self, peer: str, hostile: bool, reason: str, now: float, *, silent: bool = False
    ) -> list[Action]:
        donor = self._active.pop(peer)
        if donor.served:
            self._served[peer] = donor.served
        back = sorted(i for request in donor.requests for i in request)
        for i in back:
            del self._owner[i]
        self._todo.extendleft(reversed(back))
        self.dropped.append(Dropped(peer, hostile, reason, silent))
        log.info(
            "fragment %d: donor %s dropped (%s): %s",
            self.fragment,
            peer,
            "hostile" if hostile else "unavailable",
            reason,
        )
        return self._refill(now)

    def _refill(self, now: float) -> list[Action]:
        actions: list[Action] = []
        while len(self._active) < self.max_donors and self._spares:
            peer = self._spares.popleft()
            self._active[peer] = _Donor(peer, now)
            actions.append(
                Send(
                    peer,
                    sp.StateIndexRequest(self.me, self.run_id, self.fragment, *self.target),
                )
            )
        if not self._active:
            self._outcome = GaveUp(
                f"no donor left with {self.count - self._verified} of {self.count} pieces missing"
            )
            return [self._outcome]
        for donor in self._active.values():
            if not donor.ready:
                continue
            while self._todo and len(donor.requests) < self.window:
                run = [self._todo.popleft()]
                while self._todo and len(run) < self.per_request and self._todo[0] == run[-1] + 1:
                    run.append(self._todo.popleft())
                if not donor.requests:
                    donor.since = now  # it owes something from now on
                donor.requests.append(run)
                for i in run:
                    self._owner[i] = donor.peer
                actions.append(
                    Send(
                        donor.peer,
                        sp.StatePieceRequest(
                            self.me, self.run_id, self.fragment, *self.target, run[0], len(run)
                        ),
                    )
                )
        return actions

    def _finish(self) -> list[Action]:
        served = dict(self._served)
        for d in self._active.values():
            if d.served:
                served[d.peer] = d.served
        steps = [d.step for d in self._active.values() if d.ready] or [0]
        try:
            state = ss.decode_state(self._buf, self.numel)
        except CodecError as e:  # certified bytes that are no state: nothing to import
            self._outcome = GaveUp(f"the certified bytes are not a state: {e}")
            return [self._outcome]
        if state.version != self.target[0]:
            self._outcome = GaveUp("the certified bytes hold another version")
            return [self._outcome]
        step = int(statistics.median_low(steps))
        done = ss.FragmentState(
            state.version, state.optimizer_steps, step, state.global_params, state.momentum
        )
        self._outcome = Finished(done, tuple(sorted(served)))
        return [self._outcome]

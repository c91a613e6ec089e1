"""Driving the sans-IO round machines over a network transport.

The drivers need a :class:`~atoll.node.net.seam.RoundTransport` (the live
:class:`~atoll.node.net.host.AtollHost`, or :class:`~atoll.node.net.memory.MemoryTransport`
in tests) and, for matchmaking, a :class:`~atoll.node.net.seam.ReadyBoard` (the live
:class:`~atoll.dht.kad.AtollDHT`, or :class:`~atoll.node.net.memory.MemoryBoard`). Their
only clock is ``trio.current_time()``, so they run under ``trio.testing.MockClock`` too.

The protocol machines (:class:`~atoll.protocol.matchmaking.Matchmaker`,
:class:`~atoll.protocol.allreduce.AllReduceRound`) take events and return actions; this
module feeds them from the network and carries their actions out, in the trio loop of the
network process:

- :class:`Mailbox` reads the host's single inbox and routes each message to the round it
  belongs to, by key. Messages whose ``sender`` field is not the authenticated peer are
  dropped (the machines trust that field). Messages for a round this node has not opened
  yet (a peer formed its group a moment earlier) are held, bounded in count and bytes,
  for :attr:`Mailbox.hold_s`; messages for a round that just closed are dropped (those
  of a matchmaking slot are held: a slot is tried again after a failed round).
- :func:`run_matchmaking`: publish the declaration in the DHT, poll the DHT view of the
  slot, and run the Matchmaker until it is Formed or Alone.
- :func:`run_allreduce`: run one AllReduceRound; sends to different peers go out in
  parallel (each peer's own stream), a failed send is that peer lost. Returns Done or
  Failed, never hangs: the round's own deadlines bound it, and the sends still going
  when it ends get at most ``linger_s`` more.
- :func:`fetch_pieces`: copy a fragment's certified state from several donors at once,
  piece by piece, each piece checked as it arrives (the
  :class:`~atoll.protocol.statefetch.StateFetch` planner), bounded by a timeout;
  :func:`serve_pieces` answers a joiner's index and piece requests.
- :func:`fetch_state`: ask one peer for a fragment's whole state and reassemble its
  chunks (:mod:`atoll.protocol.statesync`), bounded by a timeout; :func:`serve_state`
  answers it. The node's syncs copy with :func:`fetch_pieces`; a node still answers this
  single-stream request.
- :func:`ask_attestations`: ask a peer for the sealed attestations it holds of one
  state (:class:`~atoll.protocol.certificate.AttestationRequest`), bounded by a timeout.

Every wait here has a deadline; nothing raises out of a round for a peer's failure: the
machines turn it into Alone or Failed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from atoll.dht.records import ReadyRecord
from atoll.node.net.seam import ReadyBoard, RoundTransport
from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import statefetch as sf
from atoll.protocol import statepieces as sp
from atoll.protocol import statesync as ss
from atoll.protocol.certificate import (
    AttestationReply,
    AttestationRequest,
    AttestationSigner,
    AttestationVerifier,
)
from atoll.protocol.errors import (
    AtollError,
    CodecError,
    ExchangeTimeout,
    PeerTimedOut,
    PeerUnavailable,
)
from atoll.protocol.liveness import Liveness
from atoll.protocol.manifest import GroupSettings

__all__ = [
    "Mailbox",
    "ReadyBoard",
    "RoundTraffic",
    "RoundTransport",
    "ask_attestations",
    "fetch_pieces",
    "fetch_state",
    "key_of",
    "run_allreduce",
    "run_matchmaking",
    "serve_attestations",
    "serve_pieces",
    "serve_state",
]

logger = logging.getLogger(__name__)

Key = Hashable
Event = tuple[str, Any]  # ("msg", message) or ("lost", peer) or ("view", declarations)


def key_of(msg: object) -> Key | None:
    """The routing key of a round message, or None for a message no round takes."""
    if isinstance(msg, ar.Part | ar.Reduced | ar.Abort | ar.Verified | ar.Evidence):
        return ("ar", msg.run_id, msg.fragment, msg.round, msg.group)
    if isinstance(msg, mm.JoinRequest | mm.JoinAccept | mm.Redirect | mm.GroupFormed | mm.Disband):
        return ("mm", msg.run_id, msg.fragment, msg.slot)
    if isinstance(msg, ss.StateChunk):
        return ("state", msg.run_id, msg.fragment, msg.sender)
    if isinstance(msg, sp.StateIndex | sp.StatePiece):
        return ("pieces", msg.run_id, msg.fragment, msg.version, msg.digest)
    if isinstance(msg, AttestationReply):
        return ("cert", msg.run_id, msg.fragment, msg.version, msg.digest, msg.sender)
    return None


def _is_slot(key: Key) -> bool:
    """Whether ``key`` is a matchmaking slot's (see :func:`key_of`)."""
    return isinstance(key, tuple) and bool(key) and key[0] == "mm"


def _size(msg: object) -> int:
    payload = getattr(msg, "payload", b"")
    size = 256 + (len(payload) if isinstance(payload, bytes) else 0)
    hashes = getattr(msg, "hashes", b"")  # a state index's piece hashes
    size += len(hashes) if isinstance(hashes, bytes) else 0
    for name in ("payloads", "seals"):  # an all-reduce Evidence's parts, a reply's seals
        items = getattr(msg, name, ())
        if isinstance(items, tuple):
            size += sum(len(b) for b in items if isinstance(b, bytes))
    return size


@dataclass(slots=True)
class _Held:
    since: float
    items: deque[tuple[str, object]] = field(default_factory=deque)
    nbytes: int = 0


class Mailbox:
    """Routes the host's incoming messages to the open rounds (see the module docstring).

    ``on_request`` handles messages no round takes (a :class:`~atoll.protocol.statesync.
    StateRequest`, say); it runs in its own task per message. ``liveness`` hears of every
    authenticated sender (a message from a peer is proof that it is there). Run
    :meth:`run` in a task.

    What a peer can make it hold is bounded twice, so that one peer (or a few fresh
    identities) flooding early messages cannot crowd out the others: all held messages
    together by ``hold_bytes`` and ``hold_messages``, each sender's by ``hold_peer_bytes``
    and ``hold_peer_messages``. Requests in progress are bounded the same way
    (``requests``, ``requests_per_peer``). What does not fit is dropped, counted in
    :attr:`dropped` and logged; nothing else is affected.
    """

    def __init__(
        self,
        host: RoundTransport,
        *,
        on_request: Callable[[str, object], Awaitable[None]] | None = None,
        hold_s: float = 30.0,
        hold_bytes: int = 512 * 1024 * 1024,
        hold_messages: int = 4096,
        closed_s: float = 2.0,
        liveness: Liveness | None = None,
        hold_peer_bytes: int = 128 * 1024 * 1024,
        hold_peer_messages: int = 512,
        requests: int = 64,
        requests_per_peer: int = 4,
        passed: Callable[[int, int], tuple[int, int] | None] | None = None,
        out_of_step: Callable[[str, mm.JoinRequest], tuple[str, int] | None] | None = None,
    ) -> None:
        self.host = host
        self.passed = passed
        """``(fragment, slot)`` -> this node's version of the fragment when it is past that
        slot (it will not match at it again), else None: a join request for such a slot
        is refused at once instead of held"""
        self.out_of_step = out_of_step
        """``(sender, request)`` -> an :data:`~atoll.protocol.matchmaking.OUT_OF_STEP`
        reason and this node's trainer step when it refuses a join request for a slot it
        is not at now as out of step
        (:func:`~atoll.protocol.matchmaking.out_of_slot_refusal`), else None"""
        self.liveness = liveness
        self.hold_s = hold_s
        self._on_request = on_request
        self._hold_bytes = hold_bytes
        self._hold_messages = hold_messages
        self._closed_s = closed_s
        self._open: dict[Key, trio.MemorySendChannel[Event]] = {}
        self._held: dict[Key, _Held] = {}
        self._closed: dict[Key, float] = {}
        self._held_bytes = 0
        self._held_count = 0
        self._hold_peer_bytes = hold_peer_bytes
        self._hold_peer_messages = hold_peer_messages
        self._peer_held: dict[str, list[int]] = {}  # sender -> [messages, bytes] held
        self._requests = requests
        self._requests_per_peer = requests_per_peer
        self._peer_requests: dict[str, int] = {}  # sender -> requests in progress
        self._requests_running = 0
        self.dropped = 0

    def open(self, key: Key, channel: trio.MemorySendChannel[Event]) -> None:
        """Deliver the messages of ``key`` to ``channel`` from now on (held ones first)."""
        self._expire(trio.current_time())
        self._closed.pop(key, None)
        self._open[key] = channel
        held = self._held.pop(key, None)
        if held is not None:
            self._release(held)
            for sender, msg in held.items:
                self._deliver(key, channel, sender, msg)

    def close(self, key: Key, channel: trio.MemorySendChannel[Event] | None = None) -> None:
        """Stop delivering ``key``; its late messages are dropped for ``closed_s``. With
        ``channel``: only while ``key`` still delivers to it (a later attempt at the same
        key may have opened it since: a group formed ahead that a sync let go while the
        sync's own matchmaking of that slot had begun; closing would cut the later one
        off)."""
        if channel is not None and self._open.get(key) is not channel:
            return
        self._open.pop(key, None)
        self._closed[key] = trio.current_time() + self._closed_s

    async def run(self) -> None:
        """Route messages until the host closes; never raises for what a peer sends."""
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    sender, msg = await self.host.receive()
                except (trio.ClosedResourceError, trio.EndOfChannel):
                    return
                self.route(sender, msg, nursery)

    def route(self, sender: str, msg: object, nursery: trio.Nursery) -> None:
        """Route one message that ``sender`` (the authenticated peer) sent."""
        claimed = getattr(msg, "sender", sender)
        if claimed != sender:
            logger.warning(
                "peer %s sent a %s claiming to be from %s: dropped",
                sender,
                type(msg).__name__,
                claimed,
            )
            self.dropped += 1
            return
        now = trio.current_time()
        if self.liveness is not None:
            self.liveness.heard(sender, now)
        key = key_of(msg)
        if key is None:
            if self._on_request is not None:
                self._start_request(sender, msg, nursery)
            return
        self._expire(now)
        channel = self._open.get(key)
        if channel is not None:
            self._deliver(key, channel, sender, msg)
            return
        if isinstance(msg, mm.JoinRequest) and self.passed is not None:
            past = self.passed(msg.fragment, msg.slot)
            if past is not None:  # the slot is over here: say so, do not let it wait
                version, step = past
                refusal = self._refuse_join(msg, f"{mm.PAST_SLOT} {version}", step)
                self._start_request(sender, msg, nursery, refusal)
                return
        if isinstance(msg, mm.JoinRequest) and self.out_of_step is not None:
            refused = self.out_of_step(sender, msg)
            if refused is not None:  # it would wait for a slot this node never reaches
                logger.info(
                    "fragment %d slot %d: refused %s as out of step (%s)",
                    msg.fragment,
                    msg.slot,
                    sender,
                    refused[0],
                )
                self._start_request(sender, msg, nursery, self._refuse_join(msg, *refused))
                return
        if key in self._closed and not _is_slot(key):
            # a round's late messages; a slot's are held: the slot may be tried again at
            # once (a peer's next attempt asks us between two of ours), and the
            # matchmaker tells an earlier attempt's answers apart itself (for_step)
            self.dropped += 1
            return
        size = _size(msg)
        mine = self._peer_held.get(sender, [0, 0])
        if mine[0] >= self._hold_peer_messages or mine[1] + size > self._hold_peer_bytes:
            logger.info(
                "peer %s already has %d messages (%d bytes) held for rounds not open: "
                "dropped its %s",
                sender,
                mine[0],
                mine[1],
                type(msg).__name__,
            )
            self.dropped += 1
            return
        if self._held_bytes + size > self._hold_bytes or self._held_count >= self._hold_messages:
            logger.info("no room to hold a %s from %s: dropped", type(msg).__name__, sender)
            self.dropped += 1
            return
        held = self._held.setdefault(key, _Held(now))
        held.items.append((sender, msg))
        held.nbytes += size
        self._held_bytes += size
        self._held_count += 1
        self._peer_held[sender] = [mine[0] + 1, mine[1] + size]

    def _deliver(
        self, key: Key, channel: trio.MemorySendChannel[Event], sender: str, msg: object
    ) -> None:
        try:
            channel.send_nowait(("msg", msg))
        except trio.WouldBlock:
            logger.info("round %s is not reading; dropped a %s from %s", key, type(msg), sender)
            self.dropped += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._open.pop(key, None)
            self.dropped += 1

    def held_by(self, sender: str) -> tuple[int, int]:
        """Messages and bytes held now from ``sender`` for rounds not yet open."""
        count, nbytes = self._peer_held.get(sender, (0, 0))
        return count, nbytes

    def _release(self, held: _Held) -> None:
        """Take what ``held`` holds off the totals and its senders' shares."""
        self._held_bytes -= held.nbytes
        self._held_count -= len(held.items)
        for sender, msg in held.items:
            mine = self._peer_held.get(sender)
            if mine is None:
                continue
            mine[0] -= 1
            mine[1] -= _size(msg)
            if mine[0] <= 0:
                del self._peer_held[sender]

    def _refuse_join(
        self, msg: mm.JoinRequest, reason: str, step: int
    ) -> Callable[[str, object], Awaitable[None]]:
        """The answer to a join request this node refuses without a slot: a Disband with
        ``reason`` and its trainer's ``step``. For a slot it is past, the reason names
        the version it is at (the requester asks another peer, or leads, at once; when
        every peer it knows is past the slot it stops looking and its trainer may move to
        that step); for a requester out of step, the requester ends alone with this step
        and moves there."""
        me = self.host.peer_id
        answer = mm.Disband(
            me, msg.run_id, msg.fragment, msg.slot, msg.version, msg.digest, reason, step, msg.step
        )

        async def refuse(sender: str, _msg: object) -> None:
            with contextlib.suppress(AtollError, CodecError):
                await self.host.send(sender, answer)

        return refuse

    def _start_request(
        self,
        sender: str,
        msg: object,
        nursery: trio.Nursery,
        handler: Callable[[str, object], Awaitable[None]] | None = None,
    ) -> None:
        running = self._peer_requests.get(sender, 0)
        if running >= self._requests_per_peer or self._requests_running >= self._requests:
            logger.info(
                "peer %s has %d requests in progress (%d in all): dropped its %s",
                sender,
                running,
                self._requests_running,
                type(msg).__name__,
            )
            self.dropped += 1
            return
        self._peer_requests[sender] = running + 1
        self._requests_running += 1
        nursery.start_soon(self._serve_request, sender, msg, handler)

    async def _serve_request(
        self,
        sender: str,
        msg: object,
        handler: Callable[[str, object], Awaitable[None]] | None = None,
    ) -> None:
        serve = handler if handler is not None else self._on_request
        assert serve is not None
        try:
            await serve(sender, msg)
        finally:
            self._requests_running -= 1
            left = self._peer_requests.get(sender, 1) - 1
            if left > 0:
                self._peer_requests[sender] = left
            else:
                self._peer_requests.pop(sender, None)

    def _expire(self, now: float) -> None:
        for key in [k for k, h in self._held.items() if now - h.since > self.hold_s]:
            held = self._held.pop(key)
            self._release(held)
            self.dropped += len(held.items)
        for key in [k for k, t in self._closed.items() if now >= t]:
            del self._closed[key]


@dataclass(slots=True)
class RoundTraffic:
    """What one round moved: wall time and payload bytes (the machine's own counts)."""

    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    members: tuple[str, ...] = ()
    parts_in_s: float | None = None
    """seconds from the start until every part of this member's chunk was in (None: never)"""
    done_s: float | None = None
    """seconds from the start until the round was done (None: it failed)"""


class _Runner:
    """Carries out Send actions in parallel tasks; a failed send reports the peer lost."""

    def __init__(
        self,
        host: RoundTransport,
        nursery: trio.Nursery,
        events: trio.MemorySendChannel[Event],
        on_sent: Callable[[object], None] | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.on_sent = on_sent
        self.liveness = liveness
        self.host = host
        self.nursery = nursery
        self.events = events
        self.pending = 0
        self.idle = trio.Event()
        self.idle.set()

    def send(self, to: str, msg: object) -> None:
        self.pending += 1
        self.idle = trio.Event() if self.pending == 1 else self.idle
        self.nursery.start_soon(self._send, to, msg)

    async def _send(self, to: str, msg: object) -> None:
        try:
            try:
                await self.host.send(to, msg)
            except PeerUnavailable as e:
                # a reset connection drops the stream; one more try opens a new one (a
                # message that did arrive the first time is a harmless duplicate). Not
                # after a timeout: a silent peer would hold the send another bound
                if isinstance(e, PeerTimedOut):
                    raise
                logger.info("sending %s to %s failed (%s); once more", type(msg).__name__, to, e)
                await self.host.send(to, msg)
            if self.on_sent is not None:
                self.on_sent(msg)
        except AtollError as e:
            logger.info("sending %s to %s failed: %s", type(msg).__name__, to, e)
            if self.liveness is not None:
                self.liveness.failed(to, trio.current_time(), f"a send failed: {e}")
            with contextlib.suppress(
                trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError
            ):
                self.events.send_nowait(("lost", to))
        finally:
            self.pending -= 1
            if self.pending == 0:
                self.idle.set()


async def _next_event(
    events: trio.MemoryReceiveChannel[Event], deadline: float | None
) -> Event | None:
    """The next event, or None when ``deadline`` (trio clock) passes first."""
    if deadline is None:
        return await events.receive()
    with trio.move_on_at(deadline):
        return await events.receive()
    return None


class _Machine(Protocol):
    """What :func:`_drive` needs of a sans-IO round machine."""

    @property
    def next_deadline(self) -> float | None: ...

    def tick(self, now: float) -> Sequence[Any]: ...

    def receive(self, msg: Any, *, now: float) -> Sequence[Any]: ...

    def peer_lost(self, peer: str, *, now: float) -> Sequence[Any]: ...


class _Refusing:
    """A matchmaker that never hears a banned peer ask to join (it waits out its answer
    bound). Its other messages pass: a leader that has not banned it may still group
    this node with it, and dropping that leader's answers would leave the group waiting
    for this node's parts."""

    def __init__(self, machine: mm.Matchmaker, banned: Callable[[str], bool]) -> None:
        self.machine = machine
        self.banned = banned
        self.tick = machine.tick
        self.peer_lost = machine.peer_lost

    @property
    def next_deadline(self) -> float | None:
        return self.machine.next_deadline

    def receive(self, msg: Any, *, now: float) -> Sequence[Any]:
        if isinstance(msg, mm.JoinRequest) and self.banned(msg.sender):
            return []
        return self.machine.receive(msg, now=now)


def _brief(msg: object) -> str:
    """A matchmaking message in one short line, for debug logs."""
    fields = ("sender", "fragment", "slot", "step", "for_step", "leader", "members", "reason")
    said = [f"{f}={getattr(msg, f)!r}"[:90] for f in fields if hasattr(msg, f)]
    return f"{type(msg).__name__}({', '.join(said)})"


async def _drive(
    machine: _Machine,
    actions: Sequence[Any],
    events: trio.MemoryReceiveChannel[Event],
    runner: _Runner,
    observe: Callable[[Any, float], Sequence[Any]] | None = None,
) -> Any:
    """Feed ``machine`` events and carry out its sends until it returns its outcome (the
    first action that is not a send). Ticks at its deadlines; ``("view", x)`` events go to
    ``observe``."""
    while True:
        outcome = None
        for action in actions:
            if isinstance(action, mm.Send | ar.Send | sf.Send):
                if isinstance(action, mm.Send) and logger.isEnabledFor(logging.DEBUG):
                    logger.debug("matchmaking: to %s: %s", action.to, _brief(action.message))
                runner.send(action.to, action.message)
            else:
                outcome = action
        if outcome is not None:
            return outcome
        event = await _next_event(events, machine.next_deadline)
        now = trio.current_time()
        if event is None:
            actions = machine.tick(now)
        elif event[0] == "msg":
            if isinstance(machine, mm.Matchmaker | _Refusing) and logger.isEnabledFor(
                logging.DEBUG
            ):
                logger.debug("matchmaking: got %s", _brief(event[1]))
            actions = machine.receive(event[1], now=now)
        elif event[0] == "lost":
            actions = machine.peer_lost(event[1], now=now)
        elif observe is not None:
            actions = observe(event[1], now)
        else:
            actions = []


# --------------------------------------------------------------------------------------
# matchmaking
# --------------------------------------------------------------------------------------
async def run_matchmaking(
    host: RoundTransport,
    mailbox: Mailbox,
    dht: ReadyBoard,
    me: mm.Declaration,
    settings: GroupSettings | Callable[[], GroupSettings],
    *,
    timeout_s: float,
    ttl_s: float,
    wall: Callable[[], float],
    poll_s: float = 0.5,
    view: Callable[[list[mm.Declaration]], None] | None = None,
    background: trio.Nursery | None = None,
    answer_s: float | None = None,
    liveness: Liveness | None = None,
    patience_s: float = 0.0,
    expected: Callable[[], Collection[str]] | None = None,
    banned: Callable[[str], bool] | None = None,
    private: Callable[[str], bool] | None = None,
    outdated: Callable[[], str | None] | None = None,
    hold: Callable[[float], None] | None = None,
    step_period: int = 0,
    max_step_lag: int = 0,
    alone_unless_seen_s: float | None = None,
    open_until: trio.Event | None = None,
    comes_later: Callable[[str], str | None] | None = None,
    stated: Callable[[str, int], None] | None = None,
) -> mm.Formed | mm.Alone:
    """Form (or fail to form) this node's group for ``me``'s slot; see the module docstring.

    ``settings`` may be a function: it is asked again at every DHT view, and the
    matchmaker resized when the answer changes (the peers that answer changed).
    ``view`` is called with every DHT view of the slot (all declarations, compatible or
    not: the caller learns from them which states the swarm holds). ``ttl_s`` is the
    lifetime of the published ready record; ``wall`` the clock records are stamped with.
    ``background``: see :func:`run_allreduce` (the DHT polls and announcements run there
    too, and stop at their next turn). ``answer_s``: the matchmaker's bound on a silent
    leader. ``liveness``: declarations of suspected peers (a request to them failed within
    their hold) are left out, as they would be asked to lead and not answer; once the hold
    passed a declaration counts again, and a request to its peer is the probe. A leader
    dropped for silence is reported to it, and so is a failed send. ``expected``: the
    peers due at this slot (read at every DHT view); one that has not declared yet
    extends the matchmaker's deadline by ``patience_s`` (once; see
    :class:`~atoll.protocol.matchmaking.Matchmaker`). ``private``: whether a peer
    cannot be dialed (the matchmaker's "Reach"). ``banned``: the declarations of
    banned peers are left out and their requests to join unanswered. ``outdated``: asked
    at every DHT view and every ``poll_s`` besides (the board may not answer); a reason
    once the state ``me`` declared lost to another, and the node then withdraws from the
    slot (:meth:`~atoll.protocol.matchmaking.Matchmaker.withdraw`) instead of waiting out
    its deadline. ``hold``: called with the seconds left to the
    deadline once the matchmaker waits with patience (peers due at the slot have not
    declared yet, or a leader took this node in), and with 0 when matchmaking ends: the
    trainer blocks meanwhile, so a node that runs ahead of the swarm falls back in step
    (see :meth:`~atoll.node.net.bridge.NetworkBridge.wait`). ``step_period`` and
    ``max_step_lag``: the matchmaker's check that groupmates are in step (its "In step").
    ``alone_unless_seen_s``: the node withdraws from the slot at the first DHT view after
    that many seconds unless some view showed another peer's compatible declaration (a
    slot joined only when somebody is there; see :class:`~atoll.protocol.sync.FindGroup`).
    ``open_until``: a group formed ahead of its sync; until the event is set (the sync
    began), a leader that could form waits for the peers ``expected`` names
    (:meth:`~atoll.protocol.matchmaking.Matchmaker.hold_open`). ``comes_later``:
    why a peer due here cannot come before this node's trainer should move on (None: it
    may come soon): its trainer is held now at another fragment's slot
    (:mod:`atoll.protocol.held`), or it has already trained past the step this node's
    trainer is held at (its schedule reaches this fragment's slot later; the two sides of
    a healed split can differ by a sync period in one fragment). When every peer this
    slot still waits for comes later, the trainer is let go (``hold(0)``) while the
    matchmaker keeps waiting for them: holding it would only make it miss the slots of
    other fragments, where those peers go first or wait for this node. ``stated``: called
    at the end with each peer's step as its matchmaking messages of this slot stated it.
    """
    key = ("mm", me.run_id, me.fragment, me.slot)
    send_ch, events = trio.open_memory_channel[Event](1024)
    now = start = trio.current_time()
    settings_of = settings if callable(settings) else (lambda: settings)
    machine = mm.Matchmaker(
        me,
        settings_of(),
        now=now,
        timeout=timeout_s,
        answer_s=answer_s,
        patience=patience_s,
        step_period=step_period,
        max_step_lag=max_step_lag,
        nonce=secrets.token_hex(8),
        private=private,
    )
    outcome: mm.Formed | mm.Alone | None = None
    mailbox.open(key, send_ch)
    stop = trio.Event()
    holding = False
    released = False  # the trainer was let go: the peers awaited are held elsewhere
    awaited: list[str] = []  # the peers due at the slot that have not declared
    mine = mm.compat_key(me)
    company = alone_unless_seen_s is None  # somebody else declared the slot
    try:
        async with contextlib.AsyncExitStack() as stack:
            io: trio.Nursery = (
                background
                if background is not None
                else await stack.enter_async_context(trio.open_nursery())
            )
            runner = _Runner(host, io, send_ch, liveness=liveness)

            async def announce() -> None:
                issued = wall()
                record = ReadyRecord.from_declaration(
                    me, issued_at=issued, expires_at=issued + ttl_s
                )
                try:
                    await dht.announce_ready(record)
                except AtollError as e:
                    logger.info("announcing ready for fragment %d failed: %s", me.fragment, e)

            async def poll() -> None:
                while not stop.is_set():
                    try:
                        records = await dht.find_ready(me.fragment, me.slot)
                        decls = [r.to_declaration() for r in records]
                        send_ch.send_nowait(("view", decls))
                    except AtollError as e:
                        logger.debug("find_ready fragment %d failed: %s", me.fragment, e)
                    except (trio.WouldBlock, trio.ClosedResourceError):
                        pass
                    with trio.move_on_after(poll_s):
                        await stop.wait()

            async def watch() -> None:
                # the swarm's certified copy is checked on a clock of its own: right after
                # a cut heals, the board's reads fail or wait out their bounds, and a sync
                # that checked only on the board's answers sat out a whole matchmaking
                # deadline at a slot the swarm had long left
                while not stop.is_set():
                    with trio.move_on_after(poll_s):
                        await stop.wait()
                    with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
                        send_ch.send_nowait(("view", None))

            async def opened() -> None:
                assert open_until is not None
                await open_until.wait()  # the sync began: the leader may form now
                with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
                    send_ch.send_nowait(("view", None))

            io.start_soon(announce)
            io.start_soon(poll)
            if outdated is not None or open_until is not None or comes_later is not None:
                io.start_soon(watch)
            if open_until is not None:
                io.start_soon(opened)

            def let_go() -> None:
                # every peer still awaited comes later than the trainer could wait for it:
                # held at another fragment's slot (maybe waiting for this node), or past
                # this node's step already (it reaches this slot after other slots)
                nonlocal holding, released
                if not holding or released or comes_later is None or not awaited:
                    return
                if machine.state in ("formed", "alone"):
                    return
                why = [comes_later(p) for p in awaited]
                if all(why):
                    assert hold is not None
                    holding, released = False, True
                    logger.info(
                        "fragment %d slot %d: the peers due here come later (%s); the "
                        "trainer trains on, the slot stays open",
                        me.fragment,
                        me.slot,
                        "; ".join(f"{p[-6:]}: {w}" for p, w in zip(awaited, why, strict=True)),
                    )
                    hold(0.0)

            def observe(decls: list[mm.Declaration] | None, now: float) -> list[Any]:
                nonlocal holding, company, awaited
                if view is not None and decls is not None:
                    view(decls)
                lost = outdated() if outdated is not None else None
                if lost is not None:
                    return machine.withdraw(lost, now=now)
                out: list[Any] = []
                if open_until is not None:
                    waited = () if open_until.is_set() or expected is None else expected()
                    out.extend(machine.hold_open(waited, now=now))
                if decls is None:  # the clock's check only: nothing new from the board
                    let_go()
                    return out
                declared = {d.peer_id for d in decls}
                if not company:
                    company = any(
                        d.peer_id != me.peer_id and mm.compat_key(d) == mine for d in decls
                    )
                    if not company and now - start >= (alone_unless_seen_s or 0.0):
                        return machine.withdraw(f"nobody else is at slot {me.slot}", now=now)
                if liveness is not None:  # a peer in its hold would not answer
                    decls = [d for d in decls if not liveness.suspected(d.peer_id, now)]
                if banned is not None:
                    decls = [d for d in decls if not banned(d.peer_id)]
                out.extend(machine.resize(settings_of(), now=now))
                if expected is not None:
                    due = [p for p in expected() if p not in declared]
                    awaited = [p for p in due if p != me.peer_id]
                    out.extend(machine.expect(due, now=now))
                out.extend(machine.observe(decls, now=now))
                waiting = machine.state not in ("formed", "alone")
                if hold is not None and machine.extended and waiting and not (holding or released):
                    holding = True
                    hold(max(0.0, machine.deadline - now))
                let_go()
                return out

            first = machine.tick(trio.current_time())
            driven = machine if banned is None else _Refusing(machine, banned)
            outcome = await _drive(driven, first, events, runner, observe)
            stop.set()
            if stated is not None:
                for peer, step in machine.stated_steps.items():
                    stated(peer, step)
            if liveness is not None:
                for peer in machine.silent:
                    liveness.failed(peer, trio.current_time(), "silent as a leader")
            if background is None:
                # the last messages (GroupFormed to the members, a Disband) must still go
                # out; what is left after the linger is cancelled (see run_allreduce)
                with trio.move_on_after(min(5.0, timeout_s)):
                    await runner.idle.wait()
                io.cancel_scope.cancel()
    finally:
        stop.set()
        mailbox.close(key, send_ch)
        if holding:
            assert hold is not None
            hold(0.0)
    return outcome


# --------------------------------------------------------------------------------------
# all-reduce
# --------------------------------------------------------------------------------------
async def run_allreduce(
    host: RoundTransport,
    mailbox: Mailbox,
    spec: ar.RoundSpec,
    payload: bytes,
    weight: float,
    *,
    phase_timeout_s: float,
    round_timeout_s: float,
    validator: ar.Validator | None = None,
    linger_s: float = 10.0,
    signer: AttestationSigner | None = None,
    opener: AttestationVerifier | None = None,
    tamper_reduced: Callable[[bytes], bytes] | None = None,
    weight_caps: Mapping[str, float] | None = None,
    traffic: RoundTraffic | None = None,
    checkpoint: Callable[[str], None] | None = None,
    background: trio.Nursery | None = None,
    liveness: Liveness | None = None,
) -> ar.Done | ar.Failed:
    """Run this node's side of one all-reduce round; Done or Failed, within the timeouts.

    ``background``: a long-lived nursery for the sends. They then finish on their own
    (each bounded by the host's ``send_timeout_s``) after the outcome is returned, and are
    never cancelled by the end of the round: a write cancelled half-way leaves a partial
    frame in the connection's encrypted stream, and py-libp2p then loses the *whole
    connection* (every stream on it, the DHT's too). Without it the sends get
    ``linger_s`` after the outcome and are cancelled after that.

    ``liveness`` hears of sends that failed. ``signer`` and ``opener`` seal this node's
    parts and open the others' (a round whose spec is ``sealed``); ``tamper_reduced``
    (the attack benchmark only) makes this node a hostile chunk owner (see
    :class:`~atoll.protocol.allreduce.AllReduceRound`). ``weight_caps``: the largest
    weight each listed member may claim, beyond the spec's cap for all (this node's view;
    see :func:`~atoll.protocol.sync.recent_member_cap`).

    ``checkpoint`` (fault injection for tests) is called with ``"start"`` before the
    first part goes out, ``"part_sent"`` once one part has been written, and
    ``"parts_sent"`` once every part has.
    """
    me = host.peer_id
    key = ("ar", spec.key.run_id, spec.key.fragment, spec.key.round, spec.key.group)
    send_ch, events = trio.open_memory_channel[Event](4 * len(spec.members) + 16)
    start = trio.current_time()
    try:
        machine = ar.AllReduceRound(
            spec,
            me,
            payload,
            weight,
            now=start,
            phase_timeout=phase_timeout_s,
            round_timeout=round_timeout_s,
            validator=validator,
            signer=signer,
            opener=opener,
            tamper_reduced=tamper_reduced,
            weight_caps=weight_caps,
        )
    except (AtollError, ValueError) as e:
        return ar.Failed(f"cannot start the round: {e}")
    outcome: ar.Done | ar.Failed | None = None
    mailbox.open(key, send_ch)
    try:
        parts_sent = 0

        def on_sent(msg: object) -> None:
            nonlocal parts_sent
            if checkpoint is None or not isinstance(msg, ar.Part):
                return
            parts_sent += 1
            if parts_sent == 1:
                checkpoint("part_sent")
            if parts_sent == len(spec.members) - 1:
                checkpoint("parts_sent")

        async with contextlib.AsyncExitStack() as stack:
            io: trio.Nursery = (
                background
                if background is not None
                else await stack.enter_async_context(trio.open_nursery())
            )
            runner = _Runner(host, io, send_ch, on_sent, liveness=liveness)
            if checkpoint is not None:
                checkpoint("start")
            outcome = await _drive(machine, machine.start(), events, runner)
            if isinstance(outcome, ar.Failed) and liveness is not None:
                for peer in outcome.missing:  # a peer, or a connection to it, went quiet
                    if peer != me:
                        liveness.failed(peer, trio.current_time(), "nothing in time in a round")
            if background is None:
                # our reduced chunk (or our Abort) is still on its way to the others
                with trio.move_on_after(linger_s):
                    await runner.idle.wait()
                io.cancel_scope.cancel()
    finally:
        mailbox.close(key, send_ch)
        if traffic is not None:
            traffic.seconds = trio.current_time() - start
            traffic.bytes_sent = machine.bytes_sent
            traffic.bytes_received = machine.bytes_received
            traffic.members = spec.members
            traffic.parts_in_s, traffic.done_s = machine.timings
    return outcome


# --------------------------------------------------------------------------------------
# state transfer
# --------------------------------------------------------------------------------------
async def fetch_state(
    host: RoundTransport,
    mailbox: Mailbox,
    peer: str,
    run_id: str,
    fragment: int,
    numel: int,
    *,
    timeout_s: float,
) -> ss.FragmentState:
    """Ask ``peer`` for its state of ``fragment`` and return it, checked.

    Raises :class:`~atoll.protocol.errors.ExchangeTimeout` when it does not arrive within
    ``timeout_s``, :class:`~atoll.protocol.errors.CodecError` when what arrives is not a
    sound state (:class:`~atoll.protocol.statesync.StateAssembler`), and the host's errors
    when the peer cannot be reached.
    """
    key = ("state", run_id, fragment, peer)
    send_ch, events = trio.open_memory_channel[Event](math.ceil(numel * 8 / ss.CHUNK_BYTES) + 8)
    assembler = ss.StateAssembler(numel)
    mailbox.open(key, send_ch)
    try:
        with trio.move_on_after(timeout_s):
            await host.send(peer, ss.StateRequest(host.peer_id, run_id, fragment))
            while True:
                kind, msg = await events.receive()
                if kind == "msg" and isinstance(msg, ss.StateChunk):
                    state = assembler.feed(msg)
                    if state is not None:
                        return state
    finally:
        mailbox.close(key, send_ch)
    raise ExchangeTimeout(f"the state of fragment {fragment} from {peer} took over {timeout_s} s")


async def serve_state(
    host: RoundTransport,
    peer: str,
    request: ss.StateRequest,
    state: ss.FragmentState | None,
    reason: str = "",
) -> None:
    """Answer ``request`` with ``state`` (None: a refusal with ``reason``); errors logged."""
    try:
        if state is None:
            await host.send(
                peer,
                ss.StateChunk(
                    host.peer_id, request.run_id, request.fragment, 0, "", 0, 0, b"", reason
                ),
            )
            return
        for chunk in ss.chunks_of(
            state, sender=host.peer_id, run_id=request.run_id, fragment=request.fragment
        ):
            await host.send(peer, chunk)
    except (AtollError, CodecError) as e:
        logger.info("serving fragment %d to %s failed: %s", request.fragment, peer, e)


async def fetch_pieces(
    host: RoundTransport,
    mailbox: Mailbox,
    fetch: sf.StateFetch,
    *,
    timeout_s: float,
    liveness: Liveness | None = None,
) -> sf.Finished | sf.GaveUp:
    """Run ``fetch`` (a multi-source copy of one state) over ``host`` until it ends, at
    most ``timeout_s``: the planner's requests go out in parallel tasks (a failed send
    drops that donor), every reply from any donor is routed here by (run, fragment,
    version, digest), and each donor's silence is bounded by the planner's own timeout.
    Never raises for what a donor does; its drops are in ``fetch.dropped``."""
    key = ("pieces", fetch.run_id, fetch.fragment, *fetch.target)
    room = 2 * fetch.max_donors * (fetch.window * fetch.per_request + 1) + 16
    send_ch, events = trio.open_memory_channel[Event](room)
    mailbox.open(key, send_ch)
    try:
        async with trio.open_nursery() as nursery:
            runner = _Runner(host, nursery, send_ch, liveness=liveness)
            with trio.move_on_after(timeout_s):
                outcome = await _drive(fetch, fetch.start(trio.current_time()), events, runner)
                nursery.cancel_scope.cancel()  # requests still being sent are moot now
                assert isinstance(outcome, sf.Finished | sf.GaveUp)
                return outcome
            nursery.cancel_scope.cancel()
    finally:
        mailbox.close(key, send_ch)
    return sf.GaveUp(
        f"took over {timeout_s:g} s ({fetch.verified} of {fetch.count} pieces verified)"
    )


async def serve_pieces(
    host: RoundTransport,
    peer: str,
    request: sp.StateIndexRequest | sp.StatePieceRequest,
    source: sp.PieceSource | None,
    *,
    step: int,
    reason: str = "",
) -> None:
    """Answer a joiner's index or piece request from ``source``, the state this node holds
    (None, or another state than the one asked for: a refusal with ``reason``); a piece
    request past the state or over :data:`~atoll.protocol.statepieces.
    MAX_PIECES_PER_REQUEST` pieces is refused too. Errors are logged."""
    me = host.peer_id
    state = (request.run_id, request.fragment, request.version, request.digest)
    held = source is not None and source.holds(request.version, request.digest)
    why = reason or "this state is not held here"
    try:
        if isinstance(request, sp.StateIndexRequest):
            if source is None or not held:
                await host.send(peer, sp.StateIndex(me, *state, 0, 0, b"", why))
            else:
                await host.send(
                    peer, sp.StateIndex(me, *state, step, len(source.data), source.hashes)
                )
            return
        first, count = request.first, request.count
        if source is None or not held:
            await host.send(peer, sp.StatePiece(me, *state, first, b"", why))
            return
        if not (
            first >= 0 and 1 <= count <= sp.MAX_PIECES_PER_REQUEST and first + count <= source.count
        ):
            why = f"no pieces {first}..{first + count - 1} of {source.count}"
            await host.send(peer, sp.StatePiece(me, *state, first, b"", why))
            return
        for i in range(first, first + count):
            await host.send(peer, sp.StatePiece(me, *state, i, source.piece(i)))
    except (AtollError, CodecError) as e:
        logger.info("serving pieces of fragment %d to %s failed: %s", request.fragment, peer, e)


# --------------------------------------------------------------------------------------
# attestations asked directly
# --------------------------------------------------------------------------------------
async def ask_attestations(
    host: RoundTransport,
    mailbox: Mailbox,
    peer: str,
    run_id: str,
    fragment: int,
    version: int,
    digest: str,
    *,
    timeout_s: float,
) -> tuple[bytes, ...]:
    """The sealed attestations ``peer`` holds of ``fragment`` at ``version`` with
    ``digest`` (unchecked: the caller checks every seal).

    Raises :class:`~atoll.protocol.errors.ExchangeTimeout` when no reply arrives within
    ``timeout_s``, and the host's errors when the peer cannot be reached. One request per
    peer and state at a time (the reply's routing key names them).
    """
    key = ("cert", run_id, fragment, version, digest, peer)
    send_ch, events = trio.open_memory_channel[Event](4)
    mailbox.open(key, send_ch)
    try:
        with trio.move_on_after(timeout_s):
            await host.send(
                peer, AttestationRequest(run_id, fragment, version, digest, host.peer_id)
            )
            while True:
                kind, msg = await events.receive()
                if kind == "msg" and isinstance(msg, AttestationReply):
                    return msg.seals
    finally:
        mailbox.close(key, send_ch)
    raise ExchangeTimeout(
        f"the attestations of fragment {fragment} version {version} from {peer}"
        f" took over {timeout_s} s"
    )


async def serve_attestations(
    host: RoundTransport, peer: str, request: AttestationRequest, seals: Sequence[bytes]
) -> None:
    """Answer ``request`` with ``seals`` (none: this node holds none); errors logged."""
    reply = AttestationReply(
        request.run_id,
        request.fragment,
        request.version,
        request.digest,
        host.peer_id,
        tuple(seals),
    )
    try:
        await host.send(peer, reply)
    except (AtollError, CodecError) as e:
        logger.info(
            "serving attestations of fragment %d to %s failed: %s", request.fragment, peer, e
        )

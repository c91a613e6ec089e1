"""An in-memory network for the round drivers: transports, a ready board and faults, on trio.

:mod:`atoll.node.net.rounds` runs over the seams of :mod:`atoll.node.net.seam`; this module
implements them in one trio loop, for tests and for simulating faults, without sockets or
threads. Its only clock is trio's (plus an injected wall clock for record expiry), so a
whole swarm runs under ``trio.testing.MockClock`` in a few milliseconds of real time.

- :class:`MemoryNetwork` (one per test, ``async with MemoryNetwork.open() as net``) owns a
  nursery with one delivery task, makes one :class:`MemoryTransport` per peer id
  (:meth:`MemoryNetwork.transport`) and holds one shared :class:`MemoryBoard`
  (:attr:`MemoryNetwork.board`).
- A send puts the message in flight and returns (a kernel buffer, not a round trip); the
  delivery task hands it to the receiver's inbox at its due time: now plus the link's
  delay plus, with :attr:`~MemoryNetwork.reorder_s`, a random jitter. Messages of one link
  with equal delays arrive in the order they were sent.
- Messages are checked as the wire would check them: with ``wire_check`` (the default)
  each one is encoded and decoded (:mod:`atoll.protocol.messages`) in ``send``, which
  raises :class:`~atoll.protocol.errors.CodecError` for one the live host could not send,
  and the receiver gets the decoded copy, never the sender's object. With
  ``wire_check=False`` the sender's object itself is delivered.

Faults, all deterministic (one ``random.Random(seed)`` draws every jitter and duplicate):

- :meth:`MemoryNetwork.kill`: a crashed process whose kernel refuses connections. Its
  ``receive`` ends (``trio.EndOfChannel``; unread messages are lost), sends to it raise
  :class:`~atoll.protocol.errors.PeerUnavailable` at once, and so do its own sends (a
  dead process sends nothing: this only stops the test's zombie coroutines). Messages in
  flight to or from it are dropped. Its ready records stay on the board until they
  expire, as in the DHT.
- :meth:`MemoryNetwork.silence`: a peer that stops answering. Messages to and from it
  vanish, in flight or not, and sends never fail.
- :meth:`MemoryNetwork.revive` undoes either (a revived peer reads a fresh inbox).
- :meth:`MemoryNetwork.partition` splits the peers into sides: messages between sides
  vanish, as for a silenced peer; :meth:`MemoryNetwork.heal` joins them again.
- :meth:`MemoryNetwork.board_of` is a peer's own view of the ready board, as a DHT of a
  small swarm gives it: a record it announces reaches the peers it can reach at that
  moment (it stays where it reached after a split), it sees only records that reached
  it, and each announcement and read tells its :class:`~atoll.protocol.liveness.Liveness`
  which peers answered (reachable) and which did not (silenced, or across a split), as
  the DHT's requests to every closest peer do.
- The board also holds attestations (:meth:`MemoryBoard.announce_attestation`,
  :meth:`MemoryBoard.find_attestations`, an
  :class:`~atoll.node.net.publisher.AttestationBoard`): one per (fragment, version,
  peer), shared by every view and visible to all (a certificate outlives the split of
  its round), each until it expires.
- :attr:`~MemoryNetwork.delay_s`, :attr:`~MemoryNetwork.link_delay_s` (per directed link),
  :attr:`~MemoryNetwork.reorder_s` and :attr:`~MemoryNetwork.duplicate` (the probability
  that a message is delivered twice): plain attributes, changeable at any time.
- :attr:`~MemoryNetwork.on_deliver`, ``(sender, to, msg) -> None``, is called right after
  each message is put in its receiver's inbox, in the delivery task: a test can kill or
  silence a peer at an exact point (after its first ``Part`` arrived somewhere, say). It
  must not block; an exception in it ends the network's nursery (and so the test).

Buffers are bounded: at most ``max_in_flight`` messages in flight (a send waits for room
at most ``send_timeout_s``, then raises PeerTimedOut, as the host's send does) and
``inbox_size`` unread messages per peer (a message that finds the inbox full is dropped,
logged and counted in :attr:`MemoryNetwork.overflowed`; tests can assert it stays 0).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from atoll.dht.records import AttestationRecord, ReadyRecord
from atoll.node.net.seam import ReadyBoard, RoundTransport
from atoll.protocol.errors import ConfigError, ExchangeTimeout, PeerTimedOut, PeerUnavailable
from atoll.protocol.liveness import Liveness
from atoll.protocol.messages import decode_message, encode_message

__all__ = ["MemoryBoard", "MemoryNetwork", "MemoryTransport"]

logger = logging.getLogger(__name__)

Inbox = tuple[str, object]
"""An inbox item: ``(authenticated sender, message)``."""


# --------------------------------------------------------------------------------------
# the ready board
# --------------------------------------------------------------------------------------
_Slot = tuple[str, int, int]  # (run, fragment, slot)
_Attests = dict[_Slot, dict[str, AttestationRecord]]  # (run, fragment, version) -> by peer


class MemoryBoard:
    """A :class:`~atoll.node.net.seam.ReadyBoard` in memory, for run ``run_id``.

    Records are held by (run, fragment, slot) and peer (a peer's newer record replaces its
    older one); :meth:`find_ready` lists those of ``run_id`` whose ``expires_at`` is still
    ahead of ``wall()``, sorted by peer id, and forgets the expired ones. :meth:`view`
    makes a board over the same records that shows only some peers' records (different
    peers' views of the DHT differ: that is how two groups form in one slot).
    """

    def __init__(
        self,
        run_id: str,
        wall: Callable[[], float],
        *,
        visible: Collection[str] | None = None,
        _records: dict[_Slot, dict[str, ReadyRecord]] | None = None,
        _reached: dict[tuple[_Slot, str], frozenset[str]] | None = None,
        _viewer: tuple[MemoryNetwork, str, Liveness | None] | None = None,
        _attests: _Attests | None = None,
    ) -> None:
        self.run_id = run_id
        self.wall = wall
        self.visible = None if visible is None else frozenset(visible)
        self._records: dict[_Slot, dict[str, ReadyRecord]] = {} if _records is None else _records
        # which peers an announcement reached (board_of views only)
        self._reached: dict[tuple[_Slot, str], frozenset[str]] = (
            {} if _reached is None else _reached
        )
        self._viewer = _viewer
        self._attests: _Attests = {} if _attests is None else _attests

    def view(self, visible: Collection[str]) -> MemoryBoard:
        """A board over the same records that shows only those of the peers ``visible``
        (announcements through it are stored for everyone)."""
        return MemoryBoard(
            self.run_id,
            self.wall,
            visible=visible,
            _records=self._records,
            _reached=self._reached,
            _attests=self._attests,
        )

    def _probe(self) -> frozenset[str] | None:
        """A board_of view: the peers its owner reaches now, told to its liveness."""
        if self._viewer is None:
            return None
        net, me, liveness = self._viewer
        now = trio.current_time()
        reached = {me}
        for peer in net.peers:
            if peer == me:
                continue
            if net.reaches(me, peer):
                reached.add(peer)
                if liveness is not None:
                    liveness.heard(peer, now)
            elif liveness is not None and not liveness.suspected(peer, now):
                liveness.failed(peer, now, "no answer to a DHT request")
        return frozenset(reached)

    async def announce_ready(self, record: ReadyRecord, /) -> None:
        """Store ``record`` until its ``expires_at`` (replacing the peer's older one)."""
        await trio.lowlevel.checkpoint()
        if not isinstance(record, ReadyRecord):
            raise ConfigError(f"announce_ready takes a ReadyRecord, not {type(record).__name__}")
        slot = (record.run_id, record.fragment, record.slot)
        self._records.setdefault(slot, {})[record.peer_id] = record
        reached = self._probe()
        key = (slot, record.peer_id)
        if reached is None:
            self._reached.pop(key, None)
        else:
            self._reached[key] = reached

    async def find_ready(self, fragment: int, slot: int, /) -> list[ReadyRecord]:
        """The unexpired ready records of this run's ``fragment`` and ``slot`` it shows."""
        await trio.lowlevel.checkpoint()
        self._probe()
        return self.records(fragment, slot)

    async def announce_attestation(self, record: AttestationRecord, /) -> None:
        """Store ``record`` until its ``expires_at`` (replacing the peer's older one of
        the same fragment and version)."""
        await trio.lowlevel.checkpoint()
        if not isinstance(record, AttestationRecord):
            raise ConfigError(
                f"announce_attestation takes an AttestationRecord, not {type(record).__name__}"
            )
        key = (record.run_id, record.fragment, record.version)
        self._attests.setdefault(key, {})[record.peer_id] = record
        self._probe()

    async def find_attestations(self, fragment: int, version: int, /) -> list[AttestationRecord]:
        """The unexpired attestation records of this run's ``fragment`` at ``version``,
        sorted by peer id."""
        await trio.lowlevel.checkpoint()
        self._probe()
        key = (self.run_id, fragment, version)
        held = self._attests.get(key, {})
        now = self.wall()
        for peer in [p for p, r in held.items() if r.expires_at <= now]:
            del held[peer]
        if not held:
            self._attests.pop(key, None)
        return [held[p] for p in sorted(held)]

    def records(self, fragment: int, slot: int) -> list[ReadyRecord]:
        """:meth:`find_ready` without the checkpoint (for tests' own looks)."""
        key = (self.run_id, fragment, slot)
        held = self._records.get(key, {})
        now = self.wall()
        for peer in [p for p, r in held.items() if r.expires_at <= now]:
            del held[peer]
        if not held:
            self._records.pop(key, None)
        viewer = None if self._viewer is None else self._viewer[1]
        return [
            held[p]
            for p in sorted(held)
            if (self.visible is None or p in self.visible)
            and (viewer is None or viewer in self._reached.get((key, p), (viewer,)))
        ]


# --------------------------------------------------------------------------------------
# transports
# --------------------------------------------------------------------------------------
class MemoryTransport:
    """One peer's :class:`~atoll.node.net.seam.RoundTransport` on a :class:`MemoryNetwork`
    (made by :meth:`MemoryNetwork.transport`; see the module docstring for the faults)."""

    def __init__(self, network: MemoryNetwork, peer_id: str, inbox_size: int) -> None:
        self._network = network
        self._peer_id = peer_id
        self._inbox_size = inbox_size
        self._inbox: trio.MemorySendChannel[Inbox]
        self._messages: trio.MemoryReceiveChannel[Inbox]
        self._inbox, self._messages = trio.open_memory_channel[Inbox](inbox_size)

    @property
    def peer_id(self) -> str:
        """This peer's id."""
        return self._peer_id

    async def send(self, peer: str, msg: object, /) -> None:
        """Put ``msg`` in flight to ``peer``; raises as the module docstring says."""
        await self._network._send(self._peer_id, peer, msg)

    async def receive(self, *, timeout_s: float | None = None) -> Inbox:
        """The next ``(sender, message)``; ``trio.EndOfChannel`` once killed or closed.

        With ``timeout_s``, :class:`~atoll.protocol.errors.ExchangeTimeout` when nothing
        arrives within it (as the live host's ``receive``).
        """
        if timeout_s is None:
            return await self._messages.receive()
        with trio.move_on_after(timeout_s):
            return await self._messages.receive()
        raise ExchangeTimeout(f"no message arrived for {self._peer_id} within {timeout_s} s")

    def _offer(self, item: Inbox) -> bool:
        """Put ``item`` in the inbox at once; False when it was dropped (full or closed)."""
        try:
            self._inbox.send_nowait(item)
        except trio.WouldBlock:
            self._network.overflowed += 1
            logger.warning(
                "inbox of %s full (%d): dropped a %s from %s",
                self._peer_id,
                self._inbox_size,
                type(item[1]).__name__,
                item[0],
            )
            return False
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    def _close(self) -> None:
        """End ``receive`` (``trio.EndOfChannel``) and lose the unread messages."""
        self._inbox.close()
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            while True:
                self._messages.receive_nowait()

    def _reopen(self) -> None:
        """A fresh inbox (after :meth:`_close`)."""
        self._inbox, self._messages = trio.open_memory_channel[Inbox](self._inbox_size)


# --------------------------------------------------------------------------------------
# the network
# --------------------------------------------------------------------------------------
@dataclass(order=True, slots=True)
class _InFlight:
    due: float
    seq: int
    sender: str = field(compare=False)
    to: str = field(compare=False)
    msg: object = field(compare=False)


def _check_probability(name: str, p: float) -> None:
    if not (math.isfinite(p) and 0.0 <= p <= 1.0):
        raise ConfigError(f"{name} must be in [0, 1], not {p!r}")


def _check_seconds(name: str, s: float) -> None:
    if not (math.isfinite(s) and s >= 0.0):
        raise ConfigError(f"{name} must be finite and >= 0, not {s!r}")


class MemoryNetwork:
    """Peers in one trio loop, with faults (see the module docstring).

    Use :meth:`open`. ``wall`` stamps and expires ready records (default
    ``trio.current_time``, so they expire on the fake clock too); ``seed`` fixes every
    random draw.

    Counters: ``sent`` (messages put in flight, duplicates not counted), ``delivered``,
    ``duplicated``, ``vanished`` (dropped by a kill or a silence) and ``overflowed``.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        run_id: str = "memory-run",
        seed: int = 0,
        wall: Callable[[], float] | None = None,
        delay_s: float = 0.0,
        reorder_s: float = 0.0,
        duplicate: float = 0.0,
        wire_check: bool = True,
        inbox_size: int = 4096,
        max_in_flight: int = 65536,
        send_timeout_s: float = 30.0,
    ) -> None:
        _check_seconds("delay_s", delay_s)
        _check_seconds("reorder_s", reorder_s)
        _check_probability("duplicate", duplicate)
        if inbox_size < 1 or max_in_flight < 1:
            raise ConfigError("inbox_size and max_in_flight must be >= 1")
        if not send_timeout_s > 0:
            raise ConfigError(f"send_timeout_s must be > 0, not {send_timeout_s!r}")
        self.wall: Callable[[], float] = wall if wall is not None else trio.current_time
        self.board = MemoryBoard(run_id, self.wall)
        self.delay_s = delay_s
        """delay of every message (seconds of trio's clock) on links without their own"""
        self.link_delay_s: dict[tuple[str, str], float] = {}
        """delay of the messages from ``sender`` to ``to``, by ``(sender, to)``"""
        self.reorder_s = reorder_s
        """each message is delayed by a further uniform draw from [0, reorder_s]"""
        self.duplicate = duplicate
        """probability that a message is delivered twice"""
        self.on_deliver: Callable[[str, str, object], None] | None = None
        """called with ``(sender, to, msg)`` right after each delivery"""
        self.wire_check = wire_check
        self.send_timeout_s = send_timeout_s
        self.sent = 0
        self.delivered = 0
        self.duplicated = 0
        self.vanished = 0
        self.overflowed = 0
        self._rng = random.Random(seed)
        self._inbox_size = inbox_size
        self._transports: dict[str, MemoryTransport] = {}
        self._dead: set[str] = set()
        self._silent: set[str] = set()
        self._side: dict[str, int] = {}
        self._heap: list[_InFlight] = []
        self._seq = 0
        self._room = trio.Semaphore(max_in_flight)
        self._wakeup = trio.Event()
        self._closed = False
        self._cancel = trio.CancelScope()
        nursery.start_soon(self._deliver_loop)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        *,
        run_id: str = "memory-run",
        seed: int = 0,
        wall: Callable[[], float] | None = None,
        delay_s: float = 0.0,
        reorder_s: float = 0.0,
        duplicate: float = 0.0,
        wire_check: bool = True,
        inbox_size: int = 4096,
        max_in_flight: int = 65536,
        send_timeout_s: float = 30.0,
    ) -> AsyncIterator[MemoryNetwork]:
        """A network whose delivery task runs in a nursery of its own until the block
        ends; then every transport is closed (``receive`` ends) and in-flight messages are
        dropped."""
        async with trio.open_nursery() as nursery:
            net = cls(
                nursery,
                run_id=run_id,
                seed=seed,
                wall=wall,
                delay_s=delay_s,
                reorder_s=reorder_s,
                duplicate=duplicate,
                wire_check=wire_check,
                inbox_size=inbox_size,
                max_in_flight=max_in_flight,
                send_timeout_s=send_timeout_s,
            )
            try:
                yield net
            finally:
                net.close()

    # -- peers ----------------------------------------------------------------------------
    def transport(self, peer_id: str) -> MemoryTransport:
        """The transport of peer ``peer_id``, which joins the network on the first call."""
        if not isinstance(peer_id, str) or not peer_id:
            raise ConfigError(f"a peer id is a non-empty string, not {peer_id!r}")
        transport = self._transports.get(peer_id)
        if transport is None:
            transport = MemoryTransport(self, peer_id, self._inbox_size)
            self._transports[peer_id] = transport
        return transport

    @property
    def peers(self) -> tuple[str, ...]:
        """Every peer id on the network, in the order they were added."""
        return tuple(self._transports)

    def kill(self, peer: str) -> None:
        """Crash ``peer`` (see the module docstring); killing a dead peer does nothing."""
        transport = self._known(peer)
        if peer in self._dead:
            return
        logger.info("memory network: %s killed", peer)
        self._dead.add(peer)
        transport._close()

    def silence(self, peer: str) -> None:
        """Make every message to and from ``peer`` vanish (see the module docstring)."""
        self._known(peer)
        logger.info("memory network: %s silenced", peer)
        self._silent.add(peer)

    def revive(self, peer: str) -> None:
        """Undo :meth:`kill` (a fresh inbox) and :meth:`silence` of ``peer``."""
        transport = self._known(peer)
        if peer in self._dead:
            self._dead.discard(peer)
            transport._reopen()
        self._silent.discard(peer)

    def partition(self, *sides: Collection[str]) -> None:
        """Split the network: messages between peers of different ``sides`` vanish (a
        peer named in no side is alone on its own)."""
        side: dict[str, int] = {}
        for i, peers in enumerate(sides):
            for peer in peers:
                self._known(peer)
                if peer in side:
                    raise ConfigError(f"peer {peer!r} is on two sides")
                side[peer] = i
        for i, peer in enumerate(p for p in self._transports if p not in side):
            side[peer] = len(sides) + i
        logger.info("memory network: split into %s", [sorted(s) for s in sides])
        self._side = side

    def heal(self) -> None:
        """Undo :meth:`partition`: every side reaches every other again."""
        logger.info("memory network: healed")
        self._side = {}

    def reaches(self, sender: str, to: str) -> bool:
        """Whether a message from ``sender`` to ``to`` would arrive now."""
        return to in self._transports and not self._blocked(sender, to) and to not in self._dead

    def board_of(self, peer: str, liveness: Liveness | None = None) -> MemoryBoard:
        """``peer``'s own view of the shared board (see the module docstring)."""
        self._known(peer)
        board = self.board
        return MemoryBoard(
            board.run_id,
            board.wall,
            _records=board._records,
            _reached=board._reached,
            _viewer=(self, peer, liveness),
            _attests=board._attests,
        )

    def is_dead(self, peer: str) -> bool:
        """Whether ``peer`` is killed (and not revived)."""
        return peer in self._dead

    def close(self) -> None:
        """Close every transport and stop delivering (what is in flight is dropped)."""
        if self._closed:
            return
        self._closed = True
        self._cancel.cancel()
        self.vanished += len(self._heap)
        self._heap.clear()
        for transport in self._transports.values():
            transport._close()

    def _known(self, peer: str) -> MemoryTransport:
        transport = self._transports.get(peer)
        if transport is None:
            raise ConfigError(f"no peer {peer!r} on the network")
        return transport

    # -- sending --------------------------------------------------------------------------
    def _delay(self, sender: str, to: str) -> float:
        delay = self.link_delay_s.get((sender, to), self.delay_s)
        if self.reorder_s > 0:
            delay += self._rng.uniform(0.0, self.reorder_s)
        return delay

    def _blocked(self, sender: str, to: str) -> bool:
        """Whether a message from ``sender`` to ``to`` vanishes now."""
        stopped = self._dead | self._silent
        if sender in stopped or to in stopped:
            return True
        return bool(self._side) and self._side.get(sender) != self._side.get(to)

    async def _send(self, sender: str, to: str, msg: object) -> None:
        await trio.lowlevel.checkpoint()
        if self.wire_check:
            msg = decode_message(encode_message(msg))  # CodecError, as the host raises it
        if to == sender:
            raise ConfigError("a node does not send messages to itself")
        if self._closed:
            raise PeerUnavailable(f"{sender} cannot send to {to}: the network is closed")
        if to not in self._transports:
            raise PeerUnavailable(f"{sender} cannot reach {to}: no such peer")
        if sender in self._dead:
            raise PeerUnavailable(f"{sender} is dead and sends nothing")
        if to in self._dead:
            raise PeerUnavailable(f"{to} refused the connection from {sender} (dead)")
        if self._blocked(sender, to):
            self.vanished += 1
            return
        with trio.move_on_after(self.send_timeout_s):
            await self._room.acquire()
            self._push(sender, to, msg)
            self.sent += 1
            if self.duplicate > 0 and self._rng.random() < self.duplicate:
                with contextlib.suppress(trio.WouldBlock):
                    self._room.acquire_nowait()
                    self._push(sender, to, msg)
                    self.duplicated += 1
            return
        raise PeerTimedOut(
            f"sending {type(msg).__name__} from {sender} to {to} timed out after "
            f"{self.send_timeout_s} s: {len(self._heap)} messages in flight"
        )

    def _push(self, sender: str, to: str, msg: object) -> None:
        self._seq += 1
        due = trio.current_time() + self._delay(sender, to)
        heapq.heappush(self._heap, _InFlight(due, self._seq, sender, to, msg))
        self._wakeup.set()

    # -- delivering -----------------------------------------------------------------------
    async def _deliver_loop(self) -> None:
        with self._cancel:
            while True:
                now = trio.current_time()
                while self._heap and self._heap[0].due <= now:
                    item = heapq.heappop(self._heap)
                    self._room.release()
                    self._deliver(item)
                self._wakeup = trio.Event()
                due = self._heap[0].due if self._heap else math.inf
                with trio.move_on_at(due):
                    await self._wakeup.wait()

    def _deliver(self, item: _InFlight) -> None:
        if self._blocked(item.sender, item.to):
            self.vanished += 1
            return
        if not self._transports[item.to]._offer((item.sender, item.msg)):
            return
        self.delivered += 1
        if self.on_deliver is not None:
            self.on_deliver(item.sender, item.to, item.msg)


if TYPE_CHECKING:  # static checks only: the memory classes fit the seams
    from atoll.node.net.publisher import AttestationBoard

    def _fits(
        transport: MemoryTransport, board: MemoryBoard
    ) -> tuple[RoundTransport, ReadyBoard, AttestationBoard]:
        return transport, board, board

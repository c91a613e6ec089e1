"""Keeping this peer's record in the DHT fresh.

:class:`RecordPublisher` announces the node's :class:`~atoll.dht.records.PeerRecord`
(addresses, per-fragment versions and digests, tokens/s) once at start, again within
``min_gap_s`` of a change of any fragment's version, and before the record expires (at a
third of its lifetime). A failed announce is logged and retried at the next turn: the
peers' view of this node is eventually right, never blocking a sync.

:class:`AttestationPublisher` does the same for this member's attestations of committed
rounds (:class:`~atoll.protocol.certificate.Attestation`): :meth:`~AttestationPublisher.
submit` seals one at once (the syncer calls it right after a commit; it never waits) and
the publisher's task puts it in the DHT as an
:class:`~atoll.dht.records.AttestationRecord` under (fragment, version, this peer),
retrying a failed announce every ``retry_s``, and republishing the attestation of the
state it still holds before its record expires (at a third of its lifetime), so that a
joiner can check the state long after its round. One attestation per fragment is kept:
memory is bounded by the fragments, and the queue of unpublished ones too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from atoll.dht.records import MAX_TTL_S, AttestationRecord, PeerRecord
from atoll.protocol.certificate import Attestation, AttestationSigner, seal_attestation
from atoll.protocol.errors import AtollError

__all__ = [
    "ATTESTATION_TTL_S",
    "RECORD_TTL_S",
    "AttestationBoard",
    "AttestationPublisher",
    "RecordPublisher",
]

logger = logging.getLogger(__name__)

RECORD_TTL_S = 120.0
"""lifetime of a published peer record; it is refreshed at a third of it"""


class PeerAnnouncer(Protocol):
    """What the publisher needs of the DHT."""

    async def announce_peer(self, record: PeerRecord, /) -> None: ...


class RecordPublisher:
    """Publishes the record ``make_record`` builds (see the module docstring)."""

    def __init__(
        self,
        dht: PeerAnnouncer,
        make_record: Callable[[], Awaitable[PeerRecord]],
        versions: Callable[[], tuple[int, ...]],
        *,
        ttl_s: float = RECORD_TTL_S,
        min_gap_s: float = 2.0,
    ) -> None:
        self.dht = dht
        self.make_record = make_record
        self.versions = versions
        self.ttl_s = ttl_s
        self.min_gap_s = min_gap_s
        self._published: tuple[int, ...] | None = None
        self._at = -float("inf")

    async def publish_once(self) -> bool:
        """Build and announce the record now; False when that failed (logged)."""
        mark = self.versions()
        record = await self.make_record()
        try:
            await self.dht.announce_peer(record)
        except AtollError as e:
            logger.info("publishing the peer record failed: %s", e)
            return False
        self._published = mark
        self._at = trio.current_time()
        return True

    async def publish_if_changed(self) -> bool:
        """Publish now when the state changed since the last record; False when that
        failed."""
        if self.versions() == self._published:
            return True
        return await self.publish_once()

    async def run(self) -> None:
        """Republish on a change (at most every ``min_gap_s``) and before expiry, forever."""
        while True:
            await trio.sleep(self.min_gap_s)
            stale = trio.current_time() - self._at > self.ttl_s / 3
            if self.versions() != self._published or stale:
                await self.publish_once()


ATTESTATION_TTL_S = MAX_TTL_S
"""lifetime of a published attestation record (the longest a record may live); the
attestation of a state still held is republished at a third of it"""


class AttestationBoard(Protocol):
    """Where attestations are published and found (the DHT, or the in-memory board)."""

    async def announce_attestation(self, record: AttestationRecord, /) -> None: ...

    async def find_attestations(
        self, fragment: int, version: int, /
    ) -> list[AttestationRecord]: ...


class AttestationPublisher:
    """Publishes this member's attestations (see the module docstring).

    ``held(p)`` is the ``(version, digest)`` of fragment ``p`` this node holds now: an
    attestation is republished only while it names that state. Times: ``wall`` stamps
    records (they expire on it); the retry and refresh periods run on trio's clock.
    """

    def __init__(
        self,
        board: AttestationBoard,
        signer: AttestationSigner,
        *,
        peer_id: str,
        wall: Callable[[], float],
        held: Callable[[int], tuple[int, str]] | None = None,
        ttl_s: float = ATTESTATION_TTL_S,
        retry_s: float = 2.0,
    ) -> None:
        self.board = board
        self.signer = signer
        self.peer_id = peer_id
        self.wall = wall
        self.held = held
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._latest: dict[int, tuple[Attestation, bytes, float]] = {}
        """per fragment: the newest attestation, its seal, when it was last published
        (-inf: not yet)"""
        self._wake = trio.Event()
        self.published = 0

    def submit(self, attestation: Attestation) -> None:
        """Seal ``attestation`` now and have it published soon (never waits)."""
        held = self._latest.get(attestation.fragment)
        if held is not None and held[0].version > attestation.version:
            return
        sealed = seal_attestation(attestation, self.signer)
        self._latest[attestation.fragment] = (attestation, sealed, -float("inf"))
        self._wake.set()

    def sealed(self, fragment: int) -> bytes | None:
        """The newest sealed attestation of ``fragment`` (to hand to a peer), or None."""
        held = self._latest.get(fragment)
        return None if held is None else held[1]

    async def publish_due(self) -> None:
        """Publish every attestation not yet published, and republish those of states
        still held that are a third of their lifetime old."""
        now = trio.current_time()
        for p, (attestation, sealed, at) in list(self._latest.items()):
            fresh = now - at < self.ttl_s / 3
            if fresh or (at > -float("inf") and not self._still_held(attestation)):
                continue
            wall = self.wall()
            record = AttestationRecord(
                self.peer_id,
                attestation.run_id,
                attestation.fragment,
                attestation.version,
                attestation.digest,
                sealed,
                wall,
                wall + self.ttl_s,
            )
            try:
                await self.board.announce_attestation(record)
            except AtollError as e:
                logger.info(
                    "publishing the attestation of fragment %d version %d failed: %s",
                    attestation.fragment,
                    attestation.version,
                    e,
                )
                continue
            self.published += 1
            current = self._latest.get(p)
            if current is not None and current[0] == attestation:
                self._latest[p] = (attestation, sealed, trio.current_time())

    def _still_held(self, attestation: Attestation) -> bool:
        if self.held is None:
            return True
        return self.held(attestation.fragment) == (attestation.version, attestation.digest)

    async def run(self) -> None:
        """Publish what :meth:`submit` hands over, retry failures every ``retry_s`` and
        republish before expiry, forever."""
        while True:
            self._wake = trio.Event()  # before publishing: a submit meanwhile wakes the wait
            await self.publish_due()
            with trio.move_on_after(self.retry_s):
                await self._wake.wait()

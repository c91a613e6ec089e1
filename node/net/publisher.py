"""Keeping this peer's record in the DHT fresh.

:class:`RecordPublisher` announces the node's :class:`~atoll.dht.records.PeerRecord`
(addresses, per-fragment versions and digests, tokens/s) once at start, again within
``min_gap_s`` of a change of any fragment's version, and before the record expires (at a
third of its lifetime). A failed announce is logged and retried at the next turn: the
peers' view of this node is eventually right, never blocking a sync.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from atoll.dht.records import PeerRecord
from atoll.protocol.errors import AtollError

__all__ = ["RECORD_TTL_S", "RecordPublisher"]

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

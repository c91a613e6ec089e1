"""The peer directory: one node's view of its run, built from the records it has read.

The network side reads records out of the DHT (:func:`atoll.dht.records.decode_value`) and
hands them to :meth:`PeerDirectory.update`; the rest of the node asks the directory who is
there (:meth:`~PeerDirectory.peers`), who is ready for a sync
(:meth:`~PeerDirectory.ready`, the input of
:meth:`atoll.protocol.matchmaking.Matchmaker.observe`), who can serve a fragment's state
(:meth:`~PeerDirectory.servers`) and how the run looks as a whole
(:meth:`~PeerDirectory.summary`, for ``atoll status``).

Each record fills one place: a peer's PeerRecord, its ReadyRecord for a (fragment, slot),
its StateRecord for a fragment. A place keeps the record with the latest ``issued_at``
(:func:`atoll.dht.records.is_newer`). Time is the injected :class:`Clock`'s wall time,
compared with the publishers' wall times under the skew bound of
:mod:`atoll.dht.records`; nothing here sleeps, reads a clock of its own or does I/O.
Expired records are invisible to every query at once and removed for good by
:meth:`~PeerDirectory.expire` (or when room is needed). The directory holds at most
``max_records`` records, so a flood of identities costs a bounded amount of memory.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, TypeVar

from atoll.dht.keys import check_run_id
from atoll.dht.records import (
    DEFAULT_MAX_SKEW_S,
    PeerRecord,
    ReadyRecord,
    Record,
    RejectedRecord,
    StateRecord,
    check_record,
    is_newer,
)
from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.manifest import short_id
from atoll.protocol.matchmaking import Declaration

__all__ = [
    "Clock",
    "DirectorySummary",
    "FragmentSummary",
    "PeerDirectory",
]

logger = logging.getLogger(__name__)

_R = TypeVar("_R", PeerRecord, ReadyRecord, StateRecord)


class Clock(Protocol):
    """The time source of the directory (injected; a fake one in tests)."""

    def wall(self) -> float:
        """Wall-clock time in seconds since the epoch, as records carry it."""
        ...


@dataclass(frozen=True, slots=True)
class FragmentSummary:
    """What the directory knows about one fragment."""

    fragment: int
    """the fragment index"""
    versions: tuple[tuple[int, int], ...]
    """``(global version, peers that hold it)``, newest version first"""
    servers: int
    """peers with a live StateRecord for it"""


@dataclass(frozen=True, slots=True)
class DirectorySummary:
    """The run at a glance, for ``atoll status``."""

    run_id: str
    """the run the directory belongs to"""
    at: float
    """the wall time the summary was taken at"""
    peers: int
    """peers with a live PeerRecord"""
    serving: int
    """of those, peers that say they serve state"""
    tokens_per_s: float
    """sum of the peers' self-reported throughput (informative only)"""
    fragments: tuple[FragmentSummary, ...]
    """per fragment, by index"""


class PeerDirectory:
    """The live records of one run, latest per place, expiring on the injected clock.

    Args:
        clock: where wall time comes from.
        run_id: the run (64 hex digits); records of any other run are refused.
        max_records: most records held at once (all kinds together).
        max_skew_s: how far ahead of this clock a record's ``issued_at`` may be.

    Raises:
        ConfigError: a malformed run id, or limits that are not positive.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        run_id: str,
        max_records: int = 10_000,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
    ) -> None:
        try:
            self._run_id = check_run_id(run_id)
        except CodecError as e:
            raise ConfigError(f"run_id: {e}") from e
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
            raise ConfigError(f"max_records must be an int >= 1, not {max_records!r}")
        if (
            isinstance(max_skew_s, bool)
            or not isinstance(max_skew_s, int | float)
            or not 0 <= max_skew_s < math.inf
        ):
            raise ConfigError(f"max_skew_s must be finite and >= 0, not {max_skew_s!r}")
        self._clock = clock
        self._max_records = max_records
        self._max_skew_s = float(max_skew_s)
        self._peers: dict[str, PeerRecord] = {}
        self._ready: dict[tuple[int, int], dict[str, ReadyRecord]] = {}
        self._state: dict[int, dict[str, StateRecord]] = {}
        self._count = 0

    @property
    def run_id(self) -> str:
        """The run this directory belongs to."""
        return self._run_id

    def __len__(self) -> int:
        """Records held, expired ones not yet removed included."""
        return self._count

    # -- updates -------------------------------------------------------------------------------
    def update(self, record: Record) -> bool:
        """Take in ``record``; True when it was stored, False when the held one is as new.

        The record must be of this run and pass every rule but the key's
        (:func:`atoll.dht.records.check_record`); it replaces the record in its place when
        that one has expired or was issued earlier.

        Raises:
            RejectedRecord: another run (``run``), a broken rule, or no room left after
                removing expired records (``capacity``).
        """
        if (
            isinstance(record, PeerRecord | ReadyRecord | StateRecord)
            and record.run_id != self._run_id
        ):
            raise RejectedRecord(
                "run",
                f"record of run {short_id(str(record.run_id))},"
                f" this directory is run {short_id(self._run_id)}",
            )
        now = self._clock.wall()
        check_record(record, now=now, max_skew_s=self._max_skew_s)
        peer = record.peer_id
        if isinstance(record, PeerRecord):
            if not self._admit(self._peers.get(peer), record, now):
                return False
            self._peers[peer] = record
        elif isinstance(record, ReadyRecord):
            slot = (record.fragment, record.slot)
            if not self._admit(self._ready.get(slot, {}).get(peer), record, now):
                return False
            self._ready.setdefault(slot, {})[peer] = record
        elif isinstance(record, StateRecord):
            fragment = record.fragment
            if not self._admit(self._state.get(fragment, {}).get(peer), record, now):
                return False
            self._state.setdefault(fragment, {})[peer] = record
        else:  # attestations are the certificate checks' (atoll.protocol.certificate)
            return False
        logger.debug(
            "run %s: stored the %s of peer %s",
            short_id(self._run_id),
            type(record).__name__,
            peer,
        )
        return True

    def _admit(self, held: Record | None, record: Record, now: float) -> bool:
        """Whether ``record`` takes the place of ``held``; counts (and makes room for) a
        new place. Tables are created only after this, so refused records leave nothing."""
        if held is not None:
            return not now < held.expires_at or is_newer(record, held)
        if self._count >= self._max_records:
            self.expire()
        if self._count >= self._max_records:
            raise RejectedRecord(
                "capacity", f"the directory holds {self._max_records} live records"
            )
        self._count += 1
        return True

    def expire(self) -> int:
        """Remove every expired record; return how many were removed."""
        now = self._clock.wall()
        removed = _drop_expired(self._peers, now)
        for slot in list(self._ready):
            removed += _drop_expired(self._ready[slot], now)
            if not self._ready[slot]:
                del self._ready[slot]
        for fragment in list(self._state):
            removed += _drop_expired(self._state[fragment], now)
            if not self._state[fragment]:
                del self._state[fragment]
        self._count -= removed
        return removed

    # -- queries -------------------------------------------------------------------------------
    def peers(self) -> list[PeerRecord]:
        """The live PeerRecords, ordered by peer id."""
        now = self._clock.wall()
        return [r for _, r in sorted(self._peers.items()) if now < r.expires_at]

    def get(self, peer_id: str) -> PeerRecord | None:
        """The live PeerRecord of ``peer_id``, or None."""
        record = self._peers.get(peer_id)
        if record is None or not self._clock.wall() < record.expires_at:
            return None
        return record

    def ready(self, fragment: int, slot: int) -> list[Declaration]:
        """The declarations of the peers ready for ``fragment``'s sync ``slot``, by peer id.

        This is what :meth:`atoll.protocol.matchmaking.Matchmaker.observe` takes.
        """
        now = self._clock.wall()
        place = self._ready.get((fragment, slot), {})
        return [r.to_declaration() for _, r in sorted(place.items()) if now < r.expires_at]

    def servers(self, fragment: int) -> list[StateRecord]:
        """The live StateRecords of ``fragment``: newest version first, then by peer id."""
        now = self._clock.wall()
        live = [r for r in self._state.get(fragment, {}).values() if now < r.expires_at]
        return sorted(live, key=lambda r: (-r.version, r.peer_id))

    def summary(self) -> DirectorySummary:
        """Peers, throughput and versions per fragment, as of now."""
        now = self._clock.wall()
        peers = self.peers()
        held: dict[int, Counter[int]] = {}
        for r in peers:
            for fragment, version in enumerate(r.versions):
                held.setdefault(fragment, Counter())[version] += 1
        served = {f: n for f in self._state if (n := len(self.servers(f)))}
        fragments = tuple(
            FragmentSummary(
                fragment=f,
                versions=tuple(sorted(held.get(f, Counter()).items(), reverse=True)),
                servers=served.get(f, 0),
            )
            for f in sorted(held.keys() | served.keys())
        )
        return DirectorySummary(
            run_id=self._run_id,
            at=now,
            peers=len(peers),
            serving=sum(r.serving for r in peers),
            tokens_per_s=math.fsum(r.tokens_per_s for r in peers),
            fragments=fragments,
        )


def _drop_expired(table: dict[str, _R], now: float) -> int:
    """Delete the records of ``table`` that expired by ``now``; return how many."""
    gone = [peer for peer, r in table.items() if not now < r.expires_at]
    for peer in gone:
        del table[peer]
    return len(gone)

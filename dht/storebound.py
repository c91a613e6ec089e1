"""What peers of the network may make one of this node's DHT stores keep: the bounds, the
ledger that applies them, and the limiter of the log lines about it (sans-IO).

py-libp2p's Kademlia bounds neither of its stores (values, provider entries) per peer,
nor its provider store in all, and a peer may store under any number of keys (one signer
can seal records for any run, fragment and slot; identities are free). So
:mod:`atoll.dht.kad` counts every value and provider entry a peer sends in a
:class:`StoreLedger`, one per store, under :class:`StoreBounds`: by default
:data:`MAX_STORED` entries in all, :data:`MAX_STORED_PER_PEER` per peer, and a fair share
of :data:`FAIR_SHARE`. The adapter decides which peer an entry counts for, when it
expires, and what the store does with an :class:`Admission`; this module only decides.

The rule
--------
Where one more entry would pass a bound, the ledger first drops the expired entries (an
entry expires at the wall time it was admitted with). Then a peer at ``per_peer`` loses
its own oldest entry (by arrival); at ``total``, the peer that holds the most loses its
oldest, if it holds more than its fair share, and otherwise the arriving entry is
refused. So a flooder evicts its own entries first, and many fresh identities with a few
entries each can take the room that is free but evict nothing that honest peers hold
within their fair share. An entry kept under the key of an arriving one is replaced: in
place when both are the same peer's, else counted anew for the arriving peer.

Log lines
---------
:class:`_Notices` rate-limits what the adapter logs of drops and refusals: a line per
peer and kind at most once per interval (a minute by default), with a count of what was
held back since, and at most :data:`_NOTICE_BUDGET` lines per interval in all (fresh
identities are free: a line per peer alone would not bound the log).

Nothing here opens a socket or imports libp2p or trio: the ledger takes the wall time as
an argument, and the notice limiter reads ``time.monotonic`` unless handed a clock.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from atoll.protocol.errors import ConfigError

__all__ = [
    "FAIR_SHARE",
    "MAX_STORED",
    "MAX_STORED_PER_PEER",
    "Admission",
    "StoreBounds",
    "StoreLedger",
    "StoreUsage",
]

MAX_STORED = 4096
"""Default of :attr:`StoreBounds.total`: values (and, apart, provider entries) that peers
of the network may make this node keep, all of them together."""

MAX_STORED_PER_PEER = 256
"""Default of :attr:`StoreBounds.per_peer`: values of one signer (provider entries of one
provider) kept here."""

FAIR_SHARE = 32
"""Default of :attr:`StoreBounds.fair_share`: a peer holding at most this many entries here
is never evicted to make room for another peer's."""

_NOTICE_INTERVAL_S = 60.0  # one log line per peer and kind of drop, at most, this often
_NOTICE_BUDGET = 20  # such lines a minute, at most, for all peers together
_NOTICE_PEERS = 1024  # (peer, kind) pairs whose last line is remembered, at most

_K = TypeVar("_K", bound=Hashable)  # a ledger's key: bytes (values), (key, peer) (providers)


@dataclass(frozen=True, slots=True)
class StoreBounds:
    """How much of one of this node's DHT stores (values; provider entries) the network may
    fill; each store has its own count. This node's own records are not counted.

    At :attr:`total`, an arriving entry first makes the ledger drop the expired entries,
    then evict the oldest (by arrival) entry of the peer that holds the most, when that
    peer holds more than :attr:`fair_share`; otherwise the arriving entry is refused. A
    peer at :attr:`per_peer` makes room among its own entries the same way. So a flooder
    evicts its own entries first, and many fresh identities with a few entries each can
    fill the room that is free but evict nobody's fair share.
    """

    total: int = MAX_STORED
    """entries kept in all"""
    per_peer: int = MAX_STORED_PER_PEER
    """entries kept of one peer (a value's signer, a provider entry's provider)"""
    fair_share: int = FAIR_SHARE
    """entries of one peer that no other peer's entry evicts"""

    def __post_init__(self) -> None:
        for name in ("total", "per_peer", "fair_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"StoreBounds {name} must be an int, not {value!r}")
        if not 1 <= self.per_peer <= self.total:
            raise ConfigError(
                f"StoreBounds needs 1 <= per_peer <= total, not {self.per_peer} and {self.total}"
            )
        if not 0 <= self.fair_share < self.per_peer:
            raise ConfigError(
                f"StoreBounds needs 0 <= fair_share < per_peer ({self.per_peer}),"
                f" not {self.fair_share}"
            )


@dataclass(frozen=True, slots=True)
class Admission(Generic[_K]):
    """What :meth:`StoreLedger.admit` decided; the store drops :attr:`drops` whether or
    not the entry is admitted."""

    admitted: bool
    """keep the arriving entry"""
    expired: tuple[_K, ...] = ()
    """entries dropped because they expired"""
    evicted: tuple[tuple[_K, str], ...] = ()
    """live entries evicted, with their peers"""
    reason: str = ""
    """why entries were evicted, or the entry refused"""

    @property
    def drops(self) -> tuple[_K, ...]:
        """Every entry to drop from the store: the expired, then the evicted."""
        return self.expired + tuple(key for key, _ in self.evicted)


@dataclass(slots=True)
class _Held:
    """One entry of a ledger: its peer, its expiry (wall clock) and its arrival number."""

    peer: str
    expires_at: float
    arrival: int


class StoreLedger(Generic[_K]):
    """The entries peers made a store keep, and which to drop when one more arrives: the
    rule of :class:`StoreBounds`, with no store, clock or network of its own (pure).

    An admission costs O(log n), plus the expired entries it drops (each once) and, when
    the top count empties, one pass over the distinct counts (at most ``per_peer``). Among
    peers tied for the most, the arriving peer is evicted from if it is one of them, else
    the one that reached that count last.
    """

    def __init__(self, bounds: StoreBounds) -> None:
        self.bounds = bounds
        self._held: dict[_K, _Held] = {}
        self._order: dict[str, dict[_K, None]] = {}  # per peer, oldest arrival first
        self._tiers: dict[int, dict[str, None]] = {}  # count -> peers, the latest to reach it last
        self._most = 0
        self._expiry: list[tuple[float, int, _K]] = []  # a heap; stale items skipped
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def held_by(self, peer: str) -> int:
        """How many entries of ``peer`` are kept."""
        return len(self._order.get(peer, ()))

    def usage(self) -> dict[str, int]:
        """Entries kept per peer."""
        return {peer: len(keys) for peer, keys in self._order.items()}

    def admit(self, key: _K, peer: str, expires_at: float, now: float) -> Admission[_K]:
        """Whether ``peer``'s entry ``key``, valid until ``expires_at``, is kept at wall time
        ``now``, and which entries make room for it (see :class:`StoreBounds`). An entry
        already kept is replaced in place: a newer record of the same key takes no room."""
        held = self._held.get(key)
        if held is not None and held.peer == peer:
            self._remove(key)
            self._add(key, peer, expires_at)
            return Admission(True)
        if held is not None:  # the key changed hands: counted anew
            self._remove(key)
        expired: list[_K] = []
        if self.held_by(peer) >= self.bounds.per_peer:
            expired = self._drop_expired(now)
            if self.held_by(peer) >= self.bounds.per_peer:
                reason = f"over its {self.bounds.per_peer}"
                evicted = ((self._evict_oldest(peer), peer),)
                self._add(key, peer, expires_at)
                return Admission(True, tuple(expired), evicted, reason)
        if len(self._held) >= self.bounds.total:
            expired += self._drop_expired(now)
        if len(self._held) < self.bounds.total:
            self._add(key, peer, expires_at)
            return Admission(True, tuple(expired))
        return self._make_room(key, peer, expires_at, tuple(expired))

    def forget(self, key: _K) -> None:
        """Stop counting ``key`` (the store dropped it itself); nothing if not counted."""
        if key in self._held:
            self._remove(key)

    def _make_room(
        self, key: _K, peer: str, expires_at: float, expired: tuple[_K, ...]
    ) -> Admission[_K]:
        """At :attr:`StoreBounds.total` with nothing expired: evict the oldest entry of the
        peer that holds the most, if it holds over its fair share; else refuse."""
        victim = self._largest(prefer=peer)
        count = self.held_by(victim)
        if count <= self.bounds.fair_share:
            reason = (
                f"{len(self._held)} entries kept, none expired, and no peer holds over"
                f" {self.bounds.fair_share}"
            )
            return Admission(False, expired, (), reason)
        reason = f"{count} of the {len(self._held)} kept, the most"
        evicted = ((self._evict_oldest(victim), victim),)
        self._add(key, peer, expires_at)
        return Admission(True, expired, evicted, reason)

    def _largest(self, prefer: str) -> str:
        """The peer holding the most entries: ``prefer`` if it is one of them, else the
        one that reached that count last. The ledger is not empty."""
        tier = self._tiers[self._most]
        return prefer if prefer in tier else next(reversed(tier))

    def _evict_oldest(self, peer: str) -> _K:
        oldest = next(iter(self._order[peer]))
        self._remove(oldest)
        return oldest

    def _drop_expired(self, now: float) -> list[_K]:
        """Drop every entry whose expiry ``now`` reached; the keys dropped."""
        dropped: list[_K] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, arrival, key = heapq.heappop(self._expiry)
            held = self._held.get(key)
            if held is not None and held.arrival == arrival:
                self._remove(key)
                dropped.append(key)
        return dropped

    def _add(self, key: _K, peer: str, expires_at: float) -> None:
        self._arrivals += 1
        self._held[key] = _Held(peer, expires_at, self._arrivals)
        order = self._order.setdefault(peer, {})
        order[key] = None
        self._recount(peer, len(order) - 1, len(order))
        heapq.heappush(self._expiry, (expires_at, self._arrivals, key))
        if len(self._expiry) > 2 * len(self._held) + 64:  # mostly stale: rebuild
            self._expiry = [(h.expires_at, h.arrival, k) for k, h in self._held.items()]
            heapq.heapify(self._expiry)

    def _remove(self, key: _K) -> None:
        peer = self._held.pop(key).peer
        order = self._order[peer]
        del order[key]
        self._recount(peer, len(order) + 1, len(order))
        if not order:
            del self._order[peer]

    def _recount(self, peer: str, old: int, new: int) -> None:
        """Move ``peer`` from the tier of ``old`` entries to that of ``new``."""
        if old:
            tier = self._tiers[old]
            del tier[peer]
            if not tier:
                del self._tiers[old]
        if new:
            self._tiers.setdefault(new, {})[peer] = None
        if new > self._most:
            self._most = new
        elif self._most not in self._tiers:
            self._most = max(self._tiers, default=0)


class _Notices:
    """Says each ``(kind, peer)`` at most once per ``interval_s``, with a count of the events
    held back since, and at most ``budget`` lines per interval in all (fresh identities
    are free: a line per peer alone would not bound the log); remembers at most
    ``capacity`` pairs."""

    def __init__(
        self,
        interval_s: float = _NOTICE_INTERVAL_S,
        *,
        budget: int = _NOTICE_BUDGET,
        capacity: int = _NOTICE_PEERS,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval_s = interval_s
        self._budget = budget
        self._capacity = capacity
        self._now = now
        self._said: dict[tuple[str, str], float] = {}  # oldest first
        self._pending: dict[tuple[str, str], int] = {}  # of pairs in _said only
        self._window = -math.inf  # when the current interval of the budget began
        self._lines = 0  # lines said in it
        self._withheld = 0  # events not said for the budget, since withheld() was asked

    def due(self, kind: str, peer: str, count: int = 1) -> int:
        """Note ``count`` more events; how many to say now (0: not yet)."""
        what = (kind, peer)
        now = self._now()
        last = self._said.get(what)
        if last is not None and now - last < self._interval_s:
            self._pending[what] = self._pending.get(what, 0) + count
            return 0
        if now - self._window >= self._interval_s:
            self._window, self._lines = now, 0
        if self._lines >= self._budget:
            self._withheld += count
            return 0
        self._lines += 1
        self._said.pop(what, None)
        self._said[what] = now
        said = self._pending.pop(what, 0) + count
        if len(self._said) > self._capacity:
            self._forget(now)
        return said

    def withheld(self) -> int:
        """The events left unsaid for the budget since the last call."""
        withheld, self._withheld = self._withheld, 0
        return withheld

    def _forget(self, now: float) -> None:
        """Forget the pairs said over an interval ago, then the oldest half if still over."""
        stale = [w for w, t in self._said.items() if now - t >= self._interval_s]
        if len(self._said) - len(stale) > self._capacity:
            stale = list(self._said)[: len(self._said) // 2]
        for what in stale:
            del self._said[what]
            self._pending.pop(what, None)


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """What peers of the network hold in this node's DHT stores (its own records aside)."""

    values: int
    """values kept"""
    providers: int
    """provider entries kept"""
    values_by_signer: dict[str, int]
    """values kept per signer"""
    providers_by_peer: dict[str, int]
    """provider entries kept per provider"""

"""Strikes and bans: a ledger of what each peer did wrong, and who is banned until when.

A node strikes a peer when it has its own proof that the peer sent something hostile or
broken (docs/DESIGN.md, "Strikes and bans"):

- ``part``: a part of the peer failed this node's checks as a chunk owner (undecodable,
  non-finite, a bad weight, a norm or weight over the group's bound: the all-reduce
  round's :attr:`~atoll.protocol.allreduce.Failed.culprit`);
- ``equivocation``: the peer sent two different parts for one chunk of one round (the
  round names it as culprit, with a reason saying so);
- ``part`` too when the peer's own :class:`~atoll.protocol.allreduce.Abort` names its
  own part as the one rejected (:func:`self_accused`): a hostile owner that checks its
  chunk first aborts the round before the honest owners got every part, and its abort
  is the only proof they get. An abort naming *another* peer is hearsay and strikes
  nobody (a liar could frame honest peers that way);
- ``forged``: the peer's own signed record declares a state far past anything
  certified (more than one version past what this node believes: no honest commit is);
- ``uncertified``: the peer declared a state whose certificate did not appear within
  the grace. It weighs nothing: an honest member does this too whenever its round was
  committed by fewer members than the quorum (a round may commit at one member and roll
  back at another), or its partners' attestations have not reached the DHT after a cut,
  until its next sync rebases it. It is kept in the ledger for the logs and status;
- ``state``: the peer served a piece of a certified state that fails its hash, or a
  piece list that does not hash to the certified digest
  (:mod:`atoll.protocol.statefetch`): a donor has no honest way to do that;
- ``evidence``: another peer published the offender's signed record of a forged claim,
  and this node checked it (the signature is the offender's, the claim is far past what
  this node believes, and no certificate of it was found).

Stalled rounds strike nobody: a round that timed out proves nothing about anyone (a
slow link and a hostile peer look alike), and :class:`~atoll.protocol.liveness.Liveness`
already sets a silent peer aside for a while.

Each reason weighs some points (:data:`WEIGHTS`); a peer whose points within
``forget_s`` reach ``threshold`` is banned for ``ban_s``, doubled at each later ban of
the same peer, at most ``max_ban_s``. A ban clears the points: once it ends, the peer
starts again from zero (its next ban is longer). The default weights ban at once for
anything proven (a check failure, equivocation, a forged claim, checked evidence) and
never for an uncertified claim alone.

Every ban is logged as a WARNING, ``banned peer <peer_id> for <seconds> s: <reason>``
(benchmarks read it), and handed to ``on_ban``. A banned peer is not grouped with, not
followed for state and not counted toward group sizes (the node's filters ask
:meth:`Strikes.banned`).

Sans-IO: the clock is injected (any monotonic clock, seconds); nothing here does IO.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from atoll.protocol.errors import ConfigError

__all__ = ["WEIGHTS", "Ban", "Reason", "Strike", "Strikes", "reason_of_failure", "self_accused"]

log = logging.getLogger(__name__)

Reason: TypeAlias = Literal["part", "equivocation", "forged", "uncertified", "evidence", "state"]

WEIGHTS: Mapping[str, int] = {
    "part": 3,
    "equivocation": 3,
    "forged": 3,
    "evidence": 3,
    "state": 3,
    "uncertified": 0,
}
"""Points per reason (see the module docstring); a ban at ``threshold`` (3) points."""


@dataclass(frozen=True, slots=True)
class Strike:
    """One strike: who, why, when (the ledger's clock) and how many points."""

    peer: str
    reason: str
    detail: str
    at: float
    points: int


@dataclass(frozen=True, slots=True)
class Ban:
    """A ban of ``peer`` from ``since`` to ``until`` (the ledger's clock); ``nth`` counts
    the peer's bans so far, this one included."""

    peer: str
    since: float
    until: float
    reason: str
    nth: int

    @property
    def seconds(self) -> float:
        return self.until - self.since


@dataclass(slots=True)
class _Peer:
    strikes: list[Strike] = field(default_factory=list)
    bans: int = 0
    until: float = -math.inf
    last: Ban | None = None


def reason_of_failure(reason: str) -> Reason:
    """The strike reason of a round that failed naming a culprit: ``equivocation`` when
    the round's reason says so, else ``part``."""
    return "equivocation" if "equivocation" in reason else "part"


_ABORTED = re.compile(r"aborted by (\S+): (.*)", re.DOTALL)


def self_accused(reason: str) -> str | None:
    """The peer whose abort, quoted in a failed round's ``reason``, names its own part as
    rejected (``aborted by X: parts for chunk j rejected: X: ...``, or ``... part of X
    rejected ...``), else None."""
    m = _ABORTED.match(reason)
    if m is None:
        return None
    peer, rest = m[1], m[2]
    if rest.startswith("parts for chunk ") and re.search(
        rf"(?:rejected: |; ){re.escape(peer)}: ", rest
    ):
        return peer
    if rest.startswith(f"part of {peer} rejected"):
        return peer
    return None


class Strikes:
    """The strike ledger of one node (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        threshold: int = 3,
        ban_s: float = 60.0,
        max_ban_s: float = 3600.0,
        forget_s: float = 600.0,
        weights: Mapping[str, int] | None = None,
        on_ban: Callable[[Ban], None] | None = None,
        max_peers: int = 4096,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ConfigError(f"threshold must be an int >= 1, not {threshold!r}")
        for name, value in (("ban_s", ban_s), ("max_ban_s", max_ban_s), ("forget_s", forget_s)):
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be finite and > 0, not {value!r}")
        if max_ban_s < ban_s:
            raise ConfigError(f"max_ban_s ({max_ban_s}) must be >= ban_s ({ban_s})")
        self.clock = clock
        self.threshold = threshold
        self.ban_s = float(ban_s)
        self.max_ban_s = float(max_ban_s)
        self.forget_s = float(forget_s)
        self.weights = dict(WEIGHTS if weights is None else weights)
        self.on_ban = on_ban
        """called with every new :class:`Ban` (after it is logged)"""
        self.max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self.total = 0
        """strikes so far, all peers"""
        self.bans_total = 0
        """bans so far, all peers"""

    # -- events ------------------------------------------------------------------------------
    def strike(
        self, peer: str, reason: str, detail: str = "", *, points: int | None = None
    ) -> Ban | None:
        """Strike ``peer`` for ``reason`` (a key of :attr:`weights`, or ``points`` given);
        returns the ban it caused, if any. Strikes of a peer banned now are recorded but
        do not extend its ban."""
        weight = self.weights.get(reason, 1) if points is None else points
        now = self.clock()
        p = self._peer(peer)
        self.total += 1
        p.strikes = [s for s in p.strikes if now - s.at < self.forget_s]
        p.strikes.append(Strike(peer, reason, detail, now, weight))
        if now < p.until:
            return None
        if sum(s.points for s in p.strikes) < self.threshold:
            log.info("strike against peer %s (%s): %s", peer, reason, detail or "-")
            return None
        seconds = min(self.max_ban_s, self.ban_s * 2 ** min(p.bans, 30))
        p.bans += 1
        p.until = now + seconds
        why = f"{reason}: {detail}" if detail else reason
        ban = Ban(peer, now, p.until, why, p.bans)
        p.last = ban
        p.strikes = []
        self.bans_total += 1
        log.warning("banned peer %s for %.0f s: %s", peer, seconds, why)
        if self.on_ban is not None:
            self.on_ban(ban)
        return ban

    # -- queries -----------------------------------------------------------------------------
    def banned(self, peer: str) -> bool:
        """Whether ``peer`` is banned now."""
        p = self._peers.get(peer)
        return p is not None and self.clock() < p.until

    def banned_peers(self) -> tuple[str, ...]:
        """The peers banned now, sorted."""
        now = self.clock()
        return tuple(sorted(peer for peer, p in self._peers.items() if now < p.until))

    def ban_of(self, peer: str) -> Ban | None:
        """``peer``'s latest ban (over or not), or None."""
        p = self._peers.get(peer)
        return None if p is None else p.last

    def points(self, peer: str) -> int:
        """``peer``'s points now (strikes within ``forget_s`` since its last ban)."""
        p = self._peers.get(peer)
        if p is None:
            return 0
        now = self.clock()
        return sum(s.points for s in p.strikes if now - s.at < self.forget_s)

    def strikes_of(self, peer: str) -> tuple[Strike, ...]:
        """``peer``'s strikes that still count (since its last ban, within ``forget_s``)."""
        p = self._peers.get(peer)
        return () if p is None else tuple(p.strikes)

    # -- inside ------------------------------------------------------------------------------
    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer()
            if len(self._peers) > self.max_peers:  # forget the longest-known unbanned peer
                now = self.clock()
                for old, q in self._peers.items():
                    if now >= q.until and old != peer:
                        del self._peers[old]
                        break
        else:
            self._peers.move_to_end(peer)
        return p

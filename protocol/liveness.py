"""Which peers answer: liveness from recent contact, not from records alone.

A peer whose link dropped silently (Wi-Fi, a closed laptop lid, a router restart) does not
refuse connections, as a crashed process does: it stops answering, and every request to
it waits out its whole timeout. Its records stay valid for minutes. :class:`Liveness`
keeps what this node learned by talking to peers, so that one silent peer costs its own
share (one timed-out request), not every later request of the swarm:

- :meth:`Liveness.heard`: the peer answered or sent something (a DHT reply, a round
  message); it is not suspected any more.
- :meth:`Liveness.failed`: a request to the peer timed out or could not be sent; the peer
  is *suspected* for :attr:`Liveness.hold_s` seconds, doubled at each failure in a row
  (up to :attr:`Liveness.max_hold_s`). A suspected peer is skipped: the DHT leaves it out
  of the closest peers it asks, group sizes and majorities do not count it, and
  matchmaking does not pick it as a leader.
- Once the hold has passed, requests may go to the peer again; the node also probes its
  silent peers in the background every few seconds, hold or not (one bounded dial each).
  A peer comes back as soon as it answers, or as soon as a message of its own arrives.
  Until then it stays *silent* (:meth:`Liveness.silent`): requests may reach it again,
  but it does not count toward group sizes and majorities.
- :meth:`Liveness.refused`: the peer reset a DHT request while its protocol was being
  chosen (the DHT tries such a stream once more first). The peer is there and talking
  (py-libp2p's yamux resets a few streams of a burst between live peers), so it is
  neither suspected nor silent: it keeps counting for groups and keeps its connections.
  But a request to it brought nothing, so the DHT *skips* it (:meth:`Liveness.skipped`)
  for :attr:`Liveness.hold_s`, or until it answers again: a peer whose streams keep
  resetting does not hold up the DHT's quorums, and a peer that reset one stream counts
  as live everywhere else.

- :meth:`Liveness.in_touch_since`: when the current spell of contact began. A peer not
  heard from for :attr:`Liveness.gap_s` seconds starts a new spell when heard again,
  failure or not: the other side of a split that nobody asked anything never failed, but
  it was out of touch all the same.

One object is shared by the DHT and the round drivers of a node. Time is passed in (any
monotonic clock, seconds); nothing here reads a clock or does IO.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from atoll.protocol.errors import ConfigError

__all__ = ["Liveness"]


@dataclass(slots=True)
class _Peer:
    heard_at: float | None = None
    failures: int = 0
    until: float = -math.inf
    reason: str = ""
    refused_at: float | None = None
    skip_until: float = -math.inf
    returned_at: float | None = None
    since: float | None = None


class Liveness:
    """Suspected peers of one node (see the module docstring)."""

    def __init__(
        self, *, hold_s: float = 5.0, max_hold_s: float = 20.0, gap_s: float = 10.0
    ) -> None:
        for name, value in (("hold_s", hold_s), ("max_hold_s", max_hold_s), ("gap_s", gap_s)):
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be finite and > 0, not {value!r}")
        if max_hold_s < hold_s:
            raise ConfigError(f"max_hold_s ({max_hold_s}) must be >= hold_s ({hold_s})")
        self.hold_s = float(hold_s)
        self.max_hold_s = float(max_hold_s)
        self.gap_s = float(gap_s)
        """a peer not heard from for longer than this starts a new spell of contact when it
        is heard again (:meth:`in_touch_since`): the other side of a split that was never
        asked anything, so never failed, was out of touch all the same"""
        self._peers: dict[str, _Peer] = {}
        self.on_suspect: Callable[[str, int], None] | None = None
        """called with ``(peer, failures in a row)`` each time a peer becomes suspected
        (the node drops its connections to a peer that failed twice in a row: a TCP
        connection that lived through a long cut stays stalled well after the link
        heals)"""
        self.suspicions = 0
        """how many times a peer became suspected (for status and benchmarks)"""
        self.skips = 0
        """how many times a refusal made the DHT skip a peer (for status and benchmarks)"""

    def heard(self, peer: str, now: float) -> None:
        """``peer`` answered, or sent us something: it is live."""
        p = self._peers.setdefault(peer, _Peer())
        if p.failures > 0:
            p.returned_at = now
        if p.failures > 0 or p.heard_at is None or now - p.heard_at > self.gap_s:
            p.since = now
        p.heard_at = now
        p.failures = 0
        p.until = -math.inf
        p.reason = ""
        p.skip_until = -math.inf

    def failed(self, peer: str, now: float, reason: str = "no answer") -> None:
        """A request to ``peer`` timed out or failed: suspect it for a while.

        The hold doubles with each failure in a row; a failure while already suspected
        (a request that was under way when the first one failed) does not extend it.
        """
        p = self._peers.setdefault(peer, _Peer())
        if now < p.until:
            return
        hold = min(self.max_hold_s, self.hold_s * 2 ** min(p.failures, 30))
        p.failures += 1
        p.until = now + hold
        p.reason = reason
        self.suspicions += 1
        if self.on_suspect is not None:
            self.on_suspect(peer, p.failures)

    def refused(self, peer: str, now: float) -> None:
        """``peer`` reset a DHT request before it was under way: skip it in the DHT for
        :attr:`hold_s`, or until it is heard again, without suspecting it (see the module
        docstring). A refusal within the hold does not extend it."""
        p = self._peers.setdefault(peer, _Peer())
        p.refused_at = now
        if now < p.skip_until:
            return
        p.skip_until = now + self.hold_s
        self.skips += 1

    def refused_since(self, peer: str, since: float) -> bool:
        """Whether ``peer`` refused a request at or after ``since``."""
        p = self._peers.get(peer)
        return p is not None and p.refused_at is not None and p.refused_at >= since

    def skipped(self, peer: str, now: float) -> bool:
        """Whether the DHT is to leave ``peer`` out now: it is suspected, or it refused a
        request and the skip's hold has not passed."""
        p = self._peers.get(peer)
        return p is not None and (now < p.until or now < p.skip_until)

    def suspected(self, peer: str, now: float) -> bool:
        """Whether ``peer`` is to be skipped now (it failed, and its hold has not passed)."""
        p = self._peers.get(peer)
        return p is not None and now < p.until

    def silent(self, peer: str) -> bool:
        """Whether ``peer`` failed since it was last heard (it does not count as live,
        even once its hold has passed and it may be tried again)."""
        p = self._peers.get(peer)
        return p is not None and p.failures > 0

    def suspects(self, now: float) -> dict[str, str]:
        """The suspected peers now, with the reason of each."""
        return {peer: p.reason for peer, p in self._peers.items() if now < p.until}

    def heard_at(self, peer: str) -> float | None:
        """When ``peer`` last answered or sent something, or None."""
        p = self._peers.get(peer)
        return None if p is None else p.heard_at

    def returned_at(self, peer: str) -> float | None:
        """When ``peer`` last answered again after it had gone silent (a cut link that
        healed, the other side of a split), or None if it never went silent. What was
        measured of it before then (its rounds' timings) says little of its link now."""
        p = self._peers.get(peer)
        return None if p is None else p.returned_at

    def in_touch_since(self, peer: str) -> float | None:
        """When the current spell of unbroken contact with ``peer`` began: since then it
        was heard at least every :attr:`gap_s` seconds up to :meth:`heard_at` and never
        failed. None if it is silent or was never heard."""
        p = self._peers.get(peer)
        return None if p is None or p.failures > 0 else p.since

    def forget(self, peer: str) -> None:
        """Drop what is known of ``peer`` (it left the run)."""
        self._peers.pop(peer, None)

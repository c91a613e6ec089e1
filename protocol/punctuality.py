"""Which peers a slot stops waiting for: those that came too late at their last slots.

A leader with a quorum closes its group after the grace window, and after twice that
while a peer expected at the slot has not come (matchmaking's second grace; see
:mod:`atoll.protocol.matchmaking`); a group formed ahead of its sync stays open for the
expected peers, and a node whose expected peers are on their way holds its trainer. That
patience lets in a peer that is a little late once, after a rebase say. A peer that is
late at every slot (a laptop six times slower than the GPUs beside it) makes the others
pay the whole extension each time and still misses most groups: in an integration run of
two fast nodes beside one six times slower, the fast nodes waited 77% of their wall time,
mostly in the second grace.

:class:`Punctuality` remembers, per peer and fragment, how many of the fragment's slots
in a row the peer was expected at (its record showed it at the slot's version or on its
way there through a copy of the state) and was not a member of the group this node's
matchmaking ended in. After :data:`LATE_AFTER` such slots the peer is *late* at that
fragment: it is no longer expected there, so nobody waits past the first grace for it and
no trainer is held for it. It is not refused: a late peer that reaches a slot within the
first grace joins as before, and one slot as a member makes it punctual there again. The
windows themselves never shrink (an earlier try that cut the grace to the median plus
3 MAD of measured lateness formed groups without punctual peers). A peer that went
silent and answers again since its last miss (a cut that healed, a restarted node)
starts punctual: its misses said nothing of its pace. Counting per fragment leaves a node
back from a cut the time to catch up: it copies each fragment's state once or twice, and
missed three slots of several fragments in a row in the fault lab while it did (counted
per peer, the others stopped waiting for it, and it shared no round before the next
fault); a laptop too slow for any window misses every slot of every fragment.

Sans-IO: the driver tells it each slot's outcome (:meth:`Punctuality.ended`) and asks
it to filter the peers it would wait for (:meth:`Punctuality.keep`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from atoll.protocol.errors import ConfigError

LATE_AFTER = 3
"""slots in a row that an expected peer was not a member of before it is late"""


class Punctuality:
    """Per peer and fragment, the fragment's slots in a row the peer was expected at and
    missed (see the module docstring)."""

    def __init__(self, late_after: int = LATE_AFTER) -> None:
        if late_after < 1:
            raise ConfigError(f"late_after must be >= 1, not {late_after!r}")
        self.late_after = late_after
        self._missed: dict[tuple[str, int], tuple[int, float]] = {}
        """(peer, fragment) -> (slots missed in a row, when the last was missed)"""

    def ended(
        self,
        fragment: int,
        expected: Iterable[str],
        members: Collection[str],
        *,
        now: float,
        returned_at: Callable[[str], float | None] = lambda peer: None,
    ) -> list[str]:
        """A slot of ``fragment`` ended at ``now`` in a group of ``members``; ``expected``
        were the peers due there. Returns the peers that became late at the fragment
        with it. Every member is punctual there again. ``returned_at``: when a peer last
        answered again after it had gone silent (None: never silent)."""
        for peer in members:
            self._missed.pop((peer, fragment), None)
        newly = []
        for peer in sorted(set(expected) - set(members)):
            missed = self._count(peer, fragment, returned_at) + 1
            self._missed[peer, fragment] = (missed, now)
            if missed == self.late_after:
                newly.append(peer)
        return newly

    def _count(self, peer: str, fragment: int, returned_at: Callable[[str], float | None]) -> int:
        """``peer``'s misses in a row at ``fragment``, none when it answered again after a
        silence since its last."""
        missed, at = self._missed.get((peer, fragment), (0, 0.0))
        back = returned_at(peer)
        if missed and back is not None and back > at:
            del self._missed[peer, fragment]
            return 0
        return missed

    def late(
        self,
        peer: str,
        fragment: int,
        returned_at: Callable[[str], float | None] = lambda p: None,
    ) -> bool:
        """Whether ``peer`` missed its last :attr:`late_after` slots of ``fragment``."""
        return self._count(peer, fragment, returned_at) >= self.late_after

    def keep(
        self,
        fragment: int,
        peers: Iterable[str],
        returned_at: Callable[[str], float | None] = lambda p: None,
    ) -> list[str]:
        """``peers`` without those late at ``fragment``, in their order."""
        return [p for p in peers if not self.late(p, fragment, returned_at)]

"""What a node's syncs did, counted for its status line and summary.

:class:`SyncTally` turns every finished sync (:class:`~atoll.node.net.syncer.SyncReport`)
and every change of a global copy into the counters of
:class:`~atoll.node.net.status.NodeStatus`: rounds applied, failed and alone, rebases, the
last sync of each fragment in words (``v7 x4``: version 7 averaged by 4 peers; ``alone``,
``failed``, ``rebased v7``), the last rounds' seconds, bytes and group sizes, and two
bounded histories the tests compare across peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atoll.node.net.status import History, Outcome
from atoll.node.net.syncer import SyncReport

__all__ = ["HISTORY", "SyncTally"]

HISTORY = 200
"""entries kept in each history"""
_RECENT = 50
"""rounds whose seconds, bytes and group size are reported"""


@dataclass(slots=True)
class SyncTally:
    """Counters of a node's syncs (see the module docstring)."""

    rounds_applied: int = 0
    rounds_failed: int = 0
    rounds_alone: int = 0
    rounds_ahead: int = 0
    """applied in a group formed ahead of the sync"""
    rebases: int = 0
    last_sync: dict[int, str] = field(default_factory=dict)
    round_s: list[float] = field(default_factory=list)
    round_bytes: list[int] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    """(fragment, version, round status, seconds, rebased) of every sync: the status of
    the round at that version (applied, failed, alone, or none when the peer rebased
    without looking for a group), and whether the sync ended with a rebase"""
    history: list[History] = field(default_factory=list)
    """(fragment, version, digest, round) after every applied round and rebase; round is
    ``"slot/leader"`` of the group (members of one group hold the same digest) or
    ``"rebase"``"""

    def record(self, report: SyncReport, version: int) -> None:
        """Count a finished sync; ``version`` is the fragment's version after it."""
        done = report.done
        p = done.fragment
        if report.traffic is not None:
            self.round_s = [*self.round_s[-_RECENT + 1 :], round(report.traffic.seconds, 3)]
            self.round_bytes = [*self.round_bytes[-_RECENT + 1 :], report.traffic.bytes_sent]
            self.group_sizes = [*self.group_sizes[-_RECENT + 1 :], len(done.members)]
        if done.round_status == "applied":
            self.rounds_applied += 1
            self.rounds_ahead += int(report.ahead)
            self.last_sync[p] = f"v{version} x{len(done.members)}"
        elif done.round_status == "failed":
            self.rounds_failed += 1
            self.last_sync[p] = "failed"
        elif done.round_status == "alone":
            self.rounds_alone += 1
            self.last_sync[p] = "alone"
        if done.rebased:
            self.rebases += 1
            self.last_sync[p] = f"rebased v{version}"
        entry = (p, done.round, done.round_status, report.seconds, done.rebased)
        self.outcomes = [*self.outcomes[-HISTORY + 1 :], entry]

    def caught_up(self) -> None:
        """Count a rebase made while catching up (no sync in flight)."""
        self.rebases += 1

    def changed(self, p: int, version: int, digest: str, how: str) -> None:
        """Note fragment ``p``'s new (version, digest) after a commit or a rebase."""
        self.history = [*self.history[-HISTORY + 1 :], (p, version, digest, how)]

    def fields(self) -> dict[str, Any]:
        """The NodeStatus fields this tally holds."""
        return {
            "rounds_applied": self.rounds_applied,
            "rounds_failed": self.rounds_failed,
            "rounds_alone": self.rounds_alone,
            "rounds_ahead": self.rounds_ahead,
            "rebases": self.rebases,
            "last_sync": dict(self.last_sync),
            "round_s": tuple(self.round_s),
            "round_bytes": tuple(self.round_bytes),
            "group_sizes": tuple(self.group_sizes),
            "history": tuple(self.history),
            "outcomes": tuple(self.outcomes),
        }

"""When to form a fragment's group ahead of its sync: the trainer's pace and the schedule.

A sync's matchmaking (announce, DHT lookups, join, group list) costs a few round trips:
about 1.5-3 s at an 80 ms RTT, more than a short overlap of τ inner steps can hide. None of
it needs the trainer's Δ (see :meth:`~atoll.node.net.syncer.Syncer.prepare`), so the
network process runs it shortly before the trainer reaches the sync step, and the sync
then costs the exchange alone.

The network process knows the trainer's step from its ``["step", n]`` notes (about two a
second) and the fragments' sync steps from the schedule (Streaming DiLoCo's staggered
offsets, arXiv 2501.18512; :class:`~atoll.protocol.schedule.Schedule`). :class:`Pace`
estimates the trainer's steps per second from the notes of the last few seconds;
:class:`Ahead` asks, at every note, which fragment's sync is due within ``lead_s`` and
prepares it once. A trainer that waits (an apply deadline, a hold) slows the estimate
down, so a group is then prepared later rather than too early; before the first two notes
nothing is prepared and syncs form their groups themselves, as they always can.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable

from atoll.protocol.schedule import Schedule

__all__ = ["AHEAD_S", "Ahead", "Pace"]

AHEAD_S = 3.0
"""How long before a sync its group starts forming (at most half the matchmaking
timeout): a few round trips at WAN latency, with a margin for a trainer that speeds up."""


class Pace:
    """The trainer's steps per second over the notes of the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = float(window_s)
        self._notes: collections.deque[tuple[float, int]] = collections.deque()

    def note(self, now: float, step: int) -> None:
        """The trainer is at ``step`` at time ``now`` (monotonic seconds)."""
        if self._notes and step < self._notes[-1][1]:  # moved back (a realignment)
            self._notes.clear()
        self._notes.append((float(now), int(step)))
        while len(self._notes) > 2 and now - self._notes[0][0] > self.window_s:
            self._notes.popleft()

    def steps_per_s(self) -> float | None:
        """The estimate, or None with too few notes (under one second of them): the lower
        median of the paces between consecutive notes, so that a jump (a node back from
        a split skips a hundred steps at once) does not make every sync seem seconds
        away for the whole window, which had groups formed ahead for syncs the trainer
        would reach only much later."""
        if len(self._notes) < 2:
            return None
        if self._notes[-1][0] - self._notes[0][0] < 1.0:
            return None
        paces = sorted(
            (s1 - s0) / (t1 - t0)
            for (t0, s0), (t1, s1) in itertools.pairwise(self._notes)
            if t1 > t0
        )
        if not paces:
            return None
        return paces[(len(paces) - 1) // 2]


class Ahead:
    """Prepares each fragment's next sync ``lead_s`` before the trainer reaches it.

    ``prepare(fragment, step)`` is the syncer's :meth:`~atoll.node.net.syncer.Syncer.
    prepare` (it returns False when it started nothing); ``clock`` a monotonic clock.
    """

    def __init__(
        self,
        schedule: Schedule,
        prepare: Callable[[int, int], bool],
        clock: Callable[[], float],
        *,
        lead_s: float = AHEAD_S,
    ) -> None:
        if not math.isfinite(lead_s) or lead_s <= 0:
            raise ValueError(f"lead_s must be finite and > 0, not {lead_s!r}")
        self.schedule = schedule
        self.prepare = prepare
        self.clock = clock
        self.lead_s = float(lead_s)
        self.pace = Pace()
        self.prepared = 0
        """groups this node started forming ahead"""

    def note(self, step: int) -> list[tuple[int, int]]:
        """The trainer is at ``step`` (the next step it runs): prepare each fragment whose
        sync (after the trainer finishes its due step) comes within ``lead_s``; returns the
        ``(fragment, step)`` pairs started now."""
        self.pace.note(self.clock(), step)
        rate = self.pace.steps_per_s()
        if rate is None or rate <= 0:
            return []
        started = []
        for p in range(self.schedule.fragments):
            due = self.schedule.next_sync(p, step)
            if (due - step + 1) / rate <= self.lead_s and self.prepare(p, due):
                started.append((p, due))
        self.prepared += len(started)
        return started

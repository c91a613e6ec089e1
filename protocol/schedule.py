"""When each fragment syncs: the Streaming DiLoCo schedule.

DiLoCo (Douillard et al., arXiv 2311.08105) syncs the whole model once every ``H`` inner
steps. Streaming DiLoCo (arXiv 2501.18512) keeps that period for every fragment but
staggers the fragments, so that one fragment sync starts about every ``H / P`` steps and
the bandwidth peak shrinks by a factor ``P``.

The rule used here: fragment ``p`` (of ``P``) has the offset

    t_p = floor((p + 1) * H / P) - 1

and its sync starts right after the peer finishes 0-based inner step ``s`` whenever
``s >= t_p`` and ``(s - t_p) mod H == 0``. Properties (all tested):

- the last fragment has ``t_{P-1} = H - 1``; with ``P = 1`` this is vanilla DiLoCo, a
  sync after steps ``H-1, 2H-1, ...``;
- since ``H / P >= 1`` the offsets are distinct, so two fragments never start on the same
  step, and the order of syncs is a function of the step number only: every peer syncs
  the fragments in the same order, which a group needs to avoid deadlock;
- in any ``H`` consecutive steps ``[s, s + H)`` with ``s >= 0`` each fragment starts
  exactly one sync (no warm-up exception: all offsets lie in ``[0, H)``);
- the gaps between consecutive starts (cyclically, across the wrap to the next period)
  are ``floor(H / P)`` or ``ceil(H / P)``;
- with an overlap of ``tau`` steps (arXiv 2501.18512, section on overlapping
  communication) at most one fragment is in flight whenever ``tau <= floor(H / P)``, in
  particular whenever ``tau < H / P``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from atoll.protocol.errors import ConfigError

__all__ = ["Schedule"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Staggered sync schedule of ``fragments`` fragments with period ``H`` inner steps.

    Requires ``H >= 1`` and ``1 <= fragments <= H``. Steps are 0-based indices of the inner
    step a peer has just finished.
    """

    H: int
    fragments: int
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_int(self.H) or self.H < 1:
            raise ConfigError(f"H (inner steps per sync) must be an int >= 1, got {self.H!r}")
        if not _is_int(self.fragments) or self.fragments < 1:
            raise ConfigError(f"fragments (P) must be an int >= 1, got {self.fragments!r}")
        if self.fragments > self.H:
            raise ConfigError(
                f"fragments (P={self.fragments}) must not exceed H={self.H}: each fragment "
                "needs its own step in every period of H inner steps"
            )
        offsets = tuple((p + 1) * self.H // self.fragments - 1 for p in range(self.fragments))
        object.__setattr__(self, "_offsets", offsets)

    @property
    def offsets(self) -> tuple[int, ...]:
        """All offsets ``t_p``, strictly increasing, in ``[0, H)``."""
        return self._offsets

    def _check_fragment(self, p: int) -> None:
        if not _is_int(p) or not 0 <= p < self.fragments:
            raise ConfigError(f"fragment index must be in [0, {self.fragments}), got {p!r}")

    def offset(self, p: int) -> int:
        """The first step after which fragment ``p`` syncs: ``floor((p+1)*H/P) - 1``."""
        self._check_fragment(p)
        return self._offsets[p]

    def due(self, step: int) -> tuple[int, ...]:
        """Fragments whose sync starts right after finishing inner step ``step``.

        Sorted ascending; with this rule it holds at most one fragment. Negative steps
        have none.
        """
        if step < 0:
            return ()
        r = step % self.H
        i = bisect.bisect_left(self._offsets, r)
        if i < self.fragments and self._offsets[i] == r:
            return (i,)
        return ()

    def next_sync(self, p: int, after: int) -> int:
        """The first step ``>= after`` at which fragment ``p`` is due."""
        self._check_fragment(p)
        t = self._offsets[p]
        if after <= t:
            return t
        periods = -(-(after - t) // self.H)
        return t + periods * self.H

    def landing(self, current: int, target: int, margin: int, ahead: int = 0) -> int:
        """Where a peer at step ``current`` that jumps to its swarm's step ``target``
        lands: on the last sync start in ``(current, target]`` when it lies at most
        ``margin`` steps before ``target``; else on the first sync start after
        ``target`` when it lies at most ``ahead`` steps after it; else on ``target``.

        A sync the swarm started up to ``margin`` steps ago (pass ``tau``: its result is
        due ``tau`` steps after the start) may still be open to the peer: the others hold
        its slot for the peers they know are due there. Landing on ``target`` itself
        would skip it, and the peer would meet that fragment a period later only (the
        faults benchmark's lone node, back from a 3|1 split, jumped to 801 while the
        three held fragment 1's slot open at 799, and that fragment had no round of all
        four for 47 s). So the peer lands on that start and begins the sync; the trainer
        then goes on to ``target`` at once (the caller's part), since staying those few
        steps behind made it arrive late at each later sync too, after the swarm's
        groups (formed ahead of their sync steps) had closed, and miss them one by one.
        With no sync start that close behind, the next one ahead is one the swarm has not
        reached yet (``target`` is the donors' step when the copy began, a second or two
        old by the time of the jump): the peer lands there and waits for the swarm's
        group at its slot.
        """
        for name, v in (
            ("current", current),
            ("target", target),
            ("margin", margin),
            ("ahead", ahead),
        ):
            if not _is_int(v):
                raise ConfigError(f"{name} must be an int, got {v!r}")
        if margin < 0 or ahead < 0:
            raise ConfigError(f"margin and ahead must be >= 0, got {margin} and {ahead}")
        if target <= current:
            return target
        lo = max(current + 1, target - margin)
        starts = self.syncs(lo, target + ahead + 1)
        back = [step for step, _ in starts if step <= target]
        if back:
            return back[-1]
        return starts[0][0] if starts else target

    def syncs(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Every ``(step, fragment)`` sync start with ``start <= step < stop``, in order.

        The order is by step (fragments never share a step); it is the single global
        order every peer follows.
        """
        out: list[tuple[int, int]] = []
        if stop <= start:
            return out
        for p in range(self.fragments):
            s = self.next_sync(p, start)
            while s < stop:
                out.append((s, p))
                s += self.H
        out.sort()
        return out

    def check_overlap(self, tau: int) -> int:
        """Validate an overlap of ``tau`` inner steps; return the peak syncs in flight.

        A sync started after step ``s`` is in flight over ``[s, s + tau)`` and its result
        is applied after step ``s + tau``. ``tau >= H`` is refused (ConfigError): the
        fragment would start its next sync before the previous result was applied.
        The return value is the largest number of fragments in flight at once in the
        steady state: 1 when ``tau`` is at most the smallest gap between two starts
        (``floor(H / P)``), hence whenever ``tau < H / P``. ``tau = 0`` (no overlap, the
        exchange blocks training) counts as 1, the one blocking exchange.
        """
        if not _is_int(tau) or tau < 0:
            raise ConfigError(f"tau (overlap steps) must be an int >= 0, got {tau!r}")
        if tau >= self.H:
            raise ConfigError(
                f"tau={tau} must be < H={self.H}: a fragment would start its next sync "
                "before the result of the previous one was applied"
            )
        if tau == 0:
            return 1
        # The steady state is periodic with period H. The peak number of intervals
        # [t, t + tau) that overlap is reached at the start of one of them, so count, for
        # each start s, the starts t (walking backwards cyclically) with s - t < tau.
        best = 1
        starts = self._offsets
        for i, s in enumerate(starts):
            n = 0
            for j in range(self.fragments):
                if (s - starts[(i - j) % self.fragments]) % self.H < tau:
                    n += 1
                else:
                    break
            best = max(best, n)
        return best

"""Deadlines that follow measured timings instead of fixed guesses.

A round's network waits need a bound: a member that goes silent must cost its group a
bounded time. The manifest's ``[timeouts]`` are that bound, chosen for the slowest link
that may join a run, so on a fast swarm a silent member costs far longer than any healthy
round takes (30 s for a phase that usually takes under a second). A
:class:`MeasuredDeadline` keeps the durations of recent waits of one kind that ended well
and proposes a deadline from them:

    deadline = max(ratio * median, median + k * 1.4826 * MAD)

clamped to ``[floor, ceiling]`` (the manifest's timeout is the ceiling). The median and
the median absolute deviation (MAD, scaled by 1.4826 to estimate the standard deviation
of normally distributed samples) are robust statistics: one round slowed by a passing
stall moves neither much, where a mean and standard deviation would follow it. Until
``min_samples`` waits have been measured it proposes the ceiling.

A wait that runs out at a measured deadline below the ceiling may have been a healthy
round on a link that became slower (a busy machine, a congested uplink), not a silent
peer: each such miss doubles the next deadlines (up to the ceiling) until a wait ends well
again, so a slower link costs one failed round, not a run of them.

:class:`RoundDeadlines` holds the two waits of an all-reduce round
(:class:`~atoll.protocol.allreduce.AllReduceRound`): every part of this member's chunk in
(the phase deadline), and the whole round done (the round deadline), each measured from
the round's start. Sans-IO: the caller measures and hands in seconds.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from atoll.protocol.errors import ConfigError

__all__ = ["MEASURED", "DeadlineRule", "MeasuredDeadline", "RoundDeadlines"]

MAD_TO_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normally distributed samples"""


@dataclass(frozen=True, slots=True)
class DeadlineRule:
    """How a measured deadline is computed from past waits (see the module docstring)."""

    k: float = 6.0
    """deviations (scaled MAD) above the median"""
    ratio: float = 3.0
    """the deadline is at least this multiple of the median"""
    floor_s: float = 3.0
    """never below this many seconds (a tiny median must not make a hair trigger)"""
    min_samples: int = 5
    """waits measured before the deadline leaves the ceiling"""
    window: int = 32
    """the most recent waits kept"""

    def __post_init__(self) -> None:
        for name in ("k", "ratio", "floor_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"deadline rule: {name} must be > 0, not {value!r}")
        if self.ratio < 1:
            raise ConfigError(f"deadline rule: ratio must be >= 1, not {self.ratio!r}")
        if not 1 <= self.min_samples <= self.window:
            raise ConfigError(
                f"deadline rule: need 1 <= min_samples ({self.min_samples}) <= window "
                f"({self.window})"
            )


MEASURED = DeadlineRule()
"""the default rule of a node's rounds"""


class MeasuredDeadline:
    """One kind of wait's deadline, from its recent durations (module docstring)."""

    def __init__(self, ceiling_s: float, rule: DeadlineRule | None = None) -> None:
        if not (math.isfinite(ceiling_s) and ceiling_s > 0):
            raise ConfigError(f"a deadline's ceiling must be > 0 s, not {ceiling_s!r}")
        self.ceiling_s = ceiling_s
        self.rule = rule if rule is not None else DeadlineRule()
        self._samples: deque[float] = deque(maxlen=self.rule.window)
        self._widen = 1.0

    @property
    def samples(self) -> int:
        """How many waits are kept."""
        return len(self._samples)

    def observe(self, seconds: float) -> None:
        """A wait of this kind ended well after ``seconds``: kept, and any widening after a
        miss is undone. Nonsense (negative, not finite) is ignored."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self._samples.append(seconds)
        self._widen = 1.0

    def missed(self, used_s: float) -> None:
        """A wait ran out at ``used_s``: when that was a measured deadline below the
        ceiling, the next ones are doubled (up to the ceiling) until one ends well."""
        if used_s < self.ceiling_s:
            self._widen = min(self._widen * 2.0, self.ceiling_s / self.rule.floor_s)

    def measured(self) -> float | None:
        """The deadline the samples alone give (no clamp, no widening); None until
        ``min_samples`` are in."""
        if len(self._samples) < self.rule.min_samples:
            return None
        med = statistics.median(self._samples)
        mad = statistics.median(abs(s - med) for s in self._samples)
        return max(self.rule.ratio * med, med + self.rule.k * MAD_TO_SIGMA * mad)

    def current(self) -> float:
        """The deadline to use now, in seconds, within ``[floor, ceiling]``."""
        base = self.measured()
        if base is None:
            return self.ceiling_s
        wanted = max(self.rule.floor_s, base) * self._widen
        return min(self.ceiling_s, max(self.rule.floor_s, wanted))


class RoundDeadlines:
    """An all-reduce round's phase and round deadlines, measured from its start: the
    manifest's ``part_s`` and ``round_s`` are their ceilings."""

    def __init__(self, part_s: float, round_s: float, rule: DeadlineRule | None = None) -> None:
        self.phase = MeasuredDeadline(part_s, rule)
        self.whole = MeasuredDeadline(round_s, rule)

    def current(self) -> tuple[float, float]:
        """(phase, round) deadlines for the next round; the round's is never shorter."""
        phase = self.phase.current()
        return phase, max(phase, self.whole.current())

    def done(self, parts_in_s: float | None, done_s: float | None) -> None:
        """A round ended well: its parts were all in after ``parts_in_s`` and it was done
        after ``done_s`` (None: not measured)."""
        if parts_in_s is not None:
            self.phase.observe(parts_in_s)
        if done_s is not None:
            self.whole.observe(done_s)

    def timed_out(self, phase_s: float, round_s: float, *, parts_in: bool) -> None:
        """A round ran out of time with deadlines ``phase_s`` and ``round_s``:
        ``parts_in`` says whether its parts had all come (then the round deadline ran
        out, else the phase's)."""
        if parts_in:
            self.whole.missed(round_s)
        else:
            self.phase.missed(phase_s)

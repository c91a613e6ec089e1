"""The trainer's side of Streaming DiLoCo: which fragment syncs when, and when it is merged.

After every inner step ``t`` a trainer (the node's, or each of the simulator's replicas)
does the same few things (docs/ALGORITHMS.md §2.2 and §2.3; arXiv 2501.18512):

1. results that came after their wait ran out (*late*) are merged now;
2. every sync started at ``t − τ`` is due: its result is awaited (at most
   ``apply_wait_s``); an applied round is merged, local ← α·local + (1−α)·global; a
   failed one changes nothing; a wait that runs out lets training go on (the result may
   arrive late, step 1);
3. every fragment the :class:`~atoll.protocol.schedule.Schedule` names for ``t`` starts
   its sync (unless its previous one is still in flight); with ``τ = 0`` its result is
   awaited at once (blocking, vanilla DiLoCo).

:class:`StreamingLoop` is that rule, once, for both drivers. It talks to the model and to
the exchange through :class:`Exchange`: the node's is the network bridge (a network
process does the rounds; its results arrive late or not at all), the simulator's is
in-process (all replicas' engines, the group reduction, injected faults).

Why here, in the sans-IO protocol package: the loop is the algorithm's timing (schedule,
τ, the merge), not IO. It owns no model, no socket and no clock; everything that touches
torch tensors, shared memory or a process sits behind :class:`Exchange`. So it imports
neither torch nor numpy, and is tested with a fake exchange, step by step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from atoll.protocol.errors import ConfigError
from atoll.protocol.schedule import Schedule

__all__ = ["Exchange", "LoopStats", "StreamingLoop", "SyncOutcome"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SyncOutcome:
    """How one started sync ended; ``applied`` means the fragment's global copy is new."""

    fragment: int
    step: int
    """the inner step the sync was started at"""
    applied: bool
    round: int
    """the fragment's global version the Δ was taken against (-1 when unknown)"""
    reason: str = ""
    """why the round was not applied (empty when it was; ``rebased ...`` after a rebase)"""
    met_at: int = -1
    """the step at which the round's other members started their syncs of it (-1: no
    round ran, or not known): a trainer that jumps to that step has met this period's
    round of the fragment already"""


class Exchange(Protocol):
    """What the loop needs from a driver: start syncs, get their outcomes, merge.

    Between :meth:`start` for fragment ``p`` and the moment its outcome is returned (by
    :meth:`wait` or :meth:`poll`), ``p`` is *in flight*: the exchange owns its Δ.
    """

    def start(self, fragment: int, step: int, tokens: int) -> None:
        """Hand the fragment's local copy over and start its sync (never blocks on IO).

        ``tokens``: the trainer's total count of tokens trained on so far.
        """
        ...

    def in_flight(self, fragment: int) -> bool:
        """A sync of ``fragment`` was started and its outcome not yet returned."""
        ...

    def poll(self) -> list[SyncOutcome]:
        """Outcomes that arrived after their wait ran out; never blocks."""
        ...

    def wait(self, fragment: int, timeout_s: float) -> SyncOutcome | None:
        """The fragment's outcome, waiting at most ``timeout_s``; None when it ran out."""
        ...

    def merge(self, fragment: int) -> None:
        """After an applied outcome: local ← α·local + (1−α)·global for ``fragment``."""
        ...


@dataclass(slots=True)
class LoopStats:
    """What the loop did (never reset)."""

    started: int = 0
    applied: int = 0
    """outcomes merged (late ones included)"""
    failed: int = 0
    """outcomes with nothing applied"""
    late: int = 0
    """applied outcomes merged after their wait had run out"""
    waits_run_out: int = 0
    """due results that did not come within ``apply_wait_s``: training went on"""
    overlapped: int = 0
    """due syncs not started because the fragment's previous one was still in flight"""
    unfinished: int = 0
    """syncs whose result had not come when :meth:`StreamingLoop.finish` gave up on them"""
    met_already: int = 0
    """due syncs not started at a jump's landing: their round of the period was met
    already (:meth:`StreamingLoop.landed`)"""


class StreamingLoop:
    """Starts each fragment's sync when it is due and merges its result τ steps later.

    Call :meth:`after_step` after every inner step (steps need not be consecutive: a
    driver may jump ahead), :meth:`finish` after the last one, and optionally
    :meth:`final_sync`. ``apply_wait_s`` bounds every wait (an in-process exchange
    never waits, so any value does).
    """

    def __init__(
        self, schedule: Schedule, exchange: Exchange, *, tau: int, apply_wait_s: float
    ) -> None:
        if not 0 <= tau < schedule.H:
            raise ConfigError(f"tau must be in [0, H={schedule.H}), not {tau}")
        if not apply_wait_s >= 0:  # NaN too
            raise ConfigError(f"apply_wait_s must be >= 0, not {apply_wait_s}")
        self.schedule = schedule
        self.exchange = exchange
        self.tau = tau
        self.apply_wait_s = apply_wait_s
        self.stats = LoopStats()
        self._apply_at: dict[int, int] = {}  # fragment -> step after which it is merged
        self._applied_step = [-1] * schedule.fragments  # start step of the last applied
        # per fragment: (this node's start, the other members' start) of the last round met
        self._met = [(-1, -1)] * schedule.fragments
        self._moved_to = -1  # the step the trainer last jumped to

    @property
    def pending(self) -> tuple[int, ...]:
        """Fragments whose result is still awaited, in the order they started."""
        return tuple(self._apply_at)

    def applied_step(self, fragment: int) -> int:
        """The start step of the fragment's last applied sync (-1: none yet)."""
        return self._applied_step[fragment]

    def after_step(self, step: int, tokens: int = 0) -> list[SyncOutcome]:
        """Everything due after inner step ``step``; the outcomes taken, in order.

        ``tokens`` is the trainer's total token count, handed to :meth:`Exchange.start`.
        """
        taken = self.collect(step)
        for p in [p for p, at in self._apply_at.items() if at <= step]:
            self._await(p, step, taken)
        for p in self.schedule.due(step):
            if self.exchange.in_flight(p):
                self.stats.overlapped += 1
                log.info("fragment %d: previous sync still in flight; this one skipped", p)
                continue
            if self._met_before_move(p, step):
                self.stats.met_already += 1
                log.info(
                    "fragment %d: its round that the swarm began at step %d was met already;"
                    " not started again",
                    p,
                    step,
                )
                continue
            self.exchange.start(p, step, tokens)
            self.stats.started += 1
            self._apply_at[p] = step + self.tau
            if self.tau == 0:
                self._await(p, step, taken)
        return taken

    def landed(self, step: int) -> None:
        """The trainer jumped to ``step``, the swarm's step (or a sync start next to it):
        its steps count as the swarm's from now on. A fragment due at a step from here on
        is not started when the round this node met last, through a sync it started
        before the jump, began at that very step for its other members. That sync was
        held at the slot until the swarm came (say, from before a cut); starting the
        fragment again would declare its next slot a whole period before the swarm, and
        hold the trainer there while the swarm's rounds of the other fragments pass."""
        self._moved_to = step

    def met_at(self, fragment: int) -> int:
        """The step at which the other members began the last round of ``fragment`` this
        node applied (-1: none, or not known)."""
        return self._met[fragment][1]

    def _met_before_move(self, p: int, step: int) -> bool:
        """Whether ``p``'s round that the swarm begins at ``step`` was met already, by a
        sync started before the trainer's last jump (only then do this node's steps
        count as the swarm's: a node whose steps trail the swarm's by whole periods but
        keep time with it reaches that step a period later, at the next slot)."""
        own, met = self._met[p]
        return met == step and own < self._moved_to <= step

    def release(self, fragment: int) -> bool:
        """Stop awaiting ``fragment``'s sync at its apply step: its outcome is merged
        whenever it arrives (a late result), and the trainer never waits for it. For a
        sync started on the way to somewhere else (a trainer that jumped onto the start of
        a sync its swarm began, in case that round is still open to it, and then went on
        to the swarm's step): waiting out ``apply_wait_s`` for it put the trainer seconds
        behind its swarm again. False when nothing was awaited."""
        return self._apply_at.pop(fragment, None) is not None

    def collect(self, step: int) -> list[SyncOutcome]:
        """Take the results that arrived since the last call without waiting (merging
        the applied ones); also after :meth:`finish`, for one that came late."""
        return [self._take(o, step, late=True) for o in self.exchange.poll()]

    def finish(self, wait_s: float | None = None) -> list[SyncOutcome]:
        """After the last step: await every sync still in flight (each at most
        ``apply_wait_s``, or ``wait_s`` when given: a node that is stopped leaves within
        seconds) and merge the applied ones; the outcomes taken."""
        taken: list[SyncOutcome] = []
        each = self.apply_wait_s if wait_s is None else max(0.0, wait_s)
        for p in list(self._apply_at):
            got = self.exchange.wait(p, each)
            self._apply_at.pop(p)
            if got is None:
                self.stats.unfinished += 1
            else:
                taken.append(self._take(got, -1, late=False))
        return taken

    def final_sync(self, step: int, tokens: int = 0) -> list[SyncOutcome]:
        """After :meth:`finish`: sync at ``step``, at once, every fragment whose last applied
        sync started before ``step``, so the global copies hold all the work."""
        if self._apply_at:
            raise ConfigError("final_sync needs finish() first: syncs are still awaited")
        taken: list[SyncOutcome] = []
        for p in range(self.schedule.fragments):
            if self._applied_step[p] < step and not self.exchange.in_flight(p):
                self.exchange.start(p, step, tokens)
                self.stats.started += 1
                self._apply_at[p] = step
                self._await(p, step, taken)
        return taken

    # -- internals -------------------------------------------------------------------------
    def _await(self, p: int, step: int, taken: list[SyncOutcome]) -> None:
        got = self.exchange.wait(p, self.apply_wait_s)
        self._apply_at.pop(p)
        if got is None:
            self.stats.waits_run_out += 1
            log.info("fragment %d: no result within %.1f s; training on", p, self.apply_wait_s)
        else:
            taken.append(self._take(got, step, late=False))

    def _take(self, outcome: SyncOutcome, step: int, *, late: bool) -> SyncOutcome:
        p = outcome.fragment
        late = late and self._apply_at.pop(p, None) is None  # not late if still awaited
        if not outcome.applied:
            self.stats.failed += 1
            log.info("fragment %d: round skipped (%s)", p, outcome.reason)
            return outcome
        self.exchange.merge(p)
        self.stats.applied += 1
        self._applied_step[p] = max(self._applied_step[p], outcome.step)
        if outcome.met_at >= 0:
            self._met[p] = (outcome.step, outcome.met_at)
        if late:
            self.stats.late += 1
            log.info("fragment %d: late result merged at step %d", p, step)
        return outcome

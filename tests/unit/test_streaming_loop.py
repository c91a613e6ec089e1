"""The trainer's streaming loop (when syncs start and merge), driven with a fake exchange."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pytest

from atoll.protocol.engine import EngineConfig, OuterEngine, merge
from atoll.protocol.errors import ConfigError
from atoll.protocol.schedule import Schedule
from atoll.protocol.streaming import Exchange, StreamingLoop, SyncOutcome


@dataclass
class FakeExchange:
    """Records every call; outcomes are scripted per (fragment, start step)."""

    events: list[tuple[str, int, int]] = field(default_factory=list)
    """(call, fragment, step or tokens)"""
    fail: set[tuple[int, int]] = field(default_factory=set)
    """(fragment, step): that sync fails"""
    slow: set[tuple[int, int]] = field(default_factory=set)
    """(fragment, step): its wait runs out; the outcome comes through the next poll"""
    started: dict[int, int] = field(default_factory=dict)
    late: list[SyncOutcome] = field(default_factory=list)

    def start(self, fragment: int, step: int, tokens: int) -> None:
        assert fragment not in self.started
        self.started[fragment] = step
        self.events.append(("start", fragment, step))

    def in_flight(self, fragment: int) -> bool:
        return fragment in self.started

    def poll(self) -> list[SyncOutcome]:
        out, self.late = self.late, []
        for o in out:
            del self.started[o.fragment]
        return out

    def wait(self, fragment: int, timeout_s: float) -> SyncOutcome | None:
        step = self.started[fragment]
        self.events.append(("wait", fragment, step))
        outcome = SyncOutcome(fragment, step, (fragment, step) not in self.fail, 0, "")
        if (fragment, step) in self.slow:
            self.slow.discard((fragment, step))
            self.late.append(outcome)
            return None
        del self.started[fragment]
        return outcome

    def merge(self, fragment: int) -> None:
        self.events.append(("merge", fragment, -1))


def _run(loop: StreamingLoop, steps: range) -> list[SyncOutcome]:
    taken: list[SyncOutcome] = []
    for step in steps:
        taken += loop.after_step(step, tokens=100 * (step + 1))
    return taken


def test_fake_is_an_exchange() -> None:
    ex: Exchange = FakeExchange()
    assert not ex.in_flight(0)


def test_starts_when_due_and_merges_tau_steps_later() -> None:
    sched = Schedule(H=6, fragments=3)  # offsets 1, 3, 5
    ex = FakeExchange()
    loop = StreamingLoop(sched, ex, tau=1, apply_wait_s=1.0)
    taken = _run(loop, range(12))
    starts = [(p, s) for kind, p, s in ex.events if kind == "start"]
    assert starts == [(p, s) for s in range(12) for p in sched.due(s)]
    # each result is awaited at start + tau, merged, before that step's own starts
    assert ex.events[:6] == [
        ("start", 0, 1),
        ("wait", 0, 1),
        ("merge", 0, -1),
        ("start", 1, 3),
        ("wait", 1, 3),
        ("merge", 1, -1),
    ]
    assert [o.step for o in taken] == [1, 3, 5, 7, 9]  # step 11's result is still awaited
    assert loop.pending == (2,)
    assert [o.step for o in loop.finish()] == [11] and loop.pending == ()
    assert loop.stats.started == loop.stats.applied == 6
    assert (loop.stats.failed, loop.stats.late, loop.stats.waits_run_out) == (0, 0, 0)


def test_tau_zero_is_blocking() -> None:
    ex = FakeExchange()
    loop = StreamingLoop(Schedule(H=4, fragments=1), ex, tau=0, apply_wait_s=1.0)
    _run(loop, range(8))
    assert ex.events == [
        ("start", 0, 3),
        ("wait", 0, 3),
        ("merge", 0, -1),
        ("start", 0, 7),
        ("wait", 0, 7),
        ("merge", 0, -1),
    ]
    assert loop.pending == ()


def test_failed_round_is_not_merged() -> None:
    ex = FakeExchange(fail={(0, 3)})
    loop = StreamingLoop(Schedule(H=4, fragments=1), ex, tau=1, apply_wait_s=1.0)
    taken = _run(loop, range(9))
    assert [(o.step, o.applied) for o in taken] == [(3, False), (7, True)]
    assert [e for e in ex.events if e[0] == "merge"] == [("merge", 0, -1)]
    assert (loop.stats.failed, loop.stats.applied) == (1, 1)
    assert loop.applied_step(0) == 7


def test_wait_runs_out_then_the_late_result_is_merged(caplog: pytest.LogCaptureFixture) -> None:
    ex = FakeExchange(slow={(0, 3)})
    loop = StreamingLoop(Schedule(H=8, fragments=2), ex, tau=2, apply_wait_s=0.5)  # offsets 3, 7
    with caplog.at_level(logging.INFO, logger="atoll.protocol.streaming"):
        assert loop.after_step(3) == []  # fragment 0 starts
        assert loop.after_step(5) == []  # its wait runs out: training goes on
        assert loop.stats.waits_run_out == 1 and loop.pending == ()
        assert ex.in_flight(0)
        late = loop.after_step(6)  # the result came meanwhile: merged first thing
    assert late == [SyncOutcome(0, 3, True, 0)]
    assert loop.stats.late == 1 and loop.applied_step(0) == 3
    assert "late result merged at step 6" in caplog.text
    assert "no result within 0.5 s" in caplog.text


def test_due_while_still_in_flight_is_skipped() -> None:
    ex = FakeExchange(slow={(0, 3)})
    loop = StreamingLoop(Schedule(H=4, fragments=1), ex, tau=1, apply_wait_s=0.0)
    loop.after_step(3)
    loop.after_step(4)  # wait runs out
    ex.late.clear()  # and the result does not come before the next due step
    loop.after_step(7)
    assert loop.stats.overlapped == 1 and loop.stats.started == 1


def test_steps_may_jump_ahead() -> None:
    ex = FakeExchange()
    loop = StreamingLoop(Schedule(H=10, fragments=2), ex, tau=3, apply_wait_s=1.0)  # 4, 9
    loop.after_step(4)
    taken = loop.after_step(30)  # a jump: the sync of step 4 is awaited now
    assert [o.step for o in taken] == [4]


def test_a_released_sync_is_not_awaited_and_merges_when_it_comes() -> None:
    ex = FakeExchange()
    loop = StreamingLoop(Schedule(H=10, fragments=2), ex, tau=3, apply_wait_s=1.0)  # 4, 9
    loop.after_step(4)
    assert loop.release(0) and not loop.release(0) and loop.pending == ()
    assert loop.after_step(7) == []  # its apply step: no wait
    assert ("wait", 0, 4) not in ex.events and ex.in_flight(0)
    ex.late.append(SyncOutcome(0, 4, True, 0, ""))  # the outcome comes later
    taken = loop.after_step(8)
    assert [o.step for o in taken] == [4] and ("merge", 0, -1) in ex.events
    assert loop.stats.late == 1 and loop.stats.waits_run_out == 0


def _met_at_24() -> tuple[FakeExchange, StreamingLoop]:
    """Fragment 0's sync started at step 4, released, and its outcome came: the other
    members began that round at step 24."""
    ex = FakeExchange()
    loop = StreamingLoop(Schedule(H=10, fragments=2), ex, tau=3, apply_wait_s=1.0)  # 4, 9
    loop.after_step(4)
    assert loop.release(0)
    ex.late.append(SyncOutcome(0, 4, True, 3, "", met_at=24))
    assert [o.met_at for o in loop.after_step(5)] == [24] and loop.met_at(0) == 24
    return ex, loop


@pytest.mark.parametrize(("landed", "start"), [(24, 34), (20, 34), (None, 24), (34, 34)])
def test_a_jump_onto_the_start_of_a_round_met_already_does_not_start_it_again(
    landed: int | None, start: int
) -> None:
    """The node's sync of fragment 0 started at step 4 and was held until the swarm
    began that round at step 24: the outcome says so (``met_at``). After a jump to 24,
    fragment 0's start, or to 20 (training on to 24), fragment 0 is not started at 24
    again (its next slot would be a period early): it starts at 34 as usual. Reaching
    24 by training with no jump (a node whose steps trail the swarm's by a period, in
    time with it) or a jump past it (34) starts it."""
    ex, loop = _met_at_24()
    if landed is not None:
        loop.landed(landed)
    first = 24 if landed is None else landed
    for step in sorted({first, 24, 34}):
        if step >= first:
            loop.after_step(step)
    starts = [s for kind, p, s in ex.events if kind == "start" and p == 0 and s > 4]
    assert starts[0] == start
    assert loop.stats.met_already == (1 if landed in (20, 24) else 0)


def test_finish_leaves_what_does_not_come() -> None:
    ex = FakeExchange(slow={(0, 3)})
    loop = StreamingLoop(Schedule(H=4, fragments=1), ex, tau=1, apply_wait_s=0.0)
    loop.after_step(3)
    assert loop.finish() == [] and loop.stats.unfinished == 1 and loop.pending == ()


def test_final_sync_covers_the_fragments_with_unsynced_work() -> None:
    sched = Schedule(H=6, fragments=3)  # offsets 1, 3, 5
    ex = FakeExchange(fail={(1, 3)})
    loop = StreamingLoop(sched, ex, tau=1, apply_wait_s=1.0)
    _run(loop, range(6))  # 0 applied at 1, 1 failed at 3, 2 started at 5
    with pytest.raises(ConfigError, match="finish"):
        loop.final_sync(5)
    assert [(o.fragment, o.step) for o in loop.finish()] == [(2, 5)]
    taken = loop.final_sync(5)
    assert [(o.fragment, o.step) for o in taken] == [(0, 5), (1, 5)]
    assert loop.final_sync(5) == []  # every fragment now holds the work up to step 5


@pytest.mark.parametrize(("tau", "wait"), [(-1, 1.0), (6, 1.0), (1, -1.0), (1, float("nan"))])
def test_bad_settings(tau: int, wait: float) -> None:
    with pytest.raises(ConfigError):
        StreamingLoop(Schedule(H=6, fragments=2), FakeExchange(), tau=tau, apply_wait_s=wait)


def test_merge_is_the_engines_arithmetic() -> None:
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(300).astype(np.float32)]
    for alpha in (0.0, 0.5, 0.9):
        eng = OuterEngine(EngineConfig(H=4, tau=1, alpha=alpha), Schedule(4, 1), init)
        local = init[0] - 0.01 * rng.standard_normal(300).astype(np.float32)
        got = merge(local, eng.global_params(0), alpha)
        assert got.dtype == np.float32 and got.tobytes() == eng.merge(0, local).tobytes()
    g = np.ones((2, 3), np.float64)
    out = merge(np.zeros(6, np.float32), g, 0.0)  # alpha 0: a flat float32 copy of global
    assert out.shape == (6,) and out.dtype == np.float32

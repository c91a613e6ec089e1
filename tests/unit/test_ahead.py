"""When a node forms a fragment's group ahead of its sync (node/net/ahead.py): the pace
estimate from the trainer's step notes and the prepare calls it makes."""

from __future__ import annotations

import pytest

from atoll.node.net.ahead import Ahead, Pace
from atoll.protocol.schedule import Schedule


def test_pace_needs_a_second_of_notes_and_follows_the_last_window() -> None:
    pace = Pace(window_s=10.0)
    assert pace.steps_per_s() is None
    pace.note(0.0, 0)
    pace.note(0.5, 2)
    assert pace.steps_per_s() is None  # under a second
    pace.note(1.0, 4)
    assert pace.steps_per_s() == pytest.approx(4.0)
    for t in range(2, 30):  # the trainer slows down to 1 step/s
        pace.note(float(t), 4 + (t - 1))
    assert pace.steps_per_s() == pytest.approx(1.0)
    pace.note(30.0, 3)  # moved back (realigned): the old notes go
    assert pace.steps_per_s() is None


def test_a_jump_does_not_make_the_trainer_seem_fast() -> None:
    pace = Pace(window_s=10.0)
    for k in range(4):  # 2 steps per second
        pace.note(k * 0.5, k)
    pace.note(2.0, 133)  # the trainer jumped 130 steps to meet its swarm
    assert pace.steps_per_s() == pytest.approx(2.0)
    for k in range(1, 4):
        pace.note(2.0 + k * 0.5, 133 + k)
    assert pace.steps_per_s() == pytest.approx(2.0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_fragment_is_prepared_once_within_the_lead_of_its_sync() -> None:
    schedule = Schedule(12, 3)  # offsets 3, 7, 11
    calls: list[tuple[int, int]] = []
    done: set[tuple[int, int]] = set()

    def prepare(p: int, step: int) -> bool:
        if (p, step) in done:
            return False
        done.add((p, step))
        calls.append((p, step))
        return True

    clock = _Clock()
    ahead = Ahead(schedule, prepare, clock, lead_s=1.0)
    assert ahead.note(0) == []  # no pace yet
    started = []
    for step in range(1, 30):  # 2 steps per second
        clock.now = step / 2
        started += ahead.note(step)
    # each sync is prepared when its due step is at most 2 steps (1 s) away, once
    assert calls == started == [(0, 3), (1, 7), (2, 11), (0, 15), (1, 19), (2, 23), (0, 27)]
    assert ahead.prepared == len(calls)


def test_a_lead_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lead_s"):
        Ahead(Schedule(4, 1), lambda p, s: True, _Clock(), lead_s=0.0)

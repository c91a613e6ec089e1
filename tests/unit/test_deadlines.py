"""Deadlines measured from past rounds (atoll.protocol.deadlines)."""

from __future__ import annotations

import statistics

import pytest

from atoll.protocol.deadlines import DeadlineRule, MeasuredDeadline, RoundDeadlines
from atoll.protocol.errors import ConfigError

RULE = DeadlineRule(k=6.0, ratio=3.0, floor_s=2.0, min_samples=5, window=8)


def test_the_ceiling_holds_until_enough_rounds_were_measured() -> None:
    d = MeasuredDeadline(30.0, RULE)
    for _ in range(RULE.min_samples - 1):
        d.observe(1.0)
        assert d.current() == 30.0 and d.measured() is None
    d.observe(1.0)
    assert d.current() == 3.0  # ratio x median: the samples have no spread


def test_median_plus_k_deviations_and_the_clamps() -> None:
    d = MeasuredDeadline(30.0, RULE)
    samples = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.3]
    for s in samples:
        d.observe(s)
    med = statistics.median(samples)
    mad = statistics.median(abs(s - med) for s in samples)
    assert d.measured() == pytest.approx(max(3 * med, med + 6 * 1.4826 * mad))
    assert d.current() == pytest.approx(d.measured())
    fast = MeasuredDeadline(30.0, RULE)
    for _ in range(5):
        fast.observe(0.05)
    assert fast.current() == RULE.floor_s  # never a hair trigger
    slow = MeasuredDeadline(30.0, RULE)
    for s in [20.0, 25.0, 15.0, 22.0, 18.0]:
        slow.observe(s)
    assert slow.current() == 30.0  # never past the manifest's timeout


def test_one_slow_round_barely_moves_it_and_old_rounds_age_out() -> None:
    d = MeasuredDeadline(60.0, RULE)
    for _ in range(6):
        d.observe(1.0)
    d.observe(25.0)  # a passing stall
    assert d.current() < 4.0
    for _ in range(RULE.window):
        d.observe(5.0)  # the link became slower for good
    assert d.current() == 15.0


def test_a_miss_doubles_the_next_deadlines_until_a_round_ends_well() -> None:
    d = MeasuredDeadline(30.0, RULE)
    for _ in range(5):
        d.observe(1.0)
    assert d.current() == 3.0
    d.missed(3.0)
    assert d.current() == 6.0
    d.missed(6.0)
    assert d.current() == 12.0
    for _ in range(5):
        d.missed(d.current())
    assert d.current() == 30.0  # capped
    d.observe(1.0)
    assert d.current() == 3.0
    d.missed(30.0)  # a miss at the ceiling widens nothing
    assert d.current() == 3.0


def test_nonsense_samples_are_ignored() -> None:
    d = MeasuredDeadline(30.0, RULE)
    for s in [float("nan"), float("inf"), -1.0]:
        d.observe(s)
    assert d.samples == 0


def test_round_deadlines_keep_the_round_no_shorter_than_its_phase() -> None:
    r = RoundDeadlines(8.0, 15.0, RULE)
    assert r.current() == (8.0, 15.0)
    for _ in range(5):
        r.done(3.0, 0.5)  # a member's chunk took long, the rest was quick
    phase, whole = r.current()
    assert phase == 8.0 and whole == phase  # 3 x 3.0 capped at part_s; round >= phase
    r.timed_out(phase, whole, parts_in=True)
    assert r.whole.current() > 2.0
    r.done(None, None)  # a round measured nothing: no change, no crash
    assert r.phase.samples == 5


@pytest.mark.parametrize(
    "kwargs",
    [{"k": 0.0}, {"ratio": 0.5}, {"floor_s": float("nan")}, {"min_samples": 0}, {"window": 2}],
)
def test_a_bad_rule_says_what_is_wrong(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="deadline rule"):
        DeadlineRule(**kwargs)  # type: ignore[arg-type]


def test_a_bad_ceiling_is_refused() -> None:
    with pytest.raises(ConfigError, match="ceiling"):
        MeasuredDeadline(0.0)

"""Tests of the Streaming DiLoCo sync schedule and its invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.errors import ConfigError
from atoll.protocol.schedule import Schedule

FAST = settings(max_examples=100, deadline=None)


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    h = draw(st.integers(1, 200))
    p = draw(st.integers(1, h))
    return Schedule(h, p)


def test_vanilla_diloco() -> None:
    s = Schedule(H=5, fragments=1)
    assert s.offset(0) == 4
    assert [step for step in range(20) if s.due(step)] == [4, 9, 14, 19]
    assert s.syncs(0, 20) == [(4, 0), (9, 0), (14, 0), (19, 0)]


def test_example_h100_p8() -> None:
    s = Schedule(100, 8)
    assert s.offsets == (11, 24, 36, 49, 61, 74, 86, 99)
    assert s.due(11) == (0,) and s.due(111) == (0,) and s.due(12) == ()
    assert s.next_sync(0, 12) == 111
    assert s.next_sync(7, 0) == 99
    assert s.check_overlap(1) == 1
    assert s.check_overlap(12) == 1
    assert s.check_overlap(13) == 2


@pytest.mark.parametrize(("h", "p"), [(0, 1), (-3, 1), (4, 0), (4, 5), (1, 2)])
def test_invalid(h: int, p: int) -> None:
    with pytest.raises(ConfigError):
        Schedule(h, p)


def test_invalid_arguments() -> None:
    s = Schedule(10, 3)
    with pytest.raises(ConfigError):
        s.offset(3)
    with pytest.raises(ConfigError):
        s.next_sync(-1, 0)
    with pytest.raises(ConfigError):
        s.check_overlap(-1)
    with pytest.raises(ConfigError, match="tau"):
        s.check_overlap(10)
    assert s.due(-1) == ()
    assert s.syncs(5, 5) == [] and s.syncs(7, 3) == []


def test_p_equals_h_syncs_every_step() -> None:
    s = Schedule(6, 6)
    assert s.offsets == tuple(range(6))
    assert [s.due(step) for step in range(12)] == [(i % 6,) for i in range(12)]
    assert s.check_overlap(0) == 1
    assert s.check_overlap(1) == 1
    assert s.check_overlap(3) == 3


@FAST
@given(s=schedules(), start=st.integers(0, 1000))
def test_each_fragment_exactly_once_per_window(s: Schedule, start: int) -> None:
    for window_start in (0, start):
        seen = [p for step in range(window_start, window_start + s.H) for p in s.due(step)]
        assert sorted(seen) == list(range(s.fragments))


@FAST
@given(s=schedules())
def test_offsets_evenly_spread(s: Schedule) -> None:
    h, p = s.H, s.fragments
    t = [s.offset(i) for i in range(p)]
    assert t == list(s.offsets)
    assert t[-1] == h - 1
    assert all(0 <= x < h for x in t)
    gaps = [b - a for a, b in itertools.pairwise(t)] + [t[0] + h - t[-1]]
    assert all(g in (h // p, -(-h // p)) for g in gaps)
    assert max(gaps) - min(gaps) <= 1
    assert sum(gaps) == h


@FAST
@given(s=schedules(), start=st.integers(0, 500), length=st.integers(0, 600))
def test_global_order_is_shared_and_never_collides(s: Schedule, start: int, length: int) -> None:
    other = Schedule(s.H, s.fragments)  # a second peer with the same settings
    stop = start + length
    mine = s.syncs(start, stop)
    assert mine == other.syncs(start, stop)
    by_step = [(step, p) for step in range(start, stop) for p in s.due(step)]
    assert mine == by_step
    steps = [step for step, _ in mine]
    assert len(steps) == len(set(steps))  # two fragments never share a step (P <= H)
    assert all(len(s.due(step)) <= 1 for step in range(start, stop))


@FAST
@given(s=schedules(), data=st.data())
def test_next_sync(s: Schedule, data: st.DataObject) -> None:
    p = data.draw(st.integers(0, s.fragments - 1))
    after = data.draw(st.integers(-5, 3 * s.H))
    n = s.next_sync(p, after)
    assert n >= after and p in s.due(n)
    assert all(p not in s.due(step) for step in range(max(after, 0), n))


def simulate_in_flight(s: Schedule, tau: int) -> int:
    """Peak number of syncs in flight, with intervals [step, step + tau), over 3 periods."""
    if tau == 0:
        return 1
    starts = [step for step, _ in s.syncs(0, 3 * s.H)]
    return max(sum(1 for t in starts if t <= x < t + tau) for x in range(3 * s.H))


@FAST
@given(s=schedules(), data=st.data())
def test_overlap_matches_simulation(s: Schedule, data: st.DataObject) -> None:
    tau = data.draw(st.integers(0, s.H - 1))
    peak = s.check_overlap(tau)
    assert peak == simulate_in_flight(s, tau)
    if tau * s.fragments < s.H:  # tau < H / P: at most one fragment in flight
        assert peak == 1
    if tau <= s.H // s.fragments:
        assert peak == 1


@FAST
@given(s=schedules(), data=st.data())
def test_overlap_refuses_tau_at_least_h(s: Schedule, data: st.DataObject) -> None:
    tau = data.draw(st.integers(s.H, 3 * s.H))
    with pytest.raises(ConfigError):
        s.check_overlap(tau)


def test_a_jump_lands_on_the_sync_the_swarm_just_started() -> None:
    # H=30, P=3: syncs after steps 9, 19, 29 of every period. A peer back from a split at
    # step 736 whose swarm is at 801 lands on 799, the fragment-1 sync two steps back,
    # and starts it at once (the faults benchmark's lone node jumped to 801 and met that
    # fragment a whole period later)
    s = Schedule(30, 3)
    assert s.due(799) == (1,)
    assert s.landing(736, 801, margin=5) == 799
    assert s.landing(736, 801, margin=1) == 801  # the sync is further back than the margin
    assert s.landing(736, 799, margin=5) == 799  # the target is a sync step itself
    assert s.landing(798, 801, margin=5) == 799
    assert s.landing(799, 801, margin=5) == 801  # never back to (or before) the current step
    assert s.landing(801, 790, margin=5) == 790  # not a jump forward: unchanged
    assert s.landing(736, 801, margin=0) == 801


def test_a_jump_past_a_sync_further_back_lands_on_the_next_one() -> None:
    # the swarm at 806 started fragment 1's sync at 799, seven steps ago, past the margin:
    # the peer lands on 809 (fragment 2's sync, not reached yet) and waits there
    s = Schedule(30, 3)
    assert s.due(809) == (2,)
    assert s.landing(736, 806, margin=5, ahead=3) == 809
    assert s.landing(736, 806, margin=5, ahead=2) == 806  # further ahead than allowed
    assert s.landing(736, 806, margin=5) == 806  # ahead defaults to 0: the target itself
    assert s.landing(736, 809, margin=5, ahead=5) == 809
    assert s.landing(736, 804, margin=5, ahead=9) == 799  # a start behind comes first


@FAST
@given(
    s=schedules(),
    current=st.integers(0, 500),
    forward=st.integers(0, 300),
    margin=st.integers(0, 40),
    ahead=st.integers(0, 40),
)
def test_landing_is_the_last_sync_within_the_margin_else_the_next_within_ahead(
    s: Schedule, current: int, forward: int, margin: int, ahead: int
) -> None:
    target = current + forward
    land = s.landing(current, target, margin, ahead)
    back = [step for step in range(max(current + 1, target - margin), target + 1) if s.due(step)]
    after = [step for step in range(target + 1, target + ahead + 1) if s.due(step)]
    if forward == 0:
        assert land == target
    elif back:
        assert land == back[-1]
        assert current < land <= target and target - land <= margin
    elif after:
        assert land == after[0]
        assert target < land <= target + ahead
    else:
        assert land == target


def test_landing_refuses_bad_arguments() -> None:
    s = Schedule(30, 3)
    with pytest.raises(ConfigError):
        s.landing(0, 10, margin=-1)
    with pytest.raises(ConfigError):
        s.landing(0, 10, margin=1, ahead=-1)
    with pytest.raises(ConfigError):
        s.landing(0, 10.0, margin=1)  # type: ignore[arg-type]

"""Tests of the micro-batch partitioner (Karmarkar-Karp differencing, greedy moves)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.errors import ConfigError
from atoll.protocol.packing import (
    Partition,
    balance,
    improve,
    in_order,
    karmarkar_karp,
    largest_first,
    pack,
    sequence_costs,
)

FAST = settings(max_examples=200, deadline=None)

costs_st = st.lists(st.integers(0, 10_000), max_size=60)
k_st = st.integers(1, 9)


def assert_valid(part: Partition, costs: Sequence[int], k: int) -> None:
    """k bins, every item in exactly one, each bin ascending, loads that add up."""
    assert part.k == k
    items = [i for b in part.bins for i in b]
    assert sorted(items) == list(range(len(costs)))
    assert all(list(b) == sorted(b) for b in part.bins)
    assert part.loads == tuple(sum(costs[i] for i in b) for b in part.bins)


def best_by_brute_force(costs: Sequence[int], k: int) -> tuple[int, int]:
    """(smallest spread, smallest heaviest bin) over every assignment of items to bins."""
    spreads, maxima = [], []
    for assignment in itertools.product(range(k), repeat=len(costs)):
        loads = [0] * k
        for item, b in enumerate(assignment):
            loads[b] += costs[item]
        spreads.append(max(loads) - min(loads))
        maxima.append(max(loads))
    return min(spreads), min(maxima)


# -- known answers ----------------------------------------------------------------------------
def test_differencing_of_the_textbook_example() -> None:
    # Karmarkar & Karp on {8, 7, 6, 5, 4}: 8-7, 6-5, then 4-1, 3-1 leave a difference of 2,
    # while {8, 7} against {6, 5, 4} is perfect; one swap of the moves finds it
    assert karmarkar_karp([8, 7, 6, 5, 4], 2).loads == (16, 14)
    best = balance([8, 7, 6, 5, 4], 2)
    assert best.loads == (15, 15)
    assert {frozenset(b) for b in best.bins} == {frozenset({0, 1}), frozenset({2, 3, 4})}


def test_three_way_differencing_by_hand() -> None:
    # (5)(4) -> [5, 4, 0]; with (3) -> [5, 4, 3]; (3)(3) -> [3, 3, 0]; the last merge joins
    # 3+3, 3+4 and 0+5: loads 7, 6, 5, the best three bins of these items can have
    part = karmarkar_karp([5, 4, 3, 3, 3], 3)
    assert part.loads == (7, 6, 5)
    assert part.bins[2] == (0,) and sorted(part.bins[0] + part.bins[1]) == [1, 2, 3, 4]
    assert balance([5, 4, 3, 3, 3], 3).spread == best_by_brute_force([5, 4, 3, 3, 3], 3)[0]


def test_largest_first_by_hand_and_a_swap_that_beats_it() -> None:
    # 5 -> A, 4 -> B, 3 -> B (7), 3 -> A (8), 3 -> B (10)
    lpt = largest_first([5, 4, 3, 3, 3], 2)
    assert lpt.bins == ((0, 3), (1, 2, 4)) and lpt.loads == (8, 10)
    # swapping the 4 for a 3 gives 9 and 9
    assert improve([5, 4, 3, 3, 3], lpt).loads == (9, 9)
    assert balance([5, 4, 3, 3, 3], 2).spread == 0


def test_in_order_cuts_consecutive_equal_counts() -> None:
    part = in_order(list(range(10)), 4)
    assert part.bins == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))
    assert part.loads == (3, 12, 13, 17)
    few = in_order([5, 6], 4)
    assert few.bins == ((0,), (1,), (), ()) and few.spread == 6


def test_fewer_items_than_bins_each_alone_and_no_items_at_all() -> None:
    part = balance([9, 1, 4], 5)
    assert sorted(len(b) for b in part.bins) == [0, 0, 1, 1, 1]
    empty = balance([], 3)
    assert empty.bins == ((), (), ()) and empty.spread == 0
    assert karmarkar_karp([], 2).loads == (0, 0)


def test_costs_are_linear_or_quadratic() -> None:
    assert sequence_costs([3, 10, 0]) == (3, 10, 0)
    assert sequence_costs([3, 10, 0], "quadratic") == (9, 100, 0)
    # quadratic cost: one sequence of 4 weighs as much as four of 2 together
    assert pack([4, 2, 2, 2, 2], 2, "kk", "quadratic").loads == (16, 16)
    assert pack([4, 2, 2, 2, 2], 2, "kk", "linear").spread == 0
    assert pack([4, 2, 2, 2, 2], 2, "plain").bins == ((0, 1, 2), (3, 4))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: balance([1, 2], 0), "bins must be >= 1"),
        (lambda: balance([1, 2], True), "must be an int"),  # type: ignore[arg-type]
        (lambda: balance([1, -2], 2), "non-negative"),
        (lambda: balance([1, 2.5], 2), "integer"),  # type: ignore[list-item]
        (lambda: in_order([True], 2), "non-negative integer"),
        (lambda: sequence_costs([1], "cubic"), "cost must be one of"),
        (lambda: pack([1], 2, "sorted"), "packing must be one of"),
        (lambda: improve([1, 2], Partition(((0,), ()), (1, 0))), "exactly once"),
        (lambda: improve([1], Partition(((0,),), (1,)), -1), "max_moves"),
    ],
)
def test_bad_arguments_are_refused(call: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()  # type: ignore[operator]


# -- properties -------------------------------------------------------------------------------
@FAST
@given(costs_st, k_st)
def test_every_partitioner_puts_each_item_in_exactly_one_of_k_bins(
    costs: list[int], k: int
) -> None:
    for part in (
        in_order(costs, k),
        karmarkar_karp(costs, k),
        largest_first(costs, k),
        balance(costs, k),
        improve(costs, in_order(costs, k)),
    ):
        assert_valid(part, costs, k)


@FAST
@given(costs_st, k_st)
def test_balance_is_never_worse_than_largest_first(costs: list[int], k: int) -> None:
    assert balance(costs, k).spread <= largest_first(costs, k).spread


@FAST
@given(costs_st, k_st)
def test_the_moves_never_raise_the_heaviest_nor_lower_the_lightest_bin(
    costs: list[int], k: int
) -> None:
    for start in (in_order(costs, k), karmarkar_karp(costs, k)):
        better = improve(costs, start)
        assert better.max_load <= start.max_load
        assert better.min_load >= start.min_load


@FAST
@given(costs_st, k_st)
def test_the_moves_stop_where_no_move_or_swap_helps_the_heaviest_bin(
    costs: list[int], k: int
) -> None:
    part = improve(costs, in_order(costs, k), max_moves=10_000)
    h = max(range(k), key=lambda b: (part.loads[b], -b))
    for lo in range(k):
        if lo == h:
            continue
        gap = part.loads[h] - part.loads[lo]
        deltas = [costs[a] for a in part.bins[h]]
        deltas += [costs[a] - costs[b] for a in part.bins[h] for b in part.bins[lo]]
        assert not any(0 < d < gap for d in deltas)


@FAST
@given(costs_st, k_st)
def test_zero_moves_change_nothing_and_results_repeat(costs: list[int], k: int) -> None:
    start = karmarkar_karp(costs, k)
    assert improve(costs, start, max_moves=0) == start
    assert balance(costs, k) == balance(list(costs), k)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=7), st.integers(1, 3))
def test_against_brute_force_on_tiny_inputs(costs: list[int], k: int) -> None:
    part = balance(costs, k)
    spread, heaviest = best_by_brute_force(costs, k)
    # the approximation bound of both heuristics (Graham; Michiels et al.)
    assert part.max_load * 3 * k <= (4 * k - 1) * heaviest
    assert part.spread >= spread and part.max_load >= heaviest
    if len(costs) <= 4:
        assert part.spread == spread


@FAST
@given(st.lists(st.integers(0, 512), min_size=1, max_size=80), st.integers(1, 16))
def test_the_spread_is_at_most_the_largest_item(lengths: list[int], k: int) -> None:
    """True of largest-first (each item goes to the lightest bin), so of balance too; the
    heaviest bin is then within one item of the mean, where plain's need not be."""
    kk = pack(lengths, k, "kk")
    assert kk.spread <= max(lengths)
    assert kk.max_load * k <= sum(lengths) + k * max(lengths)

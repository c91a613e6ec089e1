"""Balanced micro-batches: split variable-length sequences into k bins of near-equal cost.

A batch of whole documents is trained as k micro-batches with gradient accumulation. When
documents have very different lengths, cutting the batch into k groups of equal *count*
(:func:`in_order`, the plain baseline) gives micro-batches of very different cost: one
holds the long documents, another only short ones. ODC (on-demand communication, arXiv
2601.19362) balances such micro-batches with the largest differencing method of Karmarkar
and Karp ("The differencing method of set partitioning", Karmarkar & Karp 1982) in its
k-way form, followed by greedy swaps; this module is that partitioner, sans-IO and exact
on integer costs.

- :func:`sequence_costs`: the cost of a sequence, linear in its length (matrix products)
  or quadratic (attention, which dominates for long sequences).
- :func:`karmarkar_karp`: the k-way largest differencing method. Every item starts as a
  partial partition of k subsets, the item alone in one of them; the two partial
  partitions of largest spread (heaviest minus lightest subset) are merged, the heaviest
  subset of one with the lightest of the other, the second heaviest with the second
  lightest, and so on, until one partition of all items is left.
- :func:`improve`: a bounded pass of greedy moves and swaps that lower the heaviest bin.
- :func:`largest_first`: the greedy largest-first heuristic (each item, largest first,
  into the lightest bin), the reference a balanced partition must not lose to.
- :func:`balance`: the partitioner the trainer uses: differencing, then the moves, never
  worse in spread than largest-first followed by the same moves.

Every function is a deterministic function of its arguments (ties are broken by item and
bin index), so peers and a resumed node compute the same micro-batches. The method and
atoll's choices are described in docs/ALGORITHMS.md §5.2.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from atoll.protocol.errors import ConfigError

__all__ = [
    "COSTS",
    "PACKINGS",
    "Partition",
    "balance",
    "improve",
    "in_order",
    "karmarkar_karp",
    "largest_first",
    "pack",
    "sequence_costs",
]

COSTS: tuple[str, ...] = ("linear", "quadratic")
"""How a sequence's cost grows with its length: ``n`` or ``n²``."""

PACKINGS: tuple[str, ...] = ("plain", "kk")
"""How a batch is cut into micro-batches: in arrival order by count, or balanced by cost."""

DEFAULT_MAX_MOVES = 256
"""Bound on the moves and swaps of :func:`improve` (each strictly lowers a heavy bin)."""


@dataclass(frozen=True, slots=True)
class Partition:
    """k bins of item indices (each bin ascending) and the total cost of each bin."""

    bins: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]

    @property
    def k(self) -> int:
        return len(self.bins)

    @property
    def max_load(self) -> int:
        return max(self.loads)

    @property
    def min_load(self) -> int:
        return min(self.loads)

    @property
    def spread(self) -> int:
        """Heaviest minus lightest bin: 0 is a perfect balance."""
        return self.max_load - self.min_load


# -- checks -----------------------------------------------------------------------------------
def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(f"the number of bins must be an int, got {k!r}")
    if k < 1:
        raise ConfigError(f"the number of bins must be >= 1, not {k}")
    return k


def _check_costs(costs: Sequence[int]) -> list[int]:
    out = []
    for i, c in enumerate(costs):
        try:
            value = operator.index(c)
        except TypeError:
            raise ConfigError(f"cost {i} must be an integer, not {c!r}") from None
        if isinstance(c, bool) or value < 0:
            raise ConfigError(f"cost {i} must be a non-negative integer, not {c!r}")
        out.append(value)
    return out


def _partition(costs: Sequence[int], bins: Sequence[Sequence[int]]) -> Partition:
    ordered = tuple(tuple(sorted(b)) for b in bins)
    return Partition(ordered, tuple(sum(costs[i] for i in b) for b in ordered))


# -- costs ------------------------------------------------------------------------------------
def sequence_costs(lengths: Sequence[int], cost: str = "linear") -> tuple[int, ...]:
    """The cost of each sequence: its length (``linear``) or its length squared
    (``quadratic``: the attention scores a causal transformer computes grow as n²)."""
    if cost not in COSTS:
        raise ConfigError(f"cost must be one of {COSTS}, not {cost!r}")
    values = _check_costs(lengths)
    return tuple(n * n for n in values) if cost == "quadratic" else tuple(values)


# -- the plain baseline -----------------------------------------------------------------------
def in_order(costs: Sequence[int], k: int) -> Partition:
    """Items in arrival order cut into k consecutive bins of equal count (the first
    ``n mod k`` bins hold one more); bins stay empty when there are fewer than k items."""
    values = _check_costs(costs)
    _check_k(k)
    size, extra = divmod(len(values), k)
    bins, start = [], 0
    for b in range(k):
        end = start + size + (1 if b < extra else 0)
        bins.append(range(start, end))
        start = end
    return _partition(values, [list(b) for b in bins])


# -- largest differencing (Karmarkar & Karp 1982) ------------------------------------------------
def karmarkar_karp(costs: Sequence[int], k: int) -> Partition:
    """The k-way largest differencing method of Karmarkar & Karp (1982), as ODC (arXiv
    2601.19362) applies it to sequences.

    Each item i starts as a partial partition of k subsets: {i} and k - 1 empty ones. While
    more than one partial partition is left, the two of largest spread (ties: the older
    one) are merged: the subsets of the first, heaviest first, are joined with those of
    the second, lightest first, so that the large differences cancel out. The merged
    partition's subsets are sorted again and it goes back to the pool. The last one left
    is the result; its bins are in decreasing load (ties: the bin of the lowest items).
    O(n·k·log(n·k)) for n items, apart from copying item lists.
    """
    values = _check_costs(costs)
    _check_k(k)
    if not values:
        return _partition(values, [[] for _ in range(k)])
    # heap entries: (-spread, age, loads, subsets); loads are in decreasing order
    heap: list[tuple[int, int, list[int], list[list[int]]]] = []
    for i, c in enumerate(values):
        heap.append((-c, i, [c] + [0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    heapq.heapify(heap)
    age = len(values)
    while len(heap) > 1:
        _, _, loads_a, sets_a = heapq.heappop(heap)
        _, _, loads_b, sets_b = heapq.heappop(heap)
        merged = [
            (loads_a[j] + loads_b[k - 1 - j], sorted(sets_a[j] + sets_b[k - 1 - j]))
            for j in range(k)
        ]
        merged.sort(key=lambda s: (-s[0], s[1]))
        loads = [load for load, _ in merged]
        heapq.heappush(heap, (loads[-1] - loads[0], age, loads, [s for _, s in merged]))
        age += 1
    return _partition(values, heap[0][3])


def largest_first(costs: Sequence[int], k: int) -> Partition:
    """Greedy largest-first (LPT): items by decreasing cost (ties: lower index) each go
    into the currently lightest bin (ties: lower bin index)."""
    values = _check_costs(costs)
    _check_k(k)
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]
    for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + values[i], b))
    return _partition(values, bins)


# -- greedy moves and swaps ----------------------------------------------------------------------
def improve(
    costs: Sequence[int], partition: Partition, max_moves: int = DEFAULT_MAX_MOVES
) -> Partition:
    """Lower the heaviest bin with at most ``max_moves`` greedy moves and swaps.

    Each step takes the heaviest bin h (ties: lowest index) and, over every other bin l,
    every single item moved from h to l and every pair of items swapped between them,
    the change that makes the larger of the two new loads smallest, provided it is below
    h's load now (ties: a move before a swap, then the lower bin, then the lower items).
    Such a change never raises the heaviest bin nor lowers the lightest, so the spread
    never grows; it strictly lowers the sum of squared loads, so the pass ends. It stops
    when no change helps h, or after ``max_moves`` changes.
    """
    values = _check_costs(costs)
    if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 0:
        raise ConfigError(f"max_moves must be an int >= 0, not {max_moves!r}")
    bins = [list(b) for b in partition.bins]
    if sorted(i for b in bins for i in b) != list(range(len(values))):
        raise ConfigError("the partition does not hold every item exactly once")
    loads = [sum(values[i] for i in b) for b in bins]
    for _ in range(max_moves):
        h = max(range(len(bins)), key=lambda b: (loads[b], -b))
        best: tuple[int, int, int, int, int] | None = None  # (new max, kind, l, a, b)
        for lo in range(len(bins)):
            gap = loads[h] - loads[lo]
            if lo == h or gap < 2:
                continue  # a change must move 0 < d < gap to help
            for a in bins[h]:
                d = values[a]
                if 0 < d < gap:
                    cand = (max(loads[h] - d, loads[lo] + d), 0, lo, a, -1)
                    best = cand if best is None or cand < best else best
                for b in bins[lo]:
                    d = values[a] - values[b]
                    if 0 < d < gap:
                        cand = (max(loads[h] - d, loads[lo] + d), 1, lo, a, b)
                        best = cand if best is None or cand < best else best
        if best is None:
            break
        _, kind, lo, a, b = best
        bins[h].remove(a)
        bins[lo].append(a)
        moved = values[a]
        if kind == 1:
            bins[lo].remove(b)
            bins[h].append(b)
            moved -= values[b]
        loads[h] -= moved
        loads[lo] += moved
    return _partition(values, bins)


def balance(costs: Sequence[int], k: int, max_moves: int = DEFAULT_MAX_MOVES) -> Partition:
    """k bins of balanced total cost: :func:`karmarkar_karp`, then :func:`improve`.

    Largest-first followed by the same moves is computed too, and kept instead when its
    spread is smaller (ties: the smaller heaviest bin, then differencing): differencing
    is usually the better of the two, but not on every input, and the check costs little
    next to a training step. Either way the heaviest bin is at most (4/3 - 1/(3k)) times
    that of the best partition (Graham 1969 for largest-first; Michiels, Korst, Aarts and
    van Leeuwen 2007 for differencing; the moves never raise it).
    """
    values = _check_costs(costs)
    kk = improve(values, karmarkar_karp(values, k), max_moves)
    lpt = improve(values, largest_first(values, k), max_moves)
    if (lpt.spread, lpt.max_load) < (kk.spread, kk.max_load):
        return lpt
    return kk


def pack(
    lengths: Sequence[int],
    k: int,
    packing: str = "kk",
    cost: str = "linear",
    max_moves: int = DEFAULT_MAX_MOVES,
) -> Partition:
    """Micro-batches of sequences of these lengths: ``plain`` (:func:`in_order`) or
    ``kk`` (:func:`balance` of :func:`sequence_costs`); loads are in ``cost`` units."""
    if packing not in PACKINGS:
        raise ConfigError(f"packing must be one of {PACKINGS}, not {packing!r}")
    costs = sequence_costs(lengths, cost)
    if packing == "plain":
        return in_order(costs, k)
    return balance(costs, k, max_moves)

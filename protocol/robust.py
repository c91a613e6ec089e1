"""Robust aggregation rules for a chunk's owner (docs/ALGORITHMS.md §5.3).

In the all-reduce (:mod:`atoll.protocol.allreduce`) the owner of chunk ``j`` combines
chunk ``j`` of every member's pseudo-gradient. In a trusted swarm that is the
token-weighted mean; one hostile member can move a mean arbitrarily far. This module holds
the rules an owner may use instead, on float32 numpy vectors (one per member, in member
order) and their token weights:

- ``mean``: the token-weighted mean, summed in float32 in member order (the behaviour of
  Streaming DiLoCo's reduction, arXiv 2501.18512, with token weights as in Decoupled
  DiLoCo, arXiv 2604.21428). No tolerance of hostile parts.
- ``trimmed_mean``: per coordinate, drop the ``b`` highest and ``b`` lowest values and take
  the token-weighted mean of the rest (Yin, Chen, Ramchandran, Bartlett 2018, "Byzantine-
  robust distributed learning: towards optimal statistical rates", arXiv 1803.01498).
  With at most ``b`` hostile parts every coordinate of the result lies between the
  smallest and largest honest value of that coordinate.
- ``centered_clip``: start from the coordinate-wise median ``v`` and iterate
  ``v <- v + sum_i w_i clip(x_i - v, tau)``, where ``clip(z, tau) = z * min(1, tau/||z||)``
  (Karimireddy, He, Jaggi 2021, "Learning from history for Byzantine robust
  optimization", arXiv 2012.10333; BTARD, Gorbunov et al. 2021, arXiv 2106.11257, runs it
  per chunk of a butterfly all-reduce as here). Each hostile part moves ``v`` by at most
  its weight share times ``tau`` per iteration, whatever it sends.

Norms are those of the chunk the owner holds, not of the whole vector: that is all an
owner sees.

Determinism: every rule reads the parts in the order given (member order), sorts with a
stable sort, and sums with element-wise numpy operations in a fixed order (no BLAS, no
threads), so the same inputs give the same bytes on every run; members agree anyway,
because each chunk is computed once, by its owner, and everybody commits those bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from atoll.protocol.errors import ConfigError

__all__ = [
    "RULE_KINDS",
    "RobustRule",
    "RuleKind",
    "aggregate",
    "centered_clip",
    "coordinate_median",
    "normalized_weights",
    "trimmed_mean",
    "weighted_average",
]

F32Array = npt.NDArray[np.float32]
F64Array = npt.NDArray[np.float64]

RuleKind: TypeAlias = Literal["mean", "trimmed_mean", "centered_clip"]
RULE_KINDS: tuple[str, ...] = ("mean", "trimmed_mean", "centered_clip")

_STEP = 1 << 14  # coordinates per slice: n slices of this stay in the CPU cache
_MAX_ITERATIONS = 100


@dataclass(frozen=True, slots=True)
class RobustRule:
    """How a chunk's owner combines the members' parts; the group must agree on it.

    ``kind``: ``"mean"`` (trusted swarms, the default), ``"trimmed_mean"`` or
    ``"centered_clip"``.
    ``trim``: trimmed mean only, the share of the group dropped at *each* end of every
    coordinate: ``b = floor(trim * n)``, at least 1 once ``n >= 3`` (so that a group of 3
    still resists one liar) and at most ``(n - 1) // 2`` (something must remain). 0 drops
    nothing. The default 0.25 gives b = 1 for n = 3..7 and b = 2 for n = 8.
    ``clip_scale``: centered clipping only, ``tau = clip_scale * m`` where ``m`` is the
    lower median of the parts' distances to the coordinate-wise median: a multiple of the
    typical honest spread, so honest parts are rarely clipped and the rule then equals
    the weighted mean.
    ``iterations``: centered clipping only, the number of clipping steps (1 to 100).
    """

    kind: RuleKind = "mean"
    trim: float = 0.25
    clip_scale: float = 2.0
    iterations: int = 3

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ConfigError(f"aggregation kind must be one of {RULE_KINDS}, not {self.kind!r}")
        if isinstance(self.trim, bool) or not isinstance(self.trim, int | float):
            raise ConfigError(f"trim must be a number, not {self.trim!r}")
        if not (math.isfinite(self.trim) and 0 <= self.trim < 0.5):
            raise ConfigError(f"trim must lie in [0, 0.5), not {self.trim!r}")
        if isinstance(self.clip_scale, bool) or not isinstance(self.clip_scale, int | float):
            raise ConfigError(f"clip_scale must be a number, not {self.clip_scale!r}")
        if not (math.isfinite(self.clip_scale) and self.clip_scale > 0):
            raise ConfigError(f"clip_scale must be finite and > 0, not {self.clip_scale!r}")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int):
            raise ConfigError(f"iterations must be an integer, not {self.iterations!r}")
        if not 1 <= self.iterations <= _MAX_ITERATIONS:
            raise ConfigError(f"iterations must lie in [1, {_MAX_ITERATIONS}]")

    def trimmed(self, n: int) -> int:
        """``b``, the parts dropped at each end per coordinate in a group of ``n``."""
        if self.kind != "trimmed_mean" or n < 3 or self.trim == 0:
            return 0
        return min((n - 1) // 2, max(1, math.floor(self.trim * n)))

    def tolerates(self, n: int) -> int:
        """How many hostile parts among ``n`` the rule keeps within the honest values'
        reach: 0 for the mean, ``b`` for the trimmed mean, ``(n - 1) // 2`` for centered
        clipping (its median start needs an honest majority)."""
        if self.kind == "trimmed_mean":
            return self.trimmed(n)
        if self.kind == "centered_clip":
            return max(0, (n - 1) // 2)
        return 0


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def normalized_weights(weights: Sequence[float] | npt.ArrayLike) -> F64Array:
    """Weights as float64 summing to 1 (each must be finite and > 0; no overflow)."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0:
        raise ConfigError("an aggregation needs at least one part")
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise ConfigError("weights must be finite and > 0")
    w = w / w.max()  # in (0, 1]: the sum cannot overflow
    out: F64Array = w / w.sum()
    return out


def _check_parts(xs: Sequence[F32Array], weights: Sequence[float] | npt.ArrayLike) -> F64Array:
    w = normalized_weights(weights)
    if len(xs) != w.size:
        raise ConfigError(f"{len(xs)} parts but {w.size} weights")
    shape = xs[0].shape
    for i, x in enumerate(xs):
        if x.dtype != np.float32 or x.ndim != 1 or x.shape != shape:
            raise ConfigError(f"part {i} must be a 1-D float32 vector of shape {shape}")
    return w


def weighted_average(xs: Sequence[F32Array], weights: F64Array) -> F32Array:
    """``sum_i w_i x_i`` accumulated in float32 in the order of ``xs``.

    ``weights`` are already normalised (:func:`normalized_weights`). The sum is
    ``((0 + w_0 x_0) + w_1 x_1) + ...`` slice by slice, each slice of the result staying in
    the CPU cache while every part is added, so each part is read once (the reduction of
    Streaming DiLoCo, arXiv 2501.18512, summed in fp32). Not checked for overflow here.
    """
    n = xs[0].size
    w32 = [np.float32(wi) for wi in weights]
    acc = np.empty(n, dtype=np.float32)
    tmp = np.empty(min(n, _STEP), dtype=np.float32)
    for j in range(0, n, _STEP):
        a = acc[j : j + _STEP]
        t = tmp[: a.size]
        a.fill(0.0)
        for x, wi in zip(xs, w32, strict=True):
            np.multiply(x[j : j + _STEP], wi, out=t)
            np.add(a, t, out=a)
    return acc


def coordinate_median(xs: Sequence[F32Array]) -> F64Array:
    """The coordinate-wise median in float64 (the mean of the middle two for even n)."""
    n, d = len(xs), xs[0].size
    out = np.empty(d, dtype=np.float64)
    lo, hi = (n - 1) // 2, n // 2
    for j in range(0, d, _STEP):
        vals = _sort_columns([x[j : j + _STEP] for x in xs])
        out[j : j + _STEP] = 0.5 * vals[lo].astype(np.float64) + 0.5 * vals[hi]
    return out


def _distances(xs: Sequence[F32Array], v: F64Array) -> F64Array:
    """``||x_i - v||`` for every part, summed in float64 slice by slice."""
    sq = np.zeros(len(xs), dtype=np.float64)
    d = v.size
    for j in range(0, d, _STEP):
        vj = v[j : j + _STEP]
        for i, x in enumerate(xs):
            diff = x[j : j + _STEP].astype(np.float64) - vj
            sq[i] += float(np.multiply(diff, diff).sum())
    return np.sqrt(sq)


def _to_f32(v: F64Array) -> F32Array:
    with np.errstate(over="ignore"):
        return v.astype(np.float32)


# --------------------------------------------------------------------------------------
# the rules
# --------------------------------------------------------------------------------------
def trimmed_mean(
    xs: Sequence[F32Array], weights: Sequence[float] | npt.ArrayLike, b: int
) -> F32Array:
    """Coordinate-wise trimmed mean: per coordinate, drop the ``b`` lowest and ``b``
    highest values and return the token-weighted mean of the remaining ``n - 2b``.

    Yin et al. 2018 (arXiv 1803.01498). Ties are broken by member order (stable sort);
    the weighted sum runs over the kept ranks in ascending order, in float64 (a sorting
    network on order-preserving integer keys does the per-coordinate sort). With at most
    ``b`` hostile parts every coordinate of the result lies within the honest values'
    range of that coordinate, whatever the hostile parts hold. ``b = 0`` is the weighted
    mean (computed in float64, so not bit-identical to :func:`weighted_average`).

    Raises:
        ConfigError: no parts, mismatched shapes or weights, or ``2b >= n``.
    """
    w = _check_parts(xs, weights)
    n = len(xs)
    if isinstance(b, bool) or not isinstance(b, int) or b < 0 or 2 * b >= n:
        raise ConfigError(f"cannot trim {b!r} at each end of {n} parts")
    return _trimmed(xs, w, b)


def _trimmed(xs: Sequence[F32Array], w: F64Array, b: int) -> F32Array:
    n, d = len(xs), xs[0].size
    out = np.empty(d, dtype=np.float32)
    for j in range(0, d, _STEP):
        # Sort (value, member) keys: unique, so ties keep member order and the sort's
        # method cannot change the result.
        keys = _sort_columns([_order_key(x[j : j + _STEP], i) for i, x in enumerate(xs)])
        num = np.zeros(keys[0].size, dtype=np.float64)
        den = np.zeros(keys[0].size, dtype=np.float64)
        for r in range(b, n - b):  # element-wise, rank by rank: a fixed order
            value, member = _from_key(keys[r])
            wr = w[member]
            num += wr * value
            den += wr
        out[j : j + _STEP] = _to_f32(num / den)
    return out


_SIGN = np.uint32(0x80000000)


def _order_key(x: F32Array, member: int) -> npt.NDArray[np.uint64]:
    """uint64 keys ordered as the float32 values, the member index in the low 32 bits.

    A float's bits, with the sign bit set for positives and every bit flipped for
    negatives, sort as unsigned integers in the order of the values (-0 just below +0).
    """
    u = x.view(np.uint32)
    flip = (np.uint32(0) - (u >> np.uint32(31))) | _SIGN  # negative: all ones; else the sign
    ordered = (u ^ flip).astype(np.uint64)
    key: npt.NDArray[np.uint64] = (ordered << np.uint64(32)) | np.uint64(member)
    return key


def _from_key(key: npt.NDArray[np.uint64]) -> tuple[F32Array, npt.NDArray[np.intp]]:
    """The float32 values and member indices of :func:`_order_key`'s keys."""
    ordered = (key >> np.uint64(32)).astype(np.uint32)
    flip = ((ordered >> np.uint32(31)) - np.uint32(1)) | _SIGN  # inverse of the flip above
    values = (ordered ^ flip).view(np.float32)
    members = (key & np.uint64(0xFFFFFFFF)).astype(np.intp)
    return values, members


_NETWORK_MAX = 16  # up to this many parts, a sorting network beats numpy's per-lane sort


def _sort_columns(cols: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
    """Sort coordinate by coordinate across equally long vectors: afterwards ``out[r][k]``
    is the ``r``-th smallest of ``cols[*][k]``.

    Up to 16 vectors: odd-even transposition sort (n rounds of compare-exchange of
    neighbours, each an element-wise minimum and maximum over whole vectors), much faster
    than numpy's sort of many tiny lanes; above, ``np.sort`` along the stacked axis. Both
    give the same values (a sort's result is unique).
    """
    n = len(cols)
    if n > _NETWORK_MAX:
        stacked = np.sort(np.stack(cols), axis=0)
        return list(stacked)
    out = list(cols)
    for rnd in range(n):
        for i in range(rnd % 2, n - 1, 2):
            lo, hi = out[i], out[i + 1]
            out[i], out[i + 1] = np.minimum(lo, hi), np.maximum(lo, hi)
    return out


def centered_clip(
    xs: Sequence[F32Array],
    weights: Sequence[float] | npt.ArrayLike,
    *,
    clip_scale: float = 2.0,
    iterations: int = 3,
) -> F32Array:
    """Centered clipping from the coordinate-wise median.

    ``v_0`` is :func:`coordinate_median`; ``tau = clip_scale * m`` with ``m`` the lower
    median of ``||x_i - v_0||``; then ``iterations`` times
    ``v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||)`` with normalised token
    weights (Karimireddy, He, Jaggi 2021, arXiv 2012.10333, who start from the previous
    aggregate instead; a median start needs no state across rounds). Each part moves ``v``
    by at most ``w_i * tau`` per iteration, so hostile parts of total weight share ``delta``
    move it by at most ``delta * tau`` per iteration; when no part is clipped one
    iteration gives the weighted mean. Norms are those of the vectors given (a chunk).
    Computed in float64 in member order, returned as float32.

    Raises:
        ConfigError: no parts, mismatched shapes or weights, bad ``clip_scale`` or
            ``iterations``.
    """
    rule = RobustRule("centered_clip", clip_scale=clip_scale, iterations=iterations)
    return _centered(xs, _check_parts(xs, weights), rule.clip_scale, rule.iterations)


def _centered(xs: Sequence[F32Array], w: F64Array, clip_scale: float, iterations: int) -> F32Array:
    n = len(xs)
    v = coordinate_median(xs)
    dist = _distances(xs, v)
    tau = clip_scale * float(np.sort(dist)[(n - 1) // 2])
    d = v.size
    for it in range(iterations):
        if it:
            dist = _distances(xs, v)
        # min(1, tau / dist), 1 where the part sits on v (nothing to clip)
        scale = np.ones(n, dtype=np.float64)
        far = dist > tau
        scale[far] = tau / dist[far]
        coef = w * scale
        for j in range(0, d, _STEP):
            vj = v[j : j + _STEP]
            step = np.zeros(vj.size, dtype=np.float64)
            for i, x in enumerate(xs):
                step += coef[i] * (x[j : j + _STEP].astype(np.float64) - vj)
            vj += step
    return _to_f32(v)


def aggregate(
    xs: Sequence[F32Array], weights: Sequence[float] | npt.ArrayLike, rule: RobustRule
) -> F32Array:
    """Combine ``xs`` (one float32 vector per member, in member order) by ``rule``.

    ``mean`` is :func:`weighted_average` (bit for bit the plain reduction);
    ``trimmed_mean`` is :func:`trimmed_mean` with ``b = rule.trimmed(n)``;
    ``centered_clip`` is :func:`centered_clip`. The result may hold inf if a mean
    overflows float32; the caller checks (:func:`reduce.weighted_mean` does).
    """
    w = _check_parts(xs, weights)
    if rule.kind == "trimmed_mean":
        b = rule.trimmed(len(xs))
        if b:
            return _trimmed(xs, w, b)
        return weighted_average(xs, w)
    if rule.kind == "centered_clip":
        if len(xs) < 3:  # nothing to be robust against: no majority among two
            return weighted_average(xs, w)
        return _centered(xs, w, rule.clip_scale, rule.iterations)
    return weighted_average(xs, w)

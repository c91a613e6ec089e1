"""Tests of atoll.protocol.robust and atoll.protocol.checks: robust rules and part checks.

Each rule is compared with a plain numpy reference; then hostile parts are mixed into
honest groups of 3 to 8 and the rules' distance from the honest mean is compared with the
plain mean's, at two attack magnitudes: a robust rule's error must stay within a multiple
of the honest spread and must not grow with the attack, where the mean's does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.checks import PartChecks, Violation, check_parts, part_norm, violations
from atoll.protocol.codecs import Fp32Codec
from atoll.protocol.errors import ConfigError, RejectedContribution
from atoll.protocol.reduce import Contribution, reduce_encoded, weighted_mean
from atoll.protocol.robust import (
    RobustRule,
    aggregate,
    centered_clip,
    coordinate_median,
    trimmed_mean,
)

FAST = settings(max_examples=60, deadline=None)
F32 = np.float32


# --------------------------------------------------------------------------------------
# numpy references
# --------------------------------------------------------------------------------------
def ref_mean(xs: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.average(xs.astype(np.float64), axis=0, weights=w)


def ref_trimmed(xs: np.ndarray, w: np.ndarray, b: int) -> np.ndarray:
    x = xs.astype(np.float64)
    n = x.shape[0]
    order = np.argsort(x, axis=0, kind="stable")[b : n - b]
    vals = np.take_along_axis(x, order, axis=0)
    ws = w[order]
    return np.asarray((vals * ws).sum(axis=0) / ws.sum(axis=0))


def ref_centered_clip(xs: np.ndarray, w: np.ndarray, scale: float, iters: int) -> np.ndarray:
    x = xs.astype(np.float64)
    n = x.shape[0]
    wn = w / w.sum()
    v = np.median(x, axis=0)
    tau = scale * np.sort(np.linalg.norm(x - v, axis=1))[(n - 1) // 2]
    for _ in range(iters):
        dist = np.linalg.norm(x - v, axis=1)
        clip = np.ones(n)
        far = dist > tau
        clip[far] = tau / dist[far]
        v = v + ((wn * clip)[:, None] * (x - v)).sum(axis=0)
    return np.asarray(v)


def random_group(
    seed: int, n: int, d: int, *, ties: bool = False
) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    if ties:
        xs = rng.integers(-2, 3, (n, d)).astype(F32)
    else:
        xs = (rng.standard_normal((n, d)) * rng.uniform(0.1, 3, (n, 1))).astype(F32)
    w = rng.integers(1, 1000, n).astype(np.float64)
    return list(xs), w


def tol(xs: list[np.ndarray]) -> float:
    return 1e-5 * (1 + max((float(np.abs(x).max(initial=0)) for x in xs), default=0))


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "median"},
        {"kind": "trimmed_mean", "trim": 0.5},
        {"trim": -0.1},
        {"trim": math.nan},
        {"trim": True},
        {"clip_scale": 0},
        {"clip_scale": math.inf},
        {"iterations": 0},
        {"iterations": 101},
        {"iterations": 2.0},
    ],
)
def test_rule_rejects_bad_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RobustRule(**kwargs)


def test_trimmed_and_tolerated_per_group_size() -> None:
    trimmed = RobustRule("trimmed_mean")
    clip = RobustRule("centered_clip")
    sizes = range(2, 9)
    assert [trimmed.trimmed(n) for n in sizes] == [0, 1, 1, 1, 1, 1, 2]
    assert [trimmed.tolerates(n) for n in sizes] == [0, 1, 1, 1, 1, 1, 2]
    assert [clip.tolerates(n) for n in sizes] == [0, 1, 1, 2, 2, 3, 3]
    assert [RobustRule().tolerates(n) for n in sizes] == [0] * 7
    assert [RobustRule("trimmed_mean", trim=0.4).trimmed(n) for n in sizes] == [0, 1, 1, 2, 2, 2, 3]
    assert RobustRule("trimmed_mean", trim=0).trimmed(8) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"norm_factor": 0.5},
        {"norm_factor": math.nan},
        {"weight_factor": -1},
        {"min_values": -1},
        {"min_group": 1},
        {"min_group": 2.5},
    ],
)
def test_checks_reject_bad_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PartChecks(**kwargs)


def test_bad_parts_are_config_errors() -> None:
    x = np.zeros(4, F32)
    with pytest.raises(ConfigError):
        aggregate([], [], RobustRule())
    with pytest.raises(ConfigError):
        aggregate([x, x], [1.0], RobustRule())
    with pytest.raises(ConfigError):
        aggregate([x, np.zeros(5, F32)], [1.0, 1.0], RobustRule("trimmed_mean"))
    with pytest.raises(ConfigError):
        aggregate([x, x.astype(np.float64)], [1.0, 1.0], RobustRule())
    with pytest.raises(ConfigError):
        aggregate([x, x], [1.0, 0.0], RobustRule())
    with pytest.raises(ConfigError):
        trimmed_mean([x, x, x], [1, 1, 1], 2)


# --------------------------------------------------------------------------------------
# each rule against its numpy reference
# --------------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 8), st.integers(0, 300), st.integers(0, 2**31), st.booleans())
def test_mean_matches_numpy(n: int, d: int, seed: int, ties: bool) -> None:
    xs, w = random_group(seed, n, d, ties=ties)
    got = aggregate(xs, w, RobustRule())
    assert got.dtype == F32 and got.shape == (d,)
    np.testing.assert_allclose(got, ref_mean(np.array(xs), w), rtol=0, atol=tol(xs))


def test_mean_rule_is_the_plain_reduction_bit_for_bit() -> None:
    xs, w = random_group(5, 6, 70_000)
    c = Fp32Codec()
    parts = [Contribution(c.encode(x), float(wi)) for x, wi in zip(xs, w, strict=True)]
    plain = weighted_mean(parts, c, 70_000)
    assert aggregate(xs, w, RobustRule()).tobytes() == plain.tobytes()
    # what the reduction did before robust rules existed: normalise in float64, sum in f32
    wn = w / w.max()
    wn = wn / wn.sum()
    acc = np.zeros(70_000, F32)
    for x, wi in zip(xs, wn, strict=True):
        acc = acc + x * F32(wi)
    assert acc.tobytes() == plain.tobytes()


@FAST
@given(st.integers(1, 8), st.integers(0, 300), st.integers(0, 2**31), st.booleans())
def test_trimmed_mean_matches_numpy(n: int, d: int, seed: int, ties: bool) -> None:
    xs, w = random_group(seed, n, d, ties=ties)
    for b in range((n - 1) // 2 + 1):
        got = trimmed_mean(xs, w, b)
        assert got.dtype == F32 and got.shape == (d,)
        np.testing.assert_allclose(got, ref_trimmed(np.array(xs), w, b), rtol=1e-6, atol=1e-6)
    rule = RobustRule("trimmed_mean")
    expected = ref_trimmed(np.array(xs), w, rule.trimmed(n))
    np.testing.assert_allclose(aggregate(xs, w, rule), expected, rtol=1e-6, atol=tol(xs))


@FAST
@given(st.integers(1, 8), st.integers(0, 300), st.integers(0, 2**31), st.booleans())
def test_coordinate_median_matches_numpy(n: int, d: int, seed: int, ties: bool) -> None:
    xs, _ = random_group(seed, n, d, ties=ties)
    got = coordinate_median(xs)
    np.testing.assert_array_equal(got, np.median(np.array(xs, dtype=np.float64), axis=0))


@FAST
@given(
    st.integers(1, 8),
    st.integers(0, 300),
    st.integers(0, 2**31),
    st.sampled_from([0.5, 1.0, 2.0, 5.0]),
    st.integers(1, 5),
)
def test_centered_clip_matches_numpy(n: int, d: int, seed: int, scale: float, iters: int) -> None:
    xs, w = random_group(seed, n, d)
    got = centered_clip(xs, w, clip_scale=scale, iterations=iters)
    assert got.dtype == F32 and got.shape == (d,)
    expected = ref_centered_clip(np.array(xs), w, scale, iters)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=tol(xs))


def test_centered_clip_without_clipping_is_the_weighted_mean() -> None:
    xs, w = random_group(3, 5, 400)
    got = centered_clip(xs, w, clip_scale=1e6, iterations=1)
    np.testing.assert_allclose(got, ref_mean(np.array(xs), w), rtol=1e-6, atol=1e-6)


def test_small_groups_fall_back_to_the_mean() -> None:
    xs, w = random_group(4, 2, 300)
    mean = aggregate(xs, w, RobustRule())
    for kind in ("trimmed_mean", "centered_clip"):
        assert aggregate(xs, w, RobustRule(kind)).tobytes() == mean.tobytes()


def test_extreme_finite_values_do_not_overflow_the_robust_rules() -> None:
    big = np.full(300, 3e38, F32)
    xs = [big, -big, big * 0.5, np.zeros(300, F32)]
    for rule in (RobustRule("trimmed_mean"), RobustRule("centered_clip")):
        out = aggregate(xs, [1.0] * 4, rule)
        assert np.isfinite(out).all()


# --------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mean", "trimmed_mean", "centered_clip"])
def test_same_inputs_same_bytes(kind: str) -> None:
    xs, w = random_group(11, 7, 50_000)
    rule = RobustRule(kind)
    first = aggregate(xs, w, rule).tobytes()
    copies = [x.copy() for x in xs]
    assert aggregate(copies, w.copy(), rule).tobytes() == first
    c = Fp32Codec()
    parts = [Contribution(c.encode(x), float(wi)) for x, wi in zip(xs, w, strict=True)]
    assert reduce_encoded(parts, c, 50_000, rule=rule) == first


# --------------------------------------------------------------------------------------
# hostile parts
# --------------------------------------------------------------------------------------
Attack = Callable[[np.ndarray, np.ndarray, np.random.Generator, float], np.ndarray]
"""(honest parts (h, d), honest weights, rng, magnitude) -> f hostile rows (caller picks f)"""


def huge_norm(h: np.ndarray, w: np.ndarray, rng: np.random.Generator, m: float) -> np.ndarray:
    return np.full(h.shape[1], m, dtype=np.float64)


def sign_flip(h: np.ndarray, w: np.ndarray, rng: np.random.Generator, m: float) -> np.ndarray:
    return -m * np.average(h, axis=0, weights=w)


def scaled(h: np.ndarray, w: np.ndarray, rng: np.random.Generator, m: float) -> np.ndarray:
    return m * h[0]


def noise(h: np.ndarray, w: np.ndarray, rng: np.random.Generator, m: float) -> np.ndarray:
    return m * rng.standard_normal(h.shape[1])


def little(h: np.ndarray, w: np.ndarray, rng: np.random.Generator, m: float) -> np.ndarray:
    """ "A little is enough" (Baruch et al. 2019): every coordinate shifted by z standard
    deviations of the honest values, inside their spread (``m`` is ignored: z = 1)."""
    return h.mean(axis=0) - 1.0 * h.std(axis=0)


UNBOUNDED = {"huge_norm": huge_norm, "sign_flip": sign_flip, "scaled": scaled, "noise": noise}


def hostile_group(
    n: int, f: int, attack: Attack, magnitude: float, seed: int, d: int = 2000
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, float]:
    """n parts, the last f hostile (the same vector each, the strongest form); returns
    parts, weights, the honest weighted mean and the honest spread
    sqrt(mean_i ||x_i - honest mean||^2)."""
    rng = np.random.default_rng(seed)
    h = n - f
    mu = rng.standard_normal(d)
    honest = mu + 0.5 * rng.standard_normal((h, d))
    w = rng.uniform(1, 2, n)
    bad = attack(honest, w[:h], rng, magnitude)
    xs = [row.astype(F32) for row in honest] + [bad.astype(F32) for _ in range(f)]
    hmean = np.average(honest.astype(F32).astype(np.float64), axis=0, weights=w[:h])
    spread = float(np.sqrt(np.mean([np.sum((x - hmean) ** 2) for x in honest])))
    return xs, w, hmean, spread


def error(rule: RobustRule, xs: list[np.ndarray], w: np.ndarray, hmean: np.ndarray) -> float:
    return float(np.linalg.norm(aggregate(xs, w, rule).astype(np.float64) - hmean))


ROBUST = [RobustRule("trimmed_mean"), RobustRule("centered_clip")]
# How far (in honest spreads) each rule may end from the honest mean with as many hostile
# parts as it tolerates. The trimmed mean stays in the honest range per coordinate (about
# 0.3 to 1.1 spreads measured here); centered clipping with clip_scale 2 lets hostile parts
# of weight share delta pull by delta * tau per iteration (up to about 2.6 spreads at
# 2 of 5 or 3 of 7; clip_scale 1 halves that but clips honest parts too).
BOUND = {"trimmed_mean": 1.5, "centered_clip": 3.0}


@pytest.mark.parametrize("attack", sorted(UNBOUNDED))
@pytest.mark.parametrize("n", range(3, 9))
@pytest.mark.parametrize("rule", ROBUST, ids=lambda r: r.kind)
def test_robust_error_stays_bounded_where_the_mean_does_not(
    attack: str, n: int, rule: RobustRule
) -> None:
    f = rule.tolerates(n)
    assert f >= 1
    errors = {}
    for magnitude in (1e3, 1e6):
        xs, w, hmean, spread = hostile_group(n, f, UNBOUNDED[attack], magnitude, seed=n)
        errors[magnitude] = error(rule, xs, w, hmean)
        mean_error = error(RobustRule(), xs, w, hmean)
        # within the honest spread, whatever the attack's size ...
        bound = BOUND[rule.kind] * spread
        assert errors[magnitude] <= bound, (magnitude, errors[magnitude], spread)
        # ... where the plain mean is pulled far outside it
        assert mean_error > 50 * spread, (magnitude, mean_error, spread)
    # a thousandfold stronger attack moves the robust result by (almost) nothing more
    assert errors[1e6] <= errors[1e3] * 1.01 + 1e-3 * spread


@pytest.mark.parametrize("n", range(3, 9))
@pytest.mark.parametrize("rule", ROBUST, ids=lambda r: r.kind)
def test_a_little_is_enough_stays_within_the_spread(n: int, rule: RobustRule) -> None:
    # Shifts inside the honest spread cannot be told from honest variation: no rule here
    # removes them, but none lets them out of the spread either.
    f = rule.tolerates(n)
    xs, w, hmean, spread = hostile_group(n, f, little, 1.0, seed=100 + n)
    assert error(rule, xs, w, hmean) <= BOUND[rule.kind] * spread
    assert error(RobustRule(), xs, w, hmean) <= spread


@FAST
@given(st.integers(3, 8), st.integers(1, 200), st.integers(0, 2**31), st.data())
def test_trimmed_mean_stays_in_the_honest_range(
    n: int, d: int, seed: int, data: st.DataObject
) -> None:
    """With at most b hostile parts, holding anything finite, every coordinate of the
    trimmed mean lies between the smallest and largest honest value."""
    rule = RobustRule("trimmed_mean", trim=data.draw(st.sampled_from([0.1, 0.25, 0.4])))
    b = rule.trimmed(n)
    f = data.draw(st.integers(0, b))
    rng = np.random.default_rng(seed)
    honest = rng.standard_normal((n - f, d)).astype(F32)
    bad = data.draw(
        st.lists(
            st.floats(width=32, allow_nan=False, allow_infinity=False),
            min_size=f * d,
            max_size=f * d,
        )
    )
    hostile = np.array(bad, dtype=F32).reshape(f, d)
    xs = list(np.concatenate([honest, hostile]))
    perm = rng.permutation(n)  # hostile parts anywhere in member order
    xs = [xs[i] for i in perm]
    w = rng.uniform(1, 1000, n)
    got = aggregate(xs, w, rule)
    assert (got >= honest.min(axis=0)).all() and (got <= honest.max(axis=0)).all()


# --------------------------------------------------------------------------------------
# part checks
# --------------------------------------------------------------------------------------
def honest_parts(n: int, d: int, seed: int) -> tuple[list[str], list[np.ndarray], list[float]]:
    rng = np.random.default_rng(seed)
    peers = [f"peer{i}" for i in range(n)]
    parts = [(rng.standard_normal(d) * rng.uniform(0.5, 2)).astype(F32) for _ in range(n)]
    weights = [float(rng.integers(1000, 5000)) for _ in range(n)]
    return peers, parts, weights


@pytest.mark.parametrize("n", range(2, 9))
def test_checks_accept_honest_spread(n: int) -> None:
    for seed in range(20):
        peers, parts, weights = honest_parts(n, 512, seed)
        assert violations(peers, parts, weights, PartChecks()) == []
        check_parts(peers, parts, weights, PartChecks())


@pytest.mark.parametrize("n", range(3, 9))
def test_checks_reject_a_huge_norm_and_an_inflated_weight(n: int) -> None:
    peers, parts, weights = honest_parts(n, 512, n)
    parts[1] = parts[1] * F32(100)
    weights[n - 1] = weights[n - 1] * 1000
    found = violations(peers, parts, weights, PartChecks())
    assert [v.peer for v in found] == ["peer1", f"peer{n - 1}"]
    assert "norm" in found[0].reason and "weight" in found[1].reason
    with pytest.raises(RejectedContribution, match="peer1"):
        check_parts(peers, parts, weights, PartChecks())


def test_checks_tolerate_as_many_huge_parts_as_the_lower_median_allows() -> None:
    for n in range(3, 9):
        f = n - 1 - (n - 1) // 2
        peers, parts, weights = honest_parts(n, 512, n)
        for i in range(n - f, n):
            parts[i] = parts[i] * F32(1e6)
        found = violations(peers, parts, weights, PartChecks())
        assert {v.peer for v in found} == {f"peer{i}" for i in range(n - f, n)}, n


def test_checks_per_peer_caps() -> None:
    peers, parts, weights = honest_parts(4, 512, 0)
    caps = {"peer2": weights[2] - 1, "peer0": weights[0]}
    assert violations(peers, parts, weights, PartChecks(), caps) == [
        Violation("peer2", f"weight {weights[2]:g} exceeds its cap {weights[2] - 1:g}")
    ]
    # caps hold in groups too small for the group checks
    assert [v.peer for v in violations(peers[:2], parts[:2], weights[:2], PartChecks(), caps)] == []
    caps2 = {"peer1": 1.0}
    assert [v.peer for v in violations(peers[:2], parts[:2], weights[:2], PartChecks(), caps2)] == [
        "peer1"
    ]


def test_checks_skip_what_they_cannot_judge() -> None:
    peers, parts, weights = honest_parts(3, 512, 1)
    # a group of two: nobody can tell who lies
    huge = parts[0] * F32(1e6)
    assert violations(peers[:2], [huge, parts[1]], weights[:2], PartChecks()) == []
    # a short chunk: norms of a few values are noise
    short = [p[:10] for p in parts]
    short[0] = short[0] * F32(1e6)
    assert violations(peers, short, weights, PartChecks()) == []
    assert violations(peers, short, weights, PartChecks(min_values=1))[0].peer == "peer0"
    # a zero median: nothing to scale by
    zeros = [np.zeros(512, F32), np.zeros(512, F32), parts[2]]
    assert violations(peers, zeros, weights, PartChecks()) == []
    # checks turned off one by one
    heavy = [weights[0] * 1e6, weights[1], weights[2]]
    assert violations(peers, parts, heavy, PartChecks(weight_factor=math.inf)) == []
    big = [huge, parts[1], parts[2]]
    assert violations(peers, big, weights, PartChecks(norm_factor=math.inf)) == []


def test_part_norm() -> None:
    x = np.array([3, 4], F32)
    assert part_norm(x) == 5.0
    assert part_norm(np.zeros(0, F32)) == 0.0
    assert part_norm(np.full(10, 3e38, F32)) == pytest.approx(3e38 * math.sqrt(10))

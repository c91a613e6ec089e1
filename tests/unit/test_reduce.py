"""Tests of atoll.protocol.reduce: weighted reduction, chunking, byte counts and RDA."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.codecs import Codec, E3M0Codec, Fp32Codec, Int8Codec, make_codec
from atoll.protocol.errors import (
    CodecError,
    ConfigError,
    RejectedContribution,
    RejectedInput,
)
from atoll.protocol.reduce import (
    Contribution,
    allreduce_bytes_per_peer,
    chunk_bounds,
    rda_combine,
    rda_mean_norm,
    rda_split,
    reduce_encoded,
    weighted_mean,
)

FAST = settings(max_examples=60, deadline=None)


def contributions(
    codec: Codec, xs: Iterable[np.ndarray], ws: Iterable[float]
) -> list[Contribution]:
    return [Contribution(codec.encode(x), w) for x, w in zip(xs, ws, strict=True)]


# --------------------------------------------------------------------------------------
# weighted mean
# --------------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 6), st.integers(0, 500), st.integers(0, 2**31))
def test_weighted_mean_fp32_matches_numpy(peers: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((peers, n)).astype(np.float32)
    ws = rng.integers(1, 10_000, peers).astype(float)
    c = Fp32Codec()
    got = weighted_mean(contributions(c, xs, ws), c, n)
    assert got.dtype == np.float32 and got.shape == (n,)
    ref = np.average(xs.astype(np.float64), axis=0, weights=ws) if n else np.zeros(0)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * (1 + np.abs(xs).max(initial=0)))


def test_weighted_mean_single_and_equal_inputs_exact() -> None:
    c = Fp32Codec()
    x = np.linspace(-3, 3, 101, dtype=np.float32)
    np.testing.assert_array_equal(weighted_mean([Contribution(c.encode(x), 7.0)], c, 101), x)
    # identical contributions with any weights give back the same vector
    x2 = np.array([1.0, -2.0, 0.5, 0.0], np.float32)
    got = weighted_mean(contributions(c, [x2, x2, x2], [1.0, 5.0, 1e12]), c, 4)
    np.testing.assert_allclose(got, x2, rtol=1e-6)
    # simple weighted case
    a = np.array([0.0, 4.0], np.float32)
    b = np.array([4.0, 0.0], np.float32)
    np.testing.assert_array_equal(weighted_mean(contributions(c, [a, b], [3, 1]), c, 2), [1, 3])


def test_weighted_mean_huge_weights_do_not_overflow() -> None:
    c = Fp32Codec()
    x = np.ones(3, np.float32)
    got = weighted_mean(contributions(c, [x, 2 * x], [1e308, 1e308]), c, 3)
    np.testing.assert_allclose(got, 1.5 * x)


@pytest.mark.parametrize("name", ["e3m0", "int8", "bf16"])
def test_weighted_mean_encoded_matches_numpy_within_codec_error(name: str) -> None:
    rng = np.random.default_rng(5)
    c = make_codec(name)
    xs = rng.standard_normal((4, 1000)).astype(np.float32)
    ws = np.array([100.0, 300.0, 50.0, 550.0])
    got = weighted_mean(contributions(c, xs, ws), c, 1000)
    # the mean of the decoded parts, exactly what each peer's codec delivered
    dec = np.stack([c.roundtrip(x) for x in xs]).astype(np.float64)
    np.testing.assert_allclose(got, np.average(dec, axis=0, weights=ws), atol=1e-5)
    # and within the codec's worst-case error of the true mean
    err = np.abs(got - np.average(xs.astype(np.float64), axis=0, weights=ws))
    block_max = np.abs(xs).max()
    bound = {"e3m0": 0.5 * block_max * (1 + 2**-7), "int8": block_max / 254, "bf16": 2**-8 * 4}
    assert err.max() <= bound[name] * 1.01
    # the error of the mean is smaller than the typical single-peer error (it averages out)
    single = np.abs(dec[0] - xs[0]).mean()
    assert err.mean() <= single


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf, "3", True, None])
def test_bad_weight_rejected_with_index(bad: object) -> None:
    c = Fp32Codec()
    x = np.ones(4, np.float32)
    contribs = [Contribution(c.encode(x), 1.0), Contribution(c.encode(x), bad)]  # type: ignore[arg-type]
    with pytest.raises(RejectedContribution, match="contribution 1"):
        weighted_mean(contribs, c, 4)


def test_empty_contributions_is_config_error() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        weighted_mean([], Fp32Codec(), 4)
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        reduce_encoded([], Fp32Codec(), 4)


def test_undecodable_payload_names_contribution() -> None:
    c = E3M0Codec()
    x = np.ones(300, np.float32)
    good = c.encode(x)
    for bad, what in ((good[:-1], "bytes"), (b"\x80\x7f" + good[2:], "scale")):
        contribs = [Contribution(good, 1.0), Contribution(good, 2.0), Contribution(bad, 1.0)]
        with pytest.raises(CodecError, match=f"contribution 2: .*{what}"):
            weighted_mean(contribs, c, 300)


def test_reduce_encoded_quantizes_once() -> None:
    rng = np.random.default_rng(11)
    c = E3M0Codec(block=64)
    xs = rng.standard_normal((3, 640)).astype(np.float32)
    ws = [1.0, 2.0, 3.0]
    contribs = contributions(c, xs, ws)
    out = reduce_encoded(contribs, c, 640)
    assert len(out) == c.encoded_size(640)
    # identical to encoding the fp32 mean of the decoded parts once
    assert out == c.encode(weighted_mean(contribs, c, 640))
    # stochastic rounding uses the given generator
    sr = E3M0Codec(block=64, rounding="stochastic")
    a = reduce_encoded(contribs, sr, 640, rng=np.random.default_rng(1))
    b = reduce_encoded(contribs, sr, 640, rng=np.random.default_rng(1))
    assert a == b


def test_chunked_reduce_equals_whole() -> None:
    # reduce-scatter by owners of aligned chunks then all-gather == whole-vector reduction
    rng = np.random.default_rng(2)
    n, peers = 1000, 3
    for c in (Int8Codec(block=32), E3M0Codec(block=32)):
        xs = rng.standard_normal((peers, n)).astype(np.float32)
        ws = [5.0, 1.0, 2.0]
        whole = c.decode(reduce_encoded(contributions(c, xs, ws), c, n), n)
        pieces = []
        for a, b in chunk_bounds(n, peers, c.align):
            part = reduce_encoded(contributions(c, xs[:, a:b], ws), c, b - a)
            pieces.append(c.decode(part, b - a))
        np.testing.assert_array_equal(np.concatenate(pieces), whole)


# --------------------------------------------------------------------------------------
# chunk bounds
# --------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 300))
def test_chunk_bounds_properties(n: int, parts: int, align: int) -> None:
    b = chunk_bounds(n, parts, align)
    assert len(b) == parts
    assert b[0][0] == 0 and b[-1][1] == n
    for (_, e0), (s1, _) in itertools.pairwise(b):
        assert e0 == s1
    for s, e in b:
        assert 0 <= s <= e <= n
        assert s % align == 0
        assert e % align == 0 or e == n
    sizes = [e - s for s, e in b]
    assert max(sizes) - min(sizes) <= align
    units = -(-n // align)
    assert sum(1 for x in sizes if x > 0) == min(parts, units)


def test_chunk_bounds_examples() -> None:
    assert chunk_bounds(10, 3, 1) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(300, 2, 128) == [(0, 128), (128, 300)]
    assert chunk_bounds(130, 4, 128) == [(0, 0), (0, 0), (0, 128), (128, 130)]
    assert chunk_bounds(0, 3, 128) == [(0, 0), (0, 0), (0, 0)]
    assert chunk_bounds(512, 4, 128) == [(0, 128), (128, 256), (256, 384), (384, 512)]
    for bad in ((10, 0, 1), (10, 2, 0), (-1, 2, 1)):
        with pytest.raises(ConfigError):
            chunk_bounds(*bad)


# --------------------------------------------------------------------------------------
# bytes per peer
# --------------------------------------------------------------------------------------
def test_allreduce_bytes_per_peer() -> None:
    size = 12_890_626
    assert allreduce_bytes_per_peer(size, 4) == 1.5 * size
    assert allreduce_bytes_per_peer(size, 2) == size
    assert allreduce_bytes_per_peer(size, 1) == 0
    assert allreduce_bytes_per_peer(0, 8) == 0
    assert allreduce_bytes_per_peer(10, 3) == 14  # 13.33 rounded up
    for bad in ((10, 0), (-1, 2)):
        with pytest.raises(ConfigError):
            allreduce_bytes_per_peer(*bad)


# --------------------------------------------------------------------------------------
# RDA
# --------------------------------------------------------------------------------------
def test_rda_split_basic() -> None:
    d = np.array([[3.0, 0.0], [0.0, 4.0]], np.float32)
    u, norm = rda_split(d)
    assert norm == 5.0
    assert u.shape == d.shape and u.dtype == np.float32
    np.testing.assert_allclose(u, d / 5)
    z, zn = rda_split(np.zeros(7, np.float32))
    assert zn == 0.0 and np.all(z == 0) and z.shape == (7,)
    # large values: the norm is computed without float32 overflow
    big = np.full(4, 3e38, np.float32)
    u, norm = rda_split(big)
    assert math.isclose(norm, 6e38, rel_tol=1e-6)
    np.testing.assert_allclose(u, 0.5, rtol=1e-6)
    with pytest.raises(RejectedInput):
        rda_split(np.array([1.0, np.nan], np.float32))


@FAST
@given(st.integers(1, 2000), st.integers(0, 2**31))
def test_rda_split_unit_norm(n: int, seed: int) -> None:
    d = (np.random.default_rng(seed).standard_normal(n) * 1e-3).astype(np.float32)
    u, norm = rda_split(d)
    assert math.isclose(float(np.linalg.norm(u.astype(np.float64))), 1.0, rel_tol=1e-5)
    np.testing.assert_allclose(u * np.float32(norm), d, rtol=1e-5, atol=1e-12)


def test_rda_parallel_vectors_give_weighted_mean_norm() -> None:
    # peers whose updates point the same way: RDA returns that direction at the weighted
    # mean norm, through the ordinary encoded reduction of the directions
    rng = np.random.default_rng(4)
    direction = rng.standard_normal(512).astype(np.float32)
    scales = [0.5, 2.0, 7.0]
    ws = [100.0, 300.0, 600.0]
    c = Fp32Codec()
    parts = [rda_split(s * direction) for s in scales]
    mean_dir = weighted_mean(contributions(c, [p[0] for p in parts], ws), c, 512)
    mean_norm = rda_mean_norm([p[1] for p in parts], ws)
    got = rda_combine(mean_dir, mean_norm)
    expected_norm = np.average(scales, weights=ws) * np.linalg.norm(direction)
    assert math.isclose(mean_norm, float(expected_norm), rel_tol=1e-6)
    unit = direction / np.linalg.norm(direction)
    np.testing.assert_allclose(got, expected_norm * unit, rtol=1e-5, atol=1e-6)


def test_rda_keeps_length_of_orthogonal_updates() -> None:
    # a plain mean of M orthogonal equal-norm vectors shrinks by sqrt(M); RDA does not
    m = 4
    vs = np.eye(m, dtype=np.float32) * 3.0
    plain = vs.mean(axis=0)
    assert math.isclose(float(np.linalg.norm(plain)), 3.0 / math.sqrt(m), rel_tol=1e-6)
    dirs, norms = zip(*(rda_split(v) for v in vs), strict=True)
    out = rda_combine(np.mean(dirs, axis=0), rda_mean_norm(list(norms), [1.0] * m))
    assert math.isclose(float(np.linalg.norm(out)), 3.0, rel_tol=1e-6)


def test_rda_combine_edge_cases() -> None:
    assert np.all(rda_combine(np.zeros(5, np.float32), 3.0) == 0)
    assert np.all(rda_combine(np.ones(5, np.float32), 0.0) == 0)
    out = rda_combine(np.ones((2, 2), np.float32), 4.0)
    assert out.shape == (2, 2) and out.dtype == np.float32
    np.testing.assert_allclose(out, 2.0)
    # deterministic: same inputs, same bits
    d = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    assert rda_combine(d, 1.25).tobytes() == rda_combine(d.copy(), 1.25).tobytes()
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(RejectedInput):
            rda_combine(np.ones(3, np.float32), bad)
    with pytest.raises(RejectedInput):
        rda_combine(np.array([np.inf, 1.0], np.float32), 1.0)


def test_rda_mean_norm_validation() -> None:
    assert rda_mean_norm([1.0, 3.0], [1.0, 1.0]) == 2.0
    assert rda_mean_norm([1.0, 3.0], [3.0, 1.0]) == 1.5
    with pytest.raises(ConfigError):
        rda_mean_norm([], [])
    with pytest.raises(ConfigError):
        rda_mean_norm([1.0], [1.0, 2.0])
    with pytest.raises(RejectedContribution, match="contribution 1"):
        rda_mean_norm([1.0, -2.0], [1.0, 1.0])
    with pytest.raises(RejectedContribution, match="contribution 0"):
        rda_mean_norm([1.0, 2.0], [0.0, 1.0])

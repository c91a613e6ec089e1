"""Tests of atoll.protocol.codecs: error bounds, bit-exact layouts, sizes and refusals."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from atoll.protocol.codecs import (
    CODEC_NAMES,
    Bf16Codec,
    Codec,
    E3M0Codec,
    Fp32Codec,
    Int8Codec,
    bits_per_value,
    make_codec,
)
from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.reduce import chunk_bounds

FAST = settings(max_examples=60, deadline=None)

ALL_CODECS: list[Codec] = [
    Fp32Codec(),
    Bf16Codec(),
    Int8Codec(),
    Int8Codec(block=5),
    E3M0Codec(),
    E3M0Codec(block=4),
    E3M0Codec(rounding="stochastic"),
    E3M0Codec(block=6, rounding="stochastic"),
]
IDS = [repr(c) for c in ALL_CODECS]

# finite float32 values over a wide range (subnormals too)
finite32 = st.floats(
    min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32
)
vectors = hnp.arrays(np.float32, st.integers(0, 300), elements=finite32)


def e3m0_scales(codec: E3M0Codec, payload: bytes, n: int) -> np.ndarray:
    nb = -(-n // codec.block)
    bits = np.frombuffer(payload, dtype="<u2", count=nb).astype(np.uint32)
    return (bits << 16).view(np.float32)


def int8_scales(codec: Int8Codec, payload: bytes, n: int) -> np.ndarray:
    nb = -(-n // codec.block)
    return np.frombuffer(payload, dtype="<f4", count=nb)


def per_value(scales: np.ndarray, block: int, n: int) -> np.ndarray:
    return np.repeat(scales, block)[:n]


# --------------------------------------------------------------------------------------
# error bounds
# --------------------------------------------------------------------------------------
@FAST
@given(vectors)
def test_fp32_exact(x: np.ndarray) -> None:
    c = Fp32Codec()
    y = c.roundtrip(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x)


@FAST
@given(vectors)
def test_bf16_relative_error(x: np.ndarray) -> None:
    y = Bf16Codec().roundtrip(x)
    tiny = np.abs(x) < 2.0**-126  # subnormals: bf16 spacing is 2^-133 there
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert np.all(err[~tiny] <= 2.0**-8 * np.abs(x[~tiny].astype(np.float64)))
    assert np.all(err[tiny] <= 2.0**-134)


def test_bf16_round_to_nearest_even() -> None:
    one = 1.0
    ulp = 2.0**-7  # bf16 spacing at 1.0
    x = np.array([one + ulp / 2, one + 1.5 * ulp, one + ulp / 2 + 2.0**-20], np.float32)
    y = Bf16Codec().roundtrip(x)
    # a tie goes to the even mantissa; above the tie goes up
    np.testing.assert_array_equal(y, np.array([one, one + 2 * ulp, one + ulp], np.float32))
    # bit layout: 1.0 is 0x3F80, little-endian
    assert Bf16Codec().encode(np.float32(1.0)) == b"\x80\x3f"


def test_bf16_overflow_rejected() -> None:
    big = np.float32(np.finfo(np.float32).max)
    with pytest.raises(CodecError, match="overflow"):
        Bf16Codec().encode(np.array([1.0, big], np.float32))


@FAST
@given(vectors, st.sampled_from([1, 3, 8, 128]))
def test_int8_error_within_half_scale(x: np.ndarray, block: int) -> None:
    c = Int8Codec(block)
    p = c.encode(x)
    y = c.decode(p, x.size)
    scale = per_value(int8_scales(c, p, x.size), block, x.size).astype(np.float64)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    # half a scale, plus float32 rounding of the quotient and product, plus underflow of
    # scales of blocks whose max is below ~1e-43
    assert np.all(err <= scale * (0.5 + 1e-5) + 1e-42)


@FAST
@given(vectors, st.sampled_from([2, 4, 10, 128]))
def test_e3m0_nearest_levels(x: np.ndarray, block: int) -> None:
    c = E3M0Codec(block)
    p = c.encode(x)
    y = c.decode(p, x.size).astype(np.float64)
    x64 = x.astype(np.float64)
    s = per_value(e3m0_scales(c, p, x.size), block, x.size).astype(np.float64)
    # scale: max|x| of the block rounded up to bf16, so s >= |x| and s <= max*(1 + 2^-7)
    assert np.all(np.abs(x64) <= s)
    if x.size:
        mx = per_value(
            np.array([np.abs(x64[i : i + block]).max() for i in range(0, x.size, block)]),
            block,
            x.size,
        )
        assert np.all(s <= mx * (1 + 2.0**-7) + 2.0**-133)
    # every decoded value is 0 or +-s*2^-k, k in 0..6, with the sign of x
    nz = y != 0
    k = -np.log2(np.abs(y[nz]) / s[nz])
    assert np.allclose(k, np.round(k), atol=1e-9) and np.all((k >= -1e-9) & (k <= 6 + 1e-9))
    assert np.all(np.sign(y[nz]) == np.sign(x64[nz]))
    # nearest in the log domain
    ax = np.abs(x64)
    upper = (ax >= s * 2.0**-6) & (ax > 0)
    ratio = np.abs(y[upper]) / ax[upper]
    assert np.all(ratio <= math.sqrt(2) * (1 + 1e-6))
    assert np.all(ratio >= 1 / math.sqrt(2) * (1 - 1e-6))
    # between s*2^-7 and s*2^-6 the smallest level, below s*2^-7 zero
    mid = (ax >= s * 2.0**-7 * (1 + 1e-6)) & (ax < s * 2.0**-6)
    np.testing.assert_allclose(np.abs(y[mid]), s[mid] * 2.0**-6)
    low = ax < s * 2.0**-7 * (1 - 1e-6)
    assert np.all(y[low] == 0)


def test_e3m0_nearest_thresholds() -> None:
    s = 1.0
    r2 = math.sqrt(2)
    x = np.array(
        [
            s,
            s / r2 * 1.0001,
            s / r2 * 0.9999,
            s / 64,
            s / 64 / r2 * 1.0001,
            s / 128 * 1.0001,
            s / 128 * 0.9999,
            0.0,
        ],
        np.float32,
    )
    y = E3M0Codec(block=8).roundtrip(x)
    expected = np.array([1, 1, 0.5, 1 / 64, 1 / 64, 1 / 64, 0, 0], np.float32)
    np.testing.assert_array_equal(y, expected)


# --------------------------------------------------------------------------------------
# stochastic rounding
# --------------------------------------------------------------------------------------
def test_e3m0_stochastic_unbiased_and_nearest_biased() -> None:
    # One block: the max pins s = 1; the other values sit between levels and below the
    # smallest one, where nearest rounding is biased.
    base = np.array([1.0, 0.7, -0.3, 0.2, 0.011, -0.006, 0.003, 0.6], np.float32)
    reps = 20_000
    x = np.tile(base, reps)  # 20k copies, one block of 8 each
    sr = E3M0Codec(block=8, rounding="stochastic")
    y = sr.roundtrip(x, rng=np.random.default_rng(1)).reshape(reps, 8).astype(np.float64)
    mean = y.mean(axis=0)
    sd = y.std(axis=0) + 1e-12
    # each column's mean is within 5 standard errors of the true value
    assert np.all(np.abs(mean - base) <= 5 * sd / math.sqrt(reps) + 1e-9)
    # the decoded values only ever take the two neighbouring levels
    assert set(np.unique(np.abs(y[:, 1]))) <= {0.5, 1.0}
    assert set(np.unique(np.abs(y[:, 6]))) <= {0.0, 1 / 64}
    # nearest rounding of the same values is off by far more than that bound
    near = E3M0Codec(block=8).roundtrip(base).astype(np.float64)
    bias = np.abs(near - base)
    assert bias[1] > 0.05 and bias[3] > 0.03 and bias[6] > 0.002
    assert np.all(bias[[1, 3, 6]] > 20 * sd[[1, 3, 6]] / math.sqrt(reps))


def test_e3m0_stochastic_reproducible_with_seed_and_default_rng() -> None:
    x = np.linspace(-1, 1, 1001, dtype=np.float32)
    sr = make_codec("e3m0-sr")
    a = sr.encode(x, np.random.default_rng(7))
    b = sr.encode(x, np.random.default_rng(7))
    assert a == b
    # without an rng a fresh generator is used; the result is still valid
    y = sr.decode(sr.encode(x), x.size)
    assert np.all(np.abs(y - x) <= 1.0)


@FAST
@given(vectors)
def test_e3m0_stochastic_between_neighbours(x: np.ndarray) -> None:
    c = E3M0Codec(block=16, rounding="stochastic")
    p = c.encode(x, np.random.default_rng(0))
    y = np.abs(c.decode(p, x.size).astype(np.float64))
    ax = np.abs(x.astype(np.float64))
    s = per_value(e3m0_scales(c, p, x.size), 16, x.size).astype(np.float64)
    nz = ax > 0
    # the chosen level is within a factor 2 of |x| above the smallest level, else 0 or s/64
    above = ax >= s * 2.0**-6
    assert np.all(y[above] <= 2 * ax[above] * (1 + 1e-6))
    assert np.all(y[above] >= ax[above] / 2 * (1 - 1e-6))
    below = nz & ~above
    assert np.all((y[below] == 0) | np.isclose(y[below], s[below] / 64))
    assert np.all(y[~nz] == 0)


# --------------------------------------------------------------------------------------
# bit-exact layouts
# --------------------------------------------------------------------------------------
def test_e3m0_packing_bit_exact() -> None:
    c = E3M0Codec(block=4)
    # s = 2.0 (bf16 0x4000): [s, s/2, -s/4, 0] -> codes 0, 1, 0xA, 7
    p = c.encode(np.array([2.0, 1.0, -0.5, 0.0], np.float32))
    assert p == bytes([0x00, 0x40, 0x10, 0x7A])
    # odd length over two blocks: block 0 s=1 [1, -1/64, 1/8, -1], block 1 s=0.5 [-0.5]
    x = np.array([1.0, -1 / 64, 1 / 8, -1.0, -0.5], np.float32)
    p = c.encode(x)
    scales = bytes([0x80, 0x3F, 0x00, 0x3F])  # 1.0 = 0x3F80, 0.5 = 0x3F00
    codes = bytes([0xE0, 0x83, 0x78])  # (0, 0xE), (3, 8), (8, pad 7)
    assert p == scales + codes
    np.testing.assert_array_equal(c.decode(p, 5), x)


def test_e3m0_scale_rounded_up() -> None:
    # 1 + 2^-10 is not a bf16; the scale is rounded up to 1 + 2^-7
    c = E3M0Codec(block=2)
    x = np.array([1 + 2.0**-10, 0.0], np.float32)
    p = c.encode(x)
    assert p[:2] == struct.pack("<H", 0x3F81)
    assert c.decode(p, 2)[0] == np.float32(1 + 2.0**-7)


def test_e3m0_signed_zero_code_and_pad_ignored() -> None:
    c = E3M0Codec(block=2)
    scale = struct.pack("<H", 0x3F80)
    # code 0xF (negative zero) decodes to +0.0; the pad nibble of an odd count is ignored
    y = c.decode(scale + bytes([0xF0]), 1)
    np.testing.assert_array_equal(y, [1.0])
    y = c.decode(scale + bytes([0x0F]), 1)
    assert y[0] == 0.0 and not np.signbit(y[0])
    assert c.encode(np.array([-0.0], np.float32)) == bytes([0, 0, 0x77])


def test_int8_layout_bit_exact() -> None:
    c = Int8Codec(block=2)
    x = np.array([127.0, -63.4, 0.0, 0.0, 2.54], np.float32)
    p = c.encode(x)
    last = np.float32(2.54) / np.float32(127)
    expected = struct.pack("<2f", 1.0, 0.0) + last.astype("<f4").tobytes()
    expected += bytes([127, 256 - 63, 0, 0, 127])
    assert p == expected


# --------------------------------------------------------------------------------------
# shapes, dtypes, empties
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
def test_any_shape_and_dtype(codec: Codec) -> None:
    rng = np.random.default_rng(3)
    base = rng.standard_normal((3, 5, 7)).astype(np.float32)
    whole = codec.roundtrip(base, np.random.default_rng(0))
    assert whole.shape == (base.size,) and whole.dtype == np.float32
    # non-contiguous views are flattened in C order of the view
    view = base[:, ::2, 1:].transpose(2, 0, 1)
    assert not view.flags.c_contiguous
    got = codec.roundtrip(view, np.random.default_rng(0))
    ref = codec.roundtrip(np.ascontiguousarray(view), np.random.default_rng(0))
    np.testing.assert_array_equal(got, ref)
    # 0-d
    y = codec.roundtrip(np.float32(0.75), np.random.default_rng(0))
    assert y.shape == (1,)
    assert abs(float(y[0]) - 0.75) < 1e-6
    # float16 and float64 inputs give the same bytes as their float32 values
    for dt in (np.float16, np.float64):
        xd = base.astype(dt)
        assert codec.encode(xd, np.random.default_rng(0)) == codec.encode(
            xd.astype(np.float32), np.random.default_rng(0)
        )
    # empty
    assert codec.encode(np.zeros((0, 4), np.float32)) == b""
    assert codec.encoded_size(0) == 0
    e = codec.decode(b"", 0)
    assert e.shape == (0,) and e.dtype == np.float32


@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
def test_zeros_and_all_zero_blocks(codec: Codec) -> None:
    x = np.zeros(300, np.float32)
    x[200:210] = np.linspace(-1, 1, 10)
    y = codec.roundtrip(x, np.random.default_rng(0))
    assert np.all(y[:128] == 0) and np.all(y[256:] == 0)
    assert not np.signbit(y[:128]).any()
    np.testing.assert_array_equal(codec.roundtrip(np.zeros(17, np.float32)), np.zeros(17))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(codec: Codec, bad: float) -> None:
    x = np.ones(10, np.float32)
    x[3] = bad
    x[7] = bad
    with pytest.raises(CodecError, match=r"2 non-finite value\(s\), first at flat index 3"):
        codec.encode(x)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
def test_float64_out_of_float32_range_rejected(codec: Codec) -> None:
    with pytest.raises(CodecError):
        codec.encode(np.array([1.0, 1e300]))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
def test_non_float_input_rejected(codec: Codec) -> None:
    with pytest.raises(CodecError, match="floating"):
        codec.encode(np.arange(4))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
def test_decode_wrong_length_rejected(codec: Codec) -> None:
    x = np.linspace(-1, 1, 37, dtype=np.float32)
    p = codec.encode(x)
    for bad in (p[:-1], p + b"\x00", b""):
        with pytest.raises(CodecError, match="bytes, expected"):
            codec.decode(bad, x.size)
    with pytest.raises(CodecError):
        codec.decode(p, x.size + 2)
    with pytest.raises(CodecError):
        codec.decode(p, -1)
    # bytearray and memoryview payloads decode like bytes
    np.testing.assert_array_equal(codec.decode(bytearray(p), 37), codec.decode(p, 37))
    np.testing.assert_array_equal(codec.decode(memoryview(p), 37), codec.decode(p, 37))


@pytest.mark.parametrize("bits", [0x7F80, 0xFF80, 0x7FC0, 0xBF80, 0x8000])
def test_e3m0_bad_scale_rejected(bits: int) -> None:
    c = E3M0Codec(block=4)
    good = c.encode(np.ones(8, np.float32))
    bad = good[:2] + struct.pack("<H", bits) + good[4:]
    with pytest.raises(CodecError, match="scale"):
        c.decode(bad, 8)


@pytest.mark.parametrize("scale", [np.nan, np.inf, -1.0, 3e38])
def test_int8_bad_scale_rejected(scale: float) -> None:
    c = Int8Codec(block=4)
    good = c.encode(np.ones(8, np.float32))
    bad = struct.pack("<f", scale) + good[4:]
    with pytest.raises(CodecError, match="scale"):
        c.decode(bad, 8)


def test_int8_code_minus_128_rejected() -> None:
    c = Int8Codec(block=4)
    good = c.encode(np.ones(4, np.float32))
    with pytest.raises(CodecError, match="-128"):
        c.decode(good[:4] + b"\x80" + good[5:], 4)


@pytest.mark.parametrize("payload", [struct.pack("<f", np.nan), struct.pack("<f", np.inf)])
def test_fp32_non_finite_payload_rejected(payload: bytes) -> None:
    with pytest.raises(CodecError, match="non-finite"):
        Fp32Codec().decode(payload, 1)
    with pytest.raises(CodecError, match="non-finite"):
        Bf16Codec().decode(payload[2:], 1)


def test_int8_extreme_values_decode() -> None:
    big = np.finfo(np.float32).max
    x = np.array([big, -big, 1.0], np.float32)
    y = Int8Codec().roundtrip(x)
    assert np.isfinite(y).all()
    assert abs(float(y[0]) - float(big)) <= float(big) / 254 * 1.001


# --------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 1100))
def test_encoded_size_matches(n: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    for c in ALL_CODECS:
        p = c.encode(x, np.random.default_rng(0))
        assert len(p) == c.encoded_size(n)
        assert c.decode(p, n).shape == (n,)


def test_bits_per_value() -> None:
    assert bits_per_value(make_codec("e3m0")) == 4.125
    assert bits_per_value(make_codec("e3m0-sr")) == 4.125
    assert bits_per_value(make_codec("int8")) == 8.25
    assert bits_per_value(make_codec("bf16")) == 16.0
    assert bits_per_value(make_codec("fp32")) == 32.0
    assert E3M0Codec().encoded_size(128) == 2 + 64
    assert E3M0Codec().encoded_size(129) == 4 + 65
    with pytest.raises(ConfigError):
        bits_per_value(make_codec("fp32"), 0)


# --------------------------------------------------------------------------------------
# chunked encoding
# --------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(
    st.integers(0, 2000),
    st.integers(1, 9),
    st.sampled_from(["int8", "e3m0", "fp32", "bf16"]),
    st.sampled_from([2, 8, 128]),
)
def test_chunked_encoding_equals_whole(n: int, parts: int, name: str, block: int) -> None:
    c = make_codec(name, block=block)
    x = (np.random.default_rng(n).standard_normal(n) * np.linspace(0.01, 10, n)).astype(np.float32)
    whole = c.decode(c.encode(x), n)
    bounds = chunk_bounds(n, parts, c.align)
    pieces = [c.decode(c.encode(x[a:b]), b - a) for a, b in bounds]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert sum(c.encoded_size(b - a) for a, b in bounds) >= c.encoded_size(n)


# --------------------------------------------------------------------------------------
# factory
# --------------------------------------------------------------------------------------
def test_make_codec() -> None:
    assert CODEC_NAMES == ("fp32", "bf16", "int8", "e3m0", "e3m0-sr")
    for name in CODEC_NAMES:
        c = make_codec(name, block=64)
        assert c.name == name
        rebuilt = make_codec(c.name, block=getattr(c, "block", 128))
        assert repr(rebuilt) == repr(c)
    sr = make_codec("e3m0", rounding="stochastic")
    assert isinstance(sr, E3M0Codec) and sr.rounding == "stochastic" and sr.name == "e3m0-sr"
    assert isinstance(make_codec("E3M0-SR"), E3M0Codec)
    assert make_codec("int8", block=32).align == 32
    assert make_codec("e3m0", block=64).align == 64
    assert make_codec("bf16").align == 1
    with pytest.raises(ConfigError, match="fp32, bf16, int8, e3m0, e3m0-sr"):
        make_codec("fp4")
    with pytest.raises(ConfigError):
        make_codec("e3m0", rounding="down")
    with pytest.raises(ConfigError):
        make_codec("int8", rounding="stochastic")
    for bad_block in (0, 3, -2, 1):
        with pytest.raises(ConfigError):
            E3M0Codec(block=bad_block)
    with pytest.raises(ConfigError):
        Int8Codec(block=0)


def test_e3m0_throughput_smoke() -> None:
    # vectorised: a million values must take well under a second on a slow CPU
    import time

    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    c = E3M0Codec()
    t = time.perf_counter()
    c.decode(c.encode(x), x.size)
    assert time.perf_counter() - t < 2.0


# --------------------------------------------------------------------------------------
# slicing an encoded payload
# --------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 700), st.data())
def test_slice_payload_equals_encoding_of_the_slice(n: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.linspace(0.01, 10, n)).astype(np.float32)
    for c in ALL_CODECS:
        payload = c.encode(x, rng=np.random.default_rng(1))
        whole = c.decode(payload, n)
        cuts = sorted({0, n, *range(0, n, c.align)})
        a = data.draw(st.sampled_from(cuts[:-1] if len(cuts) > 1 else cuts), label="start")
        b = data.draw(st.sampled_from([v for v in cuts if v >= a]), label="stop")
        piece = c.slice_payload(payload, n, a, b)
        assert len(piece) == c.encoded_size(b - a)
        np.testing.assert_array_equal(c.decode(piece, b - a), whole[a:b])
        if not (isinstance(c, E3M0Codec) and c.rounding == "stochastic"):
            assert piece == c.encode(x[a:b]), repr(c)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
def test_slice_payload_along_chunk_bounds(codec: Codec) -> None:
    n = 3 * max(codec.align, 1) * 5 + 3  # an odd, unaligned length
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    payload = codec.encode(x, rng=np.random.default_rng(2))
    bounds = chunk_bounds(n, 4, codec.align)
    pieces = [codec.slice_payload(payload, n, a, b) for a, b in bounds]
    decoded = [codec.decode(p, b - a) for p, (a, b) in zip(pieces, bounds, strict=True)]
    np.testing.assert_array_equal(np.concatenate(decoded), codec.decode(payload, n))
    assert codec.slice_payload(payload, n, 0, n) == payload
    assert codec.slice_payload(payload, n, 0, 0) == b""


@pytest.mark.parametrize("codec", ALL_CODECS, ids=IDS)
def test_slice_payload_refusals(codec: Codec) -> None:
    n = 4 * codec.align + 1
    payload = codec.encode(np.ones(n, np.float32))
    with pytest.raises(CodecError):
        codec.slice_payload(payload + b"\0", n, 0, n)
    with pytest.raises(ConfigError):
        codec.slice_payload(payload, n, 0, n + 1)
    with pytest.raises(ConfigError):
        codec.slice_payload(payload, n, codec.align, 0)
    with pytest.raises(ConfigError):
        codec.slice_payload(payload, n, -1, n)
    with pytest.raises(ConfigError):
        codec.slice_payload(payload, n, 0.0, n)  # type: ignore[arg-type]
    if codec.align > 1:
        with pytest.raises(ConfigError):
            codec.slice_payload(payload, n, 1, n)
        with pytest.raises(ConfigError):
            codec.slice_payload(payload, n, 0, codec.align + 1)


# --------------------------------------------------------------------------------------
# bit-exactness against a straightforward reference
# --------------------------------------------------------------------------------------
# The codecs are written for speed (chunked, bit tricks, lookup tables). These are the
# plain whole-array implementations they replaced; the fast ones must give the very same
# payload bytes, decoded bits and random draws.
_SQRT_HALF_UP_REF = np.float32(math.sqrt(0.5))
if float(_SQRT_HALF_UP_REF) < math.sqrt(0.5):
    _SQRT_HALF_UP_REF = np.nextafter(_SQRT_HALF_UP_REF, np.float32(1.0))


def _ref_pad_blocks(a: np.ndarray, block: int) -> np.ndarray:
    nb = -(-a.size // block)
    out = np.zeros(nb * block, dtype=np.float32)
    out[: a.size] = a
    return out.reshape(nb, block)


def _reference_encode(codec: Codec, x: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
    a = np.asarray(x, dtype=np.float32).reshape(-1)
    n = a.size
    if isinstance(codec, Bf16Codec):
        bits = a.view(np.uint32)
        hi = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        assert not ((hi & 0x7F80) == 0x7F80).any()
        return hi.astype("<u2").tobytes()
    if n == 0:
        return b""
    if isinstance(codec, Int8Codec):
        m = _ref_pad_blocks(a, codec.block)
        scale = (np.abs(m).max(axis=1) / np.float32(127)).astype(np.float32)
        with np.errstate(over="ignore"):
            big = ~np.isfinite(scale * np.float32(127))
        if big.any():
            scale[big] = np.nextafter(scale[big], np.float32(0))
        q = np.zeros(m.shape, dtype=np.float32)
        np.divide(m, scale[:, None], out=q, where=scale[:, None] > 0)
        codes = np.clip(np.rint(q), -127, 127).astype(np.int8).reshape(-1)[:n]
        return scale.astype("<f4").tobytes() + codes.tobytes()
    assert isinstance(codec, E3M0Codec)
    m = _ref_pad_blocks(a, codec.block)
    absmax = np.abs(m).max(axis=1)
    up = (absmax.view(np.uint32) >> 16) + ((absmax.view(np.uint32) & 0xFFFF) != 0)
    up = up.astype(np.uint32)
    assert not (up >= 0x7F80).any()
    s = (up << 16).view(np.float32)
    r = np.zeros(m.shape, dtype=np.float32)
    np.divide(np.abs(m), s[:, None], out=r, where=s[:, None] > 0)
    mant, expo = np.frexp(r)
    if codec.rounding == "nearest":
        k = (-expo + (mant < _SQRT_HALF_UP_REF)).astype(np.int32)
        np.minimum(k, 6, out=k)
        k[r < np.float32(2.0**-7)] = 7
    else:
        gen = rng if rng is not None else np.random.default_rng()
        u = gen.random(r.shape, dtype=np.float32)
        k = (1 - expo - (u < 2 * mant - 1)).astype(np.int32)
        low = r < np.float32(2.0**-6)
        k[low] = np.where(u[low] < r[low] * np.float32(64.0), 6, 7)
    neg = np.signbit(m) & (k != 7)
    codes = (k.astype(np.uint8) | (neg.astype(np.uint8) << 3)).reshape(-1)[: n + (n & 1)]
    packed = codes[0::2] | (codes[1::2] << 4)
    return up.astype("<u2").tobytes() + packed.tobytes()


def _reference_decode(codec: Codec, data: bytes, n: int) -> np.ndarray:
    if isinstance(codec, Bf16Codec):
        hi = np.frombuffer(data, dtype="<u2", count=n).astype(np.uint32)
        return (hi << 16).view(np.float32)
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    nb = -(-n // codec.align)
    if isinstance(codec, Int8Codec):
        scale = np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32)
        codes = np.frombuffer(data, dtype=np.int8, count=n, offset=4 * nb)
        out = np.zeros(nb * codec.block, dtype=np.float32)
        out[:n] = codes
        out.reshape(nb, codec.block)[...] *= scale[:, None]
        return out[:n]
    assert isinstance(codec, E3M0Codec)
    s = (np.frombuffer(data, dtype="<u2", count=nb).astype(np.uint32) << 16).view(np.float32)
    pow2 = np.array([2.0**-j for j in range(7)] + [0.0], dtype=np.float32)
    mags = s[:, None] * pow2[None, :]
    table = np.concatenate([mags, -mags], axis=1)
    table[:, 15] = 0.0
    packed = np.frombuffer(data, dtype=np.uint8, count=(n + 1) // 2, offset=2 * nb)
    codes = np.full(nb * codec.block, 7, dtype=np.uint8)
    pairs = codes[: 2 * packed.size].reshape(-1, 2)
    pairs[:, 0] = packed & 0x0F
    pairs[:, 1] = packed >> 4
    if n & 1:
        codes[n] = 7
    out = np.take_along_axis(table, codes.reshape(nb, codec.block), axis=1)
    return out.reshape(-1)[:n]


EXACT_CODECS: list[Codec] = [
    Bf16Codec(),
    Int8Codec(),
    Int8Codec(block=5),
    Int8Codec(block=1),
    E3M0Codec(),
    E3M0Codec(block=2),
    E3M0Codec(block=6),
    E3M0Codec(rounding="stochastic"),
    E3M0Codec(block=4, rounding="stochastic"),
]
EXACT_IDS = [repr(c) for c in EXACT_CODECS]

# magnitudes from subnormal to near the largest float32, signed zeros, ties and repeats
_special32 = st.sampled_from(
    [0.0, -0.0, 1.0, -1.0, 2.0**-149, -(2.0**-149), 2.0**-126, 1.5 * 2.0**-130, 3.0e38,
     -3.3e38, 2.0**-7, 2.0**-6, 0.70710677, 0.7071068, 65504.0, 1e-30]
)  # fmt: skip
_any32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
_wide32 = st.one_of(finite32, _special32, _any32)


@st.composite
def _exact_inputs(draw: st.DrawFn) -> np.ndarray:
    n = draw(st.integers(0, 700))
    kind = draw(st.sampled_from(["elements", "scaled-normal", "zeros", "blocky"]))
    if kind == "elements":
        return draw(hnp.arrays(np.float32, n, elements=_wide32))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "zeros":
        x = np.zeros(n, np.float32)
        x[rng.random(n) < 0.5] = -0.0
        return x
    if kind == "scaled-normal":
        exp = draw(st.integers(-149, 126))
        with np.errstate(over="ignore", under="ignore"):
            x = (rng.standard_normal(n) * 2.0**exp).astype(np.float32)
        # a draw past float32's range (|z| * 2**126 over 3.4e38) became ±inf, which every
        # codec refuses: keep the largest finite value instead, the case meant here
        big = np.finfo(np.float32).max
        return np.nan_to_num(x, posinf=big, neginf=-big)
    # blocks of wildly different magnitudes, some all zero, some subnormal
    e = rng.integers(-160, 120, size=n // 3 + 1).repeat(3)[:n]
    x = (rng.standard_normal(n) * np.exp2(e)).astype(np.float32)
    x[rng.random(n) < 0.2] = 0.0
    return x


def _draw_state(rng: np.random.Generator) -> object:
    def plain(v: object) -> object:
        if isinstance(v, dict):
            return {k: plain(w) for k, w in v.items()}
        return v.tolist() if isinstance(v, np.ndarray) else v

    return plain(rng.bit_generator.state)


@settings(max_examples=150, deadline=None)
@given(_exact_inputs(), st.sampled_from(range(len(EXACT_CODECS))), st.integers(0, 3))
def test_codecs_bit_exact_against_reference(x: np.ndarray, which: int, gen: int) -> None:
    codec = EXACT_CODECS[which]
    if isinstance(codec, Bf16Codec):
        x = x[np.abs(x) < 3.3e38]  # larger values overflow bfloat16 and are refused
    bitgen = [np.random.PCG64, np.random.MT19937, np.random.Philox, np.random.SFC64][gen]
    r1 = np.random.Generator(bitgen(5))
    r2 = np.random.Generator(bitgen(5))
    try:
        expected = _reference_encode(codec, x, r2)
    except AssertionError:  # a scale beyond bfloat16: the codec must refuse it too
        with pytest.raises(CodecError):
            codec.encode(x, rng=r1)
        return
    payload = codec.encode(x, rng=r1)
    assert payload == expected
    # the stochastic encoder consumes the generator exactly like the reference
    assert _draw_state(r1) == _draw_state(r2)
    assert r1.random(3, dtype=np.float32).tobytes() == r2.random(3, dtype=np.float32).tobytes()
    got = codec.decode(payload, x.size)
    want = _reference_decode(codec, payload, x.size)
    assert got.dtype == np.float32 and got.shape == (x.size,)
    assert got.tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(len(EXACT_CODECS))), st.integers(0, 700), st.data())
def test_decode_bit_exact_on_arbitrary_codes(which: int, n: int, data: st.DataObject) -> None:
    # payloads no encoder would write (any nibble, any valid scale) decode like the reference
    codec = EXACT_CODECS[which]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = bytearray(rng.integers(0, 256, codec.encoded_size(n), dtype=np.uint8).tobytes())
    nb = -(-n // codec.align) if n else 0
    if isinstance(codec, E3M0Codec):
        s = rng.integers(0, 0x7F80, nb, dtype=np.uint16)  # valid: positive, finite
        raw[: 2 * nb] = s.astype("<u2").tobytes()
    elif isinstance(codec, Int8Codec):
        s = (rng.random(nb) * np.exp2(rng.integers(-150, 100, nb))).astype(np.float32)
        raw[: 4 * nb] = s.astype("<f4").tobytes()
        codes = np.frombuffer(raw, np.int8, count=n, offset=4 * nb).copy()
        codes[codes == -128] = 127
        raw[4 * nb :] = codes.tobytes()
    else:
        hi = np.frombuffer(raw, "<u2").copy()
        hi[(hi & 0x7F80) == 0x7F80] &= 0x807F
        raw[:] = hi.tobytes()
    payload = bytes(raw)
    got = codec.decode(payload, n)
    assert got.tobytes() == _reference_decode(codec, payload, n).tobytes()


@pytest.mark.parametrize("codec", EXACT_CODECS, ids=EXACT_IDS)
def test_codecs_bit_exact_large(codec: Codec) -> None:
    # long enough to cross the encoder's internal chunk boundaries, with an odd tail
    n = 3 * (1 << 16) + 3 * codec.align + 1
    rng = np.random.default_rng(3)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-140, 100, n // 64 + 1).repeat(64)[:n])
    x = np.clip(x, -3e38, 3e38).astype(np.float32)
    x[rng.random(n) < 0.1] = -0.0
    x[1000:5000] = 0.0
    payload = codec.encode(x, rng=np.random.default_rng(9))
    assert payload == _reference_encode(codec, x, np.random.default_rng(9))
    got = codec.decode(payload, n)
    assert got.tobytes() == _reference_decode(codec, payload, n).tobytes()


@pytest.mark.parametrize("codec", EXACT_CODECS, ids=EXACT_IDS)
def test_refusals_name_the_whole_input(codec: Codec) -> None:
    # The encoders work step by step, but a refusal still describes the whole input, and
    # NaN or ±inf anywhere wins over a too-large value met in an earlier step.
    n = 5 * (1 << 16) + 7
    x = np.ones(n, np.float32)
    x[[10, 3 * (1 << 16) + 1]] = np.nan
    with pytest.raises(
        CodecError, match=r"input has 2 non-finite value\(s\), first at flat index 10"
    ):
        codec.encode(x)
    x[10] = 3.4e38  # beyond bf16 and the largest E3M0 scale
    with pytest.raises(CodecError, match=r"1 non-finite value\(s\), first at flat index 196609"):
        codec.encode(x)
    x[3 * (1 << 16) + 1] = -3.4e38
    if isinstance(codec, Int8Codec):
        return
    match = "2 value" if isinstance(codec, Bf16Codec) else f"block {10 // codec.align} has max"
    with pytest.raises(CodecError, match=match):
        codec.encode(x)


def test_weighted_mean_bit_exact() -> None:
    from atoll.protocol.reduce import Contribution, weighted_mean

    n = 3 * (1 << 16) + 5
    rng = np.random.default_rng(4)
    for codec in (Fp32Codec(), E3M0Codec(), Int8Codec()):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
        cs = [Contribution(codec.encode(x), w) for x, w in zip(xs, (1.0, 3.0, 0.5), strict=True)]
        w = np.array([1.0, 3.0, 0.5])
        w /= w.max()
        w /= w.sum()
        acc = np.zeros(n, np.float32)
        for c, wi in zip(cs, w, strict=True):
            acc += np.float32(wi) * codec.decode(c.payload, n)
        assert weighted_mean(cs, codec, n).tobytes() == acc.tobytes()


def _around(bits: int, d: int = 2) -> list[int]:
    return [bits + i for i in range(-d, d + 1)]


def test_e3m0_bit_exact_at_thresholds() -> None:
    # r = |x| / s exactly at, just below and just above every decision point: the nearest
    # levels' boundaries 2^-(k + 1/2), 2^-6, 2^-7, the levels themselves and 1.
    m0 = int(_SQRT_HALF_UP_REF.view(np.uint32)) & 0x7FFFFF
    edges = [((126 - k) << 23) | m0 for k in range(7)] + [(127 - k) << 23 for k in range(9)]
    r = np.array(sorted({b for e in edges for b in _around(e)}), np.uint32).view(np.float32)
    r = r[(r > 0) & (r <= 1)]
    for exp in (0, -20, 40, -120, -135):
        # block 128 with 1.0 in it, so s = 2^exp and r is exact
        vals = np.concatenate([[1.0], r, -r, [0.0, -0.0]]).astype(np.float32) * np.float32(2.0**exp)
        x = np.resize(vals, 4 * 128 + 3)
        x[::128] = np.float32(2.0**exp)
        for codec in (E3M0Codec(), E3M0Codec(rounding="stochastic")):
            for seed in range(4):
                p = codec.encode(x, rng=np.random.default_rng(seed))
                assert p == _reference_encode(codec, x, np.random.default_rng(seed))
                got = codec.decode(p, x.size).tobytes()
                assert got == _reference_decode(codec, p, x.size).tobytes()


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "e3m0", "e3m0-sr"])
def test_decode_into_writes_what_decode_returns_even_into_a_slice(name: str) -> None:
    codec = make_codec(name)
    rng = np.random.default_rng(3)
    n = 3 * 128 + 37
    payload = codec.encode(rng.standard_normal(n).astype(np.float32), rng=rng)
    expected = codec.decode(payload, n)
    big = np.full(128 + n + 5, 7.0, dtype=np.float32)  # chunk at an aligned offset
    codec.decode_into(payload, n, big[128 : 128 + n])
    assert big[128 : 128 + n].tobytes() == expected.tobytes()
    assert (big[:128] == 7.0).all() and (big[128 + n :] == 7.0).all()
    with pytest.raises(ConfigError):
        codec.decode_into(payload, n, np.empty(n + 1, dtype=np.float32))
    with pytest.raises(ConfigError):
        codec.decode_into(payload, n, np.empty(n, dtype=np.float64))  # type: ignore[arg-type]

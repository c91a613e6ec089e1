"""Wire codecs: how a flat float32 vector is turned into bytes and back.

Four formats, from lossless to 4 bits per value:

- ``fp32``  raw little-endian float32;
- ``bf16``  bfloat16, rounded to nearest even (2 bytes per value);
- ``int8``  blockwise symmetric int8 with one float32 scale per block;
- ``e3m0``  blockwise 4-bit floats with a sign bit, a 3-bit exponent and no mantissa, the
  low-precision exchange of Streaming DiLoCo (Douillard et al., arXiv 2501.18512, section
  on FP4 / E3M0 communication). The paper leaves scaling and rounding open; our choices are
  written in docs/ALGORITHMS.md §2.4 and in :class:`E3M0Codec`. ``e3m0-sr`` is the same wire
  format encoded with stochastic (unbiased) rounding.

A payload carries no header: the message around it names the codec and the number of
values, and :meth:`Codec.decode` checks that the byte count matches exactly. Every codec
refuses NaN and infinity on both sides, so a broken or hostile peer cannot smuggle them
into an average.

The blockwise codecs have an alignment (their block size): a vector split at multiples of
it and encoded piece by piece decodes to exactly the same values as the whole vector
encoded at once, which is what lets a reduce-scatter hand out chunks of a vector.

Speed. The rules above are stated on whole arrays, but the code runs them in steps of
whole blocks of about :data:`_STEP` values through a few scratch buffers allocated once per
call, so the temporaries stay in the CPU cache instead of costing page faults (a 100 MB
vector used to make several 100 MB temporaries per encode). Within a step everything is
integer work on the float32 bits: ``max|x|`` is a max over the bits with the sign cleared,
the E3M0 exponent code comes from the exponent field of ``|x| / s`` rather than from
``frexp``, codes are packed two per byte through a ``uint16`` view, and E3M0 decoding
looks each payload byte up in a 256-entry table of two unscaled float32 values and then
multiplies by the block scale in place. Every step computes exactly the float32
operations of the whole-array rule, so payloads and decoded bits are unchanged (the unit
tests compare against a plain reference implementation); stochastic rounding draws its
uniforms step by step in the same order, which consumes the generator identically.
"""

from __future__ import annotations

import abc
import math
import operator

import numpy as np
import numpy.typing as npt

from atoll.protocol.errors import CodecError, ConfigError

__all__ = [
    "CODEC_NAMES",
    "Bf16Codec",
    "Codec",
    "E3M0Codec",
    "Fp32Codec",
    "Int8Codec",
    "bits_per_value",
    "make_codec",
]

CODEC_NAMES: tuple[str, ...] = ("fp32", "bf16", "int8", "e3m0", "e3m0-sr")
"""Names :func:`make_codec` accepts."""

ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")

F32Array = npt.NDArray[np.float32]
Buffer = bytes | bytearray | memoryview

_E3M0_ZERO = 7  # exponent code that means "zero"
_E3M0_LEVELS = 7  # nonzero magnitudes s * 2^-k, k = 0..6
# Smallest float32 that is >= 1/sqrt(2). No float32 equals 1/sqrt(2), so for a mantissa
# m in [0.5, 1): m < _SQRT_HALF_UP  <=>  m < 1/sqrt(2)  <=>  log2(m) < -0.5.
_SQRT_HALF_UP = np.float32(math.sqrt(0.5))
if float(_SQRT_HALF_UP) < math.sqrt(0.5):
    _SQRT_HALF_UP = np.nextafter(_SQRT_HALF_UP, np.float32(1.0))

_STEP = 1 << 16  # values per step of the blockwise loops (see "Speed" above)

# Typed scalars: numpy takes its vectorised loops for these, not for plain Python ints.
_U32 = np.uint32
_ABS_MASK = _U32(0x7FFFFFFF)  # clears the float32 sign bit
_INF_BITS = _U32(0x7F800000)
_MANT_MASK = _U32(0x007FFFFF)
_ONE_BITS = _U32(0x3F800000)  # 1.0f
_SHIFT_EXP = _U32(23)
_SHIFT_HALF = _U32(16)
# r = |x|/s, 0 <= r <= 1, with bits rb = (E << 23) | M. Nearest rounding picks k =
# round(-log2 r) = 126 - E + (M < M0), M0 the mantissa field of _SQRT_HALF_UP (in [0.5, 1),
# so its exponent field is 126). Adding 2^23 - M0 carries into the exponent exactly when
# M >= M0, so k = 127 - ((rb + _NEAREST_ADD) >> 23) before clamping.
_NEAREST_ADD = _U32((1 << 23) - (int(_SQRT_HALF_UP.view(np.uint32)) & 0x7FFFFF))
_R7_BITS = _U32(0x3C000000)  # 2^-7: nearest rounding sends r below it to zero
_R6_BITS = _U32(0x3C800000)  # 2^-6: the smallest nonzero level
# E3M0 decoding: payload byte b -> the two unscaled values of its nibbles (low nibble
# first), +-2^-k or +0.0 for both zero codes, as one native uint64 of two float32.
_E3M0_NIBBLE = np.array([2.0**-c for c in range(_E3M0_LEVELS)] + [0.0], dtype=np.float32)
_E3M0_NIBBLE = np.concatenate([_E3M0_NIBBLE, -_E3M0_NIBBLE[:-1], _E3M0_NIBBLE[-1:]])
_E3M0_PAIRS = (
    np.stack([np.tile(_E3M0_NIBBLE, 16), np.repeat(_E3M0_NIBBLE, 16)], axis=1)
    .view(np.uint64)
    .reshape(256)
)
_E3M0_PAIRS.flags.writeable = False


# --------------------------------------------------------------------------------------
# shared checks
# --------------------------------------------------------------------------------------
def _describe_nonfinite(a: np.ndarray) -> str:
    bad = ~np.isfinite(a)
    return f"{int(bad.sum())} non-finite value(s), first at flat index {int(np.argmax(bad))}"


def _all_finite(a: np.ndarray) -> bool:
    """Whether the flat float array ``a`` holds no NaN and no ±inf (measured: faster than
    a max/min reduction, and 2.6x faster than ``abs(a).max() < inf``, which copies ``a``)."""
    return bool(np.isfinite(a).all())


def _refuse_nonfinite(a: np.ndarray, codec: str) -> None:
    """Raise the :class:`CodecError` for NaN or ±inf in the flat input ``a``, if any."""
    if not _all_finite(a):
        raise CodecError(f"{codec}: input has {_describe_nonfinite(a)} (NaN or ±inf)")


def _as_flat_f32(x: npt.ArrayLike, codec: str, check_finite: bool = True) -> F32Array:
    """Flatten ``x`` in C order to a contiguous float32 vector, refusing NaN and infinity.

    With ``check_finite=False`` a float32 input is not scanned here: the caller finds
    non-finite values on its own pass and raises through :func:`_refuse_nonfinite`.
    """
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise CodecError(f"{codec}: can only encode floating-point values, not dtype {a.dtype}")
    a = a.reshape(-1)
    if check_finite or a.dtype != np.float32:
        _refuse_nonfinite(a, codec)
    if a.dtype != np.float32:
        with np.errstate(over="ignore"):
            f = a.astype(np.float32)
        if a.itemsize > 4 and f.size and not np.isfinite(f).all():
            raise CodecError(
                f"{codec}: input has {_describe_nonfinite(f)} after float32 conversion"
            )
        return f
    return np.ascontiguousarray(a)


def _check_numel(numel: int) -> int:
    try:
        n = operator.index(numel)
    except TypeError:
        raise CodecError(f"numel must be an integer, not {type(numel).__name__}") from None
    if n < 0:
        raise CodecError(f"numel must be >= 0, not {n}")
    return n


def _byte_view(data: Buffer, codec: str, expected: int) -> memoryview:
    """A flat byte view of ``data`` whose length is checked against ``expected``."""
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        if not mv.c_contiguous:
            raise CodecError(f"{codec}: payload buffer is not contiguous")
        mv = mv.cast("B")
    if mv.nbytes != expected:
        raise CodecError(f"{codec}: payload has {mv.nbytes} bytes, expected {expected}")
    return mv


def _check_block(block: int, codec: str, even: bool) -> int:
    if isinstance(block, bool) or not isinstance(block, int | np.integer):
        raise ConfigError(f"{codec}: block must be an integer, not {block!r}")
    b = int(block)
    low = 2 if even else 1
    if b < low or (even and b % 2):
        need = "an even integer >= 2" if even else "an integer >= 1"
        raise ConfigError(f"{codec}: block must be {need}, not {b}")
    return b


def _steps(n: int, block: int) -> tuple[list[tuple[int, int]], int]:
    """Steps over the whole blocks of ``n`` values, and the length of the partial tail.

    Each step is ``(first block, end block)``, about :data:`_STEP` values long; the tail
    (``n % block`` values, possibly 0) is left to the caller, which pads it to one block.
    """
    full, tail = divmod(n, block)
    rows = max(1, _STEP // block)
    return [(b, min(b + rows, full)) for b in range(0, full, rows)], tail


def _padded_tail(a: F32Array, block: int) -> F32Array:
    """The last, partial block of ``a`` padded with zeros to ``block`` values."""
    t = np.zeros(block, dtype=np.float32)
    rem = a.size % block
    t[:rem] = a[a.size - rem :]
    return t


def _abs_bits_max(
    u: npt.NDArray[np.uint32], rows: int, scratch: npt.NDArray[np.uint32]
) -> npt.NDArray[np.uint32]:
    """Per-row ``max|x|`` as float32 bits, for float32 bits ``u`` of ``rows`` blocks.

    ``scratch`` (as long as ``u``) receives ``|x|`` as bits. For finite values, ordering
    the bits with the sign cleared orders the magnitudes, and a NaN or ±inf shows as a
    maximum of at least ``0x7F800000``.
    """
    np.bitwise_and(u, _ABS_MASK, out=scratch)
    amax: npt.NDArray[np.uint32] = np.maximum.reduce(scratch.reshape(rows, -1), axis=1)
    return amax


# --------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------
def _check_out(out: object, numel: int) -> None:
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float32
        or out.shape != (numel,)
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ConfigError(f"out must be a writable contiguous float32 array of {numel} values")


class Codec(abc.ABC):
    """A wire format for flat float32 vectors (Streaming DiLoCo, arXiv 2501.18512).

    ``name`` identifies the format (see :data:`CODEC_NAMES`); ``align`` is the chunk
    alignment in values: a vector cut at multiples of ``align`` and encoded chunk by chunk
    decodes to the same values as the whole vector encoded at once.

    ``encode`` takes any shape and any float dtype, flattens it in C order and works in
    float32; NaN or ±inf raises :class:`CodecError`. ``decode`` returns a new 1-D float32
    array of ``numel`` values and raises :class:`CodecError` when the payload length is not
    ``encoded_size(numel)`` or when it holds non-finite values or invalid scales.
    """

    name: str
    align: int

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact length in bytes of ``encode(x)`` for any ``x`` of ``numel`` values."""

    @abc.abstractmethod
    def encode(self, x: npt.ArrayLike, rng: np.random.Generator | None = None) -> bytes:
        """Encode ``x`` (flattened in C order); ``rng`` is used only by stochastic rounding."""

    @abc.abstractmethod
    def decode(self, data: Buffer, numel: int) -> F32Array:
        """Decode a payload of ``numel`` values into a new 1-D float32 array."""

    def decode_into(self, data: Buffer, numel: int, out: F32Array) -> None:
        """:meth:`decode` into ``out`` (float32, C-contiguous, ``numel`` values).

        Bit for bit what :meth:`decode` returns; codecs that can write in place do so (no
        temporary of the decoded size), the others copy. CodecError as :meth:`decode`;
        ConfigError when ``out`` does not fit.
        """
        _check_out(out, numel)
        out[...] = self.decode(data, numel)

    def slice_payload(self, payload: Buffer, numel: int, start: int, stop: int) -> bytes:
        """The bytes ``encode(x[start:stop])`` gives, cut out of ``payload = encode(x)``.

        Nothing is decoded or re-encoded: a reduce-scatter (Streaming DiLoCo, arXiv
        2501.18512) encodes a peer's whole pseudo-gradient once and hands each chunk's
        owner its slice of those bytes. ``start`` must be a multiple of :attr:`align` and
        ``stop`` a multiple of it or ``numel``, with ``0 <= start <= stop <= numel``
        (:class:`ConfigError` otherwise); a payload whose length is not
        ``encoded_size(numel)`` raises :class:`CodecError`. The values are not checked
        here: :meth:`decode` of the slice does that.
        """
        n = _check_numel(numel)
        a, b = self._check_slice(n, start, stop)
        mv = _byte_view(payload, self.name, self.encoded_size(n))
        return self._slice(mv, n, a, b)

    def _check_slice(self, n: int, start: int, stop: int) -> tuple[int, int]:
        try:
            a, b = operator.index(start), operator.index(stop)
        except TypeError:
            raise ConfigError(
                f"{self.name}: slice bounds must be integers, not {start!r}, {stop!r}"
            ) from None
        if not 0 <= a <= b <= n:
            raise ConfigError(f"{self.name}: slice [{a}, {b}) is not within [0, {n}]")
        if a % self.align or (b % self.align and b != n):
            raise ConfigError(
                f"{self.name}: slice [{a}, {b}) of {n} values is not aligned to {self.align}"
            )
        return a, b

    @abc.abstractmethod
    def _slice(self, mv: memoryview, n: int, start: int, stop: int) -> bytes:
        """:meth:`slice_payload` once its arguments are checked."""

    def roundtrip(self, x: npt.ArrayLike, rng: np.random.Generator | None = None) -> F32Array:
        """``decode(encode(x))``: the values a receiver would see, as a 1-D float32 array."""
        payload = self.encode(x, rng)
        return self.decode(payload, int(np.size(x)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# --------------------------------------------------------------------------------------
# fp32, bf16
# --------------------------------------------------------------------------------------
class Fp32Codec(Codec):
    """Lossless reference format: little-endian float32, 4 bytes per value.

    Streaming DiLoCo (arXiv 2501.18512) uses full precision as the baseline against which
    its low-precision exchange is measured.
    """

    name = "fp32"
    align = 1

    def encoded_size(self, numel: int) -> int:
        """Four bytes per value."""
        return 4 * _check_numel(numel)

    def encode(self, x: npt.ArrayLike, rng: np.random.Generator | None = None) -> bytes:
        """Raw little-endian float32 bytes; ``rng`` is ignored."""
        a = _as_flat_f32(x, self.name)
        return a.astype("<f4", copy=False).tobytes()

    def _slice(self, mv: memoryview, n: int, start: int, stop: int) -> bytes:
        return bytes(mv[4 * start : 4 * stop])

    def decode(self, data: Buffer, numel: int) -> F32Array:
        """Read little-endian float32 values, refusing NaN and infinity."""
        n = _check_numel(numel)
        mv = _byte_view(data, self.name, 4 * n)
        out = np.frombuffer(mv, dtype="<f4", count=n).astype(np.float32)
        if not _all_finite(out):
            raise CodecError(f"{self.name}: payload has {_describe_nonfinite(out)}")
        return out

    def decode_into(self, data: Buffer, numel: int, out: F32Array) -> None:
        n = _check_numel(numel)
        _check_out(out, n)
        mv = _byte_view(data, self.name, 4 * n)
        values = np.frombuffer(mv, dtype="<f4", count=n)
        if not _all_finite(values):
            raise CodecError(f"{self.name}: payload has {_describe_nonfinite(values)}")
        np.copyto(out, values)


class Bf16Codec(Codec):
    """bfloat16, 2 bytes per value, rounded to nearest with ties to even.

    One of the low-precision float formats Streaming DiLoCo (arXiv 2501.18512) found to
    keep quality. A finite value whose rounding overflows bfloat16 (magnitude at or above
    about 3.39e38) is refused with :class:`CodecError` rather than sent as infinity.
    """

    name = "bf16"
    align = 1

    def encoded_size(self, numel: int) -> int:
        """Two bytes per value."""
        return 2 * _check_numel(numel)

    def encode(self, x: npt.ArrayLike, rng: np.random.Generator | None = None) -> bytes:
        """Round each float32 to bfloat16 (upper 16 bits, nearest-even); ``rng`` is ignored."""
        a = _as_flat_f32(x, self.name, check_finite=False)
        n = a.size
        out = np.empty(n, dtype="<u2")
        bits = a.view(np.uint32)
        t = np.empty(min(n, _STEP), dtype=np.uint32)
        for i in range(0, n, _STEP):
            u, w = bits[i : i + _STEP], t[: min(_STEP, n - i)]
            # One pass finds both refusals: |x| >= 0x7F7F8000 (as bits) is where rounding
            # overflows bfloat16, and NaN or inf lie above it.
            if np.maximum.reduce(np.bitwise_and(u, _ABS_MASK, out=w)) >= 0x7F7F8000:
                self._refuse(a)
            # Adding 0x7FFF plus the lowest kept bit, then truncating, rounds to nearest
            # even. Finite inputs cannot overflow uint32 (the largest is 0xFF7FFFFF + 0x8000).
            np.right_shift(u, _SHIFT_HALF, out=w)
            np.bitwise_and(w, _U32(1), out=w)
            np.add(w, _U32(0x7FFF), out=w)
            np.add(w, u, out=w)
            np.right_shift(w, _SHIFT_HALF, out=w)
            np.copyto(out[i : i + _STEP], w, casting="unsafe")
        return out.tobytes()

    @staticmethod
    def _refuse(a: F32Array) -> None:
        """Raise the error for ``a``, which holds a value bf16 cannot carry."""
        _refuse_nonfinite(a, "bf16")
        bits = a.view(np.uint32)
        hi = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        over = (hi & 0x7F80) == 0x7F80
        i = int(np.argmax(over))
        raise CodecError(
            f"bf16: {int(over.sum())} value(s) overflow bfloat16, first at flat index {i} "
            f"({float(a[i])!r})"
        )

    def _slice(self, mv: memoryview, n: int, start: int, stop: int) -> bytes:
        return bytes(mv[2 * start : 2 * stop])

    def decode(self, data: Buffer, numel: int) -> F32Array:
        """Expand each bfloat16 exactly to float32, refusing NaN and infinity."""
        n = _check_numel(numel)
        mv = _byte_view(data, self.name, 2 * n)
        hi = np.frombuffer(mv, dtype="<u2", count=n)
        out = np.empty(n, dtype=np.uint32)
        t = np.empty(min(n, _STEP), dtype=np.uint16)
        for i in range(0, n, _STEP):
            h, o = hi[i : i + _STEP], out[i : i + _STEP]
            # exponent field all ones: NaN or infinity
            if np.maximum.reduce(np.bitwise_and(h, np.uint16(0x7FFF), out=t[: h.size])) >= 0x7F80:
                bad = (hi.astype(np.uint32) << 16).view(np.float32)
                raise CodecError(f"{self.name}: payload has {_describe_nonfinite(bad)}")
            np.copyto(o, h)
            np.left_shift(o, _SHIFT_HALF, out=o)
        return out.view(np.float32)


# --------------------------------------------------------------------------------------
# int8
# --------------------------------------------------------------------------------------
class Int8Codec(Codec):
    """Blockwise symmetric int8: one float32 scale per ``block`` values, then int8 codes.

    A block's scale is ``max|x| / 127`` (0 for an all-zero block) and each code is
    ``round(x / scale)`` to nearest, so the error per value is at most half a scale.
    Layout: all ``ceil(n / block)`` scales (float32 little-endian), then ``n`` int8 codes.
    Streaming DiLoCo (arXiv 2501.18512) reports that low-precision exchange keeps quality;
    this is the 8-bit point between bf16 and E3M0. Code -128 is never produced and is
    refused on decode.
    """

    name = "int8"

    def __init__(self, block: int = 128) -> None:
        self.block = _check_block(block, "int8", even=False)
        self.align = self.block

    def __repr__(self) -> str:
        return f"Int8Codec(block={self.block})"

    def encoded_size(self, numel: int) -> int:
        """``4 * ceil(n / block) + n`` bytes."""
        n = _check_numel(numel)
        return 4 * (-(-n // self.block)) + n

    def encode(self, x: npt.ArrayLike, rng: np.random.Generator | None = None) -> bytes:
        """Scales then codes, as described on the class; ``rng`` is ignored."""
        a = _as_flat_f32(x, self.name, check_finite=False)
        n = a.size
        if n == 0:
            return b""
        block = self.block
        nb = -(-n // block)
        out = np.empty(4 * nb + n, dtype=np.uint8)
        scales = out[: 4 * nb].view("<f4")
        codes = out[4 * nb :].view(np.int8)
        steps, tail = _steps(n, block)
        m = max(block, min(n, _STEP // block * block))
        ubuf = np.empty(m, dtype=np.uint32)
        qbuf = np.empty(m, dtype=np.float32)
        for b0, b1 in steps:
            v0, v1 = b0 * block, b1 * block
            self._encode_step(a, a[v0:v1], scales[b0:b1], codes[v0:v1], ubuf, qbuf)
        if tail:
            c = np.empty(block, dtype=np.int8)
            self._encode_step(a, _padded_tail(a, block), scales[nb - 1 :], c, ubuf, qbuf)
            codes[n - tail :] = c[:tail]
        return out.tobytes()

    def _encode_step(
        self,
        a: F32Array,
        x: F32Array,
        scales: F32Array,
        codes: npt.NDArray[np.int8],
        ubuf: npt.NDArray[np.uint32],
        qbuf: F32Array,
    ) -> None:
        """Encode whole blocks ``x`` of the input ``a`` into the output views."""
        rows, k = len(scales), x.size
        amax = _abs_bits_max(x.view(np.uint32), rows, ubuf[:k])
        if np.maximum.reduce(amax) >= _INF_BITS:
            _refuse_nonfinite(a, self.name)
        scale = amax.view(np.float32) / np.float32(127)
        # Keep 127 * scale finite, so that decoding never produces infinity.
        with np.errstate(over="ignore"):
            big = ~np.isfinite(scale * np.float32(127))
        if big.any():
            scale[big] = np.nextafter(scale[big], np.float32(0))
        scales[...] = scale
        # An all-zero block (or one whose scale underflows to 0) gets code 0: x / inf is
        # a signed zero and rounds to code 0, as the rule's "0 where scale is 0" does.
        div = np.where(scale > 0, scale, np.float32(np.inf))
        q = qbuf[:k]
        np.divide(x.reshape(rows, -1), div[:, None], out=q.reshape(rows, -1))
        np.rint(q, out=q)
        np.clip(q, np.float32(-127), np.float32(127), out=q)
        np.copyto(codes, q, casting="unsafe")

    def _slice(self, mv: memoryview, n: int, start: int, stop: int) -> bytes:
        # The scales of blocks start/block .. ceil(stop/block), then codes start .. stop.
        nb = -(-n // self.block)
        b0, b1 = start // self.block, -(-stop // self.block)
        return bytes(mv[4 * b0 : 4 * b1]) + bytes(mv[4 * nb + start : 4 * nb + stop])

    def decode(self, data: Buffer, numel: int) -> F32Array:
        """Multiply codes by their block's scale; bad scales or code -128 raise CodecError."""
        n = _check_numel(numel)
        mv = _byte_view(data, self.name, self.encoded_size(n))
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        nb = -(-n // self.block)
        scale = np.frombuffer(mv, dtype="<f4", count=nb).astype(np.float32)
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(scale * np.float32(127)) | (scale < 0) | np.signbit(scale)
        if bad.any():
            i = int(np.argmax(bad))
            raise CodecError(
                f"int8: {int(bad.sum())} invalid block scale(s) (negative, non-finite or too "
                f"large), first in block {i} ({float(scale[i])!r})"
            )
        codes = np.frombuffer(mv, dtype=np.int8, count=n, offset=4 * nb)
        if np.minimum.reduce(codes) == -128:
            raise CodecError("int8: payload holds code -128, which the encoder never produces")
        block = self.block
        out = np.empty(n, dtype=np.float32)
        steps, tail = _steps(n, block)
        for b0, b1 in steps:
            o = out[b0 * block : b1 * block]
            np.copyto(o, codes[b0 * block : b1 * block])
            np.multiply(o.reshape(b1 - b0, block), scale[b0:b1, None], out=o.reshape(b1 - b0, -1))
        if tail:
            o = out[n - tail :]
            np.copyto(o, codes[n - tail :])
            np.multiply(o, scale[nb - 1], out=o)
        return out


# --------------------------------------------------------------------------------------
# E3M0
# --------------------------------------------------------------------------------------
class E3M0Codec(Codec):
    """Blockwise 4-bit floats with 1 sign bit, 3 exponent bits and no mantissa (E3M0).

    This is the FP4 exchange of Streaming DiLoCo (arXiv 2501.18512, section on low-precision
    communication with E3M0), with the scaling and rounding choices of
    docs/ALGORITHMS.md §2.4:

    - per block of ``block`` values a scale ``s = max|x|``, stored as bfloat16 rounded
      *up* (so every ``|x| <= s``), 0 for an all-zero block;
    - a code is ``(sign << 3) | k``: magnitude ``s * 2**-k`` for ``k = 0..6``, and ``k = 7``
      means zero (with either sign bit);
    - ``rounding="nearest"``: the level nearest in the log domain, ``k = round(-log2(|x|/s))``
      clamped to 0..6; values below ``s * 2**-7`` (the linear midpoint between zero and the
      smallest level) become zero. This is deterministic but biased;
    - ``rounding="stochastic"``: between the neighbouring levels ``lo <= |x| <= hi`` (zero
      being the level below ``s * 2**-6``) pick ``hi`` with probability
      ``(|x| - lo) / (hi - lo)``, so the decoded value equals ``x`` in expectation. Its
      ``rng`` defaults to a fresh ``np.random.default_rng()`` (OS entropy, not
      reproducible); pass a seeded generator for reproducible payloads.

    Layout: ``ceil(n / block)`` scales as little-endian uint16 (bfloat16 bits), then the
    codes packed two per byte, value ``2i`` in the low nibble and ``2i + 1`` in the high
    nibble; an odd count is padded with the zero code ``0x7`` (the decoder ignores the pad).
    Size: ``2 * ceil(n / block) + ceil(n / 2)`` bytes, 4.125 bits per value at block 128.
    Both roundings share this wire format; only the encoder differs.
    """

    def __init__(self, block: int = 128, rounding: str = "nearest") -> None:
        self.block = _check_block(block, "e3m0", even=True)
        if rounding not in ROUNDINGS:
            raise ConfigError(f"e3m0: rounding must be one of {ROUNDINGS}, not {rounding!r}")
        self.rounding = rounding
        self.align = self.block
        self.name = "e3m0" if rounding == "nearest" else "e3m0-sr"

    def __repr__(self) -> str:
        return f"E3M0Codec(block={self.block}, rounding={self.rounding!r})"

    def encoded_size(self, numel: int) -> int:
        """``2 * ceil(n / block) + ceil(n / 2)`` bytes."""
        n = _check_numel(numel)
        return 2 * (-(-n // self.block)) + (n + 1) // 2

    # -- encoding ------------------------------------------------------------------------
    def encode(self, x: npt.ArrayLike, rng: np.random.Generator | None = None) -> bytes:
        """Scales then packed 4-bit codes, as described on the class."""
        a = _as_flat_f32(x, self.name, check_finite=False)
        n = a.size
        if n == 0:
            return b""
        block = self.block
        nb = -(-n // block)
        out = np.empty(2 * nb + (n + 1) // 2, dtype=np.uint8)
        scales = out[: 2 * nb].view("<u2")
        packed = out[2 * nb :]
        gen = None
        if self.rounding == "stochastic":
            gen = rng if rng is not None else np.random.default_rng()
        steps, tail = _steps(n, block)
        work = _E3M0Work(max(block, min(n, _STEP // block * block)), gen is not None)
        for b0, b1 in steps:
            v0, v1 = b0 * block, b1 * block
            self._encode_step(a, a[v0:v1], b0, scales[b0:b1], packed[v0 // 2 : v1 // 2], gen, work)
        if tail:
            # The pad of the last block is zero (code 7) and block is even, so the bytes
            # of the first n + n%2 codes already hold the pad nibble of an odd count.
            p = np.empty(block // 2, dtype=np.uint8)
            self._encode_step(a, _padded_tail(a, block), nb - 1, scales[nb - 1 :], p, gen, work)
            packed[(n - tail) // 2 :] = p[: (tail + 1) // 2]
        return out.tobytes()

    def _encode_step(
        self,
        a: F32Array,
        x: F32Array,
        first: int,
        scales: npt.NDArray[np.uint16],
        packed: npt.NDArray[np.uint8],
        gen: np.random.Generator | None,
        w: _E3M0Work,
    ) -> None:
        """Encode whole blocks ``x`` (from block ``first`` of ``a``) into the output views.

        Per block ``s = max|x|`` rounded up to bfloat16, ``r = |x| / s`` in float32 (0 for an
        all-zero block), then the code of :class:`E3M0Codec`'s rule computed on the bits
        ``rb = (E << 23) | M`` of ``r``.
        """
        rows, k = len(scales), x.size
        rb = w.rb[:k]
        amax = _abs_bits_max(x.view(np.uint32), rows, rb)  # rb holds |x| for now
        up = (amax >> _SHIFT_HALF) + ((amax & _U32(0xFFFF)) != 0)
        if np.maximum.reduce(up) >= 0x7F80:
            _refuse_nonfinite(a, self.name)
            i = int(np.argmax(up >= 0x7F80))
            raise CodecError(
                f"e3m0: block {first + i} has max |x| = {float(amax.view(np.float32)[i])!r}, "
                "beyond the largest bfloat16 scale"
            )
        scales[...] = up
        # An all-zero block has s = 0 and r = 0; dividing its zeros by 1 gives that r.
        div = (np.where(up > 0, up, _U32(0x3F80)) << _SHIFT_HALF).view(np.float32)
        r = rb.view(np.float32)
        np.divide(r.reshape(rows, -1), div[:, None], out=r.reshape(rows, -1))
        code, zero, t = w.code[:k], w.zero[:k], w.t[:k]
        if gen is None:
            # k = round(-log2 r) = 127 - q with q = (rb + _NEAREST_ADD) >> 23, at most 6;
            # r < 2^-7 is zero (code 7 = 6 + 1).
            np.less(rb, _R7_BITS, out=zero)
            np.add(rb, _NEAREST_ADD, out=t)
            np.right_shift(t, _SHIFT_EXP, out=t)
            np.copyto(code, t, casting="unsafe")
            np.subtract(np.uint8(127), code, out=code)
            np.minimum(code, w.six[:k], out=code)
            np.add(code, zero, out=code)
        else:
            u = w.u[:k]
            gen.random(dtype=np.float32, out=u)
            # For r in [2^-6, 1]: lo = 2^(E-128) (code 128-E), hi = 2^(E-127) (code 127-E)
            # and P(hi) = (r - lo) / (hi - lo) = M / 2^23, the fraction of r's mantissa
            # (exact in float32). Below 2^-6: zero or s*2^-6 with P(s*2^-6) = 64 r. So
            # code = min(127 - E, 7) - up, up = u < M / 2^23 or u < 64 r. As 64 r >= 1 > u
            # from 2^-6 on, up = (u < 64 r) & ((u < M / 2^23) | (r < 2^-6)).
            v = w.v[:k]
            vb = v.view(np.uint32)
            np.bitwise_and(rb, _MANT_MASK, out=vb)
            np.bitwise_or(vb, _ONE_BITS, out=vb)
            np.subtract(v, np.float32(1.0), out=v)  # M / 2^23, exactly
            up_frac, up_low = w.up_frac[:k], w.neg[:k]
            np.less(u, v, out=up_frac)
            np.multiply(r, np.float32(64.0), out=v)
            np.less(u, v, out=up_low)
            np.less(rb, _R6_BITS, out=zero)
            np.logical_or(up_frac, zero, out=zero)
            np.logical_and(zero, up_low, out=zero)  # zero now holds "up"
            np.right_shift(rb, _SHIFT_EXP, out=t)
            np.copyto(code, t, casting="unsafe")
            np.subtract(np.uint8(127), code, out=code)
            np.minimum(code, w.seven[:k], out=code)
            np.subtract(code, zero, out=code)
            np.equal(code, w.seven[:k], out=zero)
        # The sign bit goes on nonzero codes only: x < 0 and not code 7 (-0.0 is code 7).
        neg = w.neg[:k]
        np.less(x, np.float32(0.0), out=neg)
        np.greater(neg, zero, out=neg)
        sign = w.sign[:k]
        np.multiply(neg.view(np.uint8), w.eight[:k], out=sign)
        np.bitwise_or(code, sign, out=code)
        # Pack: as little-endian uint16 pairs c0 | c1 << 8, the low byte of
        # (pair | pair >> 4) is c0 | c1 << 4.
        pairs = code.view("<u2")
        p16 = w.p16[: k // 2]
        np.right_shift(pairs, np.uint16(4), out=p16)
        np.bitwise_or(p16, pairs, out=p16)
        np.copyto(packed, p16, casting="unsafe")

    # -- slicing -------------------------------------------------------------------------
    def _slice(self, mv: memoryview, n: int, start: int, stop: int) -> bytes:
        # The scales of blocks start/block .. ceil(stop/block), then the packed codes. The
        # block size is even, so an aligned start begins a byte; a stop inside a byte is
        # the odd end of the whole vector, and that byte's high nibble is the pad an
        # encoding of the slice alone would carry as well.
        nb = -(-n // self.block)
        b0, b1 = start // self.block, -(-stop // self.block)
        codes = 2 * nb
        return bytes(mv[2 * b0 : 2 * b1]) + bytes(mv[codes + start // 2 : codes + (stop + 1) // 2])

    # -- decoding ------------------------------------------------------------------------
    def decode(self, data: Buffer, numel: int) -> F32Array:
        """Expand codes to ``±s * 2**-k``; non-finite or negative scales raise CodecError."""
        n = _check_numel(numel)
        # the payload's length is checked before the output is allocated: a hostile or
        # broken count (10**12, say) must fail as a CodecError, not as a MemoryError
        _byte_view(data, self.name, self.encoded_size(n))
        out = np.empty(n, dtype=np.float32)
        self.decode_into(data, n, out)
        return out

    def decode_into(self, data: Buffer, numel: int, out: F32Array) -> None:
        n = _check_numel(numel)
        _check_out(out, n)
        mv = _byte_view(data, self.name, self.encoded_size(n))
        if n == 0:
            return
        nb = -(-n // self.block)
        sbits = np.frombuffer(mv, dtype="<u2", count=nb).astype(np.uint32)
        bad = ((sbits & 0x7F80) == 0x7F80) | ((sbits & 0x8000) != 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise CodecError(
                f"e3m0: {int(bad.sum())} invalid block scale(s) (negative or non-finite), "
                f"first in block {i} (bits 0x{int(sbits[i]):04x})"
            )
        s = (sbits << 16).view(np.float32)
        # Each byte gives its two unscaled values (_E3M0_PAIRS), then the block's scale
        # multiplies them: s * 2^-k, -(s * 2^-k), +0.0 for both zero codes, exactly as a
        # table of s * 2^-k per block would give.
        packed = np.frombuffer(mv, dtype=np.uint8, count=(n + 1) // 2, offset=2 * nb)
        block = self.block
        steps, tail = _steps(n, block)
        for b0, b1 in steps:
            o = out[b0 * block : b1 * block]
            p = packed[b0 * block // 2 : b1 * block // 2]
            np.take(_E3M0_PAIRS, p, out=o.view(np.uint64), mode="clip")
            np.multiply(o.reshape(b1 - b0, -1), s[b0:b1, None], out=o.reshape(b1 - b0, -1))
        if tail:
            # the pad nibble of an odd count is decoded into t and dropped
            t = np.empty(tail + (tail & 1), dtype=np.float32)
            np.take(_E3M0_PAIRS, packed[(n - tail) // 2 :], out=t.view(np.uint64), mode="clip")
            np.multiply(t[:tail], s[nb - 1], out=out[n - tail :])


class _E3M0Work:
    """Scratch buffers of one :meth:`E3M0Codec.encode` call, ``size`` values each."""

    def __init__(self, size: int, stochastic: bool) -> None:
        self.rb = np.empty(size, dtype=np.uint32)
        self.t = np.empty(size, dtype=np.uint32)
        self.code = np.empty(size, dtype=np.uint8)
        self.zero = np.empty(size, dtype=np.bool_)
        self.neg = np.empty(size, dtype=np.bool_)
        self.sign = np.empty(size, dtype=np.uint8)
        self.p16 = np.empty(size // 2, dtype=np.uint16)
        # Array operands (not scalars): numpy vectorises uint8 minimum/multiply only then.
        self.six = np.full(size, 6, dtype=np.uint8)
        self.seven = np.full(size, _E3M0_ZERO, dtype=np.uint8)
        self.eight = np.full(size, 8, dtype=np.uint8)
        if stochastic:
            self.u = np.empty(size, dtype=np.float32)
            self.v = np.empty(size, dtype=np.float32)
            self.up_frac = np.empty(size, dtype=np.bool_)


# --------------------------------------------------------------------------------------
# factory and helpers
# --------------------------------------------------------------------------------------
def make_codec(name: str, *, block: int = 128, rounding: str = "nearest") -> Codec:
    """Build a codec by name (one of :data:`CODEC_NAMES`, case-insensitive).

    ``block`` applies to ``int8`` and the E3M0 codecs and is ignored by ``fp32``/``bf16``.
    ``rounding`` applies to ``e3m0`` (``"nearest"`` or ``"stochastic"``); ``"e3m0-sr"`` is
    E3M0 with stochastic rounding whatever ``rounding`` says, as in Streaming DiLoCo
    (arXiv 2501.18512) FP4 exchange with an unbiased quantizer. ``make_codec(c.name,
    block=c.block)`` rebuilds an equivalent codec. Unknown names raise :class:`ConfigError`.
    """
    if not isinstance(name, str):
        raise ConfigError(f"codec name must be a string, not {name!r}")
    key = name.strip().lower()
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding must be one of {ROUNDINGS}, not {rounding!r}")
    if key not in ("e3m0", "e3m0-sr") and rounding != "nearest":
        raise ConfigError(f"codec {key!r} has no {rounding!r} rounding; only e3m0 does")
    if key == "fp32":
        return Fp32Codec()
    if key == "bf16":
        return Bf16Codec()
    if key == "int8":
        return Int8Codec(block)
    if key == "e3m0":
        return E3M0Codec(block, rounding)
    if key == "e3m0-sr":
        return E3M0Codec(block, "stochastic")
    raise ConfigError(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}")


def bits_per_value(codec: Codec, numel: int = 1 << 20) -> float:
    """Average wire bits per value of ``codec`` for a vector of ``numel`` values.

    At block 128, E3M0 gives 4.125 bits (Streaming DiLoCo, arXiv 2501.18512, FP4 exchange
    with one 16-bit scale per block).
    """
    n = _check_numel(numel)
    if n == 0:
        raise ConfigError("bits_per_value needs numel > 0")
    return 8.0 * codec.encoded_size(n) / n

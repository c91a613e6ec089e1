"""Wire codecs: how a flat float32 vector is turned into bytes and back.

Four formats, from lossless to 4 bits per value:

- ``fp32``  raw little-endian float32;
- ``bf16``  bfloat16, rounded to nearest even (2 bytes per value);
- ``int8``  blockwise symmetric int8 with one float32 scale per block;
- ``e3m0``  blockwise 4-bit floats with a sign bit, a 3-bit exponent and no mantissa, the
  low-precision exchange of Streaming DiLoCo (Douillard et al., arXiv 2501.18512, section
  on FP4 / E3M0 communication). The paper leaves scaling and rounding open; our choices are
  written in ALGORITHMS.md 2.4 and in :class:`E3M0Codec`. ``e3m0-sr`` is the same wire
  format encoded with stochastic (unbiased) rounding.

A payload carries no header: the message around it names the codec and the number of
values, and :meth:`Codec.decode` checks that the byte count matches exactly. Every codec
refuses NaN and infinity on both sides, so a broken or hostile peer cannot smuggle them
into an average.

The blockwise codecs have an alignment (their block size): a vector split at multiples of
it and encoded piece by piece decodes to exactly the same values as the whole vector
encoded at once, which is what lets a reduce-scatter hand out chunks of a vector.
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


# --------------------------------------------------------------------------------------
# shared checks
# --------------------------------------------------------------------------------------
def _describe_nonfinite(a: np.ndarray) -> str:
    bad = ~np.isfinite(a)
    return f"{int(bad.sum())} non-finite value(s), first at flat index {int(np.argmax(bad))}"


def _as_flat_f32(x: npt.ArrayLike, codec: str) -> F32Array:
    """Flatten ``x`` in C order to a contiguous float32 vector, refusing NaN and infinity."""
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise CodecError(f"{codec}: can only encode floating-point values, not dtype {a.dtype}")
    a = a.reshape(-1)
    if a.size and not np.isfinite(a).all():
        raise CodecError(f"{codec}: input has {_describe_nonfinite(a)} (NaN or ±inf)")
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


def _pad_blocks(a: F32Array, block: int) -> F32Array:
    """``a`` as a (blocks, block) matrix, the last block padded with zeros."""
    nb = -(-a.size // block)
    if nb * block == a.size:
        return a.reshape(nb, block)
    out = np.zeros(nb * block, dtype=np.float32)
    out[: a.size] = a
    return out.reshape(nb, block)


# --------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------
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
        if n and not np.isfinite(out).all():
            raise CodecError(f"{self.name}: payload has {_describe_nonfinite(out)}")
        return out


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
        a = _as_flat_f32(x, self.name)
        bits = a.view(np.uint32)
        # Adding 0x7FFF plus the lowest kept bit, then truncating, rounds to nearest even.
        # Finite inputs cannot overflow uint32 here (the largest is 0xFF7FFFFF + 0x8000).
        hi = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        over = (hi & 0x7F80) == 0x7F80
        if over.any():
            i = int(np.argmax(over))
            raise CodecError(
                f"bf16: {int(over.sum())} value(s) overflow bfloat16, first at flat index {i} "
                f"({float(a[i])!r})"
            )
        return hi.astype("<u2", copy=False).tobytes()

    def _slice(self, mv: memoryview, n: int, start: int, stop: int) -> bytes:
        return bytes(mv[2 * start : 2 * stop])

    def decode(self, data: Buffer, numel: int) -> F32Array:
        """Expand each bfloat16 exactly to float32, refusing NaN and infinity."""
        n = _check_numel(numel)
        mv = _byte_view(data, self.name, 2 * n)
        hi = np.frombuffer(mv, dtype="<u2", count=n).astype(np.uint32)
        out = (hi << 16).view(np.float32)
        if n and not np.isfinite(out).all():
            raise CodecError(f"{self.name}: payload has {_describe_nonfinite(out)}")
        return out


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
        a = _as_flat_f32(x, self.name)
        n = a.size
        if n == 0:
            return b""
        m = _pad_blocks(a, self.block)
        scale = (np.abs(m).max(axis=1) / np.float32(127)).astype(np.float32)
        # Keep 127 * scale finite, so that decoding never produces infinity.
        with np.errstate(over="ignore"):
            big = ~np.isfinite(scale * np.float32(127))
        if big.any():
            scale[big] = np.nextafter(scale[big], np.float32(0))
        q = np.zeros(m.shape, dtype=np.float32)
        np.divide(m, scale[:, None], out=q, where=scale[:, None] > 0)
        codes = np.clip(np.rint(q), -127, 127).astype(np.int8).reshape(-1)[:n]
        payload: bytes = scale.astype("<f4", copy=False).tobytes() + codes.tobytes()
        return payload

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
        if (codes == -128).any():
            raise CodecError("int8: payload holds code -128, which the encoder never produces")
        out = np.zeros(nb * self.block, dtype=np.float32)
        out[:n] = codes
        out.reshape(nb, self.block)[...] *= scale[:, None]
        return out[:n]


# --------------------------------------------------------------------------------------
# E3M0
# --------------------------------------------------------------------------------------
class E3M0Codec(Codec):
    """Blockwise 4-bit floats with 1 sign bit, 3 exponent bits and no mantissa (E3M0).

    This is the FP4 exchange of Streaming DiLoCo (arXiv 2501.18512, section on low-precision
    communication with E3M0), with the scaling and rounding choices of ALGORITHMS.md 2.4:

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
    @staticmethod
    def _scales(m: F32Array) -> tuple[npt.NDArray[np.uint16], F32Array]:
        """Per-row max|x| rounded up to bfloat16: (bits, value as float32)."""
        absmax = np.abs(m).max(axis=1)
        bits = absmax.view(np.uint32)
        up = (bits >> 16) + ((bits & 0xFFFF) != 0).astype(np.uint32)
        if (up >= 0x7F80).any():
            i = int(np.argmax(up >= 0x7F80))
            raise CodecError(
                f"e3m0: block {i} has max |x| = {float(absmax[i])!r}, beyond the largest "
                "bfloat16 scale"
            )
        s = (up << 16).view(np.float32)
        return up.astype(np.uint16), s

    def _codes(self, m: F32Array, s: F32Array, rng: np.random.Generator | None) -> np.ndarray:
        """Exponent codes 0..7 (7 = zero) for a (blocks, block) matrix with scales ``s``."""
        r = np.zeros(m.shape, dtype=np.float32)
        s_col = s[:, None]
        np.divide(np.abs(m), s_col, out=r, where=s_col > 0)  # r in [0, 1]
        mant, expo = np.frexp(r)  # r = mant * 2**expo, mant in [0.5, 1) (0 for r = 0)
        k: npt.NDArray[np.int32]
        if self.rounding == "nearest":
            # round(-log2 r) = -expo + (1 if log2(mant) < -0.5 else 0)
            k = (-expo + (mant < _SQRT_HALF_UP)).astype(np.int32)
            np.minimum(k, _E3M0_LEVELS - 1, out=k)
            k[r < np.float32(2.0**-7)] = _E3M0_ZERO
        else:
            gen = rng if rng is not None else np.random.default_rng()
            u = gen.random(r.shape, dtype=np.float32)
            # For r in [2^-6, 1]: lo = 2^(expo-1) (code 1-expo), hi = 2^expo (code -expo),
            # P(hi) = (r - lo) / (hi - lo) = 2*mant - 1 (exact in float32).
            k = (1 - expo - (u < 2 * mant - 1)).astype(np.int32)
            low = r < np.float32(2.0**-6)
            # Below the smallest level: zero or s*2^-6, P(s*2^-6) = r / 2^-6.
            k[low] = np.where(u[low] < r[low] * np.float32(64.0), 6, _E3M0_ZERO)
        return k

    def encode(self, x: npt.ArrayLike, rng: np.random.Generator | None = None) -> bytes:
        """Scales then packed 4-bit codes, as described on the class."""
        a = _as_flat_f32(x, self.name)
        n = a.size
        if n == 0:
            return b""
        m = _pad_blocks(a, self.block)
        bits, s = self._scales(m)
        k = self._codes(m, s, rng)
        neg = np.signbit(m) & (k != _E3M0_ZERO)
        codes = (k.astype(np.uint8) | (neg.astype(np.uint8) << 3)).reshape(-1)
        # The padded tail of the last block is zero (code 7), and block is even, so the
        # first n + n%2 codes already include the pad of an odd count.
        codes = codes[: n + (n & 1)]
        packed = codes[0::2] | (codes[1::2] << 4)
        payload: bytes = bits.astype("<u2", copy=False).tobytes() + packed.tobytes()
        return payload

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
        mv = _byte_view(data, self.name, self.encoded_size(n))
        if n == 0:
            return np.zeros(0, dtype=np.float32)
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
        # Table of the 16 code values per block: +s*2^-k, then the negated ones; both zero
        # codes give +0.0.
        pow2 = np.array([2.0**-j for j in range(_E3M0_LEVELS)] + [0.0], dtype=np.float32)
        mags = s[:, None] * pow2[None, :]
        table = np.concatenate([mags, -mags], axis=1)
        table[:, 8 + _E3M0_ZERO] = 0.0
        packed = np.frombuffer(mv, dtype=np.uint8, count=(n + 1) // 2, offset=2 * nb)
        codes = np.full(nb * self.block, _E3M0_ZERO, dtype=np.uint8)
        pairs = codes[: 2 * packed.size].reshape(-1, 2)
        pairs[:, 0] = packed & 0x0F
        pairs[:, 1] = packed >> 4
        if n & 1:
            codes[n] = _E3M0_ZERO  # ignore the pad nibble
        out = np.take_along_axis(table, codes.reshape(nb, self.block), axis=1)
        return out.reshape(-1)[:n]


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

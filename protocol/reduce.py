"""Reduction of several peers' encoded contributions (docs/ALGORITHMS.md §2.5 and §3).

The all-reduce of Streaming DiLoCo's low-precision exchange (arXiv 2501.18512) must not
compound quantization error. Each peer encodes its pseudo-gradient once; in the
reduce-scatter, the owner of a chunk dequantizes every peer's part, takes the
token-weighted mean in fp32 and encodes that mean exactly once; the all-gather then hands
the encoded mean to everyone, who dequantizes it. Partial sums are never re-quantized hop
by hop. :func:`chunk_bounds` cuts a vector into owners' chunks at the codec's alignment so
that chunk-wise and whole-vector encodings agree, and :func:`allreduce_bytes_per_peer`
counts what that costs one peer on the wire.

Radial-directional averaging (RDA, Decoupled DiLoCo, arXiv 2604.21428) averages the norms
and the unit directions of the peers' updates separately: a plain mean of nearly
orthogonal vectors shrinks like ``1/sqrt(M)``, RDA keeps the typical length. Each peer
sends its unit direction (:func:`rda_split`) through the ordinary reduction above and its
norm as one scalar beside it; after the all-gather every peer computes the token-weighted
mean norm (:func:`rda_mean_norm`) and rescales the averaged direction locally
(:func:`rda_combine`). Those steps are deterministic functions of data every member holds
identically, so all members end with the same vector.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from atoll.protocol.codecs import Codec
from atoll.protocol.errors import CodecError, ConfigError, RejectedContribution, RejectedInput
from atoll.protocol.robust import RobustRule, aggregate

__all__ = [
    "Contribution",
    "allreduce_bytes_per_peer",
    "chunk_bounds",
    "decode_all",
    "rda_combine",
    "rda_mean_norm",
    "rda_split",
    "reduce_encoded",
    "weighted_mean",
]

F32Array = npt.NDArray[np.float32]

_NORM_STEP = 1 << 20  # values per slice when norms and rescaling run in float64


@dataclass(frozen=True, slots=True)
class Contribution:
    """One peer's encoded part of a reduction and its weight.

    ``weight`` is the number of tokens the peer processed since the fragment's last sync
    (token-weighted merging as in Decoupled DiLoCo, arXiv 2604.21428); it must be finite
    and > 0. It is checked by :func:`weighted_mean`, not here, so that a contribution
    received from the network can be built first and rejected with its index afterwards.
    """

    payload: bytes
    weight: float


def _check_size(numel: int, what: str) -> int:
    try:
        n = operator.index(numel)
    except TypeError:
        raise ConfigError(f"{what} must be an integer, not {numel!r}") from None
    if n < 0:
        raise ConfigError(f"{what} must be >= 0, not {n}")
    return n


def _weights(contributions: Sequence[Contribution]) -> npt.NDArray[np.float64]:
    """Validated weights, normalised to sum to 1 (computed without overflow)."""
    if len(contributions) == 0:
        raise ConfigError("a reduction needs at least one contribution")
    w = np.empty(len(contributions), dtype=np.float64)
    for i, c in enumerate(contributions):
        wi = c.weight
        if isinstance(wi, bool) or not isinstance(wi, int | float | np.integer | np.floating):
            raise RejectedContribution(f"contribution {i}: weight {wi!r} is not a number")
        f = float(wi)
        if not math.isfinite(f) or f <= 0:
            raise RejectedContribution(f"contribution {i}: weight must be finite and > 0, not {f}")
        w[i] = f
    w /= w.max()  # in (0, 1]: the sum cannot overflow
    w /= w.sum()
    return w


def weighted_mean(
    contributions: Sequence[Contribution],
    codec: Codec,
    numel: int,
    decoded: Sequence[F32Array | None] | None = None,
    rule: RobustRule | None = None,
) -> F32Array:
    """Token-weighted fp32 mean of the decoded contributions, or a robust rule's result.

    Every payload is decoded with ``codec`` (``numel`` values each; ``decoded[i]``, when
    given, is taken as contribution ``i``'s decoding instead: a caller that decoded the
    payloads to check them need not decode them again) and accumulated in
    float32 as ``sum_i (w_i / W) * x_i`` with ``W = sum_i w_i`` (Streaming DiLoCo,
    arXiv 2501.18512: summation stays in fp32; token weights as in Decoupled DiLoCo,
    arXiv 2604.21428). Every decoded contribution is held at once (the sum runs slice by
    slice over all of them).

    ``rule`` (default: the plain mean above) selects a robust aggregation instead
    (:func:`robust.aggregate`: coordinate-wise trimmed mean or centered clipping,
    docs/ALGORITHMS.md §5.3), applied to the decoded contributions in the order given.

    Raises:
        ConfigError: no contributions (the caller must check its quorum first), or a
            negative ``numel``.
        RejectedContribution: a weight that is not finite and > 0; the message names the
            contribution's index.
        CodecError: a payload that does not decode; the message starts with
            ``"contribution <index>:"``.
        RejectedInput: the result overflowed float32.
    """
    n = _check_size(numel, "numel")
    _weights(contributions)  # validates every weight, naming a bad one
    xs = decode_all(contributions, codec, n, decoded)
    acc = aggregate(xs, [float(c.weight) for c in contributions], rule or RobustRule())
    # all finite <=> max and min finite (a NaN propagates into both); no bool temporary
    if n and not (np.isfinite(np.maximum.reduce(acc)) and np.isfinite(np.minimum.reduce(acc))):
        raise RejectedInput("the weighted mean overflowed float32")
    return acc


def decode_all(
    contributions: Sequence[Contribution],
    codec: Codec,
    numel: int,
    decoded: Sequence[F32Array | None] | None = None,
) -> list[F32Array]:
    """Every contribution decoded (``numel`` float32 values each), ``decoded[i]`` used
    where given; errors as in :func:`weighted_mean`."""
    n = _check_size(numel, "numel")
    xs: list[F32Array] = []
    for i, c in enumerate(contributions):
        given = decoded[i] if decoded is not None else None
        if given is not None:
            if given.dtype != np.float32 or given.shape != (n,):
                raise ConfigError(f"decoded contribution {i} must be {n} float32 values")
            xs.append(given)
        else:
            try:
                xs.append(codec.decode(c.payload, n))
            except CodecError as e:
                raise CodecError(f"contribution {i}: {e}") from e
    return xs


def reduce_encoded(
    contributions: Sequence[Contribution],
    codec: Codec,
    numel: int,
    rng: np.random.Generator | None = None,
    decoded: Sequence[F32Array | None] | None = None,
    rule: RobustRule | None = None,
) -> bytes:
    """What a chunk's owner sends back: :func:`weighted_mean`, encoded once with ``codec``.

    The mean is quantized a single time, after the fp32 sum, never hop by hop
    (docs/ALGORITHMS.md §2.5; Streaming DiLoCo, arXiv 2501.18512). ``rng`` is passed to the
    encoder (stochastic rounding only); ``decoded`` and ``rule`` to :func:`weighted_mean`.
    Errors are those of :func:`weighted_mean`.
    """
    mean = weighted_mean(contributions, codec, numel, decoded, rule)
    payload: bytes = codec.encode(mean, rng=rng)
    return payload


def chunk_bounds(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into ``parts`` contiguous ``(start, end)`` chunks for ownership.

    Every boundary is a multiple of ``align`` except the final end ``numel``, so chunks of a
    blockwise codec encode independently (use ``align=codec.align``). The vector is counted
    in units of ``align`` values (the last one possibly partial); each chunk gets
    ``floor(units / parts)`` units and the last ``units % parts`` chunks one more, so they
    hold the partial unit and all chunk sizes lie within ``align`` of each other. When there
    are fewer units than parts, the leading chunks are empty (``(0, 0)``). Used for the
    reduce-scatter of Streaming DiLoCo's all-reduce (arXiv 2501.18512).
    """
    n = _check_size(numel, "numel")
    p = _check_size(parts, "parts")
    a = _check_size(align, "align")
    if p < 1:
        raise ConfigError("parts must be >= 1")
    if a < 1:
        raise ConfigError("align must be >= 1")
    units = -(-n // a)
    base, extra = divmod(units, p)
    bounds: list[tuple[int, int]] = []
    start_units = 0
    for i in range(p):
        size = base + (1 if i >= p - extra else 0)
        end_units = start_units + size
        bounds.append((min(start_units * a, n), min(end_units * a, n)))
        start_units = end_units
    return bounds


def allreduce_bytes_per_peer(encoded_size: int, peers: int) -> int:
    """Bytes one peer sends in a bandwidth-optimal reduce-scatter plus all-gather.

    In a ring or butterfly all-reduce over ``peers`` members each peer sends
    ``(peers - 1) / peers`` of the encoded vector in each of the two phases, so
    ``2 * (peers - 1) / peers * encoded_size`` bytes, rounded up to a whole byte; 0 when
    alone. This is the per-peer traffic the Streaming DiLoCo bandwidth estimates
    (arXiv 2501.18512) are stated in.
    """
    size = _check_size(encoded_size, "encoded_size")
    p = _check_size(peers, "peers")
    if p < 1:
        raise ConfigError("peers must be >= 1")
    return -(-2 * (p - 1) * size // p)


# --------------------------------------------------------------------------------------
# radial-directional averaging
# --------------------------------------------------------------------------------------
def _finite_f32(x: npt.ArrayLike, what: str) -> F32Array:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise RejectedInput(f"{what} must hold floating-point values, not dtype {a.dtype}")
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    if a.size and not np.isfinite(a).all():
        raise RejectedInput(f"{what} has {int((~np.isfinite(a)).sum())} non-finite value(s)")
    return a


def _norm(a: F32Array) -> float:
    """Euclidean norm, summed in float64 slice by slice (no overflow, little memory)."""
    flat = a.reshape(-1)
    total = 0.0
    for i in range(0, flat.size, _NORM_STEP):
        part = flat[i : i + _NORM_STEP].astype(np.float64)
        total += float(np.dot(part, part))
    return math.sqrt(total)


def _scaled(a: F32Array, factor: float) -> F32Array:
    """``a * factor`` computed in float64 slice by slice, returned as float32."""
    out = np.empty(a.shape, dtype=np.float32)
    src = a.reshape(-1)
    dst = out.reshape(-1)
    with np.errstate(over="ignore"):
        for i in range(0, src.size, _NORM_STEP):
            dst[i : i + _NORM_STEP] = src[i : i + _NORM_STEP].astype(np.float64) * factor
    if out.size and not np.isfinite(out).all():
        raise RejectedInput("rescaled vector overflowed float32")
    return out


def rda_split(delta: npt.ArrayLike) -> tuple[F32Array, float]:
    """Split ``delta`` into its unit direction and its norm, for RDA.

    Returns ``(delta / ||delta||, ||delta||)`` with the direction as float32 in the shape of
    ``delta``; a zero vector gives ``(zeros, 0.0)``. The peer sends the direction through
    the ordinary encoded reduction and the norm as a scalar (radial-directional averaging,
    Decoupled DiLoCo, arXiv 2604.21428). Non-finite input raises :class:`RejectedInput`.
    """
    a = _finite_f32(delta, "delta")
    norm = _norm(a)
    if norm == 0.0:
        return np.zeros(a.shape, dtype=np.float32), 0.0
    return _scaled(a, 1.0 / norm), norm


def rda_mean_norm(norms: Sequence[float], weights: Sequence[float]) -> float:
    """Token-weighted mean of the peers' norms, the radial half of RDA (arXiv 2604.21428).

    Norms must be finite and >= 0 and weights finite and > 0, else
    :class:`RejectedContribution` naming the index; empty input or a length mismatch
    raises :class:`ConfigError`.
    """
    if len(norms) != len(weights):
        raise ConfigError(f"{len(norms)} norms but {len(weights)} weights")
    if len(norms) == 0:
        raise ConfigError("rda_mean_norm needs at least one norm")
    values = np.empty(len(norms), dtype=np.float64)
    for i, v in enumerate(norms):
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        if not math.isfinite(f) or f < 0:
            raise RejectedContribution(f"contribution {i}: norm must be finite and >= 0, not {v!r}")
        values[i] = f
    w = _weights([Contribution(b"", wi) for wi in weights])
    return float(np.dot(w, values))


def rda_combine(direction_mean: npt.ArrayLike, mean_norm: float) -> F32Array:
    """Recombine RDA's halves: ``mean_norm * direction_mean / ||direction_mean||``.

    ``direction_mean`` is the (decoded) weighted mean of the peers' unit directions and
    ``mean_norm`` the weighted mean of their norms (Decoupled DiLoCo, arXiv 2604.21428).
    The result is float32 in the shape of ``direction_mean``; it is all zeros when the
    direction mean or ``mean_norm`` is zero. The norm is accumulated in float64 in a fixed
    order, so every member that holds the same inputs computes the same vector.
    ``mean_norm`` must be finite and >= 0 (:class:`RejectedInput` otherwise).
    """
    a = _finite_f32(direction_mean, "direction_mean")
    m = float(mean_norm)
    if not math.isfinite(m) or m < 0:
        raise RejectedInput(f"mean_norm must be finite and >= 0, not {mean_norm}")
    norm = _norm(a)
    if norm == 0.0 or m == 0.0:
        return np.zeros(a.shape, dtype=np.float32)
    return _scaled(a, m / norm)

"""Group-relative checks of the parts a chunk's owner is about to reduce (ALGORITHMS §5.3).

Before this module, a part only had to decode with the agreed codec and size, be finite
and carry a finite positive weight (:mod:`atoll.protocol.allreduce`); a part scaled by
10^6, or a weight inflated a thousandfold, went into the mean. These checks compare each
part with the rest of its group once every part of a chunk is in:

- **norm**: a part's norm must not exceed ``norm_factor`` times the lower median of the
  group's part norms. The owner sees only its chunk of each member's vector, so the norms
  are *per chunk*: a part that is sane over the whole vector but concentrated in one chunk
  is judged where it is concentrated. Chunks shorter than ``min_values`` skip the norm
  check (the norms of a few values are too noisy to accuse anyone by), and so does a
  group whose median norm is 0 (there is no scale to compare with).
- **weight**: a part's token weight must not exceed ``weight_factor`` times the lower
  median weight of the group, nor the sender's cap when the caller passes one (e.g. from
  the sender's measured throughput).

The lower median of ``n`` values is one of them (index ``(n - 1) // 2`` in sorted order),
so it is an honest value while at most ``n - 1 - (n - 1) // 2`` parts are too large,
i.e. 1 of 3, 2 of 4 or 5, 3 of 6 or 7, 4 of 8. Groups smaller than ``min_group`` (default
3) are not checked: between two parts nobody can tell which one lies.

A failed check names the peer (:class:`Violation`) so that the round driver can strike
it; :func:`check_parts` raises :class:`~atoll.protocol.errors.RejectedContribution`.
Every member sends every owner the same weight (owners compare total weights), so all
owners reach the same verdict on weights; norms differ per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from atoll.protocol.errors import ConfigError, RejectedContribution

__all__ = ["PartChecks", "Violation", "check_parts", "part_norm", "violations"]

F32Array = npt.NDArray[np.float32]

_STEP = 1 << 20  # values per slice of a norm computed in float64


def _positive(name: str, value: object, *, allow_inf: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, not {value!r}")
    f = float(value)
    if math.isnan(f) or f <= 0 or (math.isinf(f) and not allow_inf):
        raise ConfigError(f"{name} must be > 0, not {value!r}")


@dataclass(frozen=True, slots=True)
class PartChecks:
    """Bounds every part must meet relative to its group before a chunk is reduced.

    ``norm_factor``: a part's norm (over the owner's chunk) may be at most this many times
    the lower median of the group's part norms; ``inf`` turns the check off.
    ``weight_factor``: a part's token weight may be at most this many times the lower
    median weight of the group; ``inf`` turns the check off.
    ``min_values``: chunks with fewer values skip the norm check.
    ``min_group``: groups with fewer parts are not checked at all (at least 2).
    """

    norm_factor: float = 10.0
    weight_factor: float = 10.0
    min_values: int = 128
    min_group: int = 3

    def __post_init__(self) -> None:
        _positive("norm_factor", self.norm_factor, allow_inf=True)
        _positive("weight_factor", self.weight_factor, allow_inf=True)
        if self.norm_factor < 1 or self.weight_factor < 1:
            raise ConfigError("norm_factor and weight_factor must be >= 1 (the median passes)")
        for name, v in (("min_values", self.min_values), ("min_group", self.min_group)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, not {v!r}")
        if self.min_group < 2:
            raise ConfigError(f"min_group must be >= 2, not {self.min_group}")


@dataclass(frozen=True, slots=True)
class Violation:
    """``peer``'s part failed a check; ``reason`` says which and by how much."""

    peer: str
    reason: str


def part_norm(x: F32Array) -> float:
    """Euclidean norm of a float32 vector, summed in float64 slice by slice."""
    flat = x.reshape(-1)
    total = 0.0
    for i in range(0, flat.size, _STEP):
        part = flat[i : i + _STEP].astype(np.float64)
        total += float(np.multiply(part, part).sum())
    return math.sqrt(total)


def _lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def violations(
    peers: Sequence[str],
    parts: Sequence[F32Array],
    weights: Sequence[float],
    checks: PartChecks,
    caps: Mapping[str, float] | None = None,
) -> list[Violation]:
    """Every part that fails ``checks``, in member order (empty when all pass).

    ``peers``, ``parts`` (decoded float32 chunks) and ``weights`` are aligned, in member
    order. ``caps`` maps a peer to the largest weight it may claim (peers not in it are
    capped by the group rule only). Weights must already be finite and > 0.
    """
    if not (len(peers) == len(parts) == len(weights)):
        raise ConfigError("peers, parts and weights must have the same length")
    out: list[Violation] = []
    for peer, w in zip(peers, weights, strict=True):
        cap = None if caps is None else caps.get(peer)
        if cap is not None and w > cap:
            out.append(Violation(peer, f"weight {w:g} exceeds its cap {cap:g}"))
    n = len(parts)
    if n < checks.min_group:
        return out
    named = {v.peer for v in out}
    if math.isfinite(checks.weight_factor):
        med = _lower_median(list(weights))
        bound = checks.weight_factor * med
        for peer, w in zip(peers, weights, strict=True):
            if w > bound and peer not in named:
                out.append(
                    Violation(
                        peer,
                        f"weight {w:g} exceeds {checks.weight_factor:g} x the group's "
                        f"median weight {med:g}",
                    )
                )
                named.add(peer)
    size = parts[0].size if parts else 0
    if math.isfinite(checks.norm_factor) and size >= checks.min_values:
        norms = [part_norm(x) for x in parts]
        med = _lower_median(norms)
        bound = checks.norm_factor * med
        if med > 0:
            for peer, nm in zip(peers, norms, strict=True):
                if nm > bound and peer not in named:
                    out.append(
                        Violation(
                            peer,
                            f"chunk norm {nm:.4g} exceeds {checks.norm_factor:g} x the "
                            f"group's median chunk norm {med:.4g}",
                        )
                    )
                    named.add(peer)
    order = {p: i for i, p in enumerate(peers)}
    out.sort(key=lambda v: order[v.peer])
    return out


def check_parts(
    peers: Sequence[str],
    parts: Sequence[F32Array],
    weights: Sequence[float],
    checks: PartChecks,
    caps: Mapping[str, float] | None = None,
) -> None:
    """Raise :class:`RejectedContribution` naming the first peer (in member order) whose
    part fails ``checks``; see :func:`violations`."""
    found = violations(peers, parts, weights, checks, caps)
    if found:
        v = found[0]
        raise RejectedContribution(f"part of {v.peer} rejected: {v.reason}")

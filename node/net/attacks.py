"""Attack injection for benchmarks and tests: a node that lies, on purpose.

A spec (``atoll node``'s ``attack`` setting, usually from the ``ATOLL_ATTACK`` variable;
no command-line flag) makes the node hostile in one way, so that benchmarks
(``bench/attacks.py``) and tests measure what the protections do. Like
:mod:`atoll.node.net.faults` it exists for them only; a real node runs with none.

Attacks on the node's contribution to a round (a
:data:`~atoll.protocol.sync.Tamper` applied where the round's payload is built, so the
node's engine keeps its honest request):

==============  ========================================================================
``huge``        the update scaled by 10^6
``signflip``    the update negated
``scaled:K``    the update scaled by K
``noise``       Gaussian noise with the update's own root mean square in its place
``alie``        "a little is enough": every coordinate shifted by ``-z * |x_i|`` with
                z = 1. The published attack shifts the mean by z standard deviations of
                the honest updates, coordinate by coordinate; a single node sees only
                its own update, so its value stands in for the mean and its magnitude
                for the spread (a consistent push of every coordinate the same way)
``weight:K``    the token weight inflated K times (default 100)
``stale``       the first round's payload of each fragment replayed in every later one
==============  ========================================================================

Attacks on the parts as they leave (:class:`HostileTransport`: the round's own machine
checks this node's payload when the round starts, so a NaN payload handed to it never
leaves):

- ``nan``: every part's first value (or block scale) is NaN, so the owner's decoder
  refuses it as non-finite; in a round with sealed parts the node seals the NaN part
  with its own key, as a real attacker would (a part whose seal does not match is refused
  too, but proves nothing to the other members);

- ``forge``: the node's peer record claims version 10^6, with a made-up digest, for
  every fragment (:func:`forged_versions`; the swarm worker's record builder applies it);
- ``equivocate``: each part goes to its owner twice, the second copy with one byte
  changed (and sealed again in a sealed round); the owner rejects the pair and names the
  sender.

As a chunk's owner (``AllReduceRound(tamper_reduced=...)``, passed on by
:func:`~atoll.node.net.rounds.run_allreduce`):

- ``owner``: the reduced chunk the node sends every member is the true one negated and
  scaled by 4 (:func:`owner_tamper`): a well-formed chunk of the right size, which only
  a check of the owner's work (``[robust] verify_owners``) catches.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from atoll.node.net.seam import RoundTransport
from atoll.protocol import allreduce as ar
from atoll.protocol.certificate import AttestationSigner
from atoll.protocol.codecs import Codec
from atoll.protocol.errors import ConfigError
from atoll.protocol.partseal import seal_part
from atoll.protocol.sync import Tamper

__all__ = [
    "ATTACKS",
    "FORGED_VERSION",
    "Attack",
    "HostileTransport",
    "forged_versions",
    "hostile_parts",
    "nan_payload",
    "nan_prefix",
    "parse_attack",
]

logger = logging.getLogger(__name__)

ATTACKS = (
    "owner",
    "nan",
    "huge",
    "signflip",
    "scaled",
    "noise",
    "alie",
    "weight",
    "stale",
    "forge",
    "equivocate",
)
"""The attack names a spec may start with."""

FORGED_VERSION = 10**6
"""The version a forger's record claims for every fragment."""

ALIE_Z = 1.0
"""The shift of ``alie`` in multiples of each coordinate's own magnitude."""


@dataclasses.dataclass(frozen=True, slots=True)
class Attack:
    """A parsed attack spec: ``name`` and its factor ``k`` (1 when it takes none)."""

    name: str
    k: float = 1.0

    @property
    def tamper(self) -> Tamper | None:
        """The round tamper of this attack (None for those that act elsewhere)."""
        if self.name in ("forge", "equivocate", "nan", "owner"):
            return None
        return _tamper(self)

    def tamper_reduced(self, codec: Codec) -> Callable[[bytes], bytes] | None:
        """What a hostile owner sends instead of its reduced chunk (``owner`` only)."""
        return owner_tamper(codec) if self.name == "owner" else None

    @property
    def forges(self) -> bool:
        return self.name == "forge"

    @property
    def on_the_wire(self) -> bool:
        """Whether the attack tampers with parts as they leave (:class:`HostileTransport`)."""
        return self.name in ("equivocate", "nan")


def parse_attack(spec: str) -> Attack | None:
    """The attack of ``spec`` (None for an empty one); ConfigError when malformed."""
    spec = spec.strip()
    if not spec:
        return None
    name, _, arg = spec.partition(":")
    if name not in ATTACKS:
        raise ConfigError(f"attack must be one of {ATTACKS} (scaled:K, weight:K), not {spec!r}")
    if name in ("scaled", "weight"):
        try:
            k = float(arg) if arg else (10.0 if name == "scaled" else 100.0)
        except ValueError:
            raise ConfigError(f"attack {spec!r}: K must be a number") from None
        if not np.isfinite(k) or (name == "weight" and k <= 0):
            raise ConfigError(f"attack {spec!r}: K must be finite (and > 0 for weight)")
        return Attack(name, k)
    if arg:
        raise ConfigError(f"attack {name!r} takes no argument")
    return Attack(name, 1e6 if name == "huge" else 1.0)


def nan_payload(codec: Codec, numel: int) -> bytes:
    """A payload of ``numel`` values in ``codec``'s format that decodes to NaN (or is
    refused as non-finite): built byte by byte, since no codec encodes NaN."""
    name = codec.name
    if name == "fp32":
        return np.full(numel, np.nan, np.float32).tobytes()
    if name == "bf16":
        return np.full(numel, 0x7FC0, "<u2").tobytes()
    block = int(getattr(codec, "block", 128))
    nb = -(-numel // block)
    if name == "int8":
        return np.full(nb, np.nan, "<f4").tobytes() + bytes(numel)
    # e3m0 and e3m0-sr: bfloat16 NaN scales, zero codes
    return np.full(nb, 0x7FC0, "<u2").tobytes() + b"\x77" * ((numel + 1) // 2)


def owner_tamper(codec: Codec) -> Callable[[bytes], bytes]:
    """A hostile owner's change to its encoded reduced chunk: decoded, negated, scaled by
    4 and encoded again, the same size (the chunk's length is read off the payload's)."""

    def tamper(payload: bytes) -> bytes:
        n = _numel_of(codec, len(payload))
        x = codec.decode(payload, n)
        logger.info("attack owner: a reduced chunk of %d values negated and scaled", n)
        return codec.encode((x * np.float32(-4.0)).astype(np.float32))

    return tamper


def _numel_of(codec: Codec, size: int) -> int:
    """The smallest value count whose encoding in ``codec`` takes ``size`` bytes."""
    lo, hi = 0, max(1, size * 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if codec.encoded_size(mid) < size:
            lo = mid + 1
        else:
            hi = mid
    if codec.encoded_size(lo) != size:
        raise ConfigError(f"{codec.name}: no value count encodes to {size} bytes")
    return lo


def _tamper(attack: Attack) -> Tamper:
    rng = np.random.default_rng(0xA77AC)
    first: dict[tuple[int, int], bytes] = {}  # (fragment, numel) -> first payload sent

    def tamper(spec: ar.RoundSpec, payload: bytes, weight: float) -> tuple[bytes, float]:
        codec = spec.make_codec()
        n = spec.numel
        name = attack.name
        if name == "weight":
            out = (payload, weight * attack.k)
        elif name == "stale":
            out = (first.setdefault((spec.key.fragment, n), payload), weight)
        else:
            x = codec.decode(payload, n).astype(np.float64)
            if name in ("huge", "scaled"):
                y = x * attack.k
            elif name == "signflip":
                y = -x
            elif name == "noise":
                rms = float(np.sqrt(np.mean(x * x))) if n else 0.0
                y = rng.standard_normal(n) * rms
            else:  # alie
                y = x - ALIE_Z * np.abs(x)
            out = (codec.encode(y.astype(np.float32)), weight)
        logger.info(
            "attack %s: fragment %d round %d tampered", name, spec.key.fragment, spec.key.round
        )
        return out

    return tamper


def forged_versions(n: int, digest_len: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """What a forger's record declares for ``n`` fragments: version 10^6 and a made-up
    digest of ``digest_len`` hex digits each."""
    return (FORGED_VERSION,) * n, ("f" * digest_len,) * n


_NAN_PREFIX = {
    "fp32": np.array([np.nan], "<f4").tobytes(),
    "int8": np.array([np.nan], "<f4").tobytes(),  # the first block scale
    "bf16": np.array([0x7FC0], "<u2").tobytes(),
    "e3m0": np.array([0x7FC0], "<u2").tobytes(),  # the first block scale, bfloat16
    "e3m0-sr": np.array([0x7FC0], "<u2").tobytes(),
}


def nan_prefix(codec: str) -> bytes:
    """The bytes that make a payload of ``codec`` start with NaN (a value or a block
    scale): what ``nan`` writes over the head of every part."""
    return _NAN_PREFIX.get(codec, _NAN_PREFIX["fp32"])


def _resealed(msg: ar.Part, payload: bytes, signer: AttestationSigner | None) -> ar.Part:
    """``msg`` with ``payload``, sealed again with ``signer`` when it was sealed."""
    seal = msg.seal
    if seal and signer is not None:
        seal = seal_part(
            signer, msg.run_id, msg.fragment, msg.round, msg.sender, msg.chunk, msg.weight, payload
        )
    return dataclasses.replace(msg, payload=payload, seal=seal)


def hostile_parts(
    attack: Attack, msg: ar.Part, prefix: bytes, signer: AttestationSigner | None = None
) -> list[ar.Part]:
    """What a node with an on-the-wire ``attack`` sends instead of the part ``msg``:
    ``nan``, the part with ``prefix`` (:func:`nan_prefix`) over its head; ``equivocate``,
    the part and a second copy with one byte changed; ``msg`` itself for any other attack
    or an empty part. ``signer`` seals a changed part of a sealed round again."""
    if not msg.payload or not attack.on_the_wire:
        return [msg]
    if attack.name == "nan":
        k = len(prefix)
        bad = prefix + msg.payload[k:] if len(msg.payload) >= k else msg.payload
        logger.info("attack nan: a NaN part for chunk %d", msg.chunk)
        return [_resealed(msg, bad, signer)]
    flipped = bytes([msg.payload[0] ^ 0x11]) + msg.payload[1:]
    logger.info("attack equivocate: a second part for chunk %d", msg.chunk)
    return [msg, _resealed(msg, flipped, signer)]


class HostileTransport:
    """A round transport that tampers with this node's :class:`~atoll.protocol.allreduce.
    Part` messages as they leave (``nan``, ``equivocate``; see the module docstring);
    everything else goes as ``inner`` sends it. ``codec`` is the run's codec name (every
    codec's payload starts with a value or a block scale). ``signer``: this node's, to seal
    the changed parts of a sealed round again."""

    def __init__(
        self,
        inner: RoundTransport,
        attack: Attack,
        codec: str,
        signer: AttestationSigner | None = None,
    ) -> None:
        self.inner = inner
        self.attack = attack
        self.prefix = nan_prefix(codec)
        self.signer = signer

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    async def send(self, peer: str, msg: object, /) -> None:
        if not isinstance(msg, ar.Part):
            await self.inner.send(peer, msg)
            return
        for out in hostile_parts(self.attack, msg, self.prefix, self.signer):
            await self.inner.send(peer, out)

    async def receive(self) -> tuple[str, object]:
        return await self.inner.receive()

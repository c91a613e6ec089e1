"""What the members of one all-reduce round agree on and send each other: the round's key
and spec (:class:`RoundKey`, :class:`RoundSpec`) and its wire messages (:class:`Part`,
:class:`Reduced`, :class:`Abort`, :class:`Verified`, :class:`Evidence`).

The round's state machine, which sends and takes these, is
:class:`~atoll.protocol.allreduce.AllReduceRound` (see its module docstring for the
protocol); :mod:`atoll.protocol.allreduce` re-exports every name here, and callers use
them from there.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TypeAlias

from atoll.protocol.checks import PartChecks
from atoll.protocol.codecs import Codec, make_codec
from atoll.protocol.errors import ConfigError
from atoll.protocol.messages import wire_message
from atoll.protocol.partseal import MAX_PART_SEAL, Proof
from atoll.protocol.reduce import chunk_bounds
from atoll.protocol.robust import RobustRule

__all__ = [
    "DIGEST_BYTES",
    "GROUP_MAX",
    "MAX_GROUP",
    "Abort",
    "Evidence",
    "Message",
    "Part",
    "Reduced",
    "RoundKey",
    "RoundSpec",
    "Verified",
]

DIGEST_BYTES = 32
"""Length of a part's or a chunk's digest (sha256)."""
MAX_GROUP = 1024
"""Most members whose digests or parts one message may list."""
GROUP_MAX = 64
"""Longest group tag (:attr:`RoundKey.group`) a message may carry, in characters."""
_DIGESTS = {"max_len": MAX_GROUP, "item_max_len": DIGEST_BYTES}


# --------------------------------------------------------------------------------------
# the round and its group
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RoundKey:
    """Names one round of one fragment of one run; every member of the group shares it.

    ``round`` is the fragment's global version the pseudo-gradient is taken against
    (:attr:`engine.SyncRequest.round`): members with different versions cannot average.
    ``group`` names the group that runs it (the matchmaking leader's tag for its member
    list, :attr:`~atoll.protocol.matchmaking.GroupFormed.group`; "" for none): a round of
    the same version run again by a later group (the first failed) is another round, and
    the messages of the one never reach the other.
    """

    run_id: str
    fragment: int
    round: int
    group: str = ""


@dataclass(frozen=True, slots=True)
class RoundSpec:
    """What the group agreed on before the round: members, size, codec and robust rule.

    ``members`` are peer ids in the agreed order: chunk ``j`` of the vector belongs to
    ``members[j]``, and contributions are summed in this order (so every owner computes
    what :func:`engine.average_requests` computes on the requests in this order). The
    chunks are :func:`reduce.chunk_bounds` at the codec's alignment (Streaming DiLoCo,
    arXiv 2501.18512: reduce-scatter of a quantized vector without re-quantization).

    ``robust`` is how each owner combines its chunk's parts (default: the
    token-weighted mean; :class:`robust.RobustRule`). ``checks``, when set, are the bounds
    every part must meet relative to the group's before its chunk is reduced
    (:class:`checks.PartChecks`); None checks nothing beyond decoding, size, finiteness and
    weight sign. Both come from the run's settings: members of a group must agree on them.
    ``weight_cap`` is the largest token weight any member's part may carry (the most
    tokens a contribution can stand for in the run: see :mod:`~atoll.protocol.sync`); a
    part above it is refused before the reduction, naming its sender. ``inf``: no cap.
    """

    key: RoundKey
    members: tuple[str, ...]
    numel: int
    codec: str
    codec_block: int = 128
    robust: RobustRule = field(default_factory=RobustRule)
    checks: PartChecks | None = None
    verify_owners: bool = False
    sealed: bool = False
    """every part carries its sender's seal, and a refused part's proof travels with the
    round's abort, so every member can strike its sender (:mod:`~atoll.protocol.partseal`)"""
    weight_cap: float = math.inf

    def __post_init__(self) -> None:
        if not isinstance(self.members, tuple) or not self.members:
            raise ConfigError("a round needs a non-empty tuple of members")
        if not all(isinstance(m, str) and m for m in self.members):
            raise ConfigError("member ids must be non-empty strings")
        if len(set(self.members)) != len(self.members):
            raise ConfigError(f"duplicate member ids in {self.members!r}")
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 0:
            raise ConfigError(f"numel must be an integer >= 0, not {self.numel!r}")
        self.make_codec()  # validates name and block
        if not isinstance(self.robust, RobustRule):
            raise ConfigError(f"robust must be a RobustRule, not {self.robust!r}")
        if self.checks is not None and not isinstance(self.checks, PartChecks):
            raise ConfigError(f"checks must be PartChecks or None, not {self.checks!r}")
        if not isinstance(self.verify_owners, bool):
            raise ConfigError(f"verify_owners must be a bool, not {self.verify_owners!r}")
        if not isinstance(self.sealed, bool):
            raise ConfigError(f"sealed must be a bool, not {self.sealed!r}")
        cap = self.weight_cap
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0:
            raise ConfigError(f"weight_cap must be > 0, not {cap!r}")

    def make_codec(self) -> Codec:
        """The round's codec (:func:`codecs.make_codec` of ``codec`` and ``codec_block``)."""
        return make_codec(self.codec, block=self.codec_block)

    def bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every member's chunk, in member order."""
        return chunk_bounds(self.numel, len(self.members), self.make_codec().align)

    def verifiers(self) -> tuple[int, ...]:
        """The member index of each chunk's verifier (used when ``verify_owners`` is set).

        The members are ranked by ``sha256(run, fragment, round, member)``; chunk ``j``'s
        verifier is the member ranked after its owner (cyclically). So each member verifies
        exactly one chunk, never its own, and which one changes with every round, out of
        any member's choosing. A group of one has no verifier (``(0,)``).
        """
        k, m = self.key, self.members
        if len(m) < 2:
            return tuple(range(len(m)))

        def rank(i: int) -> tuple[bytes, int]:
            tag = f"{k.run_id}\0{k.fragment}\0{k.round}\0{m[i]}".encode()
            return hashlib.sha256(tag).digest(), i

        order = sorted(range(len(m)), key=rank)
        after = {order[p]: order[(p + 1) % len(m)] for p in range(len(m))}
        return tuple(after[j] for j in range(len(m)))


# --------------------------------------------------------------------------------------
# messages (primitive fields only, so that a wire codec can register them)
# --------------------------------------------------------------------------------------
@wire_message(10)
@dataclass(frozen=True, slots=True)
class Part:
    """A member's encoded chunk ``chunk`` of its pseudo-gradient, sent to the chunk's owner.

    ``weight`` is the sender's token count (token-weighted merging, Decoupled DiLoCo,
    arXiv 2604.21428); ``payload`` is the codec's encoding of those values alone.
    """

    run_id: str
    fragment: int
    round: int
    sender: str
    chunk: int
    weight: float
    payload: bytes
    digests: tuple[bytes, ...] = field(default=(), metadata=_DIGESTS)
    """with :attr:`RoundSpec.verify_owners`: the sender's commitments, the sha256 of each of
    its parts in chunk order (the same tuple in every part it sends); else empty, and left
    off the wire"""
    seal: bytes = field(default=b"", metadata={"max_len": MAX_PART_SEAL})
    """with :attr:`RoundSpec.sealed`: the sender's seal over this part
    (:func:`~atoll.protocol.partseal.seal_part`); else empty, and left off the wire"""
    group: str = field(default="", metadata={"max_len": GROUP_MAX})
    """the group's tag (:attr:`RoundKey.group`); left off the wire when empty"""


@wire_message(11)
@dataclass(frozen=True, slots=True)
class Reduced:
    """An owner's aggregate of chunk ``chunk`` (the weighted mean or the round's robust
    rule), encoded once, sent to every member.

    ``total_weight`` is the sum of the members' weights; all owners sum the same weights in
    the same order, so the values of one round must agree.
    """

    run_id: str
    fragment: int
    round: int
    sender: str
    chunk: int
    total_weight: float
    payload: bytes
    part_digests: tuple[bytes, ...] = field(default=(), metadata=_DIGESTS)
    """with :attr:`RoundSpec.verify_owners`: the sha256 of each part the owner reduced, in
    member order, so that every member can check that its own part was used"""
    group: str = field(default="", metadata={"max_len": GROUP_MAX})
    """the group's tag (:attr:`RoundKey.group`); left off the wire when empty"""


@wire_message(12)
@dataclass(frozen=True, slots=True)
class Abort:
    """The round failed at ``sender``; the receiver must roll back too.

    With :attr:`RoundSpec.sealed`, an owner that refused a part for what it holds adds the
    proof: the sealed parts of chunk ``chunk`` in member order (an absent part: weight 0
    and empty payload and seal), which every member judges for itself
    (:func:`~atoll.protocol.partseal.judge`). Otherwise ``chunk`` is -1 and the rest
    empty, left off the wire.
    """

    run_id: str
    fragment: int
    round: int
    sender: str
    reason: str
    chunk: int = -1
    weights: tuple[float, ...] = field(default=(), metadata={"max_len": MAX_GROUP})
    payloads: tuple[bytes, ...] = field(default=(), metadata={"max_len": MAX_GROUP})
    seals: tuple[bytes, ...] = field(
        default=(), metadata={"max_len": MAX_GROUP, "item_max_len": MAX_PART_SEAL}
    )
    twin_weight: float = 0.0
    """with an equivocation's proof: the second part the one member in ``payloads`` sent
    for ``chunk`` (its weight, payload and seal); else 0 and empty, left off the wire"""
    twin_payload: bytes = b""
    twin_seal: bytes = field(default=b"", metadata={"max_len": MAX_PART_SEAL})
    group: str = field(default="", metadata={"max_len": GROUP_MAX})
    """the group's tag (:attr:`RoundKey.group`); left off the wire when empty"""

    @classmethod
    def carrying(cls, key: RoundKey, sender: str, reason: str, proof: Proof | None = None) -> Abort:
        """``sender``'s abort of the round ``key``, with ``proof`` when there is one."""
        if proof is None:
            return cls(key.run_id, key.fragment, key.round, sender, reason, group=key.group)
        twin = proof.twin if proof.twin is not None else (0.0, b"", b"")
        return cls(
            key.run_id,
            key.fragment,
            key.round,
            sender,
            reason,
            proof.chunk,
            proof.weights,
            proof.payloads,
            proof.seals,
            *twin,
            group=key.group,
        )

    def proof(self) -> Proof | None:
        """The proof this abort carries (None when it carries none)."""
        if not self.payloads:
            return None
        twin = (self.twin_weight, self.twin_payload, self.twin_seal) if self.twin_payload else None
        return Proof(self.chunk, self.weights, self.payloads, self.seals, twin)


@wire_message(13)
@dataclass(frozen=True, slots=True)
class Verified:
    """A chunk's verifier's own reduction of chunk ``chunk``, by digest, sent to every member.

    ``digest`` is the sha256 of the encoded chunk the verifier computed from the same parts
    (:attr:`RoundSpec.verify_owners`); a member commits the owner's :class:`Reduced` only
    when its sha256, total weight and part digests are those given here.
    """

    run_id: str
    fragment: int
    round: int
    sender: str
    chunk: int
    total_weight: float
    digest: bytes = field(metadata={"max_len": DIGEST_BYTES})
    part_digests: tuple[bytes, ...] = field(metadata=_DIGESTS)
    group: str = field(default="", metadata={"max_len": GROUP_MAX})
    """the group's tag (:attr:`RoundKey.group`); left off the wire when empty"""


@wire_message(14)
@dataclass(frozen=True, slots=True)
class Evidence:
    """The parts of chunk ``chunk`` (weights and payloads in member order), sent to every
    member by the owner or the verifier when the other's claim disagrees with its own.

    Each member checks every part against the digest its sender committed to (in the
    :class:`Part` it sent this member), recomputes the chunk and so learns which of the two
    lied; it is only sent when a round is already lost.
    """

    run_id: str
    fragment: int
    round: int
    sender: str
    chunk: int
    weights: tuple[float, ...] = field(metadata={"max_len": MAX_GROUP})
    payloads: tuple[bytes, ...] = field(metadata={"max_len": MAX_GROUP})
    group: str = field(default="", metadata={"max_len": GROUP_MAX})
    """the group's tag (:attr:`RoundKey.group`); left off the wire when empty"""


Message: TypeAlias = Part | Reduced | Abort | Verified | Evidence

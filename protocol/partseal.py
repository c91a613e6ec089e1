"""Sealed parts: proof, checkable by any member, that a part a chunk owner refused was bad.

A chunk's owner checks every part before it reduces the chunk (:mod:`atoll.protocol.
checks`, the codec's own checks) and fails the round naming the sender of a bad part. On
its own word alone nobody else may strike that sender: a hostile owner could frame an
honest member that way. So in a round with sealed parts (:attr:`~atoll.protocol.
allreduce.RoundSpec.sealed`) every member signs what it sends: each
:class:`~atoll.protocol.allreduce.Part` carries its sender's seal over a
:class:`PartStatement` (run, fragment, round, sender, chunk, weight and the sha256 of the
payload). The owner checks the seal as the part arrives (a part without a valid seal is
refused like any other bad part), and when it refuses a part for what it holds, its
:class:`~atoll.protocol.allreduce.Abort` carries the proof: the sealed part alone when the
part is bad by itself (does not decode, is not finite, a weight that is not a positive
number), or every sealed part of the chunk when the part is bad relative to the group
(:func:`~atoll.protocol.checks.violations`: norm or weight over the group's bound), or
both sealed parts when a member sent the owner two different ones for the chunk
(equivocation: two seals of one member for one chunk and round prove it by themselves).

:func:`judge` is what a member does with such a proof: it opens every seal (each must be
the named member's, for this round and chunk, and match the payload and weight given),
runs the same checks on the parts and names the member they convict, or nobody. An honest
member seals exactly one part per chunk and round, so the full set of a chunk's sealed
parts is the one the owner judged, and the verdict is the same at every member that runs
the same checks (weight caps are each member's own: a member whose caps differ may
acquit). The proof costs nothing in a round that commits; a refused round sends one
chunk's parts to every member once. A forged or incomplete proof convicts nobody.

Sans-IO: sealing and opening are injected (:class:`~atoll.protocol.certificate.
AttestationSigner`, :class:`~atoll.protocol.certificate.AttestationVerifier`: the node's
Ed25519 envelopes).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from atoll.protocol.certificate import AttestationSigner, AttestationVerifier
from atoll.protocol.checks import PartChecks, violations
from atoll.protocol.codecs import Codec
from atoll.protocol.errors import RejectedInput
from atoll.protocol.messages import decode_message, encode_message, wire_message

__all__ = [
    "MAX_PART_SEAL",
    "PART_DOMAIN",
    "PartStatement",
    "Proof",
    "judge",
    "seal_part",
    "seal_problem",
]

F32Array = npt.NDArray[np.float32]

PART_DOMAIN = "atoll/part/v1"
"""The signing domain of a part's seal (a seal of one kind never opens as another)."""
MAX_STATEMENT_BYTES = 512
"""Most bytes of an encoded :class:`PartStatement`."""
MAX_PART_SEAL = MAX_STATEMENT_BYTES + 1024
"""Most bytes of a part's seal (the envelope, and a member certificate in a private swarm)."""


@wire_message(15)
@dataclass(frozen=True, slots=True)
class PartStatement:
    """What a member signs for each part it sends: this payload, with this weight, is my
    chunk ``chunk`` of round ``round`` of fragment ``fragment`` of run ``run_id``."""

    run_id: str = field(metadata={"max_len": 64})
    fragment: int
    round: int
    sender: str = field(metadata={"max_len": 128})
    chunk: int
    weight: float
    digest: bytes = field(metadata={"max_len": 32})


def _statement(
    run_id: str, fragment: int, round_: int, sender: str, chunk: int, weight: float, payload: bytes
) -> PartStatement:
    digest = hashlib.sha256(payload).digest()
    return PartStatement(run_id, fragment, round_, sender, chunk, float(weight), digest)


def seal_part(
    signer: AttestationSigner,
    run_id: str,
    fragment: int,
    round_: int,
    sender: str,
    chunk: int,
    weight: float,
    payload: bytes,
) -> bytes:
    """``sender``'s seal over its part ``payload`` for ``chunk`` of the round."""
    statement = _statement(run_id, fragment, round_, sender, chunk, weight, payload)
    return signer.seal(PART_DOMAIN, encode_message(statement))


def seal_problem(
    opener: AttestationVerifier,
    seal: bytes,
    run_id: str,
    fragment: int,
    round_: int,
    sender: str,
    chunk: int,
    weight: float,
    payload: bytes,
) -> str | None:
    """Why ``seal`` does not prove that ``sender`` sent this part (None when it does)."""
    if not isinstance(seal, bytes) or not seal:
        return f"the part of {sender} for chunk {chunk} carries no seal"
    try:
        body, signer = opener.open(seal, domain=PART_DOMAIN, max_payload=MAX_STATEMENT_BYTES)
        stated = decode_message(body, max_bytes=MAX_STATEMENT_BYTES)
    except RejectedInput as e:
        return f"the seal on the part of {sender} for chunk {chunk} does not open: {e}"
    if signer != sender:
        return f"the part of {sender} for chunk {chunk} is sealed by {signer}"
    expected = _statement(run_id, fragment, round_, sender, chunk, weight, payload)
    if stated != expected:
        return f"the seal on the part of {sender} for chunk {chunk} is for another part"
    return None


@dataclass(frozen=True, slots=True)
class Proof:
    """Sealed parts of one chunk, in member order (an absent part: empty payload and
    seal, weight 0): what an :class:`~atoll.protocol.allreduce.Abort` carries."""

    chunk: int
    weights: tuple[float, ...]
    payloads: tuple[bytes, ...]
    seals: tuple[bytes, ...]
    twin: tuple[float, bytes, bytes] | None = None
    """an equivocation: a second sealed part (weight, payload, seal) of the one member
    whose part is given, for the same chunk"""


def judge(
    proof: Proof,
    *,
    opener: AttestationVerifier,
    run_id: str,
    fragment: int,
    round_: int,
    members: Sequence[str],
    bounds: Sequence[tuple[int, int]],
    codec: Codec,
    checks: PartChecks | None,
    caps: Mapping[str, float] | None,
    me: str,
) -> tuple[str | None, str]:
    """``(convicted member or None, why)`` for ``proof`` (see the module docstring).

    Every part given must be sealed by its member for this round and ``proof.chunk``;
    one part bad by itself convicts its sender; with every part of the chunk given, the
    group checks run as the owner ran them. ``me`` is never convicted (a member does not
    strike itself).
    """
    n, j = len(members), proof.chunk
    if not (isinstance(j, int) and 0 <= j < n) or not (
        len(proof.weights) == len(proof.payloads) == len(proof.seals) == n
    ):
        return None, "a malformed proof"
    given = [k for k in range(n) if proof.payloads[k]]
    if not given:
        return None, "a proof without parts"
    parts = [(k, proof.weights[k], proof.payloads[k], proof.seals[k]) for k in given]
    if proof.twin is not None:
        if len(given) != 1:
            return None, "a malformed proof"
        parts.append((given[0], *proof.twin))
    for k, weight, payload, seal in parts:
        problem = seal_problem(
            opener, seal, run_id, fragment, round_, members[k], j, weight, payload
        )
        if problem is not None:
            return None, f"the proof does not hold: {problem}"
    if proof.twin is not None:
        (k,) = given
        if proof.twin[:2] == (proof.weights[k], proof.payloads[k]):
            return None, "the two sealed parts are the same"
        return _convict(members[k], me, f"it sealed two different parts for chunk {j}")
    a, b = bounds[j]
    decoded: list[F32Array] = []
    for k in given:
        w = proof.weights[k]
        if (
            isinstance(w, bool)
            or not isinstance(w, int | float)
            or not (math.isfinite(w) and w > 0)
        ):
            return _convict(members[k], me, f"its sealed weight is {w!r}")
        try:
            values = codec.decode(proof.payloads[k], b - a)
        except RejectedInput as e:
            return _convict(members[k], me, f"its sealed part is refused: {e}")
        decoded.append(values)
    if len(given) < n or (checks is None and not caps):
        return None, "every sealed part given passes"
    if checks is None:
        checks = PartChecks(norm_factor=math.inf, weight_factor=math.inf)
    found = violations(members, decoded, list(proof.weights), checks, caps)
    for v in found:
        if v.peer != me:
            return _convict(v.peer, me, f"its sealed part fails the group checks: {v.reason}")
    return None, "the sealed parts pass the group checks"


def _convict(peer: str, me: str, why: str) -> tuple[str | None, str]:
    return (None, why) if peer == me else (peer, why)

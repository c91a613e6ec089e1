"""One all-reduce round of one fragment inside an agreed group, as a sans-IO state machine.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) averages each fragment's
pseudo-gradient without compounding quantization error: every peer quantizes its delta
once, a reduce-scatter hands chunk ``j`` of every peer's encoding to the chunk's owner,
the owner dequantizes the parts and sums them in fp32, quantizes the mean once, and an
all-gather hands the encoded mean to every member, who dequantizes it. :class:`AllReduceRound`
is that exchange for one member, bandwidth-optimal (each member sends ``(M-1)/M`` of the
encoding in each phase) and token-weighted:

1. :meth:`~AllReduceRound.start`: the member cuts its encoding at
   :meth:`RoundSpec.bounds` (:meth:`Codec.slice_payload`, no re-encoding) and sends a
   :class:`Part` to every other chunk owner; it keeps its own chunk.
2. As the owner of chunk ``j`` it collects one :class:`Part` from every member, checks each
   (round key, sender, chunk index, weight, decoding, the injected :data:`Validator`), then,
   once all are in, checks them against each other (:attr:`RoundSpec.checks`: norms and
   weights within a bound of the group's, per-peer weight caps), combines them in member
   order with :func:`reduce.weighted_mean` by :attr:`RoundSpec.robust` (the
   token-weighted fp32 mean by default, or a robust rule of :mod:`~atoll.protocol.robust`),
   encodes the result once and sends a :class:`Reduced` to every other member.
3. As a member it collects the :class:`Reduced` chunk from each chunk's owner; once every
   chunk is in and decodes, the round is :class:`Done` with the averaged vector.

The arithmetic is that of :func:`engine.average_requests` chunk by chunk: the weights are
normalised over the whole group in member order, the mean is taken element by element,
and chunks cut at the codec's alignment encode exactly like the whole vector, so every
member that finishes holds the reference result bit for bit. A robust rule (trimmed mean,
centered clipping) is applied per chunk, to what that chunk's owner holds; its result is
not the whole-vector rule's, but every member still commits the same bytes.

Atomicity. A round commits or rolls back as a whole, as in torchft's Manager (errors are
latched, and a step is committed only when nothing failed). Every member ends in exactly
one of two states:

- ``done``: it holds the complete average, and every member that ends ``done`` holds the
  same bytes (each chunk was encoded once, by its owner, and everybody decodes those bytes);
- ``failed``: it applies nothing. A rejected part (undecodable, non-finite, bad weight,
  equivocation, refused by the validator or by the group checks), a Reduced chunk from a
  peer that does not own it, a lost peer it still needed, an :class:`Abort` from a
  member, or a passed deadline fail the round, and the member sends :class:`Abort` to the
  others so that they stop waiting too.

A member is never left with a partly averaged vector and never waits forever: the parts
for its own chunk are due ``phase_timeout`` after the start and the whole round
``round_timeout`` after it, enforced by :meth:`~AllReduceRound.tick`. Group-wide agreement
is *not* promised (no finite protocol over lossy links can promise it): a member may commit
while another, which lost a peer or saw an Abort first, rolls back. The outer engine
tolerates that: a rolled-back member keeps its work for its next round (``skip``), and
whoever forms the next group must compare fragment versions (the round of
:class:`RoundKey`) so that members that diverged here do not average together.

Verified owners (:attr:`RoundSpec.verify_owners`, off by default). A chunk's owner reduces
for everybody, so a hostile owner could hand out any chunk. With verification on:

- every :class:`Part` carries its sender's commitments (the sha256 of each of its parts);
  an owner or verifier rejects a part that does not hash to its entry, or a sender whose
  parts carry two different lists or weights (naming the sender);
- chunk ``j`` also goes to a verifier (:meth:`RoundSpec.verifiers`: each member verifies
  one chunk, never its own, drawn from the round key), which receives every member's
  part of it, reduces it exactly as the owner must (rules and codecs are deterministic;
  stochastic rounding is seeded by round and chunk) and sends every member a
  :class:`Verified` with the digest of the encoded result, the total weight and the
  parts' digests; the owner's :class:`Reduced` carries the parts' digests too;
- a member commits only when, for every chunk, the owner's bytes hash to the verifier's
  digest with the same total weight and part digests, and both list its own part as it
  sent it (else it names the one that misused its part);
- when the two agree on the parts but not on the result, the one of them that is honest
  knows the other lied and sends every member the parts (:class:`Evidence`); each member
  checks them against the commitments their senders gave it, recomputes the chunk and
  names whichever claim is wrong (``Failed.culprit``). When the two list different parts
  (one lies, or a member gave them different parts) or no evidence comes, the round fails
  naming nobody, with ``Failed.suspects``.

No honest member commits a wrong chunk unless a chunk's owner and its verifier both lie
together. Without signed commitments some lies stay unattributed (``suspects``); a
culprit is only named on proof. Cost: one more copy of the reduce-scatter (each member
sends ``(M-1)/M`` of its encoding twice in that phase), 32 bytes per member in each part,
one small :class:`Verified` per member to every member, one more reduction per member,
and a wait for the slowest verifier; evidence (a chunk's parts to every member) only
when a round is already lost.

The machine trusts the ``sender`` field of a message: the driver must check it against
the authenticated transport peer before calling :meth:`~AllReduceRound.receive`. Time is
passed in (``now``, any monotonic clock in seconds); nothing here reads a clock, opens a
socket or starts a thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from atoll.protocol.certificate import AttestationSigner, AttestationVerifier
from atoll.protocol.checks import PartChecks, violations
from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.partseal import Proof, judge, seal_part, seal_problem
from atoll.protocol.reduce import Contribution, reduce_encoded
from atoll.protocol.roundmsgs import (
    DIGEST_BYTES,
    GROUP_MAX,
    MAX_GROUP,
    Abort,
    Evidence,
    Message,
    Part,
    Reduced,
    RoundKey,
    RoundSpec,
    Verified,
)

__all__ = [
    "DIGEST_BYTES",
    "GROUP_MAX",
    "MAX_GROUP",
    "Abort",
    "Action",
    "AllReduceRound",
    "Done",
    "Evidence",
    "Failed",
    "Message",
    "Part",
    "Reduced",
    "RoundKey",
    "RoundSpec",
    "Send",
    "Validator",
    "Verified",
]

F32Array = npt.NDArray[np.float32]

_MAX_REASON = 300  # characters of a peer's abort reason we repeat (a hostile one can be huge)


# --------------------------------------------------------------------------------------
# actions for the driver
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to peer ``to`` (best effort: a loss shows up as a timeout)."""

    to: str
    message: Message


@dataclass(frozen=True, slots=True, eq=False)
class Done:
    """The round committed: apply ``averaged`` (float32, ``numel`` values, decoded)."""

    averaged: F32Array


@dataclass(frozen=True, slots=True)
class Failed:
    """The round rolled back: apply nothing.

    ``culprit`` is the peer whose input this member rejected (hostile or broken), or None
    when the failure proves nothing about anyone (timeout, lost peer, abort, overflow).
    """

    reason: str
    culprit: str | None = None
    missing: tuple[str, ...] = ()
    """members whose part or reduced chunk had not come by the deadline (a silent peer,
    or a connection that stalled): the driver's liveness hears of them"""
    suspects: tuple[str, ...] = ()
    """with verified owners: members of which at least one lied, when this member could
    not tell which (an owner and a verifier disagreeing with no evidence in time), or the
    ones proven wrong by the evidence; ``culprit`` is set only when the proof is complete"""


Action: TypeAlias = Send | Done | Failed

Validator: TypeAlias = Callable[[Part, F32Array], None]
"""Called with each received part and its decoded values before they are reduced; raises
:class:`~atoll.protocol.errors.RejectedContribution` to reject the part (and fail the
round, naming the sender)."""

State: TypeAlias = Literal["running", "done", "failed"]


def _finite_positive(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    return math.isfinite(float(x)) and float(x) > 0


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON] + "..."


# --------------------------------------------------------------------------------------
# the state machine
# --------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Slot:
    """The parts of one chunk this member collects: as the chunk's owner or its verifier."""

    chunk: int
    parts: list[Contribution | None]
    decoded: list[F32Array | None]
    done: bool = False
    seals: list[bytes] = field(default_factory=list)
    """with :attr:`RoundSpec.sealed`: each part's seal, in member order (b"" until in)"""

    def missing(self, members: tuple[str, ...]) -> list[str]:
        return [members[i] for i, p in enumerate(self.parts) if p is None]


@dataclass(frozen=True, slots=True)
class _Claim:
    """What an owner (its :class:`Reduced`) or a verifier (its :class:`Verified`) says
    chunk ``j`` is: the digest of its encoding, the total weight and the parts' digests."""

    digest: bytes
    total: float
    parts: tuple[bytes, ...]


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _digest_list(value: object, n: int) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == n
        and all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in value)
    )


class AllReduceRound:
    """One member's side of one round: reduce-scatter then all-gather, commit or roll back.

    The protocol is Streaming DiLoCo's low-precision all-reduce (arXiv 2501.18512):
    quantize once, reduce-scatter, fp32 weighted sum at each chunk's owner, quantize the
    mean once, all-gather. Its failure handling follows torchft (errors latched, the round
    committed or rolled back whole). See the module docstring for the guarantees, and for
    :attr:`RoundSpec.verify_owners` (every chunk recomputed by a second member before
    anybody commits it).

    Args:
        spec: the group's agreement (key, members, size, codec).
        me: this member's id, one of ``spec.members``.
        payload: this member's encoding of its *whole* fragment delta with the round's codec
            (:attr:`engine.SyncRequest.payload`).
        weight: this member's token count, finite and > 0.
        now: the current time; the deadlines count from it.
        phase_timeout: seconds within which every member's part for this member's chunk
            (and, verifying, for the chunk it verifies) must arrive (the reduce-scatter).
        round_timeout: seconds within which the whole round must finish (reduce-scatter and
            all-gather); at least ``phase_timeout``.
        validator: optional check of each received part (see :data:`Validator`).
        weight_caps: the largest token weight each listed peer may claim (e.g. from its
            measured throughput); a part above its sender's cap is rejected before the
            reduction, naming the sender. Applied whether or not ``spec.checks`` is set.
        tamper_reduced: for tests and the attack benchmark only: makes this member a
            hostile owner, sending ``tamper_reduced(encoded_chunk)`` instead of its chunk.
        tamper_verified: for tests and the attack benchmark only: makes this member a
            hostile verifier, announcing the digest of ``tamper_verified(encoded_chunk)``.
        signer: seals this member's parts (required with :attr:`RoundSpec.sealed`).
        opener: opens the seals of other members' parts and proofs (required with
            :attr:`RoundSpec.sealed`).

    Raises:
        ConfigError: inconsistent arguments (``me`` not a member, a payload of the wrong
            size, a bad weight or timeouts).
        CodecError: this member's own chunk does not decode (NaN, bad scales).
    """

    def __init__(
        self,
        spec: RoundSpec,
        me: str,
        payload: bytes,
        weight: float,
        *,
        now: float,
        phase_timeout: float,
        round_timeout: float,
        validator: Validator | None = None,
        weight_caps: Mapping[str, float] | None = None,
        tamper_reduced: Callable[[bytes], bytes] | None = None,
        tamper_verified: Callable[[bytes], bytes] | None = None,
        signer: AttestationSigner | None = None,
        opener: AttestationVerifier | None = None,
    ) -> None:
        if me not in spec.members:
            raise ConfigError(f"{me!r} is not a member of the round's group")
        if not _finite_positive(weight):
            raise ConfigError(f"weight must be finite and > 0, not {weight!r}")
        for name, t in (("now", now), ("phase_timeout", phase_timeout)):
            if not math.isfinite(t):
                raise ConfigError(f"{name} must be finite, not {t!r}")
        if not phase_timeout > 0:
            raise ConfigError(f"phase_timeout must be > 0, not {phase_timeout!r}")
        if not (math.isfinite(round_timeout) and round_timeout >= phase_timeout):
            raise ConfigError(
                f"round_timeout ({round_timeout!r}) must be finite and >= phase_timeout "
                f"({phase_timeout!r})"
            )
        if spec.sealed and (signer is None or opener is None):
            raise ConfigError("a round with sealed parts needs a signer and an opener")
        self.spec = spec
        self.me = me
        self._signer = signer
        self._opener = opener
        self._codec = spec.make_codec()
        size = self._codec.encoded_size(spec.numel)
        if len(payload) != size:
            raise ConfigError(
                f"payload has {len(payload)} bytes, expected {size} for {spec.numel} values "
                f"of {self._codec.name}"
            )
        m = len(spec.members)
        self._payload = bytes(payload)
        self._weight = float(weight)
        self._validator = validator
        caps = dict(weight_caps) if weight_caps else {}
        if math.isfinite(spec.weight_cap):  # the run's cap, the same for every member
            for mem in spec.members:
                caps[mem] = min(caps.get(mem, math.inf), float(spec.weight_cap))
        self._caps = caps or None
        self._tamper_reduced = tamper_reduced
        self._tamper_verified = tamper_verified
        self._bounds = spec.bounds()
        self._index = {mem: i for i, mem in enumerate(spec.members)}
        self._mine = self._index[me]
        self._phase_deadline = now + phase_timeout
        self._round_deadline = now + round_timeout
        self._t0 = now
        self._parts_in_s: float | None = None
        self._done_s: float | None = None
        self._state: State = "running"
        self._started = False
        self._bytes_sent = 0
        self._bytes_received = 0

        # verification (RoundSpec.verify_owners): who verifies which chunk, our own parts'
        # digests, every member's commitments and weights as it told us, the claims
        self._verify = spec.verify_owners and m > 1
        self._verifier = spec.verifiers() if self._verify else tuple(range(m))
        self._my_digests: tuple[bytes, ...] = ()
        self._commit: list[tuple[bytes, ...] | None] = [None] * m
        self._weight_of: list[float | None] = [None] * m
        self._owner_claim: list[_Claim | None] = [None] * m
        self._ver_claim: list[_Claim | None] = [None] * m
        self._settled = [not self._verify] * m
        self._disputed: set[int] = set()
        self._evidence: dict[int, Evidence] = {}
        if self._verify:
            self._my_digests = tuple(_sha(self._piece(j)) for j in range(m))
            self._commit[self._mine] = self._my_digests
            self._weight_of[self._mine] = self._weight

        # as owner of chunk self._mine (and verifier of self._vslot.chunk): one contribution
        # per member, in member order; our own input must be sound (CodecError if not)
        self._slot = self._new_slot(self._mine)
        self._vslot: _Slot | None = None
        if self._verify:
            self._vslot = self._new_slot(self._verifier.index(self._mine))
        self._reduced_mine = False
        # as member: every owner's reduced chunk, its payload (to spot equivocation) and
        # the total weight it reported
        self._chunks: list[F32Array | None] = [None] * m
        self._result: F32Array | None = None
        self._chunk_bytes: list[bytes | None] = [None] * m
        self._total_weight: float | None = None

    def _piece(self, j: int) -> bytes:
        a, b = self._bounds[j]
        return self._codec.slice_payload(self._payload, self.spec.numel, a, b)

    def _new_slot(self, j: int) -> _Slot:
        m = len(self.spec.members)
        a, b = self._bounds[j]
        own = self._piece(j)
        slot = _Slot(j, [None] * m, [None] * m, seals=[b""] * m)
        slot.decoded[self._mine] = self._codec.decode(own, b - a)
        slot.parts[self._mine] = Contribution(own, self._weight)
        slot.seals[self._mine] = self._seal(j, own)
        return slot

    def _seal(self, j: int, piece: bytes) -> bytes:
        """This member's seal over its part ``piece`` of chunk ``j`` (b"" when unsealed)."""
        if not self.spec.sealed:
            return b""
        assert self._signer is not None
        k = self.spec.key
        return seal_part(
            self._signer, k.run_id, k.fragment, k.round, self.me, j, self._weight, piece
        )

    # -- queries ---------------------------------------------------------------------------
    @property
    def state(self) -> State:
        """``"running"``, then ``"done"`` or ``"failed"`` for good."""
        return self._state

    @property
    def next_deadline(self) -> float | None:
        """When :meth:`tick` must next be called: the earliest pending deadline, or None."""
        if self._state != "running":
            return None
        return self._round_deadline if self._parts_in() else self._phase_deadline

    @property
    def bytes_sent(self) -> int:
        """Payload bytes of the parts, reduced chunks and evidence this member has sent."""
        return self._bytes_sent

    @property
    def bytes_received(self) -> int:
        """Payload bytes of the parts, reduced chunks and evidence of this round it has
        received."""
        return self._bytes_received

    @property
    def verifies(self) -> int | None:
        """The chunk this member verifies, or None when the round verifies no owner."""
        return self._vslot.chunk if self._vslot is not None else None

    def _parts_in(self) -> bool:
        """Every part this member collects is in and has been reduced (or verified)."""
        return self._slot.done and (self._vslot is None or self._vslot.done)

    # -- events ----------------------------------------------------------------------------
    def start(self) -> list[Action]:
        """Send this member's chunk ``j`` to owner ``j`` for every other member (and, when
        owners are verified, to chunk ``j``'s verifier too).

        A group of one is done at once with its own decoded payload. Call it once;
        messages received earlier are kept.
        """
        if self._started:
            raise ConfigError("start() was already called")
        self._started = True
        if self._state != "running":
            return []
        key, members = self.spec.key, self.spec.members
        if len(members) == 1:
            return self._finish_done([self._codec.decode(self._payload, self.spec.numel)])
        out: list[Action] = []
        for j, member in enumerate(members):
            to = [member] if j != self._mine else []
            if self._verify and self._verifier[j] != self._mine:
                to.append(members[self._verifier[j]])
            if not to:
                continue
            piece = self._piece(j)
            part = Part(
                key.run_id,
                key.fragment,
                key.round,
                self.me,
                j,
                self._weight,
                piece,
                self._my_digests,
                self._seal(j, piece),
                group=key.group,
            )
            out.extend(self._send(peer, part) for peer in to)
        # Our own chunk may already be complete if every other part arrived before start.
        out.extend(self._maybe_reduce())
        if self._state == "running":
            out.extend(self._maybe_verify())
        return out

    @property
    def timings(self) -> tuple[float | None, float | None]:
        """Seconds from the start until every part of this member's chunk was in, and
        until the round was done (None: not reached): what
        :class:`~atoll.protocol.deadlines.RoundDeadlines` learns from."""
        return self._parts_in_s, self._done_s

    def receive(self, msg: Message, *, now: float) -> list[Action]:
        """Handle a message from a peer; returns what to do.

        Messages of another round or from non-members (or claiming to come from this
        member) are ignored, as is everything once the round is over.
        """
        if self._state != "running" or not self._relevant(msg):
            return []
        actions = self._receive(msg, now)
        if self._parts_in_s is None and self._parts_in():
            self._parts_in_s = now - self._t0
        if self._done_s is None and any(isinstance(a, Done) for a in actions):
            self._done_s = now - self._t0
        return actions

    def _receive(self, msg: Message, now: float) -> list[Action]:
        # A message handled after a deadline passed times the round out first, so that the
        # outcome does not depend on whether the driver called tick() or receive() first.
        timed_out = self.tick(now)
        if timed_out:
            return timed_out
        if isinstance(msg, Abort):
            return self._on_abort(msg)
        if isinstance(msg, Verified):
            return self._on_verified(msg)
        if isinstance(msg, Evidence):
            self._bytes_received += sum(len(p) for p in msg.payloads if isinstance(p, bytes))
            return self._on_evidence(msg)
        self._bytes_received += len(msg.payload)
        if isinstance(msg, Part):
            return self._on_part(msg)
        return self._on_reduced(msg)

    def tick(self, now: float) -> list[Action]:
        """Enforce the deadlines: past one with the round still running, it fails."""
        if self._state != "running":
            return []
        members = self.spec.members
        if now >= self._round_deadline:
            missing = [members[j] for j, c in enumerate(self._chunks) if c is None]
            if self._verify:
                unverified = [
                    members[self._verifier[j]]
                    for j, c in enumerate(self._ver_claim)
                    if c is None and members[self._verifier[j]] not in missing
                ]
                if self._disputed and not missing and not unverified:
                    j = min(self._disputed)
                    return self._fail(
                        f"owner {members[j]} and verifier {members[self._verifier[j]]} of "
                        f"chunk {j} disagree and no evidence settled it by the deadline",
                        suspects=(members[j], members[self._verifier[j]]),
                    )
                missing += unverified
            return self._fail(
                f"timeout: reduced or verified chunks of {missing} missing at the deadline",
                missing=tuple(missing),
            )
        if not self._parts_in() and now >= self._phase_deadline:
            missing = self._slot.missing(members) if not self._slot.done else []
            if self._vslot is not None and not self._vslot.done:
                missing += [p for p in self._vslot.missing(members) if p not in missing]
            return self._fail(
                f"timeout: parts of {missing} for chunk {self._mine}"
                + (f" or {self._vslot.chunk}" if self._vslot is not None else "")
                + " missing",
                missing=tuple(missing),
            )
        return []

    def peer_lost(self, peer: str, *, now: float) -> list[Action]:
        """The transport lost ``peer``; fail if something is still needed from it."""
        if self._state != "running" or peer == self.me or peer not in self._index:
            return []
        timed_out = self.tick(now)
        if timed_out:
            return timed_out
        j = self._index[peer]
        for slot in (self._slot, self._vslot):
            if slot is not None and not slot.done and slot.parts[j] is None:
                return self._fail(f"lost {peer} before its part for chunk {slot.chunk}", skip=peer)
        if self._chunks[j] is None:
            return self._fail(f"lost {peer} before its reduced chunk {j}", skip=peer)
        if self._verify:
            t = self._verifier.index(j)
            if self._ver_claim[t] is None:
                return self._fail(f"lost {peer} before it verified chunk {t}", skip=peer)
            if any(j in (d, self._verifier[d]) for d in self._disputed):
                return self._fail(f"lost {peer} in a dispute over its chunk", skip=peer)
        return []

    # -- handlers --------------------------------------------------------------------------
    def _relevant(self, msg: Message) -> bool:
        key = self.spec.key
        kinds = (
            (Part, Reduced, Abort, Verified, Evidence) if self._verify else (Part, Reduced, Abort)
        )
        return (
            isinstance(msg, kinds)
            and (msg.run_id, msg.fragment, msg.round, msg.group)
            == (key.run_id, key.fragment, key.round, key.group)
            and msg.sender in self._index
            and msg.sender != self.me
        )

    def _on_abort(self, msg: Abort) -> list[Action]:
        reason = f"aborted by {msg.sender}: {_clip(str(msg.reason))}"
        proof = msg.proof() if self.spec.sealed else None
        if proof is None:
            return self._fail(reason, skip=msg.sender)
        assert self._opener is not None
        self._bytes_received += sum(len(p) for p in msg.payloads if isinstance(p, bytes))
        k = self.spec.key
        convicted, why = judge(
            proof,
            opener=self._opener,
            run_id=k.run_id,
            fragment=k.fragment,
            round_=k.round,
            members=self.spec.members,
            bounds=self._bounds,
            codec=self._codec,
            checks=self.spec.checks,
            caps=self._caps,
            me=self.me,
        )
        if convicted is not None:
            reason = f"{reason}; proven against {convicted}: {_clip(why)}"
        return self._fail(reason, culprit=convicted, skip=msg.sender)

    def _on_part(self, msg: Part) -> list[Action]:
        sender = msg.sender
        i = self._index[sender]
        if msg.chunk == self._mine:
            slot = self._slot
        elif self._vslot is not None and msg.chunk == self._vslot.chunk:
            slot = self._vslot
        else:
            slot = None
        prev = slot.parts[i] if slot is not None else None
        if prev is not None:
            assert slot is not None
            if prev.payload == msg.payload and prev.weight == msg.weight:
                return []  # a harmless duplicate
            why = f"{sender} sent two different parts (equivocation)"
            if self._seal_problem(msg) is not None:
                return self._reject(sender, why)  # the second one proves nothing
            proof = self._proof_of(slot.chunk, {i: (prev.weight, prev.payload, slot.seals[i])})
            if proof is not None:
                twin = (float(msg.weight), bytes(msg.payload), msg.seal)
                proof = dataclasses.replace(proof, twin=twin)
            return self._reject(sender, why, proof)
        if slot is None:
            return self._reject(
                sender, f"{sender} sent a part for chunk {msg.chunk} to the owner of {self._mine}"
            )
        unsealed = self._seal_problem(msg)
        if unsealed is not None:
            return self._reject(sender, _clip(unsealed))
        alone = self._proof_of(slot.chunk, {i: (msg.weight, bytes(msg.payload), msg.seal)})
        if not _finite_positive(msg.weight):
            return self._reject(sender, f"{sender} claimed weight {msg.weight!r}", alone)
        if self._verify:
            bad = self._commitment_error(msg, i)
            if bad is not None:  # the sealed part convicts when it is bad by itself
                return self._reject(sender, bad, alone)
        a, b = self._bounds[slot.chunk]
        try:
            values = self._codec.decode(msg.payload, b - a)
            if self._validator is not None:
                self._validator(msg, values)
        except RejectedInput as e:
            return self._reject(sender, f"part of {sender} rejected: {_clip(str(e))}", alone)
        slot.parts[i] = Contribution(bytes(msg.payload), float(msg.weight))
        slot.decoded[i] = values
        if slot.seals:
            slot.seals[i] = msg.seal
        out = self._maybe_reduce() if slot is self._slot else self._maybe_verify()
        if self._state == "running" and self._disputed:
            out.extend(self._maybe_judge())  # the commitments a judgement waits for
        return out

    def _seal_problem(self, msg: Part) -> str | None:
        """Why ``msg``'s seal does not prove its sender sent it (None when it does, and
        in a round without seals)."""
        if not self.spec.sealed:
            return None
        assert self._opener is not None
        k = self.spec.key
        return seal_problem(
            self._opener,
            msg.seal,
            k.run_id,
            k.fragment,
            k.round,
            msg.sender,
            msg.chunk,
            msg.weight,
            msg.payload,
        )

    def _commitment_error(self, msg: Part, i: int) -> str | None:
        """Why ``msg`` breaks its sender's commitments (the digest list every part of a
        verified round carries), or None. A sender must send every member the same list
        and weight, and each part must hash to its entry."""
        sender, n = msg.sender, len(self.spec.members)
        if not _digest_list(msg.digests, n):
            return f"{sender} sent a part without its {n} part digests"
        if msg.digests[msg.chunk] != _sha(msg.payload):
            return f"part {msg.chunk} of {sender} does not match the digest it committed to"
        prev, weight = self._commit[i], self._weight_of[i]
        if (prev is not None and prev != msg.digests) or (
            weight is not None and weight != msg.weight
        ):
            return f"{sender} committed to two different part lists or weights (equivocation)"
        self._commit[i] = tuple(msg.digests)
        self._weight_of[i] = float(msg.weight)
        return None

    def _on_reduced(self, msg: Reduced) -> list[Action]:
        sender, j = msg.sender, msg.chunk
        if not (isinstance(j, int) and 0 <= j < len(self.spec.members)):
            return self._reject(sender, f"{sender} sent a reduced chunk {j!r} that does not exist")
        if self.spec.members[j] != sender:
            return self._reject(sender, f"{sender} sent reduced chunk {j}, which it does not own")
        prev = self._chunk_bytes[j]
        if prev is not None:
            if prev == msg.payload and msg.total_weight == self._total_weight:
                return []
            return self._reject(sender, f"{sender} sent two different reduced chunks {j}")
        if not _finite_positive(msg.total_weight):
            return self._reject(sender, f"{sender} reported total weight {msg.total_weight!r}")
        if self._verify:
            bad = self._claim_error(msg.part_digests, j, "owner")
            if bad is not None:
                return self._reject(sender, bad)
        values = self._slot_of(j)
        try:
            self._codec.decode_into(msg.payload, values.size, values)
        except CodecError as e:
            return self._reject(sender, f"reduced chunk {j} of {sender}: {_clip(str(e))}")
        return self._accept_chunk(
            j, bytes(msg.payload), values, float(msg.total_weight), tuple(msg.part_digests)
        )

    def _claim_error(self, digests: object, j: int, role: str) -> str | None:
        """Why an owner's or verifier's list of chunk ``j``'s part digests is wrong, as this
        member knows first-hand (its own part), or None."""
        who = self.spec.members[j if role == "owner" else self._verifier[j]]
        if not _digest_list(digests, len(self.spec.members)):
            return f"{role} {who} of chunk {j} sent no valid list of part digests"
        assert isinstance(digests, tuple)
        if digests[self._mine] != self._my_digests[j]:
            return f"{role} {who} of chunk {j} did not use {self.me}'s part"
        return None

    def _on_verified(self, msg: Verified) -> list[Action]:
        sender, j = msg.sender, msg.chunk
        members = self.spec.members
        if not (isinstance(j, int) and 0 <= j < len(members)):
            return self._reject(sender, f"{sender} verified a chunk {j!r} that does not exist")
        if members[self._verifier[j]] != sender:
            return self._reject(sender, f"{sender} verified chunk {j}, which it does not verify")
        claim = _Claim(bytes(msg.digest), float(msg.total_weight), tuple(msg.part_digests))
        prev = self._ver_claim[j]
        if prev is not None:
            if prev == claim:
                return []
            return self._reject(sender, f"{sender} sent two different verdicts on chunk {j}")
        if not _finite_positive(msg.total_weight) or len(msg.digest) != DIGEST_BYTES:
            return self._reject(sender, f"{sender} sent a malformed verdict on chunk {j}")
        bad = self._claim_error(msg.part_digests, j, "verifier")
        if bad is not None:
            return self._reject(sender, bad)
        self._ver_claim[j] = claim
        return self._settle(j)

    def _on_evidence(self, msg: Evidence) -> list[Action]:
        sender, j = msg.sender, msg.chunk
        members = self.spec.members
        n = len(members)
        if not (isinstance(j, int) and 0 <= j < n) or sender not in (
            members[j],
            members[self._verifier[j]],
        ):
            return self._reject(sender, f"{sender} sent evidence on chunk {j!r}, not its own")
        if len(msg.weights) != n or len(msg.payloads) != n:
            return self._reject(sender, f"{sender} sent evidence with {len(msg.payloads)} parts")
        if j in self._evidence or self._settled[j]:
            # a second piece of evidence adds nothing; a chunk settled here was confirmed by
            # both of its checkers, one of whom is honest by assumption
            return []
        self._evidence[j] = msg
        self._disputed.add(j)  # the sender says the owner and the verifier disagree
        return self._maybe_judge()

    def _slot_of(self, j: int) -> F32Array:
        """Where chunk ``j`` of the average goes: a slice of the one result vector (each
        chunk is decoded straight into it, so no chunk is copied a second time)."""
        if self._result is None:
            self._result = np.empty(self.spec.numel, dtype=np.float32)
        a, b = self._bounds[j]
        return self._result[a:b]

    # -- steps -----------------------------------------------------------------------------
    def _reduce(self, slot: _Slot) -> tuple[bytes, float, tuple[bytes, ...]] | list[Action]:
        """Check and reduce a full slot: ``(encoded chunk, total weight, part digests)``, or
        the failure's actions (a part refused by the group checks, an overflow)."""
        parts = [p for p in slot.parts if p is not None]
        a, b = self._bounds[slot.chunk]
        total = math.fsum(p.weight for p in parts)
        rejected = self._check_group(slot, parts)
        if rejected is not None:
            return rejected
        try:
            payload = reduce_encoded(
                parts,
                self._codec,
                b - a,
                rng=self._rng(slot.chunk),
                decoded=slot.decoded,
                rule=self.spec.robust,
            )
        except RejectedInput as e:  # the mean overflowed: nobody in particular is to blame
            return self._fail(f"reduction of chunk {slot.chunk} failed: {_clip(str(e))}")
        digests = tuple(_sha(p.payload) for p in parts) if self._verify else ()
        return payload, total, digests

    def _reduce_ready(
        self, slot: _Slot, tamper: Callable[[bytes], bytes] | None
    ) -> list[Action] | tuple[bytes, float, tuple[bytes, ...]]:
        """``slot`` reduced once every part is in (nothing yet: ``[]``; a failure: its
        actions), as the owner and the verifier of a chunk both do; ``tamper`` (tests
        only) alters the encoded result."""
        if slot.done or not self._started or any(p is None for p in slot.parts):
            return []
        reduced = self._reduce(slot)
        if isinstance(reduced, list) or tamper is None:
            return reduced
        payload, total, digests = reduced
        return tamper(payload), total, digests

    def _maybe_reduce(self) -> list[Action]:
        """Once every part of our chunk is in: mean in fp32, encode once, broadcast."""
        slot = self._slot
        reduced = self._reduce_ready(slot, self._tamper_reduced)  # tamper: a hostile owner
        if isinstance(reduced, list):
            return reduced
        payload, total, digests = reduced
        values = self._slot_of(self._mine)
        try:
            self._codec.decode_into(payload, values.size, values)
        except CodecError as e:
            return self._fail(f"reduction of chunk {self._mine} failed: {_clip(str(e))}")
        slot.done = self._reduced_mine = True
        key = self.spec.key
        red = Reduced(
            key.run_id,
            key.fragment,
            key.round,
            self.me,
            self._mine,
            total,
            payload,
            digests,
            group=key.group,
        )
        out: list[Action] = [self._send(m, red) for m in self.spec.members if m != self.me]
        out.extend(self._accept_chunk(self._mine, payload, values, total, digests))
        return out

    def _maybe_verify(self) -> list[Action]:
        """Once every part of the chunk we verify is in: reduce it as its owner must, and
        announce the digest of the result to every member."""
        slot = self._vslot
        if slot is None:
            return []
        reduced = self._reduce_ready(slot, self._tamper_verified)  # a hostile verifier
        if isinstance(reduced, list):
            return reduced
        payload, total, digests = reduced
        slot.done = True
        j, key = slot.chunk, self.spec.key
        claim = _Claim(_sha(payload), total, digests)
        self._ver_claim[j] = claim
        ver = Verified(
            key.run_id,
            key.fragment,
            key.round,
            self.me,
            j,
            total,
            claim.digest,
            digests,
            group=key.group,
        )
        out: list[Action] = [Send(m, ver) for m in self.spec.members if m != self.me]
        out.extend(self._settle(j))
        return out

    def _check_group(self, slot: _Slot, parts: list[Contribution]) -> list[Action] | None:
        """The group checks of a chunk's parts (:mod:`~atoll.protocol.checks`): None when
        every part passes, else the round fails naming the first other member that failed
        (this member's own part failing blames nobody: it cannot strike itself)."""
        checks = self.spec.checks
        if checks is None and self._caps is None:
            return None
        if checks is None:  # caps only
            checks = PartChecks(norm_factor=math.inf, weight_factor=math.inf)
        decoded = [x for x in slot.decoded if x is not None]
        found = violations(
            self.spec.members, decoded, [p.weight for p in parts], checks, self._caps
        )
        if not found:
            return None
        reason = "; ".join(f"{v.peer}: {v.reason}" for v in found)
        others = [v.peer for v in found if v.peer != self.me]
        culprit = others[0] if others else None
        reason = f"parts for chunk {slot.chunk} rejected: {_clip(reason)}"
        every = {
            i: (p.weight, p.payload, slot.seals[i] if slot.seals else b"")
            for i, p in enumerate(parts)
        }
        proof = self._proof_of(slot.chunk, every) if culprit is not None else None
        return self._fail(reason, culprit=culprit, proof=proof)

    def _accept_chunk(
        self,
        j: int,
        payload: bytes,
        values: F32Array,
        total_weight: float,
        part_digests: tuple[bytes, ...] = (),
    ) -> list[Action]:
        if self._total_weight is None:
            self._total_weight = total_weight
        elif total_weight != self._total_weight:
            # Owners sum the same weights in the same order; a difference means a member
            # told owners different weights. We cannot tell who, so nobody is named.
            return self._fail(
                f"owners disagree on the total weight ({self._total_weight!r} vs "
                f"{total_weight!r} for chunk {j}): some member sent different weights"
            )
        self._chunk_bytes[j] = payload
        self._chunks[j] = values
        if self._verify:
            self._owner_claim[j] = _Claim(_sha(payload), total_weight, part_digests)
            return self._settle(j)
        return self._maybe_finish()

    def _settle(self, j: int) -> list[Action]:
        """Compare chunk ``j``'s owner's claim with its verifier's once both are in.

        Agreeing, the chunk may be committed. Disagreeing, the round is lost; this member
        knows who lied when it is one of the two (its own claim is right), and then shows
        the parts to everybody (:class:`Evidence`); anyone else waits for that evidence.
        """
        owner, ver = self._owner_claim[j], self._ver_claim[j]
        if owner is None or ver is None or self._settled[j]:
            return []
        if owner == ver:
            self._settled[j] = True
            return self._maybe_finish()
        members = self.spec.members
        names = (members[j], members[self._verifier[j]])
        if owner.parts != ver.parts:
            # The two list different parts: one of them lies, or a member gave them two
            # different parts (each matching the commitment it gave that one). Without
            # signed commitments nobody can prove which; nobody is named.
            diff = [
                members[k]
                for k, (a, b) in enumerate(zip(owner.parts, ver.parts, strict=True))
                if a != b
            ]
            return self._fail(
                f"owner {names[0]} and verifier {names[1]} of chunk {j} list different parts "
                f"of {diff}: one of them lies, or those members equivocated",
                suspects=(*names, *(d for d in diff if d not in names)),
                abort=False,  # whoever holds both claims sees it; an Abort could overtake
                # a member's first-hand proof against the owner (its own part misused)
            )
        ours = {self._mine: self._slot, self._verifier.index(self._mine): self._vslot}.get(j)
        if ours is None:
            self._disputed.add(j)
            return self._maybe_judge()
        other = members[self._verifier[j]] if ours is self._slot else members[j]
        role = "verifier" if ours is self._slot else "owner"
        parts = [p for p in ours.parts if p is not None]
        key = self.spec.key
        ev = Evidence(
            key.run_id,
            key.fragment,
            key.round,
            self.me,
            j,
            tuple(p.weight for p in parts),
            tuple(p.payload for p in parts),
            group=key.group,
        )
        out: list[Action] = [self._send(m, ev) for m in members if m not in (self.me, other)]
        # no Abort: the evidence itself ends the round at every member, and an Abort
        # overtaking it would leave them unable to name the liar
        out.extend(
            self._fail(
                f"{role} {other} of chunk {j} disagrees with this member's own reduction",
                culprit=other,
                abort=False,
            )
        )
        return out

    def _maybe_judge(self) -> list[Action]:
        """Judge a disputed chunk from the evidence once its claims and every commitment
        it is checked against are in (see the module docstring)."""
        for j in sorted(self._disputed):
            ev = self._evidence.get(j)
            owner, ver = self._owner_claim[j], self._ver_claim[j]
            if ev is None or owner is None or ver is None:
                continue
            if any(c is None for c in self._commit):
                continue  # a part whose commitment we check the evidence against is due
            return self._judge(j, ev, owner, ver)
        return []

    def _judge(self, j: int, ev: Evidence, owner: _Claim, ver: _Claim) -> list[Action]:
        members = self.spec.members
        names = {"owner": members[j], "verifier": members[self._verifier[j]]}
        by = "owner" if ev.sender == names["owner"] else "verifier"
        mine = owner if by == "owner" else ver
        shown = tuple(_sha(p) for p in ev.payloads)
        if shown != mine.parts or ev.weights[self._mine] != self._weight:
            return self._fail(
                f"{by} {ev.sender} showed parts of chunk {j} other than those it claimed",
                culprit=ev.sender,
                abort=False,
            )
        for k, (d, w) in enumerate(zip(shown, ev.weights, strict=True)):
            commit, weight = self._commit[k], self._weight_of[k]
            assert commit is not None
            if d != commit[j] or w != weight:
                # either k told us another part than it gave the pair, or the evidence is
                # forged: unsigned, nobody can tell which
                return self._fail(
                    f"the part of {members[k]} in {by} {ev.sender}'s evidence on chunk {j} "
                    f"is not the one {members[k]} committed to here",
                    abort=False,
                    suspects=(ev.sender, members[k]),
                )
        slot = _Slot(
            j,
            [Contribution(p, float(w)) for p, w in zip(ev.payloads, ev.weights, strict=True)],
            [None] * len(members),
        )
        truth = self._recompute(slot)
        wrong = [
            role
            for role, claim in (("owner", owner), ("verifier", ver))
            if truth is None or claim != truth
        ]
        if not wrong:  # cannot happen: the claims differ, and the truth is one value
            wrong = [by]
        culprit = names[wrong[0]]
        return self._fail(
            f"{' and '.join(f'{r} {names[r]}' for r in wrong)} of chunk {j} claimed a chunk "
            f"that its parts do not reduce to (judged from {by} {ev.sender}'s evidence)",
            culprit=culprit,
            abort=False,
            suspects=tuple(names[r] for r in wrong),
        )

    def _recompute(self, slot: _Slot) -> _Claim | None:
        """The claim an honest owner makes on ``slot``'s parts; None when the parts
        do not decode, fail the group checks or overflow (an honest owner fails then)."""
        a, b = self._bounds[slot.chunk]
        parts = [p for p in slot.parts if p is not None]
        try:
            for i, p in enumerate(parts):
                slot.decoded[i] = self._codec.decode(p.payload, b - a)
        except CodecError:
            return None
        checks = self.spec.checks
        if checks is not None or self._caps is not None:
            checks = checks or PartChecks(norm_factor=math.inf, weight_factor=math.inf)
            decoded = [x for x in slot.decoded if x is not None]
            if violations(
                self.spec.members, decoded, [p.weight for p in parts], checks, self._caps
            ):
                return None
        try:
            payload = reduce_encoded(
                parts,
                self._codec,
                b - a,
                rng=self._rng(slot.chunk),
                decoded=slot.decoded,
                rule=self.spec.robust,
            )
        except RejectedInput:
            return None
        total = math.fsum(p.weight for p in parts)
        return _Claim(_sha(payload), total, tuple(_sha(p.payload) for p in parts))

    def _maybe_finish(self) -> list[Action]:
        if any(c is None for c in self._chunks) or not all(self._settled):
            return []
        if self._result is not None:  # every chunk was decoded into its slice of it
            return self._finish_done([self._result])
        return self._finish_done([c for c in self._chunks if c is not None])

    def _rng(self, chunk: int) -> np.random.Generator | None:
        """A generator for stochastic rounding of chunk ``chunk``, fixed by round and chunk.

        Only the owner encodes a chunk's mean, so members agree whatever it draws; seeding
        from the round makes a rerun reproducible, and lets a verifier draw the same.
        """
        if self._codec.name != "e3m0-sr":
            return None
        key = self.spec.key
        tag = f"{key.run_id}\0{key.fragment}\0{key.round}\0{chunk}".encode()
        seed = int.from_bytes(hashlib.sha256(tag).digest()[:16], "little")
        return np.random.default_rng(seed)

    # -- endings ---------------------------------------------------------------------------
    def _send(self, to: str, msg: Message) -> Send:
        if isinstance(msg, Part | Reduced):
            self._bytes_sent += len(msg.payload)
        elif isinstance(msg, Evidence | Abort):
            self._bytes_sent += sum(len(p) for p in msg.payloads)
        return Send(to, msg)

    def _finish_done(self, chunks: list[F32Array]) -> list[Action]:
        self._state = "done"
        if len(chunks) == 1:
            averaged = chunks[0]
        else:
            averaged = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        averaged = averaged.astype(np.float32, copy=False)
        self._release()
        return [Done(averaged)]

    def _reject(self, culprit: str, reason: str, proof: Proof | None = None) -> list[Action]:
        return self._fail(reason, culprit=culprit, proof=proof)

    def _proof_of(self, j: int, parts: Mapping[int, tuple[float, bytes, bytes]]) -> Proof | None:
        """The proof an abort carries in a sealed round: ``parts`` (member index ->
        weight, payload, seal) of chunk ``j``, in member order; None when unsealed."""
        if not self.spec.sealed:
            return None
        m = range(len(self.spec.members))
        return Proof(
            j,
            tuple(float(parts[i][0]) if i in parts else 0.0 for i in m),
            tuple(parts[i][1] if i in parts else b"" for i in m),
            tuple(parts[i][2] if i in parts else b"" for i in m),
        )

    def _fail(
        self,
        reason: str,
        *,
        culprit: str | None = None,
        skip: str | None = None,
        missing: tuple[str, ...] = (),
        abort: bool = True,
        suspects: tuple[str, ...] = (),
        proof: Proof | None = None,
    ) -> list[Action]:
        """Roll back: tell every other member (but ``skip``) to abort, with ``proof``
        when there is one, then fail."""
        self._state = "failed"
        key = self.spec.key
        out: list[Action] = []
        if abort:
            msg = Abort.carrying(key, self.me, reason, proof)
            out = [self._send(m, msg) for m in self.spec.members if m != self.me and m != skip]
        out.append(Failed(reason, culprit, missing, suspects))
        self._release()
        return out

    def _release(self) -> None:
        """Drop the buffers: nothing of a finished round is used again."""
        m = len(self.spec.members)
        self._slot = _Slot(self._mine, [None] * m, [None] * m, self._slot.done)
        if self._vslot is not None:
            self._vslot = _Slot(self._vslot.chunk, [None] * m, [None] * m, self._vslot.done)
        self._chunks = [None] * m
        self._chunk_bytes = [None] * m
        self._evidence = {}
        self._result = None

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

The machine trusts the ``sender`` field of a message: the driver must check it against
the authenticated transport peer before calling :meth:`~AllReduceRound.receive`. Time is
passed in (``now``, any monotonic clock in seconds); nothing here reads a clock, opens a
socket or starts a thread.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from atoll.protocol.checks import PartChecks, violations
from atoll.protocol.codecs import Codec, make_codec
from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.messages import wire_message
from atoll.protocol.reduce import Contribution, chunk_bounds, reduce_encoded
from atoll.protocol.robust import RobustRule

__all__ = [
    "Abort",
    "Action",
    "AllReduceRound",
    "Done",
    "Failed",
    "Message",
    "Part",
    "Reduced",
    "RoundKey",
    "RoundSpec",
    "Send",
    "Validator",
]

F32Array = npt.NDArray[np.float32]

_MAX_REASON = 300  # characters of a peer's abort reason we repeat (a hostile one can be huge)


# --------------------------------------------------------------------------------------
# the round and its group
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RoundKey:
    """Names one round of one fragment of one run; every member of the group shares it.

    ``round`` is the fragment's global version the pseudo-gradient is taken against
    (:attr:`engine.SyncRequest.round`): members with different versions cannot average.
    """

    run_id: str
    fragment: int
    round: int


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
    """

    key: RoundKey
    members: tuple[str, ...]
    numel: int
    codec: str
    codec_block: int = 128
    robust: RobustRule = field(default_factory=RobustRule)
    checks: PartChecks | None = None

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

    def make_codec(self) -> Codec:
        """The round's codec (:func:`codecs.make_codec` of ``codec`` and ``codec_block``)."""
        return make_codec(self.codec, block=self.codec_block)

    def bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every member's chunk, in member order."""
        return chunk_bounds(self.numel, len(self.members), self.make_codec().align)


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


@wire_message(12)
@dataclass(frozen=True, slots=True)
class Abort:
    """The round failed at ``sender``; the receiver must roll back too."""

    run_id: str
    fragment: int
    round: int
    sender: str
    reason: str


Message: TypeAlias = Part | Reduced | Abort


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
class AllReduceRound:
    """One member's side of one round: reduce-scatter then all-gather, commit or roll back.

    The protocol is Streaming DiLoCo's low-precision all-reduce (arXiv 2501.18512):
    quantize once, reduce-scatter, fp32 weighted sum at each chunk's owner, quantize the
    mean once, all-gather. Its failure handling follows torchft (errors latched, the round
    committed or rolled back whole). See the module docstring for the guarantees.

    Args:
        spec: the group's agreement (key, members, size, codec).
        me: this member's id, one of ``spec.members``.
        payload: this member's encoding of its *whole* fragment delta with the round's codec
            (:attr:`engine.SyncRequest.payload`).
        weight: this member's token count, finite and > 0.
        now: the current time; the deadlines count from it.
        phase_timeout: seconds within which every member's part for this member's chunk
            must arrive (the reduce-scatter).
        round_timeout: seconds within which the whole round must finish (reduce-scatter and
            all-gather); at least ``phase_timeout``.
        validator: optional check of each received part (see :data:`Validator`).
        weight_caps: the largest token weight each listed peer may claim (e.g. from its
            measured throughput); a part above its sender's cap is rejected before the
            reduction, naming the sender. Applied whether or not ``spec.checks`` is set.

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
        self.spec = spec
        self.me = me
        self._codec = spec.make_codec()
        size = self._codec.encoded_size(spec.numel)
        if len(payload) != size:
            raise ConfigError(
                f"payload has {len(payload)} bytes, expected {size} for {spec.numel} values "
                f"of {self._codec.name}"
            )
        self._payload = bytes(payload)
        self._weight = float(weight)
        self._validator = validator
        self._caps = dict(weight_caps) if weight_caps else None
        self._bounds = spec.bounds()
        self._index = {m: i for i, m in enumerate(spec.members)}
        self._mine = self._index[me]
        self._phase_deadline = now + phase_timeout
        self._round_deadline = now + round_timeout
        self._state: State = "running"
        self._started = False
        self._bytes_sent = 0
        self._bytes_received = 0

        # as owner of chunk self._mine: one contribution per member, in member order
        a, b = self._bounds[self._mine]
        own = self._codec.slice_payload(self._payload, spec.numel, a, b)
        # our own input must be sound (CodecError if not); its decoding is kept for the mean
        self._decoded: list[F32Array | None] = [None] * len(spec.members)
        self._decoded[self._mine] = self._codec.decode(own, b - a)
        self._parts: list[Contribution | None] = [None] * len(spec.members)
        self._parts[self._mine] = Contribution(own, self._weight)
        self._reduced_mine = False
        # as member: every owner's reduced chunk, its payload (to spot equivocation) and
        # the total weight it reported
        self._chunks: list[F32Array | None] = [None] * len(spec.members)
        self._result: F32Array | None = None
        self._chunk_bytes: list[bytes | None] = [None] * len(spec.members)
        self._total_weight: float | None = None

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
        return self._round_deadline if self._reduced_mine else self._phase_deadline

    @property
    def bytes_sent(self) -> int:
        """Payload bytes of the parts and reduced chunks this member has sent."""
        return self._bytes_sent

    @property
    def bytes_received(self) -> int:
        """Payload bytes of the parts and reduced chunks of this round it has received."""
        return self._bytes_received

    # -- events ----------------------------------------------------------------------------
    def start(self) -> list[Action]:
        """Send this member's chunk ``j`` to owner ``j`` for every other member.

        A group of one is done at once with its own decoded payload. Call it once;
        messages received earlier are kept.
        """
        if self._started:
            raise ConfigError("start() was already called")
        self._started = True
        if self._state != "running":
            return []
        key, n = self.spec.key, self.spec.numel
        if len(self.spec.members) == 1:
            return self._finish_done([self._codec.decode(self._payload, n)])
        out: list[Action] = []
        for j, member in enumerate(self.spec.members):
            if j == self._mine:
                continue
            a, b = self._bounds[j]
            piece = self._codec.slice_payload(self._payload, n, a, b)
            part = Part(key.run_id, key.fragment, key.round, self.me, j, self._weight, piece)
            out.append(self._send(member, part))
        # Our own chunk may already be complete if every other part arrived before start.
        out.extend(self._maybe_reduce())
        return out

    def receive(self, msg: Message, *, now: float) -> list[Action]:
        """Handle a message from a peer; returns what to do.

        Messages of another round or from non-members (or claiming to come from this
        member) are ignored, as is everything once the round is over.
        """
        if self._state != "running" or not self._relevant(msg):
            return []
        # A message handled after a deadline passed times the round out first, so that the
        # outcome does not depend on whether the driver called tick() or receive() first.
        timed_out = self.tick(now)
        if timed_out:
            return timed_out
        if isinstance(msg, Abort):
            return self._on_abort(msg)
        self._bytes_received += len(msg.payload)
        if isinstance(msg, Part):
            return self._on_part(msg)
        return self._on_reduced(msg)

    def tick(self, now: float) -> list[Action]:
        """Enforce the deadlines: past one with the round still running, it fails."""
        if self._state != "running":
            return []
        if now >= self._round_deadline:
            missing = [self.spec.members[j] for j, c in enumerate(self._chunks) if c is None]
            return self._fail(
                f"timeout: reduced chunks of {missing} missing at the deadline",
                missing=tuple(missing),
            )
        if not self._reduced_mine and now >= self._phase_deadline:
            missing = [self.spec.members[j] for j, p in enumerate(self._parts) if p is None]
            return self._fail(
                f"timeout: parts of {missing} for chunk {self._mine} missing",
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
        if self._parts[j] is None and not self._reduced_mine:
            return self._fail(f"lost {peer} before its part for chunk {self._mine}", skip=peer)
        if self._chunks[j] is None:
            return self._fail(f"lost {peer} before its reduced chunk {j}", skip=peer)
        return []

    # -- handlers --------------------------------------------------------------------------
    def _relevant(self, msg: Message) -> bool:
        key = self.spec.key
        return (
            isinstance(msg, Part | Reduced | Abort)
            and (msg.run_id, msg.fragment, msg.round) == (key.run_id, key.fragment, key.round)
            and msg.sender in self._index
            and msg.sender != self.me
        )

    def _on_abort(self, msg: Abort) -> list[Action]:
        reason = _clip(str(msg.reason))
        return self._fail(f"aborted by {msg.sender}: {reason}", skip=msg.sender)

    def _on_part(self, msg: Part) -> list[Action]:
        sender = msg.sender
        i = self._index[sender]
        prev = self._parts[i]
        if prev is not None:
            if prev.payload == msg.payload and prev.weight == msg.weight:
                return []  # a harmless duplicate
            return self._reject(sender, f"{sender} sent two different parts (equivocation)")
        if msg.chunk != self._mine:
            return self._reject(
                sender, f"{sender} sent a part for chunk {msg.chunk} to the owner of {self._mine}"
            )
        if not _finite_positive(msg.weight):
            return self._reject(sender, f"{sender} claimed weight {msg.weight!r}")
        a, b = self._bounds[self._mine]
        try:
            values = self._codec.decode(msg.payload, b - a)
            if self._validator is not None:
                self._validator(msg, values)
        except RejectedInput as e:
            return self._reject(sender, f"part of {sender} rejected: {_clip(str(e))}")
        self._parts[i] = Contribution(bytes(msg.payload), float(msg.weight))
        self._decoded[i] = values
        return self._maybe_reduce()

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
        values = self._slot_of(j)
        try:
            self._codec.decode_into(msg.payload, values.size, values)
        except CodecError as e:
            return self._reject(sender, f"reduced chunk {j} of {sender}: {_clip(str(e))}")
        return self._accept_chunk(j, bytes(msg.payload), values, float(msg.total_weight))

    def _slot_of(self, j: int) -> F32Array:
        """Where chunk ``j`` of the average goes: a slice of the one result vector (each
        chunk is decoded straight into it, so no chunk is copied a second time)."""
        if self._result is None:
            self._result = np.empty(self.spec.numel, dtype=np.float32)
        a, b = self._bounds[j]
        return self._result[a:b]

    # -- steps -----------------------------------------------------------------------------
    def _maybe_reduce(self) -> list[Action]:
        """Once every part of our chunk is in: mean in fp32, encode once, broadcast."""
        if self._reduced_mine or not self._started or any(p is None for p in self._parts):
            return []
        parts = [p for p in self._parts if p is not None]
        a, b = self._bounds[self._mine]
        total = math.fsum(p.weight for p in parts)
        rejected = self._check_group(parts)
        if rejected is not None:
            return rejected
        try:
            payload = reduce_encoded(
                parts,
                self._codec,
                b - a,
                rng=self._rng(),
                decoded=self._decoded,
                rule=self.spec.robust,
            )
            values = self._slot_of(self._mine)
            self._codec.decode_into(payload, b - a, values)
        except RejectedInput as e:  # the mean overflowed: nobody in particular is to blame
            return self._fail(f"reduction of chunk {self._mine} failed: {_clip(str(e))}")
        self._reduced_mine = True
        key = self.spec.key
        out: list[Action] = []
        for member in self.spec.members:
            if member != self.me:
                red = Reduced(
                    key.run_id, key.fragment, key.round, self.me, self._mine, total, payload
                )
                out.append(self._send(member, red))
        out.extend(self._accept_chunk(self._mine, payload, values, total))
        return out

    def _check_group(self, parts: list[Contribution]) -> list[Action] | None:
        """The group checks of this chunk's parts (:mod:`~atoll.protocol.checks`): None when
        every part passes, else the round fails naming the first other member that failed
        (this member's own part failing blames nobody: it cannot strike itself)."""
        checks = self.spec.checks
        if checks is None and self._caps is None:
            return None
        if checks is None:  # caps only
            checks = PartChecks(norm_factor=math.inf, weight_factor=math.inf)
        decoded = [x for x in self._decoded if x is not None]
        found = violations(
            self.spec.members, decoded, [p.weight for p in parts], checks, self._caps
        )
        if not found:
            return None
        reason = "; ".join(f"{v.peer}: {v.reason}" for v in found)
        others = [v.peer for v in found if v.peer != self.me]
        culprit = others[0] if others else None
        reason = f"parts for chunk {self._mine} rejected: {_clip(reason)}"
        return self._fail(reason, culprit=culprit)

    def _accept_chunk(
        self, j: int, payload: bytes, values: F32Array, total_weight: float
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
        if any(c is None for c in self._chunks):
            return []
        if self._result is not None:  # every chunk was decoded into its slice of it
            return self._finish_done([self._result])
        return self._finish_done([c for c in self._chunks if c is not None])

    def _rng(self) -> np.random.Generator | None:
        """A generator for stochastic rounding at the owner, fixed by round and chunk.

        Only the owner encodes a chunk's mean, so members agree whatever it draws; seeding
        from the round makes a rerun reproducible.
        """
        if self._codec.name != "e3m0-sr":
            return None
        key = self.spec.key
        tag = f"{key.run_id}\0{key.fragment}\0{key.round}\0{self._mine}".encode()
        seed = int.from_bytes(hashlib.sha256(tag).digest()[:16], "little")
        return np.random.default_rng(seed)

    # -- endings ---------------------------------------------------------------------------
    def _send(self, to: str, msg: Message) -> Send:
        if isinstance(msg, Part | Reduced):
            self._bytes_sent += len(msg.payload)
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

    def _reject(self, culprit: str, reason: str) -> list[Action]:
        return self._fail(reason, culprit=culprit)

    def _fail(
        self,
        reason: str,
        *,
        culprit: str | None = None,
        skip: str | None = None,
        missing: tuple[str, ...] = (),
    ) -> list[Action]:
        """Roll back: tell every other member (but ``skip``) to abort, then fail."""
        self._state = "failed"
        key = self.spec.key
        out: list[Action] = [
            Send(m, Abort(key.run_id, key.fragment, key.round, self.me, reason))
            for m in self.spec.members
            if m != self.me and m != skip
        ]
        out.append(Failed(reason, culprit, missing))
        self._release()
        return out

    def _release(self) -> None:
        """Drop the buffers: nothing of a finished round is used again."""
        self._parts = [None] * len(self.spec.members)
        self._decoded = [None] * len(self.spec.members)
        self._chunks = [None] * len(self.spec.members)
        self._chunk_bytes = [None] * len(self.spec.members)
        self._result = None

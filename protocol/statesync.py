"""Fragment state transfer: how a peer whose global copy fell behind catches up.

Streaming DiLoCo (arXiv 2501.18512) keeps, per fragment, a global copy and an outer
optimizer state that every peer must hold identically, or their averages drift apart. In a
swarm a peer misses rounds (it was alone, its round rolled back, it joined late), and two
groups of one slot may apply different averages. Matchmaking already keeps peers of
different states apart (:func:`atoll.protocol.matchmaking.compat_key`); this module is how
such a peer *rebases*: it copies the state of the swarm's leading copy from a peer that
holds it, then groups with that peer again (the "rebase first or stay out" rule of
Decoupled DiLoCo's asynchronous learners, arXiv 2604.21428).

Pieces (sans-IO, numpy only):

- :class:`FragmentState`: version, outer-optimizer step count, inner step of the server,
  the global copy and the momentum buffer, with :meth:`~FragmentState.encode` to bytes
  and :func:`decode_state` back; :meth:`~FragmentState.digest` is the hash declared in
  the DHT and in matchmaking (two peers with equal digests hold the same bytes), a
  two-level hash over the encoding's 1 MiB pieces (:func:`state_digest`) so that a
  copy from several donors checks each piece as it arrives
  (:mod:`atoll.protocol.statefetch`);
- :func:`leading_state`: THE RULE for which (version, digest) of a fragment the swarm
  follows: the highest version; among equal versions, the one held by most peers; then
  the smallest digest. Every peer computes it from the same declarations and so agrees;
  a peer rebases when the leading state is not its own and is ahead of it
  (:func:`should_rebase`). Only *believed* states take part: a ``believes(version,
  digest)`` check (:class:`~atoll.protocol.certificate.CertifiedStates`: the seed, or a
  state with a valid certificate) leaves out what a peer merely declares, so a forged
  version 10^6 is never followed and nobody tries to fetch it;
- :class:`StateRequest` / :class:`StateChunk`: the wire messages (kinds 30 and 31). The
  encoding is cut into chunks of at most :data:`CHUNK_BYTES`; :class:`StateAssembler`
  puts them back together and checks every chunk against the first (same version, digest
  and total size), the offsets (contiguous, in order) and, at the end, the digest of the
  whole, so a peer cannot hand over state other than what it claims.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.messages import wire_message

__all__ = [
    "CHUNK_BYTES",
    "PIECE_BYTES",
    "PIECE_HASH_LEN",
    "Believes",
    "FragmentState",
    "StateAssembler",
    "StateChunk",
    "StateRequest",
    "believing_own",
    "chunks_of",
    "decode_state",
    "digest_of_pieces",
    "hashes_of",
    "leading_state",
    "piece_hashes",
    "pieces_in",
    "should_rebase",
    "state_bytes",
    "state_digest",
]

CHUNK_BYTES: int = 8 * 1024 * 1024
"""Most payload bytes of one :class:`StateChunk` (well under the 64 MiB frame limit)."""

_MAGIC = b"ATST"
_HEADER = struct.Struct(">4sQQQQ")  # magic, version, optimizer steps, inner step, numel
_ID = {"max_len": 128}
DIGEST_LEN = 32  # hex digits of a state digest (128 bits)

PIECE_BYTES: int = 1024 * 1024
"""Bytes of one piece of a state's encoding: the unit its digest hashes and a joiner
checks and fetches (:func:`state_digest`). Fixed: changing it changes every digest."""
PIECE_HASH_LEN = 32  # bytes of one piece's sha256
_DIGEST_MAGIC = b"ATSD"
_DIGEST_HEAD = struct.Struct(">4sQQQ")  # magic, piece size, total bytes, pieces

Believes = Callable[[int, str], bool]
"""``believes(version, digest)``: whether a declared state of the fragment may be
followed (certified, or the seed)."""


@dataclass(frozen=True, slots=True, eq=False)
class FragmentState:
    """The shared part of one fragment's outer state, as a peer serves it.

    ``step`` is the server's inner step when it answered: a joining peer starts its own
    step counter there, so that its sync slots line up with the swarm's.
    """

    version: int
    optimizer_steps: int
    step: int
    global_params: np.ndarray
    momentum: np.ndarray

    def __post_init__(self) -> None:
        for name in ("version", "optimizer_steps", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, not {value!r}")
        g = np.ascontiguousarray(self.global_params, dtype=np.float32).reshape(-1)
        m = np.ascontiguousarray(self.momentum, dtype=np.float32).reshape(-1)
        if g.size != m.size:
            raise ConfigError(f"global copy has {g.size} values, momentum {m.size}")
        object.__setattr__(self, "global_params", g)
        object.__setattr__(self, "momentum", m)

    def encode(self) -> bytes:
        """Header, global copy, momentum (float32 little-endian); see :func:`decode_state`."""
        return self._encode(0)

    def digest(self) -> str:
        """The two-level hash (:func:`state_digest`) of the encoding with ``step`` left out.

        Equal digests mean equal version, optimizer steps, global copy and momentum: the
        peers may average together.
        """
        return state_digest(self.version, self.optimizer_steps, self.global_params, self.momentum)

    def wire(self) -> bytes:
        """The encoding sent to a peer: as :meth:`encode`, with the server's step in it."""
        return self._encode(self.step)

    def _encode(self, step: int) -> bytes:
        n = self.global_params.size
        head = _HEADER.pack(_MAGIC, self.version, self.optimizer_steps, step, n)
        le = np.dtype("<f4")
        return head + self.global_params.astype(le).tobytes() + self.momentum.astype(le).tobytes()


def state_digest(
    version: int, optimizer_steps: int, global_params: np.ndarray, momentum: np.ndarray
) -> str:
    """:meth:`FragmentState.digest` of these values, hashed in place (no copy of the
    arrays on a little-endian machine): what a peer declares for its fragment.

    A two-level hash, as BitTorrent's piece hashes: the :meth:`FragmentState.encode`
    bytes are cut into pieces of :data:`PIECE_BYTES`, each piece is hashed
    (:func:`piece_hashes`) and the digest is the hash of a fixed header and that list
    (:func:`digest_of_pieces`). A joiner that holds a certified digest checks a donor's
    list against it once, then every piece from any donor against its own hash as it
    arrives (:mod:`atoll.protocol.statefetch`)."""
    hashes = piece_hashes(version, optimizer_steps, global_params, momentum)
    return digest_of_pieces(_HEADER.size + 8 * global_params.size, hashes)


def piece_hashes(
    version: int, optimizer_steps: int, global_params: np.ndarray, momentum: np.ndarray
) -> list[bytes]:
    """The sha256 of each :data:`PIECE_BYTES` piece of the state's encoding (the last one
    shorter), hashed in place over the header and both arrays."""
    head = _HEADER.pack(_MAGIC, version, optimizer_steps, 0, global_params.size)
    le = np.dtype("<f4")
    segments = [memoryview(head)] + [
        np.ascontiguousarray(a, dtype=le).reshape(-1).data.cast("B")
        for a in (global_params, momentum)
    ]
    return _hash_pieces(segments)


def _hash_pieces(segments: Iterable[memoryview]) -> list[bytes]:
    hashes: list[bytes] = []
    h = hashlib.sha256()
    room = PIECE_BYTES
    for seg in segments:
        at = 0
        while at < len(seg):
            take = min(room, len(seg) - at)
            h.update(seg[at : at + take])
            at += take
            room -= take
            if room == 0:
                hashes.append(h.digest())
                h, room = hashlib.sha256(), PIECE_BYTES
    if room < PIECE_BYTES or not hashes:
        hashes.append(h.digest())
    return hashes


def hashes_of(data: bytes | bytearray | memoryview) -> list[bytes]:
    """:func:`piece_hashes` of an encoding already in memory (:meth:`FragmentState.encode`)."""
    return _hash_pieces([memoryview(data).cast("B")])


def state_bytes(numel: int) -> int:
    """Bytes of the encoding of a state of ``numel`` values (header, two float32 arrays)."""
    return _HEADER.size + 8 * numel


def pieces_in(total: int) -> int:
    """How many pieces an encoding of ``total`` bytes has."""
    return max(1, -(-total // PIECE_BYTES))


def digest_of_pieces(total: int, hashes: Sequence[bytes]) -> str:
    """The state digest of an encoding of ``total`` bytes whose pieces hash to ``hashes``:
    sha256 (first 128 bits, hex) of a fixed header (magic, piece size, total, count) and
    the hashes in order."""
    h = hashlib.sha256(_DIGEST_HEAD.pack(_DIGEST_MAGIC, PIECE_BYTES, total, len(hashes)))
    for piece in hashes:
        h.update(piece)
    return h.hexdigest()[:DIGEST_LEN]


def decode_state(data: bytes | bytearray, numel: int) -> FragmentState:
    """The :class:`FragmentState` in ``data`` (:meth:`FragmentState.wire` or ``encode``).

    Raises :class:`~atoll.protocol.errors.CodecError` when the bytes are not a state of
    ``numel`` values (bad magic, wrong size) or hold non-finite values.
    """
    if len(data) < _HEADER.size:
        raise CodecError(f"fragment state of {len(data)} bytes is shorter than its header")
    magic, version, steps, step, n = _HEADER.unpack_from(data, 0)
    if magic != _MAGIC:
        raise CodecError("not a fragment state (bad magic)")
    if n != numel or len(data) != _HEADER.size + 8 * numel:
        raise CodecError(
            f"fragment state holds {n} values in {len(data)} bytes; expected {numel} values"
        )
    values = np.frombuffer(data, dtype="<f4", offset=_HEADER.size).astype(np.float32)
    if not np.isfinite(values).all():
        raise CodecError("fragment state holds non-finite values")
    return FragmentState(int(version), int(steps), int(step), values[:numel], values[numel:])


# --------------------------------------------------------------------------------------
# which state the swarm follows
# --------------------------------------------------------------------------------------
def leading_state(
    holdings: Iterable[tuple[str, int, str]], *, believes: Believes | None = None
) -> tuple[int, str] | None:
    """The ``(version, digest)`` the swarm follows, from ``(peer, version, digest)`` triples.

    Highest version first; then most peers holding it (each peer counted once per state);
    then the smallest digest. With ``believes``, states it does not believe are left out
    first. None when there is nothing to choose from.
    """
    seen: dict[tuple[int, str], set[str]] = {}
    for peer, version, digest in holdings:
        if believes is None or believes(version, digest):
            seen.setdefault((version, digest), set()).add(peer)
    if not seen:
        return None
    counts = Counter({k: len(v) for k, v in seen.items()})
    return min(counts, key=lambda k: (-k[0], -counts[k], k[1]))


def should_rebase(
    me: str,
    mine: tuple[int, str],
    holdings: Iterable[tuple[str, int, str]],
    *,
    believes: Believes | None = None,
) -> bool:
    """Whether peer ``me`` holding ``mine`` must copy the leading state before it may group.

    The leading state is taken over the believed ``holdings`` and this peer's own (which
    it always believes: it committed or checked it); True when it is not ``mine``. A peer
    that holds the leading state never rebases.
    """
    lead = leading_state([*holdings, (me, *mine)], believes=believing_own(believes, mine))
    return lead is not None and lead != mine


def believing_own(believes: Believes | None, mine: tuple[int, str]) -> Believes | None:
    """``believes`` that also believes ``mine`` (a peer's own state); None stays None."""
    if believes is None:
        return None
    return lambda version, digest: (version, digest) == mine or believes(version, digest)


# --------------------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------------------
@wire_message(30)
@dataclass(frozen=True, slots=True)
class StateRequest:
    """``sender`` asks the receiver for its state of ``fragment`` of run ``run_id``."""

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int


@wire_message(31)
@dataclass(frozen=True, slots=True)
class StateChunk:
    """Bytes ``[offset, offset + len(payload))`` of a :meth:`FragmentState.wire` encoding.

    ``total`` is the length of the whole encoding; ``version`` and ``digest`` name the
    state. An empty ``digest`` with ``total == 0`` means "I cannot serve it" (``reason``).
    """

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    digest: str = field(metadata=_ID)
    offset: int
    total: int
    payload: bytes = field(metadata={"max_len": CHUNK_BYTES})
    reason: str = field(default="", metadata={"max_len": 300})


def chunks_of(
    state: FragmentState, *, sender: str, run_id: str, fragment: int
) -> Iterator[StateChunk]:
    """The chunks that carry ``state`` to a peer, in order."""
    data = state.wire()
    digest = state.digest()
    for offset in range(0, max(1, len(data)), CHUNK_BYTES):
        yield StateChunk(
            sender,
            run_id,
            fragment,
            state.version,
            digest,
            offset,
            len(data),
            data[offset : offset + CHUNK_BYTES],
        )


class StateAssembler:
    """Puts one peer's :class:`StateChunk` stream back together and checks it.

    :meth:`feed` returns the :class:`FragmentState` after the last chunk, None before;
    raises :class:`~atoll.protocol.errors.CodecError` on anything out of order, on a
    change of version, digest or total, on a size that cannot be a state of ``numel``
    values, on a refusal (``reason``) and on a digest that does not match the bytes.
    """

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._expected_total = _HEADER.size + 8 * numel
        self._buf = bytearray()
        self._first: StateChunk | None = None

    def feed(self, chunk: StateChunk) -> FragmentState | None:
        if chunk.total == 0 and not chunk.digest:
            raise CodecError(f"peer cannot serve the state: {chunk.reason or 'no reason given'}")
        first = self._first
        if first is None:
            if chunk.total != self._expected_total:
                raise CodecError(
                    f"state of {chunk.total} bytes announced; {self._expected_total} expected"
                )
            self._first = first = chunk
        elif (chunk.version, chunk.digest, chunk.total) != (
            first.version,
            first.digest,
            first.total,
        ):
            raise CodecError("state chunks disagree on version, digest or size")
        if chunk.offset != len(self._buf) or len(self._buf) + len(chunk.payload) > chunk.total:
            raise CodecError(f"state chunk at offset {chunk.offset} is out of order")
        if not chunk.payload:
            raise CodecError("empty state chunk")
        self._buf += chunk.payload
        if len(self._buf) < chunk.total:
            return None
        state = decode_state(bytes(self._buf), self.numel)
        if state.version != first.version or state.digest() != first.digest:
            raise CodecError("the state's bytes do not match the digest it was announced with")
        return state

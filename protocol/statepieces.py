"""The pieces of a fragment's state on the wire: what a donor serves to a multi-source copy.

A state's digest is a two-level hash (:func:`~atoll.protocol.statesync.state_digest`):
the hash of the list of its pieces' hashes, as BitTorrent's piece hashes (BEP 3) let a
downloader check each piece against the torrent's info hash. So a joiner that holds a
certified ``(version, digest)`` (:mod:`atoll.protocol.certificate`) asks a donor for the
piece list (:class:`StateIndexRequest` / :class:`StateIndex`), checks it against the
digest once (:func:`check_index`), and then checks every piece from any donor
(:class:`StatePieceRequest` / :class:`StatePiece`) against its own hash as it arrives: a
donor that sends one bad piece is caught at that piece, and the others serve the rest.

The pieces carry the encoding of :meth:`~atoll.protocol.statesync.FragmentState.encode`
(the donor's inner step left out, so every donor serves the same bytes); each donor
names its step in its index, and the joiner takes the median of the steps of the donors
it used.

A donor answers only for the exact state it holds (:class:`PieceSource`); anything else
gets a refusal (an index of ``total == 0``, a piece with an empty payload, both with a
``reason``). Replies are bounded: an index holds at most :data:`MAX_PIECES` hashes, a
request asks for at most :data:`MAX_PIECES_PER_REQUEST` pieces, a piece holds at most
:data:`~atoll.protocol.statesync.PIECE_BYTES`.

Sans-IO, numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.protocol import statesync as ss
from atoll.protocol.errors import CodecError
from atoll.protocol.messages import wire_message

__all__ = [
    "MAX_PIECES",
    "MAX_PIECES_PER_REQUEST",
    "PieceSource",
    "StateIndex",
    "StateIndexRequest",
    "StatePiece",
    "StatePieceRequest",
    "check_index",
]

MAX_PIECES = 1 << 18
"""Most pieces of one fragment's state (256 GiB at 1 MiB a piece); an index of that many
hashes is 8 MiB, well within a frame."""

MAX_PIECES_PER_REQUEST = 4
"""Most pieces one :class:`StatePieceRequest` asks for (4 MiB of replies)."""

_ID = {"max_len": 128}


@wire_message(32)
@dataclass(frozen=True, slots=True)
class StateIndexRequest:
    """``sender`` asks for the piece list of ``fragment``'s state ``(version, digest)``."""

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    digest: str = field(metadata=_ID)


@wire_message(33)
@dataclass(frozen=True, slots=True)
class StateIndex:
    """The piece list of a state: ``total`` bytes of encoding, ``hashes`` the sha256 of
    each piece in order (:data:`~atoll.protocol.statesync.PIECE_HASH_LEN` bytes each),
    ``step`` the donor's inner step. ``total == 0`` is a refusal (``reason``)."""

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    digest: str = field(metadata=_ID)
    step: int
    total: int
    hashes: bytes = field(metadata={"max_len": MAX_PIECES * ss.PIECE_HASH_LEN})
    reason: str = field(default="", metadata={"max_len": 300})


@wire_message(34)
@dataclass(frozen=True, slots=True)
class StatePieceRequest:
    """``sender`` asks for pieces ``first .. first + count - 1`` of a state."""

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    digest: str = field(metadata=_ID)
    first: int
    count: int


@wire_message(35)
@dataclass(frozen=True, slots=True)
class StatePiece:
    """Piece ``index`` of a state's encoding; an empty ``payload`` is a refusal (``reason``)."""

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    digest: str = field(metadata=_ID)
    index: int
    payload: bytes = field(metadata={"max_len": ss.PIECE_BYTES})
    reason: str = field(default="", metadata={"max_len": 300})


def check_index(index: StateIndex, target: tuple[int, str], numel: int) -> list[bytes]:
    """The piece hashes of ``index`` once it is sound for ``target`` (version, digest) of
    a state of ``numel`` values: the right state, size and count, and hashes that hash to
    the digest. Raises :class:`~atoll.protocol.errors.CodecError` otherwise (a refusal
    included: its ``reason`` is in the message)."""
    if index.total == 0:
        raise CodecError(f"peer cannot serve the state: {index.reason or 'no reason given'}")
    if (index.version, index.digest) != target:
        raise CodecError("the index names another state")
    total = ss.state_bytes(numel)
    if index.total != total:
        raise CodecError(f"an index of {index.total} bytes; {total} expected")
    count = ss.pieces_in(total)
    if len(index.hashes) != count * ss.PIECE_HASH_LEN:
        raise CodecError(f"an index of {len(index.hashes)} hash bytes; {count} pieces expected")
    n = ss.PIECE_HASH_LEN
    hashes = [index.hashes[i * n : (i + 1) * n] for i in range(count)]
    if ss.digest_of_pieces(total, hashes) != target[1]:
        raise CodecError("the piece hashes do not hash to the certified digest")
    return hashes


@dataclass(frozen=True, slots=True, eq=False)
class PieceSource:
    """One state as a donor serves it: the encoding and its piece hashes, computed once
    (:meth:`of`) and answered from for every joiner that asks for this exact state."""

    version: int
    digest: str
    data: bytes
    hashes: bytes

    @classmethod
    def of(cls, state: ss.FragmentState) -> PieceSource:
        data = state.encode()
        hashes = ss.hashes_of(data)
        return cls(state.version, ss.digest_of_pieces(len(data), hashes), data, b"".join(hashes))

    @property
    def count(self) -> int:
        return ss.pieces_in(len(self.data))

    def holds(self, version: int, digest: str) -> bool:
        return (version, digest) == (self.version, self.digest)

    def piece(self, i: int) -> bytes:
        """Piece ``i`` (0-based; IndexError outside the state)."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        return self.data[i * ss.PIECE_BYTES : (i + 1) * ss.PIECE_BYTES]

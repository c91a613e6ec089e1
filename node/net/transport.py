"""A leaner Noise session and yamux muxer for py-libp2p 0.8.1: the same wire, less Python.

An all-reduce round is CPU-bound on loopback and on fast links: profiled (py-spy, 4 peers
x 100 MB fp32 on 2 cores), about 60% of a peer's CPU went to py-libp2p's layers between
the socket and the stream, not to encryption (ChaCha20-Poly1305 runs at about 2.5 GB/s
through ``cryptography``) or to the reduction. Per 64 KB Noise message py-libp2p made two
socket reads, went through five Python layers, and copied each received byte about six
times (BytesIO buffer, slices, bytearray joins); each yamux frame also formatted debug
strings whether or not debug logging was on.

Nothing here changes a byte on the wire; peers running stock py-libp2p, go-libp2p or
rust-libp2p see the same Noise XX session and yamux frames:

- :class:`LeanNoiseTransport` runs py-libp2p's own Noise XX handshake, then hands the
  session's two cipher states to a :class:`LeanNoiseSession`, which reads the socket in
  large pieces, opens each transport message in place (``decrypt_into``), and seals a
  whole write (many messages) into one buffer sent with one socket write. The framing is
  the Noise spec's for libp2p: a 2-byte big-endian length, then ciphertext with its 16-byte
  tag; nonces count up from the handshake's, little-endian, after four zero bytes
  (ChaCha20-Poly1305 as the Noise spec, section 12.4, defines it). A send that has begun
  is finished even when its writer is cancelled (bounded by the writer's deadline plus
  :data:`WRITE_GRACE_S`), so a timeout never leaves half a message on the wire, which
  would break the whole connection.
- :class:`LeanYamux` writes frames without per-frame debug work and reads a DATA frame's
  body with one call. With it the host lets yamux frames carry up to
  :data:`FRAME_PAYLOAD` bytes (yamux allows any length within the receive window), so one
  frame goes out as 16 Noise messages in one socket write instead of 16 trips through
  every layer.

Only sessions that the lean path can carry are switched over (ChaCha20-Poly1305 cipher
states from a finished handshake, over py-libp2p's own transport reader/writer); anything
else keeps py-libp2p's session unchanged.

Unfinished frames, bounded across peers
---------------------------------------
A peer may announce a frame of up to ``max_frame_bytes`` (64 MiB) and send all of it but
the last byte; identities cost nothing, so per-peer limits alone let a few dozen fresh
identities make a node hold gigabytes. :func:`read_frames` cuts a stream into frames
against one :class:`FrameBudget` shared by every stream of the process (default
:data:`DEFAULT_FRAME_BUDGET_BYTES`): before a read's bytes are buffered they are charged
to the stream, and when the charge does not fit, the streams holding the most (more than
the one charging) are reset to make room, largest first; when the charging stream holds
the most itself, it is the one reset (:class:`FrameBudgetExceeded`). Either way a warning
names the peer, what it held and the budget. A peer that sends its frames promptly holds
little for little time and is not touched while others hold more. A frame once begun must
also keep coming: it has :data:`FRAME_START_S` plus one second per
:data:`MIN_FRAME_RATE` bytes received of it, so a peer trickling a byte a second is cut
off (:class:`~atoll.protocol.errors.ExchangeTimeout`) instead of holding its partial frame
forever. Time the reader spends handing frames on (a full inbox) does not count.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

import trio
from cryptography.exceptions import InvalidTag
from libp2p.abc import IRawConnection, ISecureConn
from libp2p.io.abc import ReadWriteCloser
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_NOISE_MESSAGE_LEN, NoiseTransportReadWriter
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.yamux import yamux as _yamux
from noise.backends.default.ciphers import ChaCha20Cipher
from noise.constants import MAX_NONCE
from noise.exceptions import NoiseInvalidMessage
from noise.state import CipherState

from atoll.protocol.errors import CodecError, ConfigError, ExchangeTimeout
from atoll.protocol.messages import MAX_FRAME_BYTES, FrameDecoder

logger = logging.getLogger(__name__)

TAG_BYTES = 16
"""ChaCha20-Poly1305's authentication tag, appended to every transport message."""
MAX_PLAINTEXT = MAX_NOISE_MESSAGE_LEN - TAG_BYTES
"""Plaintext bytes one Noise transport message carries at most (65,519)."""
FRAME_PAYLOAD = 16 * MAX_PLAINTEXT - _yamux.HEADER_SIZE
"""Payload of the largest yamux DATA frame atoll sends: header and payload fill exactly
16 Noise messages (1,048,292 bytes of payload). The receive window still bounds it."""
_RECV_CHUNK = 1 << 20  # bytes asked of the socket per read
_HAND_OVER = 1 << 16  # reads from this size on return their bytearray, not a bytes copy
WRITE_GRACE_S = 10.0
"""How long past its writer's deadline a send that has begun may take to finish before
the connection counts as dead."""
_LEN = struct.Struct(">H")
_NONCE_PAD = b"\x00\x00\x00\x00"


class LeanNoiseTransport(NoiseTransport):
    """py-libp2p's Noise transport whose finished sessions are :class:`LeanNoiseSession`."""

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        return lean_session(await super().secure_inbound(conn))

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        return lean_session(await super().secure_outbound(conn, peer_id))


def lean_session(session: ISecureConn) -> ISecureConn:
    """``session`` as a :class:`LeanNoiseSession` when the lean path can carry it, else
    ``session`` itself."""
    if type(session) is not SecureSession:
        return session
    conn = session.conn
    if type(conn) is not NoiseTransportReadWriter:
        return session
    state = conn.noise_state
    if not getattr(state, "handshake_finished", False):
        return session
    protocol = state.noise_protocol
    tx = protocol.cipher_state_encrypt
    rx = protocol.cipher_state_decrypt
    if not all(
        isinstance(c, CipherState)
        and isinstance(c.cipher, ChaCha20Cipher)
        and c.has_key()
        and hasattr(c.cipher.cipher, "encrypt_into")  # cryptography's in-place AEAD calls
        and hasattr(c.cipher.cipher, "decrypt_into")
        for c in (tx, rx)
    ):
        return session
    raw = conn.read_writer.read_write_closer
    return LeanNoiseSession(session, raw, tx, rx)


class LeanNoiseSession(SecureSession):
    """A Noise transport session read and written by atoll, byte-compatible with
    py-libp2p's :class:`SecureSession`.

    ``read(n)`` returns exactly ``n`` bytes, or fewer only when the connection ends (as
    py-libp2p's does), as a ``bytearray`` from 64 KiB on (the buffer it decrypted into);
    ``read()`` returns what one message or the buffer holds. A message
    whose tag does not verify raises ``NoiseInvalidMessage`` and the session is unusable
    from then on (the nonces are out of step). Writes are sealed and sent under one lock,
    so nonce order is wire order whoever writes.
    """

    def __init__(
        self, session: SecureSession, raw: ReadWriteCloser, tx: CipherState, rx: CipherState
    ) -> None:
        super().__init__(
            local_peer=session.local_peer,
            local_private_key=session.local_private_key,
            remote_peer=session.remote_peer,
            remote_permanent_pubkey=session.remote_permanent_pubkey,
            is_initiator=session.is_initiator,
            conn=session.conn,  # close and addresses go through py-libp2p's reader/writer
        )
        self._raw = raw
        self._tx = tx
        self._rx = rx
        self._write_lock = trio.Lock()
        self._in = bytearray()  # ciphertext received and not yet opened, from _in_pos
        self._in_pos = 0
        self._plain = b""  # an opened message not yet returned whole, from _plain_pos
        self._plain_pos = 0
        self._failed: str | None = None  # why reading broke for good
        self._write_failed: str | None = None  # why writing broke for good

    # -- reading ----------------------------------------------------------------------------
    async def read(self, n: int | None = None) -> bytes:
        if n == 0:
            return b""
        if n is None or n < 0:
            if self._plain_pos < len(self._plain):
                return self._take(len(self._plain) - self._plain_pos)
            while True:  # an empty message (a bare tag) is not the end of the stream
                msg = await self._open_next()
                if msg is None:
                    raise IncompleteReadError("Connection closed", 1, 0)
                if msg:
                    return msg
        if self._plain_pos < len(self._plain):
            head = self._take(n)
            if len(head) == n:
                return head
            out = bytearray(n)
            out[: len(head)] = head
            filled = len(head)
        else:
            out = None
            filled = 0
        while filled < n:
            size = await self._next_size()
            if size < 0:  # the connection ended
                if out is None or filled == 0:
                    raise IncompleteReadError("Connection closed", n, 0)
                return bytes(out[:filled])
            if out is None:
                if size == n:  # the common case of a read that one message fills
                    msg = self._open(size)
                    return msg
                out = bytearray(n)
            if size <= n - filled:
                self._open_into(size, out, filled)
                filled += size
            else:
                msg = self._open(size)
                need = n - filled
                out[filled:n] = memoryview(msg)[:need]
                self._plain, self._plain_pos = msg, need
                filled = n
        if out is None:
            return b""
        # a large read (a yamux frame's body) hands over its buffer: no one else holds it,
        # and yamux only appends it to the stream's buffer
        return cast(bytes, out) if n >= _HAND_OVER else bytes(out)

    def _take(self, n: int) -> bytes:
        start = self._plain_pos
        end = min(len(self._plain), start + n)
        self._plain_pos = end
        if start == 0 and end == len(self._plain):
            chunk, self._plain = self._plain, b""
            self._plain_pos = 0
            return chunk
        chunk = self._plain[start:end]
        if end == len(self._plain):
            self._plain, self._plain_pos = b"", 0
        return chunk

    async def _open_next(self) -> bytes | None:
        size = await self._next_size()
        return None if size < 0 else self._open(size)

    async def _next_size(self) -> int:
        """Buffer the next whole message; its plaintext size, or -1 at the end of the
        connection (between messages, or inside one: the latter is logged)."""
        if self._failed is not None:
            raise NoiseInvalidMessage(self._failed)
        while True:
            have = len(self._in) - self._in_pos
            if have >= 2:
                (length,) = _LEN.unpack_from(self._in, self._in_pos)
                if length < TAG_BYTES:
                    self._failed = f"a Noise message of {length} bytes, shorter than its tag"
                    raise NoiseInvalidMessage(self._failed)
                if have >= 2 + length:
                    return int(length) - TAG_BYTES
            data = await self._raw.read(_RECV_CHUNK)
            if not data:
                if have:
                    logger.debug("connection ended inside a Noise message (%d bytes)", have)
                return -1
            if self._in_pos:
                del self._in[: self._in_pos]
                self._in_pos = 0
            self._in += data

    def _nonce(self, state: CipherState) -> bytes:
        n: int = state.n
        if n >= MAX_NONCE:
            raise NoiseInvalidMessage("Noise nonce exhausted")
        return _NONCE_PAD + n.to_bytes(8, "little")

    def _open(self, size: int) -> bytes:
        out = bytearray(size)
        self._open_into(size, out, 0)
        return bytes(out)

    def _open_into(self, size: int, out: bytearray, at: int) -> None:
        """Open the buffered message of plaintext ``size`` into ``out[at:at+size]``."""
        start = self._in_pos + 2
        rx = self._rx
        with (
            memoryview(self._in) as src,
            src[start : start + size + TAG_BYTES] as sealed,
            memoryview(out) as dst,
            dst[at : at + size] as target,
        ):
            try:
                rx.cipher.cipher.decrypt_into(self._nonce(rx), sealed, None, target)
            except InvalidTag:
                self._failed = "Failed authentication of message"
                raise NoiseInvalidMessage(self._failed) from None
        rx.n += 1
        self._in_pos = start + size + TAG_BYTES
        if self._in_pos == len(self._in):
            self._in.clear()
            self._in_pos = 0

    # -- writing ----------------------------------------------------------------------------
    async def write(self, data: bytes) -> None:
        # the writer's deadline, read before the lock's checkpoint: once trio has seen it
        # pass (at that checkpoint, say, after sealing began), it reports -inf instead
        deadline = trio.current_effective_deadline()
        with memoryview(data) as view:
            plain = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            total = plain.nbytes
            count = max(1, -(-total // MAX_PLAINTEXT))
            out = bytearray(total + count * (2 + TAG_BYTES))
            async with self._write_lock:
                tx = self._tx
                seal = tx.cipher.cipher.encrypt_into
                pos = 0
                with memoryview(out) as dst:
                    for i in range(count):
                        chunk = plain[i * MAX_PLAINTEXT : (i + 1) * MAX_PLAINTEXT]
                        length = chunk.nbytes + TAG_BYTES
                        _LEN.pack_into(out, pos, length)
                        seal(self._nonce(tx), chunk, None, dst[pos + 2 : pos + 2 + length])
                        tx.n += 1
                        pos += 2 + length
                    del chunk
                await self._send_whole(out, deadline)

    async def _send_whole(self, out: bytearray, writer_deadline: float) -> None:
        """Send sealed messages whole, even when the writer is cancelled meanwhile.

        Cancelling a write half-way would leave part of a Noise message on the wire (or
        messages whose nonces were used but never sent): every later message on the
        connection then fails to decrypt at the peer, and all its streams die with it.
        That was the cause of failed rounds in a local swarm (DHT polls and sends cut
        short when a round ended). So the send is shielded, and a cancellation of the
        writer takes effect when it returns. The writer's own deadline (``writer_deadline``,
        read when the write began) still bounds it, :data:`WRITE_GRACE_S` later: a send
        still not through by then goes to a dead or stalled peer, so the connection is
        closed, and this write and every later one fail. (A writer without a deadline
        waits as long as the send does, as before; closing the host closes the
        connection, which ends it.)
        """
        if self._write_failed is not None:
            raise ConnectionClosedError(self._write_failed)
        deadline = writer_deadline + WRITE_GRACE_S
        with trio.CancelScope(shield=True, deadline=deadline) as scope:
            try:
                await self._raw.write(out)  # type: ignore[arg-type]  # any buffer goes
            except BaseException as e:
                self._write_failed = f"connection failed while sending: {e!r}"
                raise
        if scope.cancelled_caught:
            self._write_failed = (
                f"sending {len(out)} bytes outlasted the writer's deadline by "
                f"{WRITE_GRACE_S} s; connection closed"
            )
            with (
                trio.CancelScope(shield=True, deadline=trio.current_time() + 1.0),
                contextlib.suppress(Exception),
            ):
                await self._raw.close()
            raise ConnectionClosedError(self._write_failed)


class LeanYamux(_yamux.Yamux):
    """py-libp2p's yamux without per-frame debug formatting and with one-call body reads."""

    async def _write_frame(self, data: bytes) -> None:
        async with self._write_lock:
            await self.secured_conn.write(data)
        await trio.lowlevel.checkpoint()

    async def _read_data_body(self, length: int) -> bytes:
        with trio.fail_after(_yamux._yamux_data_read_timeout()):
            data = await self.secured_conn.read(length)
        if len(data) != length:
            raise IncompleteReadError(
                f"yamux frame body: {len(data)} of {length} bytes", length, len(data)
            )
        return data


def tune_frames() -> None:
    """Let yamux frames carry :data:`FRAME_PAYLOAD` bytes (the module constant is read at
    each write, so this takes effect for the process)."""
    _yamux.MAX_MESSAGE_SIZE = FRAME_PAYLOAD + _yamux.HEADER_SIZE


# -- unfinished frames, bounded across peers ---------------------------------------------------
DEFAULT_FRAME_BUDGET_BYTES: int = 256 << 20
"""Bytes of unfinished frames all peers together may make the process hold (256 MiB)."""
FRAME_START_S: float = 30.0
"""Seconds a frame, once begun, may take beyond one second per :data:`MIN_FRAME_RATE`
bytes of it received."""
MIN_FRAME_RATE: int = 64 << 10
"""Bytes per second below which a frame in progress runs out of time (64 KiB/s; a 64 MiB
frame then has 30 s plus 1,024 s)."""
_FRAME_READ = 64 << 20  # most bytes one read asks of the stream (see host._READ_CHUNK)


class FrameBudgetExceeded(CodecError):
    """A stream's unfinished frames did not fit in the process's :class:`FrameBudget`:
    the stream is to be reset. ``peer`` is the peer that sent them."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer


class FrameStream(Protocol):
    """What :func:`read_frames` reads: a libp2p stream, or a fake in tests. ``read``
    returns up to ``n`` bytes, ``b""`` (or raises ``StreamEOF``) at the end."""

    async def read(self, n: int | None = None) -> bytes: ...


class _Holder:
    """One stream's share of a :class:`FrameBudget`."""

    __slots__ = ("evicted", "held", "on_evict", "peer")

    def __init__(self, peer: str, on_evict: Callable[[], None]) -> None:
        self.peer = peer
        self.on_evict = on_evict
        self.held = 0
        self.evicted: str | None = None


class FrameBudget:
    """Bytes of unfinished frames the whole process holds, over every peer's stream.

    One per process (or per host), shared by every :func:`read_frames`. Sans-IO and not
    thread-safe: all its streams run in one trio loop. See the module docstring for the
    rule it applies when full.
    """

    def __init__(self, limit_bytes: int = DEFAULT_FRAME_BUDGET_BYTES) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 1:
            raise ConfigError(f"a frame budget is an int of bytes >= 1, not {limit_bytes!r}")
        self._limit = limit_bytes
        self._used = 0
        self._holders: set[_Holder] = set()
        self.evictions = 0
        """Streams reset so far to keep within the budget (as the largest holder)."""

    @property
    def limit(self) -> int:
        """Most bytes of unfinished frames held at once."""
        return self._limit

    @property
    def used(self) -> int:
        """Bytes of unfinished frames held now."""
        return self._used

    def join(self, peer: str, on_evict: Callable[[], None]) -> _Holder:
        """A share for a new stream from ``peer``; ``on_evict`` ends that stream's reader
        (at once, without waiting) when another stream needs its room."""
        holder = _Holder(peer, on_evict)
        self._holders.add(holder)
        return holder

    def leave(self, holder: _Holder) -> None:
        """Give back everything ``holder`` held; it holds nothing from now on."""
        if holder in self._holders:
            self._holders.discard(holder)
            self._used -= holder.held
        holder.held = 0

    def charge(self, holder: _Holder, nbytes: int) -> None:
        """Let ``holder`` hold ``nbytes`` (its new total, not an increment).

        When that does not fit, the holders holding more than ``nbytes`` are evicted,
        largest first, until it does; when it still does not (``holder`` holds the
        most), :class:`FrameBudgetExceeded` is raised and ``holder`` keeps what it had.
        """
        if holder.evicted is not None:
            raise FrameBudgetExceeded(holder.peer, holder.evicted)
        if holder not in self._holders:
            raise FrameBudgetExceeded(holder.peer, f"peer {holder.peer}: stream left the budget")
        over = self._used - holder.held + nbytes - self._limit
        if over > 0:
            larger = sorted(
                (h for h in self._holders if h is not holder and h.held > nbytes),
                key=lambda h: h.held,
                reverse=True,
            )
            for victim in larger:
                if over <= 0:
                    break
                over -= victim.held
                self._evict(victim, holder.peer, nbytes)
        if over > 0:
            self.evictions += 1
            message = (
                f"peer {holder.peer} would hold {nbytes} bytes of unfinished frames, the "
                f"most of any peer, while all peers' unfinished frames fill the budget of "
                f"{self._limit} bytes ({self._used} used); its stream is reset"
            )
            logger.warning("%s", message)
            raise FrameBudgetExceeded(holder.peer, message)
        self._used += nbytes - holder.held
        holder.held = nbytes

    def _evict(self, victim: _Holder, for_peer: str, nbytes: int) -> None:
        self.evictions += 1
        victim.evicted = (
            f"peer {victim.peer} held {victim.held} bytes of unfinished frames, more than "
            f"any other, when peer {for_peer} needed {nbytes} and the budget of "
            f"{self._limit} bytes was full; its stream is reset"
        )
        logger.warning("%s", victim.evicted)
        self.leave(victim)
        victim.on_evict()


async def read_frames(
    stream: FrameStream,
    *,
    peer: str,
    budget: FrameBudget,
    on_frame: Callable[[bytes], Awaitable[None]],
    max_bytes: int = MAX_FRAME_BYTES,
    on_bytes: Callable[[int], None] | None = None,
    frame_start_s: float = FRAME_START_S,
    min_frame_rate: int = MIN_FRAME_RATE,
    read_bytes: int = _FRAME_READ,
) -> None:
    """Read ``stream`` (from ``peer``) to its end, handing each whole frame's body to
    ``on_frame`` in order; unfinished frames are charged to ``budget``.

    ``on_bytes`` hears of every read's size. Returns when the stream ends (a frame left
    unfinished is dropped and logged). Raises :class:`FrameBudgetExceeded` when the
    stream's unfinished frames do not fit in the budget or another stream needed their
    room, ``CodecError`` when a frame header is over ``max_bytes``, and
    :class:`~atoll.protocol.errors.ExchangeTimeout` when a frame begun is not finished
    within ``frame_start_s`` plus one second per ``min_frame_rate`` bytes of it
    received. Whatever it raised or however it ended, it holds nothing of the budget
    afterwards; the caller resets the stream on an error. No wait bounds a stream idle
    between frames: that is normal between rounds.
    """
    if not (math.isfinite(frame_start_s) and frame_start_s > 0):
        raise ConfigError(f"frame_start_s must be > 0, not {frame_start_s!r}")
    if (
        isinstance(min_frame_rate, bool)
        or not isinstance(min_frame_rate, int)
        or min_frame_rate < 1
    ):
        raise ConfigError(f"min_frame_rate must be an int >= 1, not {min_frame_rate!r}")
    decoder = FrameDecoder(max_bytes)
    with trio.CancelScope() as evicted:
        holder = budget.join(peer, evicted.cancel)
        try:
            began = 0.0  # when the unfinished frame began, moved on by time spent handing over
            got = 0  # bytes of it received so far
            while True:
                if decoder.buffered:
                    deadline = began + frame_start_s + got / min_frame_rate
                    with trio.move_on_at(deadline) as late:
                        data = await _read_some(stream, read_bytes)
                    if late.cancelled_caught:
                        raise ExchangeTimeout(
                            f"peer {peer} sent {got} bytes of a frame in "
                            f"{trio.current_time() - began:.1f} s, slower than "
                            f"{min_frame_rate} bytes/s after {frame_start_s} s; stream reset"
                        )
                else:
                    data = await _read_some(stream, read_bytes)
                if not data:
                    if decoder.buffered:
                        logger.info(
                            "peer %s closed its stream inside a frame (%d bytes dropped)",
                            peer,
                            decoder.buffered,
                        )
                    return
                if on_bytes is not None:
                    on_bytes(len(data))
                # charged before it is buffered: a frame's bytes never sit uncounted
                budget.charge(holder, decoder.buffered + len(data))
                was_buffered = decoder.buffered
                bodies = decoder.feed(data)
                left = decoder.buffered
                budget.charge(holder, left)
                if not left:
                    got = 0
                elif bodies or not was_buffered:  # a new frame began in this read
                    began, got = trio.current_time(), left
                else:
                    got += len(data)
                start = trio.current_time()
                for body in bodies:
                    await on_frame(body)
                began += trio.current_time() - start
        finally:
            budget.leave(holder)
    if evicted.cancelled_caught:
        raise FrameBudgetExceeded(peer, holder.evicted or f"peer {peer}: stream evicted")


async def _read_some(stream: FrameStream, n: int) -> bytes:
    try:
        return await stream.read(n)
    except StreamEOF:
        return b""

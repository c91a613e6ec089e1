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
"""

from __future__ import annotations

import contextlib
import logging
import struct
from typing import cast

import trio
from cryptography.exceptions import InvalidTag
from libp2p.abc import IRawConnection, ISecureConn
from libp2p.io.abc import ReadWriteCloser
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_NOISE_MESSAGE_LEN, NoiseTransportReadWriter
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.yamux import yamux as _yamux
from noise.backends.default.ciphers import ChaCha20Cipher
from noise.constants import MAX_NONCE
from noise.exceptions import NoiseInvalidMessage
from noise.state import CipherState

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

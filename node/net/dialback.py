"""Dial-back over libp2p: the stream protocol behind a node's reachability check.

A server (every bootstrap peer, and every node) answers a stream of
:data:`DIALBACK_PROTOCOL` (``/atoll/dialback/1.0.0``): the asker writes one
:class:`~atoll.protocol.reachability.DialBackRequest`, length-prefixed (2 bytes, big
endian); the server dials each port it names on a *fresh* TCP connection to the address
the stream came from (:func:`~atoll.protocol.reachability.dialable`), counts the port as
reached when a libp2p listener greets it there (the multistream-select header a listener
sends first), and writes one :class:`~atoll.protocol.reachability.DialBackReply` before it
closes the stream.

A fresh connection is the point: libp2p's own AutoNAT server dials through the swarm,
which hands back the connection the request came on, so it finds every asker reachable.
The greeting proves a libp2p listener at that address and port, not which peer it is;
the server dials nothing but the asker's own address, so it cannot be aimed at a third
party. Bounds: :data:`MAX_CONCURRENT` dial-backs at once per server (more are answered
at once with nothing reached and a reason), each dial within ``dial_timeout_s``, the
exchange within the asker's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import struct
from collections.abc import Callable, Iterable, Sequence

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol

from atoll.dht.peeraddr import parse_peer_addr
from atoll.protocol.errors import CodecError, ExchangeTimeout, PeerUnavailable
from atoll.protocol.messages import decode_message, encode_message
from atoll.protocol.reachability import MAX_PORTS, DialBackReply, DialBackRequest, dialable

__all__ = [
    "DIALBACK_PROTOCOL",
    "MAX_CONCURRENT",
    "ask_dialback",
    "listen_ports",
    "serve_dialback",
]

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = TProtocol("/atoll/dialback/1.0.0")
MAX_CONCURRENT = 4
"""dial-backs a server runs at once"""
MAX_FRAME = 1024
"""the largest request or reply, in bytes"""
GREETING = b"/multistream/1.0.0\n"
"""what a libp2p listener sends first on a new connection (after a varint length)"""
_LEN = struct.Struct(">H")


def listen_ports(addrs: Iterable[str]) -> list[int]:
    """The TCP ports of multiaddrs ``addrs`` (``/ip4/.../tcp/4001/...``), sorted, once each."""
    ports = set()
    for addr in addrs:
        parts = addr.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            with contextlib.suppress(ValueError):
                ports.add(int(parts[parts.index("tcp") + 1]))
    return sorted(ports)


def _frame(msg: object) -> bytes:
    body = encode_message(msg)
    return _LEN.pack(len(body)) + body


async def _read_frame(stream: INetStream) -> bytes:
    """One length-prefixed frame of at most :data:`MAX_FRAME` bytes."""
    buf = b""
    need = _LEN.size
    while len(buf) < need:
        data = await stream.read(need - len(buf))
        if not data:
            raise PeerUnavailable("the stream ended inside a frame")
        buf += data
        if need == _LEN.size and len(buf) == _LEN.size:
            (size,) = _LEN.unpack(buf)
            if not 0 < size <= MAX_FRAME:
                raise CodecError(f"a dial-back frame of {size} bytes (at most {MAX_FRAME})")
            need += size
    return buf[_LEN.size :]


async def greets(ip: str, port: int, timeout_s: float) -> bool:
    """Whether a fresh TCP connection to ``ip``:``port`` reaches a libp2p listener
    (it sends the multistream-select header) within ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        try:
            tcp = await trio.open_tcp_stream(ip, port)
        except OSError:
            return False
        async with tcp:
            got = b""
            while len(got) < len(GREETING) + 1:
                try:
                    data = await tcp.receive_some(64)
                except (trio.BrokenResourceError, OSError):
                    return False
                if not data:
                    break
                got += data
            return GREETING in got
    return False


def serve_dialback(
    host: IHost,
    *,
    wall: Callable[[], float],
    dial_timeout_s: float = 3.0,
    timeout_s: float = 15.0,
) -> None:
    """Answer :data:`DIALBACK_PROTOCOL` streams on ``host`` (see the module docstring);
    ``wall`` is the clock the replies state."""
    limiter = trio.CapacityLimiter(MAX_CONCURRENT)

    async def dial(ip: str, ports: Sequence[int]) -> tuple[tuple[int, ...], str]:
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            return (), "busy: too many dial-backs at once, ask again later"
        try:
            targets = dialable(ip, ports)
            if not targets:
                return (), f"nothing to dial at {ip!r}"
            reached: list[int] = []

            async def one(addr: str, port: int) -> None:
                if await greets(addr, port, dial_timeout_s):
                    reached.append(port)

            async with trio.open_nursery() as nursery:
                for addr, port in targets:
                    nursery.start_soon(one, addr, port)
            return tuple(sorted(reached)), ""
        finally:
            limiter.release()

    async def handler(stream: INetStream) -> None:
        try:
            with trio.move_on_after(timeout_s):
                request = decode_message(await _read_frame(stream))
                if not isinstance(request, DialBackRequest):
                    raise CodecError(f"a {type(request).__name__}, not a DialBackRequest")
                remote = stream.get_remote_address()
                ip, port = remote if remote is not None else ("", 0)
                reached, why = await dial(ip, request.ports)
                reply = DialBackReply(request.nonce, ip, port, reached, wall(), why)
                await stream.write(_frame(reply))
                await stream.close()
                logger.debug("dial-back for %s:%d: reached %s", ip, port, reached)
                return
        except Exception as e:  # a bad request or an asker that went away
            logger.debug("dial-back request failed: %s", e)
        with contextlib.suppress(Exception):
            await stream.reset()

    host.set_stream_handler(DIALBACK_PROTOCOL, handler)


async def ask_dialback(
    host: IHost, addr: str, ports: Sequence[int], *, timeout_s: float = 10.0
) -> DialBackReply:
    """Ask the peer at ``addr`` (``/ip4/.../tcp/.../p2p/...``) to dial this node back at
    ``ports``; its reply.

    Raises ConfigError on a malformed address, :class:`PeerUnavailable` when the peer
    cannot be reached, does not serve the protocol or answers nonsense, ExchangeTimeout
    when it does not answer within ``timeout_s``.
    """
    info = parse_peer_addr(addr)
    request = DialBackRequest(secrets.token_bytes(16), tuple(ports)[:MAX_PORTS])
    reply: object = None
    stream: INetStream | None = None
    with trio.move_on_after(timeout_s) as scope:
        try:
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [DIALBACK_PROTOCOL])
            await stream.write(_frame(request))
            reply = decode_message(await _read_frame(stream))
        except CodecError as e:
            raise PeerUnavailable(f"{addr}: a dial-back answer that does not decode: {e}") from None
        except Exception as e:
            raise PeerUnavailable(f"{addr}: no dial-back from this peer ({e})") from None
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.close()
    if scope.cancelled_caught:
        raise ExchangeTimeout(f"{addr}: no dial-back answer within {timeout_s} s")
    if not isinstance(reply, DialBackReply) or reply.nonce != request.nonce:
        raise PeerUnavailable(f"{addr}: an answer that is not the reply to this request")
    return reply

"""One py-libp2p host per node: Noise only, yamux, length-prefixed atoll messages.

:func:`open_host` runs a libp2p host inside the network process's trio loop and yields an
:class:`AtollHost` that connects to peers, sends them wire messages
(:mod:`atoll.protocol.messages`) and receives theirs.
:func:`open_libp2p_host` runs the same host bare (no message protocol, no run), for a
peer that only serves the DHT (``atoll bootstrap``).

The stream protocol
-------------------
A stream of :data:`ATOLL_PROTOCOL` (``/atoll/<PROTOCOL_VERSION>/msg``) carries frames one
way, from the peer that opened it (the *sender*) to the other (the *receiver*); each
direction between two peers has its own stream, opened lazily and then reused (a libp2p
``connect()`` costs >= 250 ms, a stream one round trip):

1. the sender writes one frame holding its :class:`~atoll.protocol.messages.Hello` and
   waits for the answer before it writes anything else;
2. the receiver reads that first frame (at most :data:`HELLO_MAX_BYTES`, within
   ``hello_timeout_s``) and checks it: a Hello of this protocol version whose ``peer_id``
   is the one Noise authenticated on the connection, for this node's run. Then it answers
   with its own Hello and from there on only reads.

   - a valid Hello of *another run*: the receiver closes its side (FIN) without
     answering and logs why; the sender sees the stream end before any answer on a live
     connection and raises :class:`WrongRun` (a peer learns nothing about a run it is not
     in, not even its id);
   - a valid Hello of this run from a peer that the run's membership does not admit (a
     private run: not on the allowlist, no valid member certificate in the Hello, or
     revoked; :class:`~atoll.security.membership.Membership`): refused the same way,
     before any atoll message is read, with one WARNING line naming the peer and the
     reason. A sender in a private run that sees this refusal raises
     :class:`~atoll.security.membership.NotAMember` (it cannot tell it from a peer of
     another run: both close without a word, by design). The sender checks the answering
     Hello the same way: a non-member's answer is refused too;
   - anything else (bytes that do not decode, a first frame over the limit, another
     message, another version, a ``peer_id`` that is not the connection's): hostile or
     broken input, so the receiver resets the stream without answering and logs why;
3. the sender writes frames; a dedicated task of the receiver drains the stream at once
   (yamux fails a writer whose reader stalls for 5 s) through
   :func:`~atoll.node.net.transport.read_frames` and
   :func:`~atoll.protocol.messages.decode_message` into a bounded queue read by
   :meth:`AtollHost.receive`. A frame that does not decode is hostile input: the stream is
   reset. The sender of a message is the peer id of the authenticated connection, never a
   field of the message.

Every incoming stream of a host charges its unfinished frames to the host's one
:class:`~atoll.node.net.transport.FrameBudget` (``frame_budget_bytes``): a peer may
announce a frame of ``max_frame_bytes`` and never finish it, and identities are free, so
without a bound across peers a few dozen of them could make the process hold gigabytes.
When the budget is full the streams holding the most are reset (see
:mod:`atoll.node.net.transport`); a frame begun but trickled too slowly is cut off too.
A stream that never shows its Hello is reset after ``hello_timeout_s``, and a peer may
hold at most :data:`MAX_PENDING_STREAMS` such streams at once (those it opens beyond are
reset at once, with one WARNING line per burst).

A peer that does not speak :data:`ATOLL_PROTOCOL` at all (another protocol version, or
not atoll) fails the multistream negotiation: :class:`VersionMismatch`.

Security and noise
------------------
py-libp2p 0.8.1's ``new_host`` offers Noise, TLS, SECIO and ``/plaintext/2.0.0`` by
default, and a plaintext dialer showing another peer's public key is accepted as that
peer. The host here is built with ``sec_opt`` = Noise alone and ``muxer_opt`` = yamux
alone. Its auto-connector (which dials every peer in the peerstore while the node has
fewer than 150 connections) is stopped: atoll chooses whom to connect to. Whatever the
host needs of py-libp2p's internals (that stop among them) goes through
:mod:`atoll.node.net.libp2p_internals`.
libp2p's and py-multiaddr's loggers are set to WARNING (libp2p's auto-connector sets
itself to INFO and logs every cycle) and libp2p's made to propagate to the node's handlers
(libp2p turns propagation off at import, so its warnings went to stderr through logging's
last-resort handler); the ERROR lines it writes about failures it also raises (a refused
dial, four lines each) are dropped, since atoll raises them again. Set ``LIBP2P_DEBUG``
to get libp2p's own logging instead.

Errors (added to the tree of :mod:`atoll.protocol.errors`)::

    ConfigError
    ├── WrongRun          the peer serves another run: not retryable
    └── VersionMismatch   the peer speaks another atoll protocol version, or none
    RetryableError
    └── PeerUnavailable   dial, negotiation, Hello or write failed or timed out
    RejectedInput
    └── NotAMember        (atoll.security.membership) the peer, or this node, is not a
                          member of the private run
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import ipaddress
import logging
import math
import os
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import ConnectionConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID

from atoll.dht.peeraddr import parse_peer_addr
from atoll.node.net import libp2p_internals
from atoll.node.net.transport import (
    DEFAULT_FRAME_BUDGET_BYTES,
    FrameBudget,
    FrameBudgetExceeded,
    LeanNoiseTransport,
    LeanYamux,
    read_frames,
    tune_frames,
)
from atoll.protocol.errors import (
    AtollError,
    CodecError,
    ConfigError,
    ExchangeTimeout,
    PeerTimedOut,
    PeerUnavailable,
    unwrap_lone,
)
from atoll.protocol.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Hello,
    decode_message,
    encode_message,
    encode_message_pieces,
    frame,
    frame_header,
)
from atoll.security.identity import Identity
from atoll.security.membership import Membership, NotAMember

__all__ = [
    "AGENT",
    "ATOLL_PROTOCOL",
    "HELLO_MAX_BYTES",
    "MAX_PENDING_STREAMS",
    "AtollHost",
    "HostConfig",
    "VersionMismatch",
    "WrongRun",
    "exclusive_listen_addr",
    "expand_wildcard",
    "open_host",
    "open_libp2p_host",
]

logger = logging.getLogger(__name__)

ATOLL_PROTOCOL: TProtocol = TProtocol(f"/atoll/{PROTOCOL_VERSION}/msg")
"""The libp2p protocol id of atoll's message streams; it carries the wire version."""

MAX_PENDING_STREAMS: int = 8
"""Streams one peer may hold open to this host before their Hello was read; one it opens
beyond that is reset at once (a peer opening streams and leaving them silent would
otherwise hold a task each for ``hello_timeout_s``). An honest peer has one."""

HELLO_MAX_BYTES: int = 1024
"""Largest first frame accepted on a stream (a Hello encodes to ~200 bytes, ~430 with a
member certificate)."""

try:
    AGENT: str = f"atoll/{importlib.metadata.version('atoll')}"
except importlib.metadata.PackageNotFoundError:  # running from a bare checkout
    AGENT = "atoll/unknown"
"""What this node says it runs, in its Hello."""

_HEADER = struct.Struct(">I")  # the frame header of atoll.protocol.messages.frame
_READ_CHUNK = 64 << 20
"""Most bytes one read takes from yamux. py-libp2p 0.8.1 serves ``read(n)`` from a
bytearray of up to 16 MiB (its largest window) with ``bytes(buf[:n]); del buf[:n]``, which
moves the rest of the buffer on every read; asking for more than it holds takes all of it
in one copy (``bytes(buf); buf.clear()``)."""
_CLEANUP_S = 1.0  # bound on a stream reset done while failing or shutting down
_CLOSE_S = 5.0  # bound on closing the host (SwarmConn.close sleeps 0.1 s per connection)
_LS_TIMEOUT_S = 2  # bound on asking a peer which protocols it serves (error path only)
_RUN_ID = re.compile(r"[0-9a-f]{64}")

# py-libp2p 0.8.1 logs at ERROR, with a traceback-free line, failures that it also raises
# to the caller and that atoll raises again (PeerUnavailable, VersionMismatch) with the
# same text: a refused dial (4 lines per dial), a peer that answered "na", a stream opened
# on a connection going down, a plaintext or other non-Noise peer. Those lines are
# dropped; every other record passes.
_RAISED_AGAIN = {
    "libp2p.transport.tcp.tcp": ("Failed to open TCP stream",),
    "libp2p.network.swarm": ("failed to upgrade security for peer", "fail to upgrade mux"),
    "libp2p.host.basic_host": ("Failed to open stream to peer",),
    "libp2p.protocol_muxer.multiselect_client": ("MultiselectClient handshake:",),
}


class WrongRun(ConfigError):
    """The peer serves another run than this node's; retrying will not help.

    ``peer_id`` is the peer, ``run_id`` this node's run.
    """

    def __init__(self, peer_id: str, run_id: str, message: str) -> None:
        super().__init__(message)
        self.peer_id = peer_id
        self.run_id = run_id


class VersionMismatch(ConfigError):
    """The peer speaks another atoll protocol version (or no atoll protocol at all).

    ``offered`` lists the atoll protocol ids the peer said it serves, when it said;
    ``version`` is the protocol version its Hello named, when it answered one.
    """

    def __init__(
        self,
        peer_id: str,
        message: str,
        offered: tuple[str, ...] = (),
        *,
        version: int | None = None,
    ) -> None:
        super().__init__(message)
        self.peer_id = peer_id
        self.offered = offered
        self.version = version


@dataclass(frozen=True, slots=True)
class HostConfig:
    """Settings of the network host; every network wait below is bounded by one of them."""

    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    """multiaddrs to listen on (TCP); port 0 lets the OS pick one"""
    dial_timeout_s: float = 10.0
    """one dial: TCP connect, Noise handshake, yamux set-up (libp2p retries inside)"""
    hello_timeout_s: float = 5.0
    """opening a stream: protocol negotiation and the Hello exchange, both directions"""
    send_timeout_s: float = 30.0
    """one send(): waiting for earlier sends to that peer, opening the stream, writing"""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """largest message sent or accepted, in bytes"""
    receive_queue: int = 16
    """decoded messages held for receive(); when full, streams stop draining (and yamux
    fails their senders' writes after 5 s), so read receive() promptly"""
    frame_budget_bytes: int = DEFAULT_FRAME_BUDGET_BYTES
    """bytes of unfinished frames all peers' streams together may make the host hold; when
    full, the streams holding the most are reset (raised to ``max_frame_bytes`` when
    smaller, so one frame of the largest size always fits)"""

    def __post_init__(self) -> None:
        if not self.listen or not all(isinstance(a, str) for a in self.listen):
            raise ConfigError("HostConfig.listen needs at least one multiaddr string")
        for name in ("dial_timeout_s", "hello_timeout_s", "send_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"HostConfig.{name} must be a number, not {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"HostConfig.{name} must be > 0, not {value}")
        size = self.max_frame_bytes
        if isinstance(size, bool) or not isinstance(size, int):
            raise ConfigError(f"HostConfig.max_frame_bytes must be an int, not {size!r}")
        if not HELLO_MAX_BYTES <= size <= 0xFFFFFFFF:
            raise ConfigError(
                f"HostConfig.max_frame_bytes must be in [{HELLO_MAX_BYTES}, {0xFFFFFFFF}],"
                f" not {size}"
            )
        queue = self.receive_queue
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ConfigError(f"HostConfig.receive_queue must be an int >= 1, not {queue!r}")
        budget = self.frame_budget_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ConfigError(f"HostConfig.frame_budget_bytes must be an int >= 1, not {budget!r}")


@dataclass(slots=True)
class _Outgoing:
    """This node's stream to one peer; the lock keeps frames whole and opens it once."""

    lock: trio.Lock = field(default_factory=trio.Lock)
    stream: INetStream | None = None


class AtollHost:
    """A running libp2p host speaking atoll messages; made by :func:`open_host` only.

    ``bytes_sent`` and ``bytes_received`` count, per peer id, the bytes this node wrote
    to and read from atoll streams (frame headers and Hellos included; libp2p's Noise,
    yamux and multistream overheads not).
    """

    def __init__(
        self,
        host: BasicHost,
        identity: Identity,
        run_id: str,
        config: HostConfig,
        nursery: trio.Nursery,
        inbox: trio.MemorySendChannel[tuple[str, object]],
        outbox: trio.MemoryReceiveChannel[tuple[str, object]],
        membership: Membership | None = None,
        certificate: bytes | None = None,
    ) -> None:
        self._host = host
        self._peer_id = identity.peer_id
        self._run_id = run_id
        self._config = config
        self._nursery = nursery
        self._inbox = inbox
        self._messages = outbox
        self._membership = membership
        self._members: set[str] = set()  # peers whose Hello passed the membership check
        self._member_certs: dict[str, bytes | None] = {}
        self._awaited: dict[str, trio.Event] = {}  # wait_admitted's, per peer
        self._hello_frame = frame(
            encode_message(Hello(PROTOCOL_VERSION, run_id, identity.peer_id, AGENT, certificate))
        )
        self._outgoing: dict[str, _Outgoing] = {}
        self._incoming: dict[str, INetStream] = {}
        self._pending: Counter[str] = Counter()  # streams per peer still awaiting a Hello
        self._flooding: set[str] = set()  # peers over MAX_PENDING_STREAMS, warned once
        # one budget for every incoming stream: it bounds the process, not each peer
        self._frame_budget = FrameBudget(max(config.frame_budget_bytes, config.max_frame_bytes))
        # Counter: reading a peer never seen gives 0 without adding it
        self._sent: Counter[str] = Counter()
        self._received: Counter[str] = Counter()

    # -- what it is -----------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        """This node's peer id (base58btc, ``12D3KooW...``)."""
        return self._peer_id

    @property
    def run_id(self) -> str:
        """The run this host serves."""
        return self._run_id

    @property
    def membership(self) -> Membership | None:
        """The run's membership policy checked on every Hello (None: anyone)."""
        return self._membership

    def admitted(self, peer_id: str) -> bool:
        """Whether ``peer_id`` passed a Hello exchange with this host, membership and all,
        and stays a member by the policy now (its certificate may have expired since)."""
        if peer_id not in self._members:
            return False
        try:
            self._check_member(peer_id, self._member_certs.get(peer_id))
        except NotAMember:
            self._members.discard(peer_id)
            return False
        return True

    async def wait_admitted(self, peer_id: str) -> bool:
        """:meth:`admitted`, after waiting up to ``hello_timeout_s`` for a Hello of
        ``peer_id`` in progress (a peer may open another protocol's stream on the same
        connection while its first atoll stream is still being admitted)."""
        if self.admitted(peer_id):
            return True
        event = self._awaited.setdefault(peer_id, trio.Event())
        try:
            with trio.move_on_after(self._config.hello_timeout_s):
                await event.wait()
        finally:
            if self._awaited.get(peer_id) is event:
                del self._awaited[peer_id]
        return self.admitted(peer_id)

    @property
    def libp2p_host(self) -> BasicHost:
        """The libp2p host under atoll's message streams (the DHT runs on it too)."""
        return self._host

    @property
    def addrs(self) -> list[str]:
        """The multiaddrs peers can dial, each ending in ``/p2p/<peer_id>``."""
        return [str(a) for a in self._host.get_addrs()]

    @property
    def frame_budget(self) -> FrameBudget:
        """The bytes of unfinished frames every incoming stream of this host charges
        (``used``, ``limit``, and ``evictions``: streams reset to keep within it)."""
        return self._frame_budget

    @property
    def bytes_sent(self) -> Mapping[str, int]:
        """Bytes written to each peer's atoll stream (a live read-only view)."""
        return MappingProxyType(self._sent)

    @property
    def bytes_received(self) -> Mapping[str, int]:
        """Bytes read from each peer's atoll streams (a live read-only view)."""
        return MappingProxyType(self._received)

    # -- the API --------------------------------------------------------------------------
    async def connect(self, addr: str) -> str:
        """Connect to the peer at ``addr`` (a multiaddr ending in ``/p2p/<id>``), check that
        it serves this run and protocol version, and return its peer id.

        Reuses the connection and the stream when they exist. The dial is bounded by
        ``dial_timeout_s``, the Hello exchange by ``hello_timeout_s``, waiting for a send
        to that peer in progress by ``send_timeout_s``.

        Raises :class:`PeerUnavailable` (retryable) when the peer cannot be reached or
        does not answer in time, :class:`WrongRun` or :class:`VersionMismatch` (not
        retryable) when it serves another run or protocol version, ``ConfigError`` on a
        malformed address, and ``CodecError`` when it answers with something not a Hello.
        """
        info = parse_peer_addr(addr)
        peer = str(info.peer_id)
        if peer == self._peer_id:
            raise ConfigError(f"{addr} is this node's own address")
        # the libp2p swarm refuses for 60 s to dial a peer whose addresses all failed; an
        # explicit connect, maybe to a peer that just came back, deserves a real try
        libp2p_internals.clear_dial_backoff(self._host, peer)
        await self._ensure_stream(info, addr)
        return peer

    def add_addrs(self, peer_id: str, addrs: Sequence[str], *, ttl_s: float) -> None:
        """Remember ``addrs`` (multiaddrs without ``/p2p/``) as where ``peer_id`` listens,
        for ``ttl_s`` seconds, so that a lost connection can be dialed again. Addresses
        that do not parse, and a peer id that is not one, are ignored."""
        try:
            pid = ID.from_base58(peer_id)
            parsed = [multiaddr.Multiaddr(a) for a in addrs]
        except Exception:
            return
        if parsed and ttl_s > 0:
            self._host.get_peerstore().add_addrs(pid, parsed, int(ttl_s))

    async def send(self, peer_id: str, msg: object) -> None:
        """Send ``msg`` (a registered wire message) to ``peer_id``.

        Frames go, whole and in order, on this node's one stream to that peer, opened
        (with the Hello exchange, and a dial to the peer's known addresses if there is no
        connection) on first use. The whole call is bounded by ``send_timeout_s``.

        Raises ``CodecError`` before any I/O when ``msg`` cannot be encoded or is larger
        than ``max_frame_bytes``; :class:`PeerUnavailable` when the peer cannot be
        reached, the write fails or the time runs out (the stream is then dropped: the
        next send opens a new one); :class:`WrongRun` or :class:`VersionMismatch` when the
        stream it had to open was refused.
        """
        head, tail = encode_message_pieces(msg)
        header = frame_header(len(head) + len(tail), max_bytes=self._config.max_frame_bytes)
        # a large payload goes out behind its header in a second write, never copied (as a
        # memoryview, yamux cuts it into frames without copying each frame's slice first)
        pieces: list[bytes | memoryview] = [header + head]
        if tail:
            pieces.append(memoryview(tail))
        size = len(header) + len(head) + len(tail)
        pid = self._parse_peer_id(peer_id)
        out = self._outgoing.setdefault(peer_id, _Outgoing())
        with trio.move_on_after(self._config.send_timeout_s) as scope:
            async with out.lock:
                stream = await self._stream_of(out, PeerInfo(pid, []), peer_id)
                try:
                    for piece in pieces:
                        await stream.write(piece)  # type: ignore[arg-type]  # yamux slices any buffer
                except BaseException as e:
                    # a write cut short (error, timeout, cancellation) may have left part
                    # of a frame on the stream, which is then out of step: drop it
                    out.stream = None
                    await _reset(stream)
                    if isinstance(e, Exception):  # libp2p's errors: no documented set
                        raise PeerUnavailable(
                            f"sending {type(msg).__name__} ({size} bytes) to peer "
                            f"{peer_id} failed: {_describe(e)}"
                        ) from e
                    raise
                self._sent[peer_id] += size
        if scope.cancelled_caught:
            raise PeerTimedOut(
                f"sending {type(msg).__name__} ({size} bytes) to peer {peer_id} "
                f"timed out after {self._config.send_timeout_s} s"
            )

    async def forget_peer(self, peer_id: str) -> None:
        """Close every connection to ``peer_id`` and this node's stream to it, and let it
        be dialed again at once: the next send or request dials afresh.

        For a peer that went silent: a TCP connection that lived through a cut link
        resumes only when its retransmission back-off next fires (tens of seconds after
        a long cut), and meanwhile everything written to it waits unseen; a fresh
        connection works as soon as the link does. Bounded by ``dial_timeout_s``; errors
        are logged, never raised.
        """
        pid = self._parse_peer_id(peer_id)
        out = self._outgoing.get(peer_id)
        if out is not None and out.stream is not None:
            stale, out.stream = out.stream, None
            await _reset(stale)
        with trio.move_on_after(self._config.dial_timeout_s):
            try:
                await self._host.disconnect(pid)
            except Exception as e:  # libp2p's errors: no documented set
                logger.debug("closing the connections to %s: %s", peer_id, _describe(e))
        libp2p_internals.clear_dial_backoff(self._host, peer_id)

    async def receive(self, *, timeout_s: float | None = None) -> tuple[str, object]:
        """The next ``(sender peer id, message)`` from any peer, in arrival order per peer.

        Waits until one arrives or, with ``timeout_s``, at most that long
        (:class:`~atoll.protocol.errors.ExchangeTimeout`). After the host closed it raises
        ``trio.ClosedResourceError``.
        """
        if timeout_s is None:
            return await self._messages.receive()
        with trio.move_on_after(timeout_s):
            return await self._messages.receive()
        raise ExchangeTimeout(f"no message arrived within {timeout_s} s")

    # -- outgoing streams -------------------------------------------------------------------
    def _parse_peer_id(self, peer_id: str) -> ID:
        try:
            pid = ID.from_base58(peer_id)
        except Exception as e:  # base58 raises ValueError; be safe with any text
            raise ConfigError(f"{peer_id!r} is not a peer id: {e}") from None
        if str(pid) != peer_id:
            raise ConfigError(f"{peer_id!r} is not a peer id in canonical base58btc")
        if peer_id == self._peer_id:
            raise ConfigError("a node does not send messages to itself")
        return pid

    async def _ensure_stream(self, info: PeerInfo, addr: str) -> None:
        peer = str(info.peer_id)
        out = self._outgoing.setdefault(peer, _Outgoing())
        with trio.move_on_after(self._config.send_timeout_s) as scope:
            async with out.lock:
                await self._stream_of(out, info, peer, addr)
        if scope.cancelled_caught:
            raise PeerTimedOut(
                f"connecting to peer {peer} took over {self._config.send_timeout_s} s "
                "(a send in progress, the dial and the Hello exchange)"
            )

    async def _stream_of(
        self, out: _Outgoing, info: PeerInfo, peer: str, addr: str | None = None
    ) -> INetStream:
        """The peer's open stream, or a new one; the caller holds ``out.lock``."""
        if out.stream is not None and not _connection_alive(out.stream):
            logger.debug("connection to peer %s is gone; opening a new stream", peer)
            stale, out.stream = out.stream, None
            await _reset(stale)
        if out.stream is None:
            out.stream = await self._open_outgoing(info, peer, addr)
        return out.stream

    async def _open_outgoing(
        self, info: PeerInfo, peer: str, addr: str | None = None
    ) -> INetStream:
        """Dial if needed, open an atoll stream, exchange Hellos; the caller holds the lock."""
        where = f" at {addr}" if addr else ""
        with trio.move_on_after(self._config.dial_timeout_s) as dial_scope:
            try:
                # reuses a live connection; otherwise dials the addresses in info and the
                # peerstore (libp2p retries a refused dial 3 times, ~0.7 s)
                await self._host.connect(info)
            except Exception as e:  # libp2p's dial errors have no documented set
                raise PeerUnavailable(
                    f"cannot connect to peer {peer}{where}: {_describe(e)}"
                ) from e
        if dial_scope.cancelled_caught:
            raise PeerTimedOut(
                f"connecting to peer {peer}{where} timed out after {self._config.dial_timeout_s} s"
            )
        stream: INetStream | None = None
        ok = False
        with trio.move_on_after(self._config.hello_timeout_s) as hello_scope:
            try:
                try:
                    stream = await self._host.new_stream(info.peer_id, [ATOLL_PROTOCOL])
                except Exception as e:
                    if _not_supported(e):
                        raise await self._version_mismatch(info.peer_id, peer) from e
                    raise PeerUnavailable(
                        f"cannot open an atoll stream to peer {peer}: {_describe(e)}"
                    ) from e
                try:
                    await stream.write(self._hello_frame)
                    self._sent[peer] += len(self._hello_frame)
                    hello = await self._read_hello(stream, peer)
                except StreamEOF:
                    if _connection_alive(stream) and self._private:
                        raise NotAMember(
                            self._peer_id,
                            f"peer {peer}{where} closed the stream after this node's Hello "
                            "without answering: it does not count this node as a member of "
                            f"run {self._run_id[:12]} (check --cert, the certificate's "
                            "expiry and the manifest's [membership] table), or it serves "
                            "another run",
                        ) from None
                    if _connection_alive(stream):
                        raise WrongRun(
                            peer,
                            self._run_id,
                            f"peer {peer}{where} does not serve run {self._run_id}: it "
                            "closed the stream after our Hello without answering, as atoll "
                            "peers do for a peer of another run. Check the run manifest and "
                            "the peer address.",
                        ) from None
                    raise PeerUnavailable(
                        f"peer {peer} closed the connection during the Hello exchange"
                    ) from None
                except CodecError:
                    raise
                except Exception as e:
                    raise PeerUnavailable(
                        f"Hello exchange with peer {peer} failed: {_describe(e)}"
                    ) from e
                problem = self._hello_problem(hello, peer)
                if problem is not None:
                    raise problem
                ok = True
            finally:
                if stream is not None and not ok:
                    await _reset(stream)
        if hello_scope.cancelled_caught or stream is None:
            raise PeerTimedOut(
                f"peer {peer} did not complete the Hello exchange within "
                f"{self._config.hello_timeout_s} s"
            )
        logger.debug("stream to peer %s open (run %s)", peer, self._run_id[:12])
        return stream

    async def _version_mismatch(self, pid: ID, peer: str) -> VersionMismatch:
        offered: tuple[str, ...] = ()
        with trio.move_on_after(_LS_TIMEOUT_S):
            try:
                listed = await self._host.send_command(pid, "ls", _LS_TIMEOUT_S)
                offered = tuple(p for p in listed if p.startswith("/atoll/"))
            except Exception as e:  # best effort: only makes the message better
                logger.debug("peer %s: cannot list its protocols: %s", peer, _describe(e))
        if offered:
            detail = f"it serves {', '.join(offered)}"
        else:
            detail = "it serves no atoll protocol (another atoll version, or not atoll)"
        return VersionMismatch(
            peer,
            f"peer {peer} does not speak {ATOLL_PROTOCOL} (this node's wire version "
            f"{PROTOCOL_VERSION}): {detail}",
            offered,
        )

    def _hello_problem(self, msg: Hello, peer: str) -> AtollError | None:
        """Why a stream's Hello is refused, or None when it is good."""
        if msg.protocol != PROTOCOL_VERSION:
            return VersionMismatch(
                peer,
                f"peer {peer} says protocol version {msg.protocol} in its Hello; "
                f"this node speaks {PROTOCOL_VERSION}",
                version=msg.protocol,
            )
        if msg.peer_id != peer:
            return CodecError(f"peer {peer} sent a Hello naming peer {msg.peer_id!r}, not itself")
        if msg.run_id != self._run_id:
            return WrongRun(
                peer,
                self._run_id,
                f"peer {peer} serves run {msg.run_id}, this node serves run {self._run_id}",
            )
        try:
            self._check_member(peer, msg.certificate)
        except NotAMember as e:
            return e
        self._members.add(peer)
        self._member_certs[peer] = msg.certificate
        waiting = self._awaited.pop(peer, None)
        if waiting is not None:
            waiting.set()
        return None

    @property
    def _private(self) -> bool:
        return self._membership is not None and self._membership.private

    def _check_member(self, peer: str, certificate: bytes | None) -> None:
        if self._membership is not None:
            self._membership.check(peer, certificate, time.time())

    async def _read_hello(self, stream: INetStream, peer: str) -> Hello:
        """The stream's first message, which must be a Hello (else ``CodecError``).

        Reads nothing past it (what follows is the drain's). Raises ``StreamEOF`` when
        the stream ends first; the caller bounds the time.
        """
        body = await self._read_first_frame(stream, peer)
        try:
            msg = decode_message(body, max_bytes=HELLO_MAX_BYTES)
        except CodecError as e:
            raise CodecError(f"peer {peer} sent a first frame that does not decode: {e}") from e
        if not isinstance(msg, Hello):
            raise CodecError(f"peer {peer} sent {type(msg).__name__} where a Hello belongs")
        return msg

    async def _read_first_frame(self, stream: INetStream, peer: str) -> bytes:
        """The first frame's body, reading no further (what follows is the drain's).

        Raises ``CodecError`` when its header announces more than HELLO_MAX_BYTES and
        ``StreamEOF`` when the stream ends first. The caller bounds the time.
        """
        header = await self._read_exactly(stream, peer, _HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > HELLO_MAX_BYTES:
            raise CodecError(
                f"peer {peer} announced a first frame of {size} bytes, over the Hello "
                f"limit of {HELLO_MAX_BYTES}"
            )
        return await self._read_exactly(stream, peer, size)

    async def _read_exactly(self, stream: INetStream, peer: str, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            data = await stream.read(n - len(buf))
            if not data:
                raise StreamEOF("stream ended")
            self._received[peer] += len(data)
            buf += data
        return bytes(buf)

    # -- incoming streams -------------------------------------------------------------------
    async def _on_stream(self, stream: INetStream) -> None:
        """libp2p's handler: it runs in the connection's task for this stream; the work goes
        into open_host's nursery, so closing the host ends it. Waiting for it keeps
        libp2p's stream accounting right."""
        done = trio.Event()
        try:
            self._nursery.start_soon(self._serve_incoming, stream, done)
        except RuntimeError:  # the nursery is closed: the host is shutting down
            await _reset(stream)
            return
        await done.wait()

    async def _serve_incoming(self, stream: INetStream, done: trio.Event) -> None:
        peer = str(stream.muxed_conn.peer_id)  # authenticated by Noise
        try:
            if self._pending[peer] >= MAX_PENDING_STREAMS:
                if peer not in self._flooding:
                    self._flooding.add(peer)
                    logger.warning(
                        "peer %s holds %d streams without a Hello; resetting the ones it "
                        "opens beyond that",
                        peer,
                        MAX_PENDING_STREAMS,
                    )
                return
            self._pending[peer] += 1
            try:
                admitted = await self._admit(stream, peer)
            finally:
                self._pending[peer] -= 1
                if not self._pending[peer]:
                    del self._pending[peer]
                    self._flooding.discard(peer)
            if not admitted:
                return
            old = self._incoming.get(peer)
            self._incoming[peer] = stream
            if old is not None:
                # one incoming stream per peer bounds what a peer can make us buffer; a
                # peer opens a new one only when its old one failed
                logger.debug("peer %s opened a new stream; dropping its old one", peer)
                await _reset(old)
            try:
                await self._drain(stream, peer)
            finally:
                if self._incoming.get(peer) is stream:
                    del self._incoming[peer]
        except FrameBudgetExceeded:
            pass  # the budget logged its warning, naming the peer and what it held
        except CodecError as e:
            logger.warning("hostile input, stream from peer %s reset: %s", peer, e)
        except ExchangeTimeout as e:  # a frame begun and left (nearly) unfinished
            logger.warning("stream from peer %s reset: %s", peer, e)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            logger.debug("host closing: dropping the stream from peer %s", peer)
        except Exception as e:  # a peer must never take the host down, whatever it sends
            logger.info("stream from peer %s ended: %s", peer, _describe(e))
        finally:
            try:
                await _reset(stream)  # refused, hostile, ended or cancelled: never reused
            finally:
                done.set()

    async def _admit(self, stream: INetStream, peer: str) -> bool:
        """Read and check the first frame; answer a good Hello. False: stream refused.

        Raises ``CodecError`` on hostile bytes; the caller logs it and resets.
        """
        hello: Hello | None = None
        with trio.move_on_after(self._config.hello_timeout_s):
            try:
                hello = await self._read_hello(stream, peer)
            except StreamEOF:
                logger.debug("peer %s closed a stream before its Hello", peer)
                return False
        if hello is None:
            logger.info(
                "peer %s sent no Hello within %s s; stream reset",
                peer,
                self._config.hello_timeout_s,
            )
            return False
        problem = self._hello_problem(hello, peer)
        if isinstance(problem, WrongRun):
            logger.info("refusing a stream from peer %s: %s", peer, problem)
            await self._refuse(stream)
            return False
        if isinstance(problem, NotAMember):
            logger.warning("refused peer %s of run %s: %s", peer, self._run_id[:12], problem)
            await self._refuse(stream)
            return False
        if problem is not None:
            logger.warning("refusing a stream from peer %s: %s; stream reset", peer, problem)
            return False
        with trio.fail_after(self._config.hello_timeout_s):
            await stream.write(self._hello_frame)
        self._sent[peer] += len(self._hello_frame)
        logger.debug("stream from peer %s admitted (%s)", peer, hello.agent)
        return True

    async def _refuse(self, stream: INetStream) -> None:
        """Close our side (FIN) so the sender sees a refusal, not a failure; wait (bounded)
        for it to close its side so our reset cannot overtake the FIN."""
        await stream.close()
        with trio.move_on_after(self._config.hello_timeout_s):
            try:
                while await stream.read(HELLO_MAX_BYTES):
                    pass  # a sender has nothing to say before its Hello is answered
            except Exception:  # EOF or reset: the sender got the message
                pass

    async def _drain(self, stream: INetStream, peer: str) -> None:
        """Read the stream as fast as it arrives; decoded messages go to the inbox.

        Unfinished frames are charged to the host's :attr:`frame_budget`; a frame that
        does not decode, a stream reset to keep within the budget and a frame trickled too
        slowly raise (the caller logs and resets). No timeout bounds an idle stream: that
        is normal between rounds, and nothing waits on it; a dead connection ends it
        through libp2p. When the inbox is full this task blocks, the stream stops draining
        and the sender's writes fail after 5 s (yamux).
        """
        max_bytes = self._config.max_frame_bytes
        received = self._received

        def on_bytes(n: int) -> None:
            received[peer] += n

        async def on_frame(body: bytes) -> None:
            msg = decode_message(body, max_bytes=max_bytes)  # CodecError: hostile
            await self._inbox.send((peer, msg))

        await read_frames(
            stream,
            peer=peer,
            budget=self._frame_budget,
            on_frame=on_frame,
            max_bytes=max_bytes,
            on_bytes=on_bytes,
            read_bytes=_READ_CHUNK,
        )
        logger.debug("peer %s closed its stream", peer)


@asynccontextmanager
async def open_host(
    identity: Identity,
    run_id: str,
    config: HostConfig,
    *,
    membership: Membership | None = None,
    certificate: bytes | None = None,
) -> AsyncIterator[AtollHost]:
    """Run a libp2p host for ``identity`` serving run ``run_id``; yield its :class:`AtollHost`.

    ``membership`` is the run's policy, checked on every Hello in both directions (None:
    anyone); ``certificate`` is this node's member certificate, shown in its Hello.

    The host listens on ``config.listen`` (Noise only, yamux only) until the block exits;
    then every stream task is cancelled and every connection closed (bounded, 5 s). Must
    run inside the trio loop of the network process. An exception leaving the block comes
    out as raised, not wrapped in the exception groups of the nurseries inside (several
    at once stay grouped; so does any cancellation).
    """
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"a run id is 64 lowercase hex digits, not {run_id!r}")
    host, listen = _build_host(identity, config)
    inbox, messages = trio.open_memory_channel[tuple[str, object]](config.receive_queue)
    # an exception of the block comes out of three nurseries (ours, libp2p's host and
    # service runners) wrapped three times; a lone one is handed back as it was raised
    with unwrap_lone(keep_grouped=(trio.Cancelled,)):
        async with inbox, messages, host.run(listen_addrs=listen), trio.open_nursery() as nursery:
            await libp2p_internals.stop_auto_connector(host)
            nursery.start_soon(_sweep_closed_connections, host)
            atoll = AtollHost(
                host, identity, run_id, config, nursery, inbox, messages, membership, certificate
            )
            host.set_stream_handler(ATOLL_PROTOCOL, atoll._on_stream)
            logger.info(
                "host %s up for run %s on %s",
                identity.peer_id,
                run_id[:12],
                ", ".join(atoll.addrs),
            )
            try:
                yield atoll
            finally:
                # replaced, not removed: a stream still being negotiated looks its handler
                # up after an await, and a removed one raises KeyError in py-libp2p
                host.set_stream_handler(ATOLL_PROTOCOL, _reset)
                nursery.cancel_scope.cancel()
                await _close_host(host)


@asynccontextmanager
async def open_libp2p_host(identity: Identity, config: HostConfig) -> AsyncIterator[BasicHost]:
    """Run the libp2p host :func:`open_host` runs, bare: no atoll message protocol, no run.

    Same security (Noise only, yamux only), listen addresses, timeouts, logging set-up and
    bounded close (5 s) as :func:`open_host`; no stream handler of its own. For a peer that
    only serves other protocols on the host, such as the run-agnostic DHT of ``atoll
    bootstrap`` (:class:`~atoll.dht.kad.AtollDHT` with ``run_id=None``). Must run inside a
    trio loop. An exception leaving the block comes out as raised, not wrapped in the
    exception groups of libp2p's nurseries (several at once stay grouped; so does any
    cancellation).
    """
    host, listen = _build_host(identity, config)
    with unwrap_lone(keep_grouped=(trio.Cancelled,)):
        async with host.run(listen_addrs=listen), trio.open_nursery() as nursery:
            await libp2p_internals.stop_auto_connector(host)
            nursery.start_soon(_sweep_closed_connections, host)
            logger.info(
                "host %s up on %s",
                identity.peer_id,
                ", ".join(str(a) for a in host.get_transport_addrs()),
            )
            try:
                yield host
            finally:
                nursery.cancel_scope.cancel()
                await _close_host(host)


_MAX_CONNECTIONS_PER_PEER = 16
_SWEEP_EVERY_S = 0.5


def exclusive_listen_addr(addr: str) -> str:
    """``addr`` with a TCP port no other socket holds: port 0 replaced by a free port.

    py-libp2p 0.8.1 listens with SO_REUSEPORT (for hole punching), so a second process
    of the same user can bind a port already served, and the kernel then splits incoming
    connections between the two: peers dialing one node's address would reach the other,
    under another peer id, about every other time. Measured here: with port 0, a node
    of a local swarm was given a port another node already served and never completed a
    dial. A plain bind (no SO_REUSEPORT) fails while anyone listens on a port and never
    picks such a port for port 0; so a fixed port is checked with one (ConfigError when
    taken) and port 0 is replaced by the port a plain bind picks, released at once. A
    race with a process starting in the same instant remains. Names (``/dns4/...``) and
    non-TCP addresses are returned unchanged.
    """
    ma = multiaddr.Multiaddr(addr)
    ip = family = None
    for proto, fam in (("ip4", socket.AF_INET), ("ip6", socket.AF_INET6)):
        with contextlib.suppress(Exception):
            ip = ma.value_for_protocol(proto)
        if ip:
            family = fam
            break
    try:
        port = int(ma.value_for_protocol("tcp") or 0)
    except Exception:  # no tcp part: libp2p will say what it makes of it
        return addr
    if not ip or family is None:
        return addr
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: connections of an earlier run in TIME_WAIT must not block a restart
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {addr}: {e.strerror or e} (is another atoll peer or "
                "program using the port?)"
            ) from None
        if port:
            return addr
        free = probe.getsockname()[1]
    return re.sub(r"/tcp/0(?=/|$)", f"/tcp/{free}", addr, count=1)


def expand_wildcard(addr: multiaddr.Multiaddr) -> list[multiaddr.Multiaddr]:
    """``addr`` with a wildcard IP (``0.0.0.0``, ``::``) replaced by this machine's
    interface addresses (no traffic); any other address as it is."""
    ip = None
    for proto in ("ip4", "ip6"):
        with contextlib.suppress(Exception):
            ip = addr.value_for_protocol(proto)
        if ip:
            break
    if not ip or not ipaddress.ip_address(ip).is_unspecified:
        return [addr]
    # libp2p's own expansion (interface enumeration, no traffic)
    try:
        return libp2p_internals.expand_wildcard_address(addr) or [addr]
    except Exception as e:
        logger.info("could not list the interfaces behind %s: %s", addr, e)
        return [addr]


def _advertised(candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """What the host tells peers (identify, DHT provider records): its addresses with
    wildcards expanded, since a peer cannot dial ``0.0.0.0``. Order kept, no duplicates."""
    out: list[multiaddr.Multiaddr] = []
    for addr in candidates:
        for concrete in expand_wildcard(addr):
            if concrete not in out:
                out.append(concrete)
    return out


def _build_host(
    identity: Identity, config: HostConfig
) -> tuple[BasicHost, list[multiaddr.Multiaddr]]:
    """A libp2p host for ``identity`` (not started) and the addresses it is to listen on."""
    if not isinstance(identity, Identity):
        raise ConfigError(f"a libp2p host needs an Identity, not {type(identity).__name__}")
    try:
        listen = [multiaddr.Multiaddr(a) for a in config.listen]
    except Exception as e:
        raise ConfigError(f"HostConfig.listen holds a bad multiaddr: {e}") from None
    listen = [multiaddr.Multiaddr(exclusive_listen_addr(str(a))) for a in listen]
    _configure_libp2p_logging()
    tune_frames()

    key_pair = create_new_key_pair(identity.private_bytes())
    if str(ID.from_pubkey(key_pair.public_key)) != identity.peer_id:
        raise ConfigError("libp2p derives another peer id from this identity's key")
    # new_host's defaults add TLS, SECIO and /plaintext/2.0.0; a plaintext dialer could
    # claim any peer id. Noise alone, with a fresh X25519 key per process (the Noise
    # static key is signed by the identity key in the handshake).
    noise = LeanNoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): LeanYamux},
        listen_addrs=listen,
        addrs_factory=_advertised,
        connection_config=ConnectionConfig(
            dial_timeout=config.dial_timeout_s,
            inbound_upgrade_timeout=config.dial_timeout_s,
            outbound_upgrade_timeout=config.dial_timeout_s,
            inbound_stream_protocol_negotiation_timeout=config.hello_timeout_s,
            outbound_stream_protocol_negotiation_timeout=config.hello_timeout_s,
            # two peers that dial each other at once hold two connections; with the
            # default of 3 per peer, trimming closed the one carrying the other side's
            # stream mid-round (TCP reset, measured in the local swarm). Keep them all.
            max_connections_per_peer=_MAX_CONNECTIONS_PER_PEER,
        ),
    )
    if not isinstance(host, BasicHost):  # new_host builds one when no router is given
        raise TypeError(f"libp2p.new_host built a {type(host).__name__}, not a BasicHost")
    return host, listen


async def _sweep_closed_connections(host: BasicHost) -> None:
    """Forget closed connections at once, every :data:`_SWEEP_EVERY_S`.

    py-libp2p 0.8.1 marks a connection closed first and removes it from the swarm's
    table only after its muxer and socket have closed, which can take long on a dead
    link; meanwhile a new stream to that peer fails with "No valid connections available"
    instead of dialing again (the closed one still counts as the peer's connection).
    Seen here in a local swarm under load: a peer unreachable for many seconds after a
    reset. Removing closed entries lets the next stream dial a fresh connection.
    """
    network = host.get_network()
    while True:
        await trio.sleep(_SWEEP_EVERY_S)
        try:
            table = dict(network.get_connections_map())
        except Exception:  # the swarm is shutting down
            return
        for conns in table.values():
            for conn in list(conns):
                if getattr(conn, "is_closed", False):
                    with contextlib.suppress(Exception):
                        libp2p_internals.forget_connection(network, conn)


# -- helpers --------------------------------------------------------------------------------
async def _reset(stream: INetStream) -> None:
    """Reset a stream, shielded and bounded: used while failing, cancelled or closing."""
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + _CLEANUP_S
        try:
            await stream.reset()
        except Exception as e:  # the connection may be gone already
            logger.debug("stream reset failed: %s", _describe(e))


async def _close_host(host: BasicHost) -> None:
    """Close every connection and listener before leaving ``host.run()``, shielded and
    bounded. Leaving ``run()`` alone stops the swarm by cancellation, which cuts short the
    closing of connections: a dialer's sockets stayed open and its peers noticed nothing
    (measured: the acceptor still held the connection seconds later)."""
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + _CLOSE_S
        try:
            await host.close()
        except Exception as e:
            logger.warning("closing the libp2p host failed: %s", _describe(e))
    if scope.cancelled_caught:
        logger.warning("closing the libp2p host took over %s s; left to cancellation", _CLOSE_S)


def _connection_alive(stream: INetStream) -> bool:
    """Whether the stream's connection still stands (an EOF then came from the peer)."""
    muxed = stream.muxed_conn
    if libp2p_internals.muxer_shutting_down(muxed):  # yamux's, not in the ABC
        return False
    return not muxed.is_closed


def _not_supported(error: BaseException) -> bool:
    """Whether a failed new_stream means the peer answered "na" to every protocol.

    py-libp2p wraps it as StreamFailure from MultiselectClientError and tells it apart
    from a timeout or a broken stream only by its text.
    """
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, MultiselectClientError) and "not supported" in str(seen):
            return True
        seen = seen.__cause__
    return False


def _describe(error: BaseException) -> str:
    text = str(error)
    name = type(error).__name__
    return f"{name}: {text}" if text else name


def _configure_libp2p_logging() -> None:
    """libp2p's loggers at WARNING through the node's handlers, minus the lines that
    repeat a failure atoll raises anyway (:data:`_RAISED_AGAIN`).

    On import libp2p gives its ``libp2p`` logger no handler and turns propagation off, so
    its warnings reach stderr through logging's last-resort handler, bypassing the node's
    configuration. With LIBP2P_DEBUG set, libp2p's own set-up is left alone. Idempotent.
    """
    if os.environ.get("LIBP2P_DEBUG"):
        return
    root = logging.getLogger("libp2p")
    # ATOLL_LIBP2P_LOG=INFO (or DEBUG) shows more of libp2p through atoll's handlers
    level = getattr(logging, os.environ.get("ATOLL_LIBP2P_LOG", "WARNING").upper(), None)
    level = level if isinstance(level, int) else logging.WARNING
    root.setLevel(level)
    root.propagate = True
    # py-multiaddr logs every address parse at DEBUG (several per stream)
    logging.getLogger("multiaddr").setLevel(logging.WARNING)
    # some modules set their own level at import (the auto-connector: INFO, every cycle)
    for name, child in list(logging.root.manager.loggerDict.items()):
        if (
            name.startswith("libp2p.")
            and isinstance(child, logging.Logger)
            and logging.NOTSET < child.level < level
        ):
            child.setLevel(level)
    for name, prefixes in _RAISED_AGAIN.items():
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropRaisedAgain) for f in lg.filters):
            lg.addFilter(_DropRaisedAgain(prefixes))
    swarm = logging.getLogger("libp2p.network.swarm")
    if not any(isinstance(f, _DropCancelled) for f in swarm.filters):
        swarm.addFilter(_DropCancelled())


class _DropCancelled(logging.Filter):
    """Drops the records that carry a ``trio.Cancelled``: a connection still being set
    up when the host closes is cancelled with it, and libp2p logs that with a traceback
    (``[ADDCONN_FAIL]``) although nothing failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, trio.Cancelled)


class _DropRaisedAgain(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self._prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self._prefixes))

"""Every py-libp2p 0.8.1 internal that atoll.node relies on, in one place.

py-libp2p's documented surface (``new_host``, the ``libp2p.abc`` interfaces, the host's
and the swarm's public methods) does not cover everything the host needs: a dial that
is refused for 60 s after a failure, closed connections kept in the swarm's table, an
auto-connector that dials everyone, a yamux shutdown the muxer ABC does not show. Those
reach-ins live here, as small functions whose docstrings say which internal they touch
and why; :mod:`atoll.node.net.host` calls these and never touches a private name itself.

:data:`INTERNALS` lists each internal with its expected kind (and parameters where the
signature matters): the functions below, and the subclass overrides and reach-ins of
:mod:`atoll.node.net.transport` (a replacement of py-libp2p's Noise session and yamux
muxer, which stays in its module). ``tests/unit/test_libp2p_internals.py`` walks the list
against the installed py-libp2p, so upgrading the pin starts with that test: a failure
names the internal that moved and the atoll function that needs it.
"""

from __future__ import annotations

import logging

import multiaddr
import trio
from libp2p.abc import IHost, IMuxedConn, INetConn, INetworkService

from atoll.dht.libp2p_internals import Internal

__all__ = [
    "INTERNALS",
    "Internal",
    "clear_dial_backoff",
    "expand_wildcard_address",
    "forget_connection",
    "muxer_shutting_down",
    "stop_auto_connector",
]

logger = logging.getLogger(__name__)


_SWARM = "libp2p.network.swarm"
_YAMUX = "libp2p.stream_muxer.yamux.yamux"
_NOISE_IO = "libp2p.security.noise.io"
_SESSION = "libp2p.security.secure_session"
_BASE_SESSION = "libp2p.security.base_session"

INTERNALS: tuple[Internal, ...] = (
    # -- this module (called by host.py) ------------------------------------------------------
    Internal(f"{_SWARM}:Swarm", "class", used_by="clear_dial_backoff, forget_connection"),
    Internal(
        f"{_SWARM}:Swarm._negative_peer_cache", "instance attribute", None, "clear_dial_backoff"
    ),
    Internal(
        f"{_SWARM}:_NegativePeerCache.evict", "method", ("self", "peer_id"), "clear_dial_backoff"
    ),
    Internal(f"{_SWARM}:Swarm.remove_conn", "method", ("self", "swarm_conn"), "forget_connection"),
    Internal(f"{_SWARM}:Swarm.auto_connector", "instance attribute", None, "stop_auto_connector"),
    Internal(
        "libp2p.network.auto_connector:AutoConnector.stop",
        "async method",
        ("self",),
        "stop_auto_connector",
    ),
    Internal(
        f"{_YAMUX}:Yamux.event_shutting_down", "instance attribute", None, "muxer_shutting_down"
    ),
    Internal("libp2p.utils.address_validation", "module", None, "expand_wildcard_address"),
    Internal(
        "libp2p.utils.address_validation:expand_wildcard_address",
        "function",
        ("addr", "port"),
        "expand_wildcard_address",
    ),
    # -- transport.py: LeanYamux and tune_frames ----------------------------------------------
    Internal(f"{_YAMUX}:HEADER_SIZE", "int constant", None, "transport.FRAME_PAYLOAD, tune_frames"),
    Internal(
        f"{_YAMUX}:MAX_MESSAGE_SIZE", "int constant", None, "transport.tune_frames (writes it)"
    ),
    Internal(f"{_YAMUX}:_yamux_data_read_timeout", "function", (), "LeanYamux._read_data_body"),
    Internal(f"{_YAMUX}:Yamux._write_frame", "async method", ("self", "data"), "LeanYamux"),
    Internal(f"{_YAMUX}:Yamux._read_data_body", "async method", ("self", "length"), "LeanYamux"),
    Internal(f"{_YAMUX}:Yamux._write_lock", "instance attribute", None, "LeanYamux._write_frame"),
    Internal(f"{_YAMUX}:Yamux.secured_conn", "instance attribute", None, "LeanYamux"),
    # -- transport.py: LeanNoiseTransport, lean_session, LeanNoiseSession ---------------------
    Internal(
        "libp2p.security.noise.transport:Transport.__init__",
        "method",
        (
            "self",
            "libp2p_keypair",
            "noise_privkey",
            "early_data",
            "early_data_handler",
            "rekey_policy",
        ),
        "host._build_host (LeanNoiseTransport(key_pair, noise_privkey=...))",
    ),
    Internal(
        "libp2p.security.noise.transport:Transport.secure_inbound",
        "async method",
        ("self", "conn"),
        "LeanNoiseTransport",
    ),
    Internal(
        "libp2p.security.noise.transport:Transport.secure_outbound",
        "async method",
        ("self", "conn", "peer_id"),
        "LeanNoiseTransport",
    ),
    Internal(f"{_NOISE_IO}:MAX_NOISE_MESSAGE_LEN", "int constant", None, "transport.MAX_PLAINTEXT"),
    Internal(f"{_NOISE_IO}:NoiseTransportReadWriter", "class", None, "lean_session"),
    Internal(
        f"{_NOISE_IO}:NoiseTransportReadWriter.noise_state",
        "instance attribute",
        None,
        "lean_session",
    ),
    Internal(
        f"{_NOISE_IO}:NoiseTransportReadWriter.read_writer",
        "instance attribute",
        None,
        "lean_session",
    ),
    Internal(
        f"{_NOISE_IO}:NoisePacketReadWriter.read_write_closer",
        "instance attribute",
        None,
        "lean_session",
    ),
    Internal(
        f"{_SESSION}:SecureSession.__init__",
        "method",
        (
            "self",
            "local_peer",
            "local_private_key",
            "remote_peer",
            "remote_permanent_pubkey",
            "is_initiator",
            "conn",
        ),
        "LeanNoiseSession.__init__",
    ),
    Internal(f"{_SESSION}:SecureSession.conn", "instance attribute", None, "lean_session"),
    Internal(f"{_SESSION}:SecureSession.read", "async method", ("self", "n"), "LeanNoiseSession"),
    Internal(
        f"{_SESSION}:SecureSession.write", "async method", ("self", "data"), "LeanNoiseSession"
    ),
    Internal(
        f"{_BASE_SESSION}:BaseSession.local_peer", "instance attribute", None, "LeanNoiseSession"
    ),
    Internal(
        f"{_BASE_SESSION}:BaseSession.local_private_key",
        "instance attribute",
        None,
        "LeanNoiseSession",
    ),
    Internal(
        f"{_BASE_SESSION}:BaseSession.remote_peer", "instance attribute", None, "LeanNoiseSession"
    ),
    Internal(
        f"{_BASE_SESSION}:BaseSession.remote_permanent_pubkey",
        "instance attribute",
        None,
        "LeanNoiseSession",
    ),
    Internal(
        f"{_BASE_SESSION}:BaseSession.is_initiator", "instance attribute", None, "LeanNoiseSession"
    ),
)
"""The py-libp2p 0.8.1 internals atoll.node relies on (see the module docstring)."""


def clear_dial_backoff(host: IHost, peer_id: str) -> None:
    """Let ``peer_id`` be dialed at once, even if all its addresses failed lately.

    Touches ``Swarm._negative_peer_cache`` (a ``_NegativePeerCache``) and its ``evict``:
    the swarm refuses for 60 s to dial a peer whose addresses all failed, and an explicit
    connect (maybe to a peer that just came back) deserves a real try. A network without
    the cache is left alone.
    """
    cache = getattr(host.get_network(), "_negative_peer_cache", None)
    if cache is not None:
        cache.evict(peer_id)


def forget_connection(network: INetworkService, conn: INetConn) -> None:
    """Drop ``conn`` from the swarm's connection table without closing it.

    Touches ``Swarm.remove_conn`` (not in ``INetworkService``): py-libp2p 0.8.1 removes a
    closed connection from the table only after its muxer and socket have closed, and
    meanwhile a new stream to that peer fails instead of dialing again. Raises whatever
    the swarm raises (an ``AttributeError`` on a network without the method).
    """
    network.remove_conn(conn)  # type: ignore[attr-defined]


async def stop_auto_connector(host: IHost) -> None:
    """Stop the swarm's auto-connector, which dials every peer in the peerstore (a dead
    peer's address included, for 2 minutes) while the node has fewer than 150 connections.

    Touches ``Swarm.auto_connector`` (not in ``INetworkService``) and its ``stop()``: atoll
    chooses whom to connect to. A network without one is left alone.
    """
    auto_connector = getattr(host.get_network(), "auto_connector", None)
    if auto_connector is not None:
        await auto_connector.stop()


def muxer_shutting_down(muxed: IMuxedConn) -> bool:
    """Whether ``muxed`` (a yamux connection) has begun to shut down.

    Touches ``Yamux.event_shutting_down`` (yamux's own ``trio.Event``, not in the
    ``IMuxedConn`` ABC, whose ``is_closed`` turns true only later): a stream whose
    connection is going down is not reused. False for a muxer without the event.
    """
    shutting_down = getattr(muxed, "event_shutting_down", None)
    return isinstance(shutting_down, trio.Event) and shutting_down.is_set()


def expand_wildcard_address(addr: multiaddr.Multiaddr) -> list[multiaddr.Multiaddr]:
    """``addr`` (a wildcard ``0.0.0.0`` or ``::`` address) as this machine's interface
    addresses (no traffic).

    Calls ``libp2p.utils.address_validation.expand_wildcard_address``, a module outside
    py-libp2p's documented API, imported at the call so that importing the host never
    depends on it. Raises what it raises.
    """
    from libp2p.utils.address_validation import expand_wildcard_address as expand

    return list(expand(addr))

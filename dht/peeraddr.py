"""Parsing a peer's address, ``/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...``, as given on a
command line (``--join``) or by a peer, with one clear error for malformed text."""

from __future__ import annotations

import multiaddr
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from atoll.protocol.errors import ConfigError

__all__ = ["parse_peer_addr"]


def parse_peer_addr(addr: str) -> PeerInfo:
    """The peer id and address in ``addr``; ConfigError when it is not a peer address."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as e:  # multiaddr raises a zoo of types on bad text
        raise ConfigError(
            f"{addr!r} is not a peer address like /ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...: {e}"
        ) from None

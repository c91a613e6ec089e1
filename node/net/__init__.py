"""atoll.node.net: the network side of a node, run in a process of its own on one trio loop.

Map of the modules:

- ``host``  one py-libp2p host (Noise only, yamux): connect to peers with a Hello check
            of run and protocol version, send and receive wire messages on reused,
            constantly drained streams, per-peer byte counters

Still to come: the DHT adapter, matchmaking and all-reduce drivers over the host, and the
shared-memory bridge to the trainer process.
"""

from atoll.node.net.host import (
    AGENT,
    ATOLL_PROTOCOL,
    HELLO_MAX_BYTES,
    AtollHost,
    HostConfig,
    VersionMismatch,
    WrongRun,
    open_host,
)

__all__ = [
    "AGENT",
    "ATOLL_PROTOCOL",
    "HELLO_MAX_BYTES",
    "AtollHost",
    "HostConfig",
    "VersionMismatch",
    "WrongRun",
    "open_host",
]

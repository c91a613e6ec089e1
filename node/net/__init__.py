"""atoll.node.net: the network side of a node, run in a process of its own on one trio loop.

Map of the modules:

- ``host``  one py-libp2p host (Noise only, yamux): connect to peers with a Hello check
            of run and protocol version, send and receive wire messages on reused,
            constantly drained streams, per-peer byte counters; ``open_libp2p_host``, the
            same host bare, for a DHT-only peer
- ``bridge`` the trainer's side of the network process: fragments in shared memory, a
            spawned process running a trio worker (the OuterEngine lives there), small
            msgpack commands over pipes; ``serve`` and a loopback reference worker

Still to come: the DHT adapter, and matchmaking and all-reduce drivers over the host.
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
    open_libp2p_host,
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
    "open_libp2p_host",
]

"""atoll.node.net: the network side of a node, run in a process of its own on one trio loop.

Map of the modules:

- ``host``   one py-libp2p host (Noise only, yamux): connect to peers with a Hello check
             of run and protocol version, send and receive wire messages on reused,
             constantly drained streams, per-peer byte counters; ``open_libp2p_host``, the
             same host bare, for a DHT-only peer
- ``bridge`` the trainer's side of the network process: fragments in shared memory, a
             spawned process running a trio worker, small msgpack commands over pipes;
             ``serve`` and a loopback reference worker
- ``rounds`` the drivers of the sans-IO round machines over a host: the mailbox that
             routes messages to rounds, matchmaking, all-reduce, state transfer
- ``swarm``  the swarm worker: host, DHT, OuterEngine, joining, syncs, rebases, status

Nothing is re-exported here: the trainer imports ``bridge`` alone, and importing the
package must not load libp2p into the training process.
"""

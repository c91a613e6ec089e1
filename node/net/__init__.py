"""atoll.node.net: the network side of a node, run in a process of its own on one trio loop.

Map of the modules:

- ``host``   one py-libp2p host (Noise only, yamux): connect to peers with a Hello check
             of run and protocol version, send and receive wire messages on reused,
             constantly drained streams, per-peer byte counters; ``open_libp2p_host``, the
             same host bare, for a DHT-only peer
- ``bridge`` the trainer's side of the network process: fragments in shared memory, a
             spawned process running a trio worker, small msgpack commands over pipes;
             ``serve`` and a loopback reference worker
- ``seam``   the two small interfaces the round drivers use: a message transport
             (peer id, send, receive) and a board of ready peers
- ``memory`` both in memory on trio channels, with seeded faults (tests under a fake clock)
- ``rounds`` the drivers of the sans-IO round machines over the seams: the mailbox that
             routes messages to rounds, matchmaking, all-reduce, state transfer
- ``syncer`` the driver of a fragment sync (``atoll.protocol.sync``) over the rounds, and
             the answers to peers' state requests
- ``peers``  the live peers of the run from their DHT records
- ``publisher`` this peer's record in the DHT, kept fresh
- ``tally``  counters of the syncs for the status; ``status``: the typed ``NodeStatus``
- ``join``   joining through ``--join`` addresses, and why a join failed
- ``faults`` tests' fault injection (kill the network process at a point of a round)
- ``transport``, ``heap``, ``libp2p_internals`` the lean Noise/yamux path, malloc
             settings, and every use of py-libp2p's private internals
- ``swarm``  the swarm worker: wires the above to the host, the DHT and the engine

Nothing is re-exported here: the trainer imports ``bridge`` alone, and importing the
package must not load libp2p into the training process.
"""

"""atoll.protocol: the training protocol, sans-IO (no sockets, no event loop, no torch).

Map of the modules:

- ``errors``     the exception tree (retryable versus rejected input)
- ``codecs``     what is sent: fp32, bf16, blockwise int8, blockwise 4-bit E3M0
- ``reduce``     token-weighted reduction of encoded contributions, RDA, byte accounting
- ``fragments``  Streaming DiLoCo fragment planner (strided blocks, balanced bins)
- ``schedule``   which fragment syncs at which inner step
- ``outer``      the outer optimizer (Nesterov SGD on fp32 global copies)
- ``engine``     per-fragment outer state: begin a sync, deliver a result, or skip

Everything here works on flat float32 numpy vectors, so a bootstrap peer can import it
without torch and the network process can run it on bytes it received.
"""

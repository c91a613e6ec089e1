"""atoll.protocol: the training protocol, sans-IO (no sockets, no event loop, no torch).

Map of the modules:

- ``errors``     the exception tree (retryable versus rejected input)
- ``codecs``     what is sent: fp32, bf16, blockwise int8, blockwise 4-bit E3M0
- ``reduce``     token-weighted reduction of encoded contributions, RDA, byte accounting
- ``fragments``  Streaming DiLoCo fragment planner (strided blocks, balanced bins)
- ``schedule``   which fragment syncs at which inner step
- ``packing``    balanced micro-batches of variable-length documents (Karmarkar-Karp)
- ``outer``      the outer optimizer (Nesterov SGD on fp32 global copies)
- ``engine``     per-fragment outer state: begin a sync, deliver a result, or skip
- ``manifest``   the run manifest (TOML) whose hash identifies a run, and ``OuterLoop``,
  the outer-loop settings it shares with the engine, the simulator and the demo
- ``messages``   wire messages (msgpack, typed and size-checked) and length-prefixed frames
- ``matchmaking`` who averages with whom: rank-ordered leaders, quorum, grace window
- ``allreduce``  one atomic round of reduce-scatter + all-gather inside an agreed group
- ``statesync``  the state a peer copies when it rebases, and which state the swarm follows
- ``sync``       one fragment sync owned by one machine: rebase or group, commit or roll
  back (the only caller of the engine's deliver, skip and import)
- ``streaming``  the trainer-side loop: which fragment is due, apply at t+τ, merge
- ``liveness``   which peers answer: suspicion holds from failed requests
- ``held``       where peers' trainers are held at a slot (so that no two waits wait on
  each other)
- ``robust``     robust aggregation at a chunk's owner: trimmed mean, centered clipping
- ``checks``     a part's norm and token weight against its group's, before reduction
- ``certificate`` members' attestations of a committed state, certificates, believed states
- ``strikes``    strikes against misbehaving peers and the bans they lead to

Everything here works on flat float32 numpy vectors, so a bootstrap peer can import it
without torch and the network process can run it on bytes it received.
"""

from atoll.protocol.codecs import CODEC_NAMES, Codec, make_codec
from atoll.protocol.engine import (
    EngineConfig,
    FragmentStats,
    OuterEngine,
    SyncRequest,
    average_requests,
)
from atoll.protocol.errors import (
    AtollError,
    CodecError,
    ConfigError,
    ExchangeTimeout,
    PeerUnavailable,
    RejectedContribution,
    RejectedInput,
    RetryableError,
    RoundAborted,
)
from atoll.protocol.fragments import (
    Fragment,
    FragmentPlan,
    TensorSpec,
    plan_balanced,
    plan_fragments,
)
from atoll.protocol.manifest import OuterLoop
from atoll.protocol.outer import OuterSGD
from atoll.protocol.reduce import (
    Contribution,
    allreduce_bytes_per_peer,
    chunk_bounds,
    reduce_encoded,
    weighted_mean,
)
from atoll.protocol.schedule import Schedule

__all__ = [
    "CODEC_NAMES",
    "AtollError",
    "Codec",
    "CodecError",
    "ConfigError",
    "Contribution",
    "EngineConfig",
    "ExchangeTimeout",
    "Fragment",
    "FragmentPlan",
    "FragmentStats",
    "OuterEngine",
    "OuterLoop",
    "OuterSGD",
    "PeerUnavailable",
    "RejectedContribution",
    "RejectedInput",
    "RetryableError",
    "RoundAborted",
    "Schedule",
    "SyncRequest",
    "TensorSpec",
    "allreduce_bytes_per_peer",
    "average_requests",
    "chunk_bounds",
    "make_codec",
    "plan_balanced",
    "plan_fragments",
    "reduce_encoded",
    "weighted_mean",
]

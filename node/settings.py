"""Torch-free settings: the config dataclasses of training, importable without PyTorch.

:class:`SimConfig` (``atoll simulate``), :class:`InnerConfig` (the inner optimizer) and
:class:`BootstrapConfig` (``atoll bootstrap``) live here rather than next to the code that
runs them, so that the ``atoll`` command line builds its parser, and a light subcommand
such as ``atoll bootstrap`` or ``atoll version`` runs, without importing torch (seconds of
start-up, and a dependency a bootstrap host need not have; a test checks). Nothing here
may import torch, trio or libp2p. :mod:`atoll.node.simulate` and :mod:`atoll.node.train`
re-export the first two; import them from either place.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.manifest import (
    MembershipSettings,
    OuterLoop,
    RobustSettings,
    RunManifest,
    short_id,
)
from atoll.protocol.packing import COSTS, PACKINGS
from atoll.protocol.sync import LATE_WEIGHT
from atoll.security.membership import (
    MAX_CERTIFICATE_BYTES,
    Membership,
    NotAMember,
    read_certificate,
)
from atoll.security.signing import BadSignature

__all__ = [
    "ALGOS",
    "DEFAULT_BOOTSTRAP_IDENTITY",
    "DEFAULT_NODE_IDENTITY",
    "BootstrapConfig",
    "InnerConfig",
    "NodeConfig",
    "SimConfig",
    "check_own_membership",
    "load_membership",
    "read_certificate_file",
]

ALGOS = ("ddp", "diloco", "streaming")

_RUN = OuterLoop()
"""The outer loop's own defaults (Streaming DiLoCo's), where :class:`SimConfig`'s start."""

_DILOCO: dict[str, Any] = {"tau": 0, "alpha": 0.0, "codec": "fp32"}
"""What every algorithm but streaming changes of those defaults: vanilla DiLoCo (arXiv
2311.08105) syncs blocking, keeps nothing of the local copy and sends fp32."""

DEFAULT_BOOTSTRAP_IDENTITY = "~/.atoll/bootstrap.key"
DEFAULT_NODE_IDENTITY = "~/.atoll/node.key"
"""Where ``atoll bootstrap`` keeps its identity unless told otherwise."""


@dataclass(frozen=True, slots=True)
class InnerConfig:
    """Inner optimizer settings (defaults from DiLoCo, warmup shortened for small models)."""

    lr: float = 2e-3
    """peak inner learning rate"""
    warmup: int = 50
    """linear warmup steps"""
    total_steps: int = 1000
    """steps of the cosine decay (the run's length)"""
    min_lr_ratio: float = 0.1
    """the cosine ends at lr × this"""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """clip the gradient norm to this (0 = off)"""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"inner lr must be > 0, not {self.lr}")
        if self.warmup < 0 or self.total_steps < 1:
            raise ConfigError("warmup must be >= 0 and total_steps >= 1")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. ``None`` means: the algorithm's own default.

    The outer-loop settings, ``H`` to ``aggregation``, are those of
    :class:`~atoll.protocol.manifest.OuterLoop`, which declares, documents and checks them;
    here they are only what this run changes of them, and :meth:`engine_config` builds the
    ``OuterLoop`` (construction checks it, except for ddp, which has no outer loop). They
    stay fields of their own so that each is a flag of ``atoll simulate`` and a keyword of
    ``SimConfig(...)`` and :meth:`with_`, and so that ``tau``, ``alpha`` and ``codec`` can
    be left to the algorithm: streaming takes OuterLoop's defaults, diloco vanilla DiLoCo's
    (τ 0, α 0, fp32), whatever the algorithm of a config derived with :meth:`with_`.
    """

    algo: str = "streaming"
    """ddp, diloco or streaming"""
    replicas: int = 4
    """M, the number of simulated peers"""
    steps: int = 1000
    """inner steps per replica (the token budget is steps × M × batch × seq_len)"""
    batch_size: int = 16
    """sequences per replica per step"""
    preset: str = "tiny"
    """model preset (micro, tiny, small, base, 125m, 350m, 1b) or hf:CONFIG.json"""
    data: str = "stdlib"
    """'stdlib' or comma-separated text/jsonl files or folders"""
    seed: int = 0
    lr: float = 2e-3
    """peak inner learning rate"""
    warmup: int = 50
    min_lr_ratio: float = 0.1
    H: int = _RUN.H
    tau: int | None = None
    """overlap steps (default: 0 for diloco, 1 for streaming)"""
    alpha: float | None = None
    """merge weight of the local copy (default: 0 for diloco, 0.5 for streaming)"""
    codec: str | None = None
    """wire codec (default: fp32 for diloco, e3m0 for streaming)"""
    codec_block: int = _RUN.codec_block
    outer_lr: float = _RUN.outer_lr
    outer_momentum: float = _RUN.outer_momentum
    nesterov: bool = _RUN.nesterov
    error_feedback: bool = _RUN.error_feedback
    aggregation: str = _RUN.aggregation
    blocks_per_fragment: int = 3
    extras: str = "own"
    """where embeddings/norm/head go: own, first or last fragment"""
    fail_prob: float = 0.0
    """probability that a round's exchange fails (all members skip it): fault injection"""
    final_sync: bool = True
    """sync every fragment once more at the end so the global model holds all the work"""
    eval_batches: int = 16
    eval_every: int = 0
    """evaluate the global parameters every N steps (0 = only at the end)"""
    log_every: int = 50
    device: str = "auto"
    rule: str = "mean"
    """how each chunk is combined: mean, trimmed_mean or centered_clip (the manifest's
    ``[robust] rule``); any robust setting or attack runs every round through the real
    all-reduce machines (:mod:`atoll.node.simattack`)"""
    checks: bool = False
    """check every part's norm and weight against the group's, sealed (``[robust] checks``)"""
    verify_owners: bool = False
    """a second member recomputes every chunk (``[robust] verify_owners``)"""
    attack: str = ""
    """what the hostile replicas do (an attack spec of ``atoll.node.net.attacks``, not forge)"""
    attackers: int = 0
    """how many replicas are hostile (the last ones; replica 0, the one evaluated, never)"""
    step_s: float = 1.0
    """simulated seconds per inner step: the clock of strikes and bans"""
    late: int = 0
    """how many replicas are late (replicas 1 to late): each misses each slot with
    probability late_prob, then meets the swarm a version behind"""
    late_prob: float = 0.5
    keep_late: bool = True
    """a late replica's Δ is offered at the newer state it copied (else dropped)"""
    late_weight: float = LATE_WEIGHT
    """the share of its token weight a Δ offered one version late keeps (the protocol's
    ``LATE_WEIGHT``)"""

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ConfigError(f"algo must be one of {', '.join(ALGOS)}, not {self.algo!r}")
        if self.replicas < 1 or self.steps < 1 or self.batch_size < 1:
            raise ConfigError("replicas, steps and batch_size must be >= 1")
        if not 0.0 <= self.fail_prob <= 1.0:
            raise ConfigError(f"fail_prob must be in [0, 1], not {self.fail_prob}")
        if self.algo != "ddp":
            self.engine_config()
        self.robust_settings()  # checks the rule
        if not 0 <= self.attackers < self.replicas:
            raise ConfigError(f"attackers must be in [0, replicas), not {self.attackers}")
        if not 0 <= self.late < self.replicas - self.attackers:
            raise ConfigError("late must be in [0, replicas - attackers) (replica 0 never is)")
        if self.attackers and not self.attack.strip():
            raise ConfigError("attackers need an attack (--attack)")
        if self.hostile and self.algo == "ddp":
            raise ConfigError("attacks and robust rules need an outer loop (not ddp)")

    def robust_settings(self) -> RobustSettings:
        """The ``[robust]`` table of this run."""
        return RobustSettings(rule=self.rule, checks=self.checks, verify_owners=self.verify_owners)

    @property
    def hostile(self) -> bool:
        """Whether rounds go through the all-reduce machines (an attack or a protection)."""
        return (
            bool(self.attackers)
            or bool(self.late)
            or not self.keep_late
            or self.late_weight != LATE_WEIGHT
            or self.robust_settings() != RobustSettings()
        )

    def engine_config(self) -> OuterLoop:
        """The outer loop the replicas drive: the algorithm's defaults, then this run's."""
        values = dict(_DILOCO) if self.algo != "streaming" else {}
        for f in fields(OuterLoop):
            if getattr(self, f.name) is not None:
                values[f.name] = getattr(self, f.name)
        return OuterLoop(**values)

    def inner_config(self) -> InnerConfig:
        return InnerConfig(
            lr=self.lr, warmup=self.warmup, total_steps=self.steps, min_lr_ratio=self.min_lr_ratio
        )

    def with_(self, **changes: Any) -> SimConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class BootstrapConfig:
    """A bootstrap peer: a light DHT server of every run, with a fixed identity and address.

    ``listen`` holds one or more multiaddrs separated by commas (the command line's
    ``--listen`` may be given several times instead). The default listens on every IPv4
    interface on TCP port 4001, the port libp2p peers are usually found on; give a fixed
    port, since peers are told this address.
    """

    identity: str = DEFAULT_BOOTSTRAP_IDENTITY
    """identity key file (created mode 0600 on first start; one running process per file)"""
    listen: str = "/ip4/0.0.0.0/tcp/4001"
    """multiaddr(s) to listen on, comma-separated; --listen may be repeated"""
    addr_file: str | None = None
    """also write the full multiaddr(s) to this file, one per line (replaced atomically)"""
    timeout_s: float = 10.0
    """bound on each dial and DHT request, in seconds"""
    run: str = ""
    """a private run's manifest: serve that run's members only (default: every run, anyone)"""
    cert: str = ""
    """the bootstrap's own member certificate, for --run of a run with an organisation key"""

    def __post_init__(self) -> None:
        if not self.identity.strip():
            raise ConfigError("bootstrap identity must be a file path, not empty")
        if not self.listen_addrs():
            raise ConfigError("bootstrap listen needs at least one multiaddr")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"bootstrap timeout_s must be > 0 and finite, not {self.timeout_s}")

    def listen_addrs(self) -> tuple[str, ...]:
        """``listen`` split at commas, blanks dropped."""
        return tuple(a.strip() for a in self.listen.split(",") if a.strip())


PROGRESS_MODES = ("text", "jsonl", "none")


@dataclass(frozen=True)
class NodeConfig:
    """One peer of a swarm (``atoll node``): which run, whom to join, how to report.

    ``join`` and ``listen`` hold multiaddrs separated by commas (the command line's
    ``--join`` and ``--listen`` may be repeated instead).
    """

    run: str = ""
    """the run's manifest (TOML); its hash is the run id, peers of other manifests never mix"""
    join: str = ""
    """bootstrap or peer multiaddr(s) ending in /p2p/<id>, comma-separated"""
    identity: str = DEFAULT_NODE_IDENTITY
    """identity key file (created mode 0600 on first start; one running node per file)"""
    listen: str = "/ip4/0.0.0.0/tcp/0"
    """multiaddr(s) to listen on, comma-separated (port 0: any free port)"""
    steps: int = 0
    """inner steps to train, then stop (0: up to the manifest's total_steps)"""
    wait_peers: int = 0
    """before training, wait until this many other peers of the run are in the DHT"""
    join_timeout_s: float = 60.0
    """the whole join's deadline, from when it begins (after start-up): the join addresses
    are retried with backoff until then, and a failure is told then, one line each"""
    device: str = "auto"
    threads: int = 0
    """torch CPU threads (0: torch's default)"""
    log_every: int = 20
    """a progress line every N steps (and at least every 10 s)"""
    eval_batches: int = 8
    """validation batches evaluated at the end (0: none)"""
    micro_batches: int = 4
    """micro-batches per step in a run with batching = "documents" (gradient accumulation)"""
    packing: str = "plain"
    """how such a batch is cut into micro-batches: plain (arrival order, equal counts) or
    kk (balanced cost: Karmarkar-Karp largest differencing, then greedy swaps)"""
    packing_cost: str = "quadratic"
    """a document's cost for kk packing: linear or quadratic in its length"""
    progress: str = "text"
    """text (a status line on stderr), jsonl (JSON lines on stdout) or none"""
    cert: str = ""
    """this node's member certificate (atoll org issue), for a run whose manifest names an
    organisation key"""
    fault: str = ""
    """fault injection for tests (kill:POINT:FRAGMENT:SLOT[:MEMBERS] or stop:..., usually
    from ATOLL_FAULT): the network process kills itself (or freezes with SIGSTOP) at that
    point of that fragment's first round at or after SLOT (of at least MEMBERS members);
    no command-line flag"""
    attack: str = ""
    """attack injection for benchmarks and tests (nan, huge, signflip, scaled:K, noise,
    alie, weight:K, stale, forge, equivocate; usually from ATOLL_ATTACK): this node lies
    on purpose (atoll.node.net.attacks)"""
    checkpoint_dir: str = ""
    """where this node keeps its checkpoints (default: checkpoints/<run>/<peer> next to
    the identity file)"""
    checkpoint_every_s: float = 300.0
    """write a checkpoint every this many seconds while training (0: only when the node
    stops); one is always written when it stops"""
    checkpoint_keep: int = 3
    """how many checkpoints to keep (older ones are removed)"""
    resume: bool = True
    """resume from the newest checkpoint in checkpoint_dir (--no-resume: start afresh,
    the checkpoints stay)"""
    slowdown: float = 1.0
    """a slow peer, for tests and benchmarks (bench/churn.py): after each step the trainer
    sleeps (slowdown - 1) times that step's compute time, so 2.0 trains half as fast
    (usually from ATOLL_SLOWDOWN; 1.0: no delay)"""
    ahead_s: float = 3.0
    """form each fragment's group this many seconds before the trainer reaches its sync
    (at most half the manifest's matchmaking timeout), so that a sync costs the exchange
    alone; 0: each sync forms its group when it starts"""
    fixed_deadlines: bool = False
    """use the manifest's part_s and round_s as every round's deadlines instead of
    deadlines measured from the fragment's past rounds (atoll.protocol.deadlines), which
    stay within them"""

    def __post_init__(self) -> None:
        if not self.run.strip():
            raise ConfigError("a node needs --run MANIFEST.toml (the run to train in)")
        if self.steps < 0 or self.log_every < 1 or self.eval_batches < 0:
            raise ConfigError("steps and eval_batches must be >= 0, log_every >= 1")
        if not (math.isfinite(self.checkpoint_every_s) and self.checkpoint_every_s >= 0):
            raise ConfigError(f"checkpoint_every_s must be >= 0, not {self.checkpoint_every_s}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"checkpoint_keep must be >= 1, not {self.checkpoint_keep}")
        if not (math.isfinite(self.ahead_s) and self.ahead_s >= 0):
            raise ConfigError(f"ahead_s must be >= 0, not {self.ahead_s}")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ConfigError(f"slowdown must be >= 1, not {self.slowdown}")
        if not (math.isfinite(self.join_timeout_s) and self.join_timeout_s > 0):
            raise ConfigError(f"join_timeout_s must be > 0, not {self.join_timeout_s}")
        if self.progress not in PROGRESS_MODES:
            raise ConfigError(f"progress must be one of {PROGRESS_MODES}, not {self.progress!r}")
        if not self.listen_addrs():
            raise ConfigError("a node needs at least one --listen multiaddr")
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, not {self.micro_batches}")
        if self.packing not in PACKINGS or self.packing_cost not in COSTS:
            raise ConfigError(
                f"packing must be one of {PACKINGS} and packing_cost one of {COSTS}, "
                f"not {self.packing!r} and {self.packing_cost!r}"
            )
        from atoll.node.net.attacks import parse_attack  # checked here, used by the worker

        parse_attack(self.attack)

    def checkpoint_folder(self, run_id: str, peer_id: str) -> Path:
        """Where this node's checkpoints of run ``run_id`` go."""
        if self.checkpoint_dir.strip():
            return Path(self.checkpoint_dir).expanduser()
        base = Path(self.identity).expanduser().parent
        return base / "checkpoints" / run_id[:16] / peer_id[-16:]

    def join_addrs(self) -> tuple[str, ...]:
        """``join`` split at commas, blanks dropped."""
        return tuple(a.strip() for a in self.join.split(",") if a.strip())

    def listen_addrs(self) -> tuple[str, ...]:
        """``listen`` split at commas, blanks dropped."""
        return tuple(a.strip() for a in self.listen.split(",") if a.strip())


# -- membership -------------------------------------------------------------------------------
def read_certificate_file(path: str) -> bytes:
    """The member certificate in the file at ``path`` (as ``atoll org issue`` writes it),
    decoded and its signature checked; ConfigError naming the file otherwise."""
    file = Path(path).expanduser()
    try:
        with file.open("rb") as f:
            data = f.read(MAX_CERTIFICATE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read the certificate {file}: {e.strerror or e}") from None
    try:
        read_certificate(data)
    except (CodecError, BadSignature) as e:
        raise ConfigError(f"{file} is not a member certificate: {e}") from None
    return data


def load_membership(
    manifest: RunManifest, cert_file: str = ""
) -> tuple[Membership | None, bytes | None]:
    """The run's membership policy (None for a public run that revokes nobody) and this
    node's certificate read from ``cert_file`` (None when not given)."""
    policy = None
    if manifest.membership != MembershipSettings():
        policy = Membership.from_settings(manifest.membership)
    certificate = read_certificate_file(cert_file) if cert_file else None
    return policy, certificate


def check_own_membership(
    manifest: RunManifest, peer_id: str, certificate: bytes | None, now: float | None = None
) -> None:
    """Raise ConfigError (one line) when the run's membership would refuse this node: its
    peers would refuse every connection, so it is better not to start."""
    policy = load_membership(manifest)[0]
    if policy is None:
        return
    try:
        policy.check(peer_id, certificate, time.time() if now is None else now)
    except NotAMember as e:
        raise ConfigError(
            f"this node (peer {peer_id}) is not a member of run {manifest.name!r} "
            f"({short_id(manifest.run_id())}): {e.reason}"
        ) from None

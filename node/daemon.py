"""``atoll node``: one peer of a training swarm, the trainer side.

The trainer is plain synchronous PyTorch in this process; the swarm (host, DHT, groups,
all-reduce, the outer engine) runs in a network process of its own
(:func:`atoll.node.net.swarm.swarm_worker` behind a
:class:`~atoll.node.net.bridge.NetworkBridge`), so that a transfer never steals the
trainer's GIL (docs/DESIGN.md, "Concurrency"). Per inner step:

1. train one step (AdamW, the manifest's schedule), on this peer's own data stream;
2. for every fragment whose sync is due (Streaming DiLoCo's schedule, arXiv 2501.18512):
   copy its values into shared memory and start the sync; training goes on;
3. ``τ`` steps later, wait for the result at most ``timeouts.apply_wait_s`` (longer while
   the network process holds the fragment: this node reached the slot before peers due
   there, and waits for them rather than run ahead); an applied round is merged
   (local ← α·local + (1−α)·global); a wait that runs out is counted and logged, and a
   late result is merged when it arrives.

Steps 2 and 3 are :class:`~atoll.protocol.streaming.StreamingLoop`, the simulator's loop
too; its exchange here is the bridge (:class:`_BridgeExchange`). After a rebase that
found the swarm further ahead in time, the trainer jumps to the swarm's step, or to the
start of the sync the swarm began at most τ steps before it, so that it joins that
fragment's round instead of meeting the fragment a period later.

Progress goes to stderr every ``log_every`` steps: step, loss, tokens/s, peers seen, the
last sync of every fragment, bytes up and down, and the time spent waiting on the
network; ``--progress jsonl`` writes the same as JSON lines to stdout (for ``atoll demo``
and scripts). Ctrl+C (SIGINT) or SIGTERM stops after the current step: the network
process is told to shut down (bounded), the summary is printed and written, exit 0.
SIGUSR1 finishes the run after the current step as its last step would (the fragments
settle first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import numpy as np
import torch

from atoll.node.checkpoint import CheckpointStore
from atoll.node.data import load_corpus
from atoll.node.documents import make_batcher
from atoll.node.model import build_for_run
from atoll.node.net.bridge import (
    NetworkBridge,
    Settled,
    SharedFragments,
    SyncOutcome,
    WarmWorker,
)
from atoll.node.net.status import NodeStatus
from atoll.node.settings import NodeConfig
from atoll.node.snapshot import NodeCheckpoints, ResumePoint, restore_trainer, resume_point
from atoll.node.train import FragmentViews, InnerConfig, Replica, evaluate, lr_at, resolve_device
from atoll.protocol.engine import merge
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import RunManifest, Timeouts
from atoll.protocol.matchmaking import BEHIND, OUT_OF_STEP
from atoll.protocol.reduce import allreduce_bytes_per_peer
from atoll.protocol.schedule import Schedule
from atoll.protocol.streaming import StreamingLoop
from atoll.security.identity import IdentityLock, load_or_create
from atoll.security.manifest_sig import check_manifest_signature

__all__ = ["NodeSummary", "run_node"]

logger = logging.getLogger(__name__)

WORKER = "atoll.node.net.swarm:swarm_worker"
STOP_WAIT_S = 2.0
"""how long a stopped node waits for the engine's part of its last checkpoint before it
leaves without it (it is gone within about 5 s of Ctrl+C)"""


@dataclass
class NodeSummary:
    """What a node reports when it stops (also the ``--json`` file)."""

    peer_id: str
    run_id: str
    start_step: int
    steps: int
    final_step: int
    first_loss: float
    last_loss: float
    eval_loss: float | None
    tokens: int
    wall_s: float
    compute_s: float
    net_wait_s: float
    bytes_up: int
    bytes_down: int
    ddp_bytes: int
    """bytes a data-parallel peer would have sent for the same steps (ring all-reduce)"""
    rounds_applied: int
    rounds_failed: int
    rounds_alone: int
    rounds_ahead: int
    """of the rounds applied, those in a group formed ahead of the sync"""
    rebases: int
    waits_run_out: int
    met_already: int
    """due syncs not started after a jump: the node had met their round already, through
    a sync started before the jump"""
    steps_jumped: int
    """steps skipped after a rebase found the swarm further ahead in time (or moved, back
    or forth, to the swarm's step after its peers refused this node as out of step)"""
    realigned: int
    waits_held: int
    """waits made longer because the node reached a slot before its peers (it waited
    for them there instead of running ahead)"""
    stopped_by: str
    global_digest: str
    settled: bool = False
    """every peer that answered held this node's global copy when it stopped"""
    settle_detail: str = ""
    checkpoint: dict[str, Any] = field(default_factory=dict)
    """the checkpoint it resumed from (``resumed``, ``resumed_step``, ``fetched``: the
    fragments the swarm had moved past, copied at start), the checkpoints written
    (``saved``, ``failed``, ``last``) and how long each save stopped training
    (``stall_max_s``, ``stall_mean_s``)"""
    info: dict[str, Any] = field(default_factory=dict)
    """the network process's last :class:`~atoll.node.net.status.NodeStatus` (as_dict)"""

    @property
    def utilisation(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["utilisation"] = self.utilisation
        return d


def settle_timeout_s(timeouts: Timeouts) -> float:
    """How long a node settles at the end of a run: its last sync (matchmaking, round and
    a state copy) plus the same again for its peers' last ones."""
    return 2 * (timeouts.matchmaking_s + timeouts.round_s)


class _Stop:
    """Catches SIGINT/SIGTERM while the node runs: the loop stops after its step, and the
    node leaves. SIGUSR1 asks it to finish instead: the run ends after this step as if
    its last step were reached (the rounds in flight finish, every fragment settles onto
    the swarm's copy, the summary says ``SIGUSR1``), for a script that ends a run of
    nodes at a time of its choosing rather than at a step count."""

    def __init__(self) -> None:
        self.by = ""
        self.finish = ""
        """the signal that asked the run to finish (the loop ends; not a leave)"""
        self.on_stop: Callable[[], None] | None = None
        """called in the signal handler (the bridge's interrupt: a wait returns at once)"""

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        def handler(signum: int, _frame: FrameType | None) -> None:
            if self.by:  # a second Ctrl+C: the user insists
                raise KeyboardInterrupt
            self.by = signal.Signals(signum).name
            logger.warning("%s: stopping after this step", self.by)
            if self.on_stop is not None:
                self.on_stop()

        def finish(signum: int, _frame: FrameType | None) -> None:
            if not self.finish:
                self.finish = signal.Signals(signum).name
                logger.warning("%s: finishing the run after this step", self.finish)

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, finish)
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _peer_number(peer_id: str) -> int:
    """A data stream index of this peer: different peers read different batches."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:3], "big")


def _digest(shared: SharedFragments) -> str:
    h = hashlib.sha256()
    for p in range(len(shared)):
        h.update(shared.global_(p).tobytes())
    return h.hexdigest()


def run_node(
    cfg: NodeConfig,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[dict[str, Any]], None] | None = None,
) -> NodeSummary:
    """Train as one peer of the swarm ``cfg`` names until ``cfg.steps`` or a stop signal.

    ``on_start`` is called once the node joined and caught up, with the network
    process's status as a dict (:meth:`NodeStatus.as_dict
    <atoll.node.net.status.NodeStatus.as_dict>`: ``peer_id``, ``addrs``, ``run_id``,
    ``start_step``, ...).
    """
    manifest_path = Path(cfg.run).expanduser()
    manifest = RunManifest.load(manifest_path)
    # the network process imports its libraries meanwhile (seconds, on a busy machine)
    with WarmWorker(WORKER) as warm:
        _yield_to_the_network()
        return _run_node(cfg, manifest, manifest_path, warm, progress, on_start)


TRAINER_NICE = 5
"""how much lower the trainer's CPU priority is than its network process's"""


def _yield_to_the_network() -> None:
    """Lower this (the trainer's) process's CPU priority by :data:`TRAINER_NICE`, once
    its network process is started (it keeps the priority it started with). A trainer
    on the CPU takes every core it is given; at the same priority, on a machine as busy
    as its cores, the network process waited its turn behind it, its DHT requests ran
    past their bounds and peers gave it up as silent. Where nothing else wants the CPU
    the trainer still gets all of it."""
    with contextlib.suppress(OSError):
        os.nice(TRAINER_NICE)


def _run_node(
    cfg: NodeConfig,
    manifest: RunManifest,
    manifest_path: Path,
    warm: WarmWorker,
    progress: Callable[[dict[str, Any]], None] | None,
    on_start: Callable[[dict[str, Any]], None] | None,
) -> NodeSummary:
    # a manifest naming its owner is trusted only with the owner's signature next to it
    # (checked here too, so that every caller of run_node gets the check, not only the CLI)
    logger.info("%s", check_manifest_signature(manifest, manifest_path).describe())
    run_id = manifest.run_id()
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    corpus = load_corpus(manifest.data)
    if manifest.corpus_sha256 and corpus.fingerprint != manifest.corpus_sha256:
        raise ConfigError(
            f"this peer's data ({corpus.fingerprint[:12]}) is not the run's "
            f"({manifest.corpus_sha256[:12]}): check 'data' in {cfg.run}"
        )
    model, seq_len, plan = build_for_run(manifest)
    schedule = Schedule(manifest.H, len(plan))
    schedule.check_overlap(manifest.tau)
    views = FragmentViews(model, plan)
    identity_path = Path(cfg.identity).expanduser()
    lock = IdentityLock(identity_path)
    lock.acquire()  # IdentityInUse (one line) when another node runs with this identity
    stop = _Stop()
    try:
        identity = load_or_create(identity_path)
        batcher = make_batcher(corpus, seq_len, manifest, cfg)
        inner = InnerConfig(
            lr=manifest.lr,
            warmup=manifest.warmup,
            total_steps=manifest.total_steps,
            min_lr_ratio=manifest.min_lr_ratio,
        )
        rep = Replica(model, inner, batcher, _peer_number(identity.peer_id), device)
        n_params = sum(p.numel() for p in model.parameters())
        store = CheckpointStore(
            cfg.checkpoint_folder(run_id, identity.peer_id), keep=cfg.checkpoint_keep
        )
        resumed = None
        if cfg.resume:
            resumed = resume_point(
                store, run_id=run_id, peer_id=identity.peer_id, fragments=len(plan)
            )
        if resumed is not None:
            restore_trainer(rep.model, rep.optimizer, resumed.loaded.tensors)
            logger.info("%s", resumed.describe())
        shared = SharedFragments.create([views.numel(p) for p in range(len(plan))])
        ckpts = NodeCheckpoints(
            store,
            every_s=cfg.checkpoint_every_s,
            identity={"run_id": run_id, "peer_id": identity.peer_id, "model": manifest.model},
        )
        try:
            seeds = resumed.engine_globals() if resumed is not None else None
            for p in range(len(plan)):
                shared.global_(p)[:] = views.get(p) if seeds is None else seeds[p]
            args = {
                "manifest": manifest,
                "identity_file": str(identity_path),
                "join": tuple(cfg.join_addrs()),
                "listen": tuple(cfg.listen_addrs()),
                "join_timeout_s": cfg.join_timeout_s,
                "seed": manifest.seed,
                "wait_peers": cfg.wait_peers,
                "ahead_s": cfg.ahead_s,
                "fixed_deadlines": cfg.fixed_deadlines,
                "tokens_per_step": batcher.tokens_per_batch,
                "fault": cfg.fault,
                "attack": cfg.attack,
                "cert_file": cfg.cert,
                "resume": resumed.engine_part() if resumed is not None else None,
            }
            with (
                stop.installed(),
                NetworkBridge(
                    shared, WORKER, args, start_timeout_s=cfg.join_timeout_s + 120, warm=warm
                ) as bridge,
            ):
                stop.on_stop = bridge.interrupt
                return _train(
                    cfg,
                    manifest,
                    bridge,
                    shared,
                    rep,
                    views,
                    schedule,
                    stop,
                    progress,
                    n_params=n_params,
                    run_id=run_id,
                    seq_len=seq_len,
                    on_start=on_start,
                    resumed=resumed,
                    ckpts=ckpts,
                )
        finally:
            ckpts.close()
            shared.close()
            shared.unlink()
    finally:
        lock.release()


def _train(
    cfg: NodeConfig,
    manifest: RunManifest,
    bridge: NetworkBridge,
    shared: SharedFragments,
    rep: Replica,
    views: FragmentViews,
    schedule: Schedule,
    stop: _Stop,
    progress: Callable[[dict[str, Any]], None] | None,
    *,
    on_start: Callable[[dict[str, Any]], None] | None = None,
    n_params: int,
    run_id: str,
    seq_len: int,
    resumed: ResumePoint | None = None,
    ckpts: NodeCheckpoints | None = None,
) -> NodeSummary:
    status = bridge.status
    start = status.start_step
    # the swarm's global copies (the seed's, or a peer's after a catch-up) start training;
    # a resumed node keeps its own weights where its global copy is still the swarm's
    kept = resumed.engine_globals() if resumed is not None else None
    fetched = []
    for p in range(len(shared)):
        if kept is None or not np.array_equal(shared.global_(p), kept[p]):
            views.set(p, shared.global_(p))
            fetched.append(p)
    resume_info: dict[str, Any] = {}
    if resumed is not None:
        start = max(start, resumed.step)
        resume_info = {
            "resumed": str(resumed.path),
            "resumed_step": resumed.step,
            "fetched": fetched,
        }
        logger.info(
            "resumed at step %d; %s",
            resumed.step,
            f"copied fragments {fetched} from the swarm (it had moved past them)"
            if fetched
            else "every fragment was still the swarm's copy: nothing fetched",
        )
    logger.info("peer %s trains from step %d", status.peer_id, start)
    if on_start is not None:
        on_start({**status.as_dict(), "start_step": start})  # a resumed node's own step
    exchange = _BridgeExchange(bridge, shared, views, manifest.alpha)
    loop = StreamingLoop(
        schedule, exchange, tau=manifest.tau, apply_wait_s=manifest.timeouts.apply_wait_s
    )
    run = _Run(start=start, end=start + cfg.steps if cfg.steps else manifest.total_steps)
    base_tokens = resumed.tokens if resumed is not None else 0

    def ckpt_meta() -> dict[str, Any]:
        return {"lr": lr_at(run.step, rep.inner), "start_step": run.start}

    jump_to = 0  # a rebase found the swarm at this step (0: no jump)
    last_report = time.monotonic()
    # a lag within one period (H steps) is left alone: the peers due at a slot wait for
    # this node there (matchmaking's patience holds their trainers), while a jump to the
    # serving peer's step (the fastest peer's, often, and its counter may differ from the
    # others' by whole periods) skips this node's own syncs of the slots they wait at.
    # Unless a sync found every peer already past its slot (nobody waits for this node
    # there, and each of its syncs would come too late): then any lag is closed
    lag_allowed = schedule.H
    behind = False
    realign_to = -1  # its peers refused this node as out of step: their step
    then_to = landed = -1  # a jump landed on a sync start behind the swarm (landed): the
    # step to go on to once that sync started
    last_step = run.step - 1  # the step trained last: another than this one - 1 is a move
    while run.step < run.end and not stop.by and not stop.finish:
        if realign_to >= 0 and realign_to != run.step:
            run.realign(realign_to, extend=bool(cfg.steps))
            then_to = -1
        elif jump_to > run.step + (0 if behind else lag_allowed):
            ahead = min(schedule.H // schedule.fragments, 2 * manifest.tau)
            land = schedule.landing(run.step, jump_to, manifest.tau, ahead=ahead)
            run.jump(jump_to, extend=bool(cfg.steps), land=land)
            loop.landed(run.step)
            # landed on a sync the swarm began: start it, then on to the swarm's step
            then_to, landed = (jump_to, land) if land < jump_to else (-1, -1)
        elif then_to >= 0:
            run.go_on(then_to, extend=bool(cfg.steps))
            for p in schedule.due(landed):  # its round may be over: no wait for it
                loop.release(p)
            then_to = -1
        jump_to, realign_to, behind = 0, -1, False
        compute_before = rep.timer.compute_s
        run.losses.append(rep.train_step(run.step))
        if cfg.slowdown > 1.0:  # a slow peer (tests, benchmarks): NodeConfig.slowdown
            time.sleep((cfg.slowdown - 1.0) * (rep.timer.compute_s - compute_before))
        run.tokens += rep.batcher.tokens_per_batch
        for outcome in loop.after_step(run.step, run.tokens):
            if outcome.applied and outcome.reason.startswith("rebased"):
                # the swarm got ahead in time, not only in versions: rejoin its rounds
                jump_to = max(jump_to, bridge.status.swarm_step)
            elif OUT_OF_STEP in outcome.reason and run.since_move(outcome.step):
                # its schedule, learning rate and data position are not the swarm's (a
                # checkpoint of a wrong step, say): move to the step of the refusing peers.
                # Not for a sync started before the trainer last moved: it speaks of a
                # step the trainer left (it would move back, or on past its peers)
                realign_to = bridge.status.swarm_step
            if f"alone: {BEHIND}:" in outcome.reason:
                # the peers it asked had all left this slot: they train at their step
                jump_to, behind = max(jump_to, bridge.status.swarm_step), True
        moved = run.step != last_step + 1  # a jump, a realignment or a go-on
        last_step = run.step
        run.step += 1
        # peers that copy a state from here start at this step
        bridge.note_step(run.step, moved=moved)
        if ckpts is not None:
            quiet = not loop.pending and not any(bridge.in_flight(p) for p in range(len(shared)))
            ckpts.poll(
                bridge,
                rep.model,
                rep.optimizer,
                step=run.step,
                tokens=base_tokens + run.tokens,
                quiet=quiet,
                meta=ckpt_meta,
            )
        if progress and (
            run.step % cfg.log_every == 0
            or run.step == run.end
            or time.monotonic() - last_report > 10
        ):
            last_report = time.monotonic()
            progress(run.progress(rep, bridge, cfg.log_every))
    if stop.by:
        # leaving: the rounds in flight are abandoned (the signal handler interrupted the
        # bridge's waits; each round aborts as a whole, here and at its peers, when the
        # network process stops); the node is gone within seconds
        loop.finish(wait_s=0.0)
    else:
        loop.finish()  # the rounds still in flight finish (bounded) so the last results merge
    wall = time.perf_counter() - run.t0
    if stop.by:
        settled = Settled(False, f"stopped by {stop.by}: not settled")
    else:
        # every fragment onto the swarm's copy, so nodes that finish together agree
        settled = bridge.settle(settle_timeout_s(manifest.timeouts))
        log = logger.info if settled.agreed else logger.warning
        log("end of run: %s", settled.detail)
    if ckpts is not None:
        # what the node holds now: a settled copy at the end of a run, or the state a
        # stopped node resumes from (a late result that came meanwhile merged first)
        loop.collect(run.step)
        ckpts.final(
            bridge,
            rep.model,
            rep.optimizer,
            step=run.step,
            tokens=base_tokens + run.tokens,
            meta=ckpt_meta(),
            timeout_s=STOP_WAIT_S if stop.by else 60.0,
        )
    final = bridge.refresh(1.5)
    if stop.by:
        bridge.close()  # withdraws this node from the swarm's groups before the last eval
    eval_loss: float | None = None
    if cfg.eval_batches and not stop.by:  # a stopped node leaves at once
        eval_loss = evaluate(rep.model, rep.batcher.val_batches(cfg.eval_batches, 16), rep.device)
    ddp_step = allreduce_bytes_per_peer(4 * n_params, max(2, 1 + final.peers_seen))
    return run.summary(
        final,
        rep,
        bridge,
        run_id=run_id,
        wall_s=wall,
        eval_loss=eval_loss,
        ddp_bytes=ddp_step * len(run.losses),
        waits_run_out=loop.stats.waits_run_out,
        met_already=loop.stats.met_already,
        stopped_by=stop.by or stop.finish or "steps",
        global_digest=_digest(shared),
        log_every=cfg.log_every,
        settled=settled,
        checkpoint=_checkpoint_info(resume_info, ckpts),
    )


def _checkpoint_info(resume_info: dict[str, Any], ckpts: NodeCheckpoints | None) -> dict[str, Any]:
    out = dict(resume_info)
    if ckpts is not None:
        stalls = ckpts.stats.stalls
        out.update(
            saved=ckpts.stats.saved,
            failed=ckpts.stats.failed,
            last=ckpts.stats.last_path,
            stall_max_s=max(stalls, default=0.0),
            stall_mean_s=sum(stalls) / len(stalls) if stalls else 0.0,
        )
    return out


class _BridgeExchange:
    """The node's :class:`~atoll.protocol.streaming.Exchange`: the network bridge, plus the
    copies of fragment values between the model and shared memory."""

    def __init__(
        self, bridge: NetworkBridge, shared: SharedFragments, views: FragmentViews, alpha: float
    ) -> None:
        self.bridge = bridge
        self.shared = shared
        self.views = views
        self.alpha = alpha

    def start(self, fragment: int, step: int, tokens: int) -> None:
        self.shared.local(fragment)[:] = self.views.get(fragment)
        self.bridge.start_sync(fragment, step, tokens)

    def in_flight(self, fragment: int) -> bool:
        return self.bridge.in_flight(fragment)

    def poll(self) -> list[SyncOutcome]:
        return self.bridge.poll()

    def wait(self, fragment: int, timeout_s: float) -> SyncOutcome | None:
        return self.bridge.wait(fragment, timeout_s)

    def merge(self, fragment: int) -> None:
        local = self.views.get(fragment)
        self.views.set(fragment, merge(local, self.shared.global_(fragment), self.alpha))


@dataclass
class _Run:
    """The trainer's counters while it runs: steps, tokens, losses, jumps."""

    start: int
    end: int
    step: int = field(init=False)
    """the next step to train"""
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    jumped: int = 0
    """steps skipped to meet the swarm"""
    realigned: int = 0
    """times the node moved to its peers' step after they refused it as out of step"""
    t0: float = field(default_factory=time.perf_counter)
    moved_to: int = field(init=False)
    """the step the trainer last jumped or moved to (its start at first)"""

    def __post_init__(self) -> None:
        self.step = self.moved_to = self.start

    def since_move(self, step: int) -> bool:
        """Whether a sync started at ``step`` began since the trainer's last move (on
        the steps it has trained through since)."""
        return self.moved_to <= step <= self.step

    def jump(self, to: int, *, extend: bool, land: int | None = None) -> None:
        """Skip to the swarm's step ``to`` (never past the last step). ``extend``: the end
        moves too (``--steps`` counts steps trained, so a jump does not use them up; a
        node that jumped then ends after the others and settles onto their copy).
        ``land``: the step to go to instead, a sync start a few steps before ``to`` (the
        trainer starts that sync, then goes on to ``to``: :meth:`go_on`) or after it
        (:meth:`~atoll.protocol.schedule.Schedule.landing`)."""
        land = to if land is None else land
        if land == to:
            logger.warning(
                "step %d: the swarm is at step %d; jumping there to meet its rounds", self.step, to
            )
        elif land > to:
            logger.warning(
                "step %d: the swarm is at step %d; jumping to %d, the start of its next sync,"
                " %d steps ahead, to wait there for its round",
                self.step,
                to,
                land,
                land - to,
            )
        else:
            logger.warning(
                "step %d: the swarm is at step %d; jumping to %d, the start of the sync it"
                " began %d steps ago, to start that sync and go on to the swarm's step",
                self.step,
                to,
                land,
                to - land,
            )
        if extend:
            self.end += land - self.step
        target = min(land, self.end - 1)
        self.jumped += target - self.step
        self.step = self.moved_to = target

    def go_on(self, to: int, *, extend: bool) -> None:
        """After a jump that landed on a sync start behind the swarm and started that
        sync: skip on to the swarm's step ``to``, a few steps on (before the sync's result
        is due), so that the trainer meets the swarm's later syncs in phase rather than
        those few steps late, each (never past the last step)."""
        if extend:
            self.end += to - self.step
        target = min(to, self.end - 1)
        if target <= self.step:
            return
        logger.info("step %d: past the sync start it landed on; on to step %d", self.step, target)
        self.jumped += target - self.step
        self.step = target  # the landed sync began since the move (see since_move)

    def realign(self, to: int, *, extend: bool) -> None:
        """Move to the step ``to`` of the peers that refused this node as out of step,
        back or forth (never past the last step); ``extend`` as for :meth:`jump`."""
        logger.warning(
            "step %d: the swarm's peers are at step %d and this node is out of step with "
            "them (its learning-rate schedule, fragment phase and data position follow "
            "the step); moving there",
            self.step,
            to,
        )
        if extend:
            self.end += to - self.step
        target = max(0, min(to, self.end - 1))
        self.jumped += abs(target - self.step)
        self.realigned += 1
        self.step = self.moved_to = target

    def progress(self, rep: Replica, bridge: NetworkBridge, log_every: int) -> dict[str, Any]:
        """One progress report (the status line, or a JSON line)."""
        window = self.losses[-log_every:]
        wall = time.perf_counter() - self.t0
        status = bridge.status
        return {
            "step": self.step,
            "end": self.end,
            "loss": sum(window) / len(window),
            "tokens_per_s": self.tokens / max(wall, 1e-9),
            "wall_s": wall,
            "compute_s": rep.timer.compute_s,
            "net_wait_s": bridge.stats.wait_s,
            "peers": status.peers_seen,
            "peers_live": status.peers_live,
            "last_sync": {str(k): v for k, v in sorted(status.last_sync.items())},
            "bytes_up": status.bytes_up,
            "bytes_down": status.bytes_down,
            "rounds_applied": status.rounds_applied,
            "peer_id": status.peer_id,
            "reach": status.reach,
        }

    def summary(
        self,
        status: NodeStatus,
        rep: Replica,
        bridge: NetworkBridge,
        *,
        run_id: str,
        wall_s: float,
        eval_loss: float | None,
        ddp_bytes: int,
        waits_run_out: int,
        met_already: int,
        stopped_by: str,
        global_digest: str,
        log_every: int,
        settled: Settled,
        checkpoint: dict[str, Any],
    ) -> NodeSummary:
        """What the node reports when it stops, from the network process's last status."""
        done = len(self.losses)  # steps trained (jumps excluded)
        window = self.losses[-log_every:] or [float("nan")]
        return NodeSummary(
            peer_id=status.peer_id,
            run_id=run_id,
            start_step=self.start,
            steps=done,
            final_step=self.step,
            first_loss=self.losses[0] if self.losses else float("nan"),
            last_loss=sum(window) / len(window),
            eval_loss=eval_loss,
            tokens=self.tokens,
            wall_s=wall_s,
            compute_s=rep.timer.compute_s,
            net_wait_s=bridge.stats.wait_s,
            bytes_up=status.bytes_up,
            bytes_down=status.bytes_down,
            ddp_bytes=ddp_bytes,
            rounds_applied=status.rounds_applied,
            rounds_failed=status.rounds_failed,
            rounds_alone=status.rounds_alone,
            rounds_ahead=status.rounds_ahead,
            rebases=status.rebases,
            waits_run_out=waits_run_out,
            met_already=met_already,
            steps_jumped=self.jumped,
            realigned=self.realigned,
            waits_held=bridge.stats.held,
            stopped_by=stopped_by,
            global_digest=global_digest,
            settled=settled.agreed,
            settle_detail=settled.detail,
            checkpoint=checkpoint,
            info=status.as_dict(),
        )


class ProgressPrinter:
    """The live status line of ``atoll node`` (stderr), or JSON lines (stdout)."""

    def __init__(self, mode: str, stream: TextIO | None = None) -> None:
        self.mode = mode
        self.stream = stream or (sys.stdout if mode == "jsonl" else sys.stderr)

    def __call__(self, p: dict[str, Any]) -> None:
        if self.mode == "none":
            return
        if self.mode == "jsonl":
            self.stream.write(json.dumps({"progress": p}) + "\n")
            self.stream.flush()
            return
        syncs = " ".join(f"{k}:{v}" for k, v in sorted(p["last_sync"].items())) or "-"
        self.stream.write(
            f"step {p['step']:>6}/{p['end']}  loss {p['loss']:.4f}  "
            f"{p['tokens_per_s'] / 1e3:6.1f} ktok/s  peers {p['peers_live']}/{p['peers']}  "
            f"up {p['bytes_up'] / 1e6:7.2f} MB  down {p['bytes_down'] / 1e6:7.2f} MB  "
            f"net wait {p['net_wait_s']:5.1f} s  syncs [{syncs}]"
            + (f"  {p['reach']}" if p.get("reach") else "")
            + "\n"
        )
        self.stream.flush()

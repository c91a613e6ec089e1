"""Train M replicas in one process with no network, counting the bytes a swarm would send.

Three algorithms on the same model, data and token budget:

- ``ddp``: data-parallel, gradients averaged every step (the baseline). Computed as one
  model on the concatenation of the M replicas' batches, which is the same gradient.
- ``diloco``: DiLoCo (arXiv 2311.08105), one fragment, blocking sync every H steps.
- ``streaming``: Streaming DiLoCo (arXiv 2501.18512): fragments on a staggered schedule,
  overlap τ, merge α, low-precision (4-bit E3M0 by default) exchange.

The replicas drive :class:`atoll.protocol.engine.OuterEngine` exactly as the swarm's peers
do; the group reduction is :func:`atoll.protocol.engine.average_requests`. Bytes are the
encoded sizes under a bandwidth-optimal all-reduce (reduce-scatter + all-gather).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from atoll.node.data import Batcher, Corpus, load_corpus
from atoll.node.model import build, tensor_specs
from atoll.node.settings import ALGOS, SimConfig
from atoll.node.train import FragmentViews, Replica, evaluate, resolve_device
from atoll.protocol import allreduce as ar
from atoll.protocol.engine import OuterEngine, average_requests
from atoll.protocol.errors import RoundAborted
from atoll.protocol.fragments import Fragment, FragmentPlan, plan_fragments
from atoll.protocol.reduce import allreduce_bytes_per_peer
from atoll.protocol.schedule import Schedule
from atoll.protocol.streaming import StreamingLoop, SyncOutcome
from atoll.protocol.sync import FragmentSync, SyncDone, weight_cap

if TYPE_CHECKING:
    from atoll.node.simattack import HostileRounds

__all__ = ["ALGOS", "Progress", "SimConfig", "SimResult", "simulate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Progress:
    """A progress report, every ``log_every`` steps."""

    algo: str
    step: int
    steps: int
    loss: float
    tokens_per_s: float
    bytes_per_replica: int
    eval_loss: float | None = None


@dataclass
class SimResult:
    """What a run measured (the JSON of ``bench/parity.py`` is built from this)."""

    algo: str
    eval_loss: float
    train_loss: float
    tokens: int
    bytes_per_replica: int
    ddp_bytes_per_replica: int
    wall_s: float
    compute_s: float
    params: int
    fragments: int
    syncs_applied: int
    syncs_skipped: int
    config: dict[str, Any]
    history: list[tuple[int, float]] = field(default_factory=list)
    global_digests: list[str] = field(default_factory=list)
    """sha256 of each replica's global copies: all equal when every round was applied whole"""
    attack: dict[str, Any] | None = None
    """with hostile replicas or a robust setting: :class:`~atoll.node.simattack.AttackStats`"""

    @property
    def bytes_ratio(self) -> float:
        """Data-parallel bytes ÷ this run's bytes (inf when nothing was sent)."""
        return (
            self.ddp_bytes_per_replica / self.bytes_per_replica
            if self.bytes_per_replica
            else float("inf")
        )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes_ratio"] = self.bytes_ratio if self.bytes_per_replica else None
        return d


def _digest(engine: OuterEngine) -> str:
    h = hashlib.sha256()
    for p in range(engine.num_fragments):
        h.update(engine.global_params(p).tobytes())
    return h.hexdigest()


def _plan(cfg: SimConfig, model: torch.nn.Module) -> FragmentPlan:
    specs = tensor_specs(model)
    if cfg.algo == "diloco":
        names = tuple(s.name for s in specs)
        blocks = tuple(sorted({s.block for s in specs if s.block is not None}))
        numel = sum(s.numel for s in specs)
        return FragmentPlan((Fragment(0, names, numel, blocks),))
    return plan_fragments(specs, blocks_per_fragment=cfg.blocks_per_fragment, extras=cfg.extras)


def simulate(
    cfg: SimConfig,
    *,
    corpus: Corpus | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> SimResult:
    """Run one simulated training job and return what it measured."""
    device = resolve_device(cfg.device)
    corpus = corpus if corpus is not None else load_corpus(cfg.data)
    model0, seq_len = build(cfg.preset, cfg.seed)
    batcher = Batcher(corpus, seq_len, cfg.batch_size, cfg.seed)
    val = batcher.val_batches(cfg.eval_batches, 16)
    n_params = sum(p.numel() for p in model0.parameters())
    tokens_per_step = cfg.replicas * batcher.tokens_per_batch
    ddp_step_bytes = allreduce_bytes_per_peer(4 * n_params, cfg.replicas)
    run = _Reporter(cfg, val, device, tokens_per_step, progress)
    train = _train_ddp if cfg.algo == "ddp" else _train_outer
    done = train(cfg, model0, batcher, run, ddp_step_bytes)
    window = run.losses[-cfg.log_every :]
    result = SimResult(
        algo=cfg.algo,
        eval_loss=done.eval_loss,
        train_loss=sum(window) / len(window),
        tokens=cfg.steps * tokens_per_step,
        bytes_per_replica=done.sent,
        ddp_bytes_per_replica=ddp_step_bytes * cfg.steps,
        wall_s=time.perf_counter() - run.t0,
        compute_s=done.compute_s,
        params=n_params,
        fragments=done.fragments,
        syncs_applied=done.applied,
        syncs_skipped=done.skipped,
        config={
            **asdict(cfg),
            "engine": asdict(cfg.engine_config()) if cfg.algo != "ddp" else None,
        },
        history=[*run.history, (cfg.steps, done.eval_loss)],
        global_digests=done.digests,
        attack=done.attack,
    )
    log.info("%s done: eval %.4f, %d bytes/replica", cfg.algo, done.eval_loss, done.sent)
    return result


@dataclass(frozen=True, slots=True)
class _Trained:
    """What a training loop of the simulator hands back to :func:`simulate`."""

    eval_loss: float
    compute_s: float
    sent: int
    """bytes each replica sent"""
    fragments: int = 0
    applied: int = 0
    skipped: int = 0
    digests: list[str] = field(default_factory=list)
    attack: dict[str, Any] | None = None


class _Reporter:
    """The losses, the periodic evaluations and the progress reports of one run."""

    def __init__(
        self,
        cfg: SimConfig,
        val: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        tokens_per_step: int,
        progress: Callable[[Progress], None] | None,
    ) -> None:
        self.cfg = cfg
        self.val = val
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.progress = progress
        self.losses: list[float] = []
        self.history: list[tuple[int, float]] = []
        self.t0 = time.perf_counter()

    def step(self, step: int, eval_model: Callable[[], torch.nn.Module], sent: int) -> None:
        """After step ``step``: evaluate every ``eval_every`` steps, report every
        ``log_every`` steps (``sent``: bytes per replica so far)."""
        cfg = self.cfg
        done = step + 1
        ev = None
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            ev = evaluate(eval_model(), self.val, self.device)
            self.history.append((done, ev))
        if self.progress and (done % cfg.log_every == 0 or done == cfg.steps or ev is not None):
            window = self.losses[-cfg.log_every :]
            rate = done * self.tokens_per_step / max(1e-9, time.perf_counter() - self.t0)
            loss = sum(window) / len(window)
            self.progress(Progress(cfg.algo, done, cfg.steps, loss, rate, sent, ev))


def _train_ddp(
    cfg: SimConfig, model0: torch.nn.Module, batcher: Batcher, run: _Reporter, step_bytes: int
) -> _Trained:
    """Data-parallel: one model on the concatenation of the M replicas' batches."""
    rep = Replica(model0, cfg.inner_config(), batcher, 0, run.device)
    for step in range(cfg.steps):
        batches = [batcher.batch(m, step) for m in range(cfg.replicas)]
        run.losses.append(rep.train_step(step, batches))
        run.step(step, lambda: rep.model, step_bytes * (step + 1))
    eval_loss = evaluate(rep.model, run.val, run.device)
    return _Trained(eval_loss, rep.timer.compute_s, step_bytes * cfg.steps)


def _train_outer(
    cfg: SimConfig, model0: torch.nn.Module, batcher: Batcher, run: _Reporter, _: int
) -> _Trained:
    """DiLoCo or Streaming DiLoCo: M replicas, each with its own engine, and one loop."""
    eng_cfg = cfg.engine_config()
    plan = _plan(cfg, model0)
    schedule = Schedule(cfg.H, len(plan))
    inner = cfg.inner_config()
    reps = [
        Replica(copy.deepcopy(model0), inner, batcher, m, run.device) for m in range(cfg.replicas)
    ]
    views = [FragmentViews(r.model, plan) for r in reps]
    initial = [views[0].get(p) for p in range(len(plan))]
    engines = [
        OuterEngine(eng_cfg, schedule, initial, seed=cfg.seed * 1000 + m)
        for m in range(cfg.replicas)
    ]
    log.info("%s: %d fragments\n%s", cfg.algo, len(plan), plan.describe())
    exchange = _InProcessExchange(views, engines, eng_cfg.aggregation, cfg.fail_prob, cfg.seed)
    if cfg.hostile:
        exchange.hostile = _hostile_rounds(cfg, engines, batcher.tokens_per_batch)
    loop = StreamingLoop(schedule, exchange, tau=eng_cfg.tau, apply_wait_s=0.0)
    global_model = functools.partial(_global_model, reps[0].model, plan, engines[0])
    for step in range(cfg.steps):
        step_losses = []
        for rep, eng in zip(reps, engines, strict=True):
            step_losses.append(rep.train_step(step))
            eng.add_tokens(batcher.tokens_per_batch)
        run.losses.append(sum(step_losses) / len(step_losses))
        loop.after_step(step)
        run.step(step, global_model, exchange.sent)
    loop.finish()  # the last exchanges complete after the final step
    if cfg.final_sync:
        exchange.fail_prob = 0.0  # the final sync never fails: the model holds every token
        loop.final_sync(cfg.steps - 1)
    first = engines[0]
    return _Trained(
        eval_loss=evaluate(global_model(), run.val, run.device),
        compute_s=sum(r.timer.compute_s for r in reps),
        sent=exchange.sent,
        fragments=len(plan),
        applied=sum(first.stats(p).applied for p in range(len(plan))),
        skipped=sum(first.stats(p).skipped for p in range(len(plan))),
        digests=[_digest(e) for e in engines],
        attack=exchange.hostile.stats.as_dict() if exchange.hostile is not None else None,
    )


def _hostile_rounds(
    cfg: SimConfig, engines: list[OuterEngine], tokens_per_step: int
) -> HostileRounds:
    from atoll.node.net.attacks import parse_attack
    from atoll.node.simattack import HostileRounds

    return HostileRounds(
        engines,
        cfg.robust_settings(),
        parse_attack(cfg.attack) if cfg.attackers else None,
        cfg.attackers,
        weight_cap=weight_cap(cfg.H, tokens_per_step),
        step_s=cfg.step_s,
        late=cfg.late,
        late_prob=cfg.late_prob,
        keep_late=cfg.keep_late,
        late_weight=cfg.late_weight,
        seed=cfg.seed,
    )


def _global_model(
    model: torch.nn.Module, plan: FragmentPlan, engine: OuterEngine
) -> torch.nn.Module:
    """A copy of ``model`` holding ``engine``'s global parameters (what is evaluated)."""
    m = copy.deepcopy(model)
    views = FragmentViews(m, plan)
    for p in range(len(plan)):
        views.set(p, engine.global_params(p))
    return m


class _InProcessExchange:
    """The simulator's :class:`~atoll.protocol.streaming.Exchange`: every replica's engine
    in one process. A round is the group of all M replicas, reduced by
    :func:`~atoll.protocol.engine.average_requests`; with ``fail_prob`` its exchange
    breaks (all members skip it), drawn from ``random.Random(seed)``, once per round."""

    def __init__(
        self,
        views: list[FragmentViews],
        engines: list[OuterEngine],
        aggregation: str,
        fail_prob: float,
        seed: int,
    ) -> None:
        self.views = views
        self.engines = engines
        self.codec = engines[0].codec
        self.aggregation = aggregation
        self.fail_prob = fail_prob
        self.faults = random.Random(seed)
        self.sent = 0
        """bytes per replica so far; a failed round counts as sent in full (an upper bound)"""
        self._syncs: dict[int, list[FragmentSync]] = {}
        self.hostile: HostileRounds | None = None
        """set: every round runs through the all-reduce machines with its protections
        and attackers (:mod:`atoll.node.simattack`) instead of ``average_requests``"""

    def start(self, fragment: int, step: int, tokens: int) -> None:
        if self.hostile is not None:
            syncs = self.hostile.syncs(fragment)
        else:
            syncs = [
                FragmentSync(eng, fragment, peer_id=f"replica-{m}", run_id="simulated")
                for m, eng in enumerate(self.engines)
            ]
        for sync, view in zip(syncs, self.views, strict=True):
            sync.begin(view.get(fragment), step)
        self._syncs[fragment] = syncs

    def in_flight(self, fragment: int) -> bool:
        return fragment in self._syncs

    def poll(self) -> list[SyncOutcome]:
        return []  # every round is finished when it is awaited

    def wait(self, fragment: int, timeout_s: float) -> SyncOutcome:
        syncs = self._syncs.pop(fragment)
        requests = [sync.request for sync in syncs if sync.request is not None]
        if self.hostile is not None:
            outcome = self.hostile.run(fragment, syncs, requests[0].step)
            stats = self.hostile.stats  # rounds and state copies, averaged over replicas
            self.sent = (stats.round_bytes + stats.fetch_bytes) // len(self.engines)
            return outcome
        averaged, nbytes = average_requests(requests, self.codec, self.aggregation)
        self.sent += nbytes
        step, round_ = requests[0].step, requests[0].round
        result: ar.Done | ar.Failed = ar.Done(averaged)
        if self.fail_prob and self.faults.random() < self.fail_prob:
            result = ar.Failed("injected fault")  # the exchange broke: nobody applies it
        for sync in syncs:  # the group is every replica, formed without matchmaking
            done = sync.reduced(result)
            if isinstance(result, ar.Done) and not (isinstance(done, SyncDone) and done.applied):
                raise RoundAborted(f"a replica refused the group's result: {done}")
        if isinstance(result, ar.Failed):
            return SyncOutcome(fragment, step, False, round_, "injected fault")
        return SyncOutcome(fragment, step, True, round_)

    def merge(self, fragment: int) -> None:
        for view, eng in zip(self.views, self.engines, strict=True):
            view.set(fragment, eng.merge(fragment, view.get(fragment)))

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
import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from atoll.node.data import Batcher, Corpus, load_corpus
from atoll.node.model import build, tensor_specs
from atoll.node.settings import ALGOS, SimConfig
from atoll.node.train import FragmentViews, Replica, evaluate, resolve_device
from atoll.protocol.engine import OuterEngine, SyncRequest, average_requests
from atoll.protocol.fragments import Fragment, FragmentPlan, plan_fragments
from atoll.protocol.reduce import allreduce_bytes_per_peer
from atoll.protocol.schedule import Schedule

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
    inner = cfg.inner_config()
    tokens_per_step = cfg.replicas * batcher.tokens_per_batch
    ddp_step_bytes = allreduce_bytes_per_peer(4 * n_params, cfg.replicas)
    history: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    sent = 0
    losses: list[float] = []

    def report(step: int, eval_model: Callable[[], torch.nn.Module]) -> None:
        done = step + 1
        ev = None
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            ev = evaluate(eval_model(), val, device)
            history.append((done, ev))
        if progress and (done % cfg.log_every == 0 or done == cfg.steps or ev is not None):
            window = losses[-cfg.log_every :]
            rate = done * tokens_per_step / max(1e-9, time.perf_counter() - t0)
            progress(Progress(cfg.algo, done, cfg.steps, sum(window) / len(window), rate, sent, ev))

    if cfg.algo == "ddp":
        rep = Replica(model0, inner, batcher, 0, device)
        for step in range(cfg.steps):
            batches = [batcher.batch(m, step) for m in range(cfg.replicas)]
            losses.append(rep.train_step(step, batches))
            sent += ddp_step_bytes
            report(step, lambda: rep.model)
        eval_loss = evaluate(rep.model, val, device)
        compute_s, n_frags, applied, skipped = rep.timer.compute_s, 0, 0, 0
        digests = []
    else:
        eng_cfg = cfg.engine_config()
        plan = _plan(cfg, model0)
        schedule = Schedule(cfg.H, len(plan))
        reps = [
            Replica(copy.deepcopy(model0), inner, batcher, m, device) for m in range(cfg.replicas)
        ]
        views = [FragmentViews(r.model, plan) for r in reps]
        initial = [views[0].get(p) for p in range(len(plan))]
        engines = [
            OuterEngine(eng_cfg, schedule, initial, seed=cfg.seed * 1000 + m)
            for m in range(cfg.replicas)
        ]
        codec = engines[0].codec
        in_flight: dict[int, list[SyncRequest]] = {}
        log.info("%s: %d fragments\n%s", cfg.algo, len(plan), plan.describe())

        faults = random.Random(cfg.seed)

        def finish(p: int, final: bool = False) -> None:
            nonlocal sent
            requests = in_flight.pop(p)
            averaged, nbytes = average_requests(requests, codec, eng_cfg.aggregation)
            sent += nbytes  # a failed round counts as sent in full: an upper bound
            if not final and cfg.fail_prob and faults.random() < cfg.fail_prob:
                for eng in engines:  # the exchange broke: every member skips, none applies
                    eng.skip(p, "injected fault")
                return
            applied_upto[p] = requests[0].step
            for view, eng in zip(views, engines, strict=True):
                eng.deliver(p, averaged, requests[0].round)
                view.set(p, eng.merge(p, view.get(p)))

        def start(p: int, step: int) -> None:
            in_flight[p] = [
                eng.begin(p, view.get(p), step) for view, eng in zip(views, engines, strict=True)
            ]

        def global_model() -> torch.nn.Module:
            m = copy.deepcopy(reps[0].model)
            global_views = FragmentViews(m, plan)
            for p in range(len(plan)):
                global_views.set(p, engines[0].global_params(p))
            return m

        applied_upto = [-1] * len(plan)  # step of the last start whose round was applied
        for step in range(cfg.steps):
            step_losses = []
            for rep, eng in zip(reps, engines, strict=True):
                step_losses.append(rep.train_step(step))
                eng.add_tokens(batcher.tokens_per_batch)
            losses.append(sum(step_losses) / len(step_losses))
            for p in [p for p, reqs in in_flight.items() if reqs[0].apply_step == step]:
                finish(p)
            for p in schedule.due(step):
                start(p, step)
                if eng_cfg.tau == 0:
                    finish(p)
            report(step, global_model)
        for p in list(in_flight):  # the last exchanges complete after the final step
            finish(p)
        if cfg.final_sync:
            for p in range(len(plan)):
                if applied_upto[p] < cfg.steps - 1:
                    start(p, cfg.steps - 1)
                    finish(p, final=True)
        eval_loss = evaluate(global_model(), val, device)
        compute_s = sum(r.timer.compute_s for r in reps)
        n_frags = len(plan)
        applied = sum(e.stats(p).applied for e in engines[:1] for p in range(len(plan)))
        skipped = sum(e.stats(p).skipped for e in engines[:1] for p in range(len(plan)))
        digests = [_digest(e) for e in engines]

    result = SimResult(
        algo=cfg.algo,
        eval_loss=eval_loss,
        train_loss=sum(losses[-cfg.log_every :]) / len(losses[-cfg.log_every :]),
        tokens=cfg.steps * tokens_per_step,
        bytes_per_replica=sent,
        ddp_bytes_per_replica=ddp_step_bytes * cfg.steps,
        wall_s=time.perf_counter() - t0,
        compute_s=compute_s,
        params=n_params,
        fragments=n_frags,
        syncs_applied=applied,
        syncs_skipped=skipped,
        config={
            **asdict(cfg),
            "engine": asdict(cfg.engine_config()) if cfg.algo != "ddp" else None,
        },
        history=[*history, (cfg.steps, eval_loss)],
        global_digests=digests,
    )
    log.info("%s done: eval %.4f, %d bytes/replica", cfg.algo, eval_loss, sent)
    return result

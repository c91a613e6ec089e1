"""Per-fragment outer state of Streaming DiLoCo, and the API the exchange calls.

Streaming DiLoCo (arXiv 2501.18512) keeps, for every fragment p, an fp32 global copy
θp and its own outer optimizer. At p's scheduled step a peer computes the pseudo-gradient
Δp = θp_global − θp_local (DiLoCo, arXiv 2311.08105), hands it to an exchange and keeps
training; τ steps later it needs the averaged Δp and then

1. θp_global ← OuterOpt(θp_global, Δp)           (:meth:`OuterEngine.deliver`)
2. θp_local  ← α·θp_local + (1−α)·θp_global       (:meth:`OuterEngine.merge`)

An exchange that fails leaves the fragment training locally: :meth:`OuterEngine.skip`
counts it and changes nothing, so a round is applied whole or not at all. The work of a
skipped round is not lost: the next Δp is taken against the same, unchanged global copy.

This module is sans-IO. A caller (the in-process simulator, or the swarm's network
process) drives it per fragment::

    for p in engine.due(step):
        request = engine.begin(p, local_flat(p), step)   # encoded Δp, weight, round
        exchange.start(request)
    ...
    # at request.apply_step (or at once when τ = 0):
    engine.deliver(p, averaged_delta, request.round)      # or engine.skip(p, reason)
    set_local_flat(p, engine.merge(p, local_flat(p)))

:func:`average_requests` is the reference reduction of a group's requests (the same
arithmetic the networked all-reduce performs chunk by chunk).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from atoll.protocol.codecs import Codec
from atoll.protocol.errors import ConfigError, RoundAborted
from atoll.protocol.manifest import AGGREGATIONS, OuterLoop
from atoll.protocol.outer import OuterSGD
from atoll.protocol.reduce import (
    Contribution,
    allreduce_bytes_per_peer,
    rda_combine,
    rda_split,
    reduce_encoded,
)
from atoll.protocol.schedule import Schedule
from atoll.protocol.statesync import FragmentState, state_digest

__all__ = [
    "AGGREGATIONS",
    "EngineConfig",
    "FragmentStats",
    "OuterEngine",
    "SyncRequest",
    "average_requests",
    "merge",
]

log = logging.getLogger(__name__)

EngineConfig = OuterLoop
"""The engine's settings: the run's outer loop, :class:`~atoll.protocol.manifest.OuterLoop`
(docs/ALGORITHMS.md §1 and §2), which declares and checks them; the engine, the network
bridge and the tests know it by this name."""


@dataclass(frozen=True, slots=True)
class SyncRequest:
    """One peer's contribution to one round of one fragment."""

    fragment: int
    round: int
    """the fragment's global version Δ is taken against; all members of a group must agree"""
    step: int
    """inner step after which the sync started"""
    apply_step: int
    """inner step after which the averaged result is needed (step + τ)"""
    weight: float
    """tokens processed since the fragment's last applied sync"""
    payload: bytes
    """Δ (or its unit direction, with RDA) encoded with the run's codec"""
    numel: int
    norm: float | None = None
    """‖Δ‖ when aggregation is RDA, else None"""


@dataclass(slots=True)
class FragmentStats:
    """Counters of one fragment (never reset)."""

    applied: int = 0
    skipped: int = 0
    bytes_encoded: int = 0
    last_skip_reason: str = ""


@dataclass(slots=True)
class _Fragment:
    global_params: np.ndarray
    optimizer: OuterSGD
    residual: np.ndarray | None
    version: int = 0
    tokens_mark: int = 0
    pending: SyncRequest | None = None
    pending_residual: np.ndarray | None = None
    pending_tokens: int = 0
    stats: FragmentStats = field(default_factory=FragmentStats)
    digest: str | None = None
    """the shared state's digest while it is unchanged (None: compute it again)"""


class OuterEngine:
    """Outer optimisation of one peer (or one simulated replica) across all fragments."""

    def __init__(
        self,
        config: EngineConfig,
        schedule: Schedule,
        initial: Sequence[np.ndarray],
        *,
        seed: int = 0,
    ) -> None:
        if len(initial) != schedule.fragments:
            raise ConfigError(
                f"{len(initial)} initial fragments for a schedule of {schedule.fragments}"
            )
        if schedule.H != config.H:
            raise ConfigError(f"schedule H={schedule.H} differs from config H={config.H}")
        schedule.check_overlap(config.tau)
        self.config = config
        self.schedule = schedule
        self.codec = config.make_codec()
        self._rng = np.random.default_rng(seed)
        self._tokens = 0
        self._frags = [
            _Fragment(
                global_params=np.array(x, dtype=np.float32, copy=True).reshape(-1),
                optimizer=OuterSGD(int(np.size(x)), config),
                residual=np.zeros(int(np.size(x)), np.float32) if config.error_feedback else None,
            )
            for x in initial
        ]

    # -- queries -------------------------------------------------------------------------
    @property
    def num_fragments(self) -> int:
        return len(self._frags)

    def due(self, step: int) -> tuple[int, ...]:
        """Fragments whose sync starts right after inner step ``step`` (0-based)."""
        return self.schedule.due(step)

    def global_params(self, p: int) -> np.ndarray:
        """The fragment's fp32 global copy (read-only view)."""
        view = self._frags[p].global_params.view()
        view.flags.writeable = False
        return view

    def version(self, p: int) -> int:
        return self._frags[p].version

    def pending(self, p: int) -> SyncRequest | None:
        return self._frags[p].pending

    def stats(self, p: int) -> FragmentStats:
        return self._frags[p].stats

    def add_tokens(self, n: int) -> None:
        """Count tokens trained on since the start; they weight this peer's contributions."""
        self._tokens += n

    # -- the three calls an exchange drives ----------------------------------------------
    def begin(self, p: int, local: np.ndarray, step: int) -> SyncRequest:
        """Start fragment ``p``'s sync: compute and encode Δp = global − local."""
        frag = self._frags[p]
        if frag.pending is not None:
            raise ConfigError(f"fragment {p} already has a sync in flight (round {frag.version})")
        local = np.asarray(local, dtype=np.float32).reshape(-1)
        if local.size != frag.global_params.size:
            raise ConfigError(
                f"fragment {p}: {local.size} values, expected {frag.global_params.size}"
            )
        delta = frag.global_params - local
        if frag.residual is not None:
            delta += frag.residual
        norm: float | None = None
        to_send = delta
        if self.config.aggregation == "rda":
            to_send, norm = rda_split(delta)
        payload = self.codec.encode(to_send, rng=self._rng)
        if frag.residual is not None:
            sent = self.codec.decode(payload, delta.size)
            if norm is not None:
                sent = sent * np.float32(norm)
            frag.pending_residual = delta - sent
        weight = self._tokens - frag.tokens_mark
        frag.pending_tokens = self._tokens
        frag.pending = SyncRequest(
            fragment=p,
            round=frag.version,
            step=step,
            apply_step=step + self.config.tau,
            weight=float(max(weight, 1)),
            payload=payload,
            numel=delta.size,
            norm=norm,
        )
        frag.stats.bytes_encoded += len(payload)
        return frag.pending

    def deliver(self, p: int, averaged: np.ndarray, round: int) -> np.ndarray:
        """Apply the group's averaged Δp with the outer optimizer; returns the new global copy."""
        frag = self._frags[p]
        if frag.pending is None or frag.pending.round != round:
            raise RoundAborted(
                f"fragment {p}: result for round {round} but "
                f"{'none' if frag.pending is None else frag.pending.round} is pending"
            )
        averaged = np.asarray(averaged, dtype=np.float32).reshape(-1)
        if averaged.size != frag.global_params.size or not np.isfinite(averaged).all():
            raise RoundAborted(
                f"fragment {p}: averaged result has a wrong size or non-finite values"
            )
        frag.optimizer.step(frag.global_params, averaged)
        frag.version += 1
        frag.digest = None
        frag.tokens_mark = frag.pending_tokens
        if frag.residual is not None and frag.pending_residual is not None:
            frag.residual = frag.pending_residual
        frag.pending = None
        frag.pending_residual = None
        frag.stats.applied += 1
        return self.global_params(p)

    def skip(self, p: int, reason: str) -> None:
        """Abandon fragment ``p``'s sync in flight: nothing is applied, training goes on."""
        frag = self._frags[p]
        if frag.pending is None:
            return
        log.info("fragment %d round %d skipped: %s", p, frag.version, reason)
        frag.pending = None
        frag.pending_residual = None
        frag.stats.skipped += 1
        frag.stats.last_skip_reason = reason

    def merge(self, p: int, local: np.ndarray) -> np.ndarray:
        """The new local copy after a delivered round: α·local + (1−α)·global (:func:`merge`)."""
        return merge(local, self._frags[p].global_params, self.config.alpha)

    # -- state transfer (rebase) -----------------------------------------------------------
    def export_fragment(self, p: int, step: int = 0) -> FragmentState:
        """Fragment ``p``'s shared state (version, outer state, global copy) to serve a peer.

        ``step`` is this peer's inner step, handed to the peer that copies it.
        """
        frag = self._frags[p]
        opt = frag.optimizer.state_dict()
        return FragmentState(
            version=frag.version,
            optimizer_steps=int(cast(int, opt["steps"])),
            step=int(step),
            global_params=frag.global_params.copy(),
            momentum=cast(np.ndarray, opt["momentum_buffer"]),
        )

    def digest(self, p: int) -> str:
        """The digest of fragment ``p``'s shared state (:meth:`FragmentState.digest`),
        hashed in place and kept until the state changes (deliver, import)."""
        frag = self._frags[p]
        if frag.digest is None:
            frag.digest = state_digest(
                frag.version,
                frag.optimizer.steps,
                frag.global_params,
                frag.optimizer.momentum,
            )
        return frag.digest

    def import_fragment(self, p: int, state: FragmentState) -> None:
        """Replace fragment ``p``'s shared state by a peer's copy (a rebase).

        A sync in flight is skipped first (its Δ was taken against the old copy). The
        error-feedback residual is cleared; the token mark is kept, so the work since the
        last applied round still counts. ConfigError when the sizes do not fit.
        """
        frag = self._frags[p]
        if state.global_params.size != frag.global_params.size:
            raise ConfigError(
                f"fragment {p}: peer state has {state.global_params.size} values, "
                f"expected {frag.global_params.size}"
            )
        self.skip(p, "rebased")
        opt = OuterSGD(frag.global_params.size, self.config)
        opt.load_state_dict(
            {
                "numel": frag.global_params.size,
                "steps": state.optimizer_steps,
                "momentum_buffer": state.momentum.copy(),
            }
        )
        frag.global_params = state.global_params.copy()
        frag.optimizer = opt
        frag.version = state.version
        frag.digest = None
        if frag.residual is not None:
            frag.residual = np.zeros_like(frag.global_params)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: global copies, outer states, residuals, versions.

        A sync in flight is not part of it: a restored engine starts with none pending,
        as if that round had been skipped.
        """
        return {
            "tokens": self._tokens,
            "fragments": [
                {
                    "global": f.global_params.copy(),
                    "optimizer": f.optimizer.state_dict(),
                    "residual": None if f.residual is None else f.residual.copy(),
                    "version": f.version,
                    "tokens_mark": f.tokens_mark,
                }
                for f in self._frags
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ConfigError when it does not fit this engine."""
        try:
            frags = list(state["fragments"])
            tokens = int(state["tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"engine state is malformed: {e!r}") from None
        if len(frags) != len(self._frags):
            raise ConfigError(
                f"engine state has {len(frags)} fragments, expected {len(self._frags)}"
            )
        restored = []
        for p, (mine, saved) in enumerate(zip(self._frags, frags, strict=True)):
            glob = np.asarray(saved["global"])
            if glob.dtype != np.float32 or glob.shape != mine.global_params.shape:
                raise ConfigError(f"fragment {p}: saved global copy has a wrong shape or dtype")
            if not np.isfinite(glob).all():
                raise ConfigError(f"fragment {p}: saved global copy has non-finite values")
            opt = OuterSGD(glob.size, self.config)
            opt.load_state_dict(saved["optimizer"])
            residual = saved["residual"]
            if self.config.error_feedback:
                residual = (
                    np.zeros_like(glob) if residual is None else np.asarray(residual, np.float32)
                )
                if residual.shape != glob.shape:
                    raise ConfigError(f"fragment {p}: saved residual has a wrong shape")
            else:
                residual = None
            restored.append(
                _Fragment(
                    global_params=glob.copy(),
                    optimizer=opt,
                    residual=None if residual is None else residual.copy(),
                    version=int(saved["version"]),
                    tokens_mark=int(saved["tokens_mark"]),
                )
            )
        self._frags = restored  # all or nothing: nothing changed if any check failed
        self._tokens = tokens


def merge(local: np.ndarray, global_: np.ndarray, alpha: float) -> np.ndarray:
    """A peer's new local copy of a fragment after an applied round: α·local + (1−α)·global.

    float32 arithmetic, flat result; with α = 0 a copy of the global copy (DiLoCo). The
    one implementation: :meth:`OuterEngine.merge` and the node's trainer (whose global
    copy comes from the network process) both call it.
    """
    g = np.asarray(global_, dtype=np.float32).reshape(-1)
    a = np.float32(alpha)
    if a == 0:
        return g.copy()
    out: np.ndarray = a * np.asarray(local, dtype=np.float32).reshape(-1) + (1 - a) * g
    return out


def average_requests(
    requests: Sequence[SyncRequest], codec: Codec, aggregation: str = "mean"
) -> tuple[np.ndarray, int]:
    """The reference group reduction: what every member receives, and bytes sent per peer.

    Dequantize every contribution, take the token-weighted fp32 mean, encode it once and
    decode (docs/ALGORITHMS.md §2.5). With RDA the members' unit directions go through the
    reduction and the result is rescaled to the weighted mean norm. The byte count is that
    of a bandwidth-optimal reduce-scatter + all-gather of the encoded vector.
    """
    if not requests:
        raise ConfigError("average_requests needs at least one request")
    first = requests[0]
    for r in requests:
        if (r.fragment, r.round, r.numel) != (first.fragment, first.round, first.numel):
            raise RoundAborted("requests of one group disagree on fragment, round or size")
    contribs = [Contribution(r.payload, r.weight) for r in requests]
    result = reduce_encoded(contribs, codec, first.numel)
    averaged = codec.decode(result, first.numel)
    if aggregation == "rda":
        total = sum(r.weight for r in requests)
        mean_norm = sum(r.weight * (r.norm or 0.0) for r in requests) / total
        averaged = rda_combine(averaged, mean_norm)
    sent = allreduce_bytes_per_peer(codec.encoded_size(first.numel), len(requests))
    return averaged, sent

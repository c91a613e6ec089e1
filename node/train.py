"""The inner loop: one replica's model, AdamW, learning-rate schedule and fragment views.

DiLoCo's inner optimizer (arXiv 2311.08105): AdamW with weight decay 0.1 and betas
(0.9, 0.95), linear warmup then cosine decay, gradient clipping; its state stays local and
is never sent. Mixed precision (bf16 autocast) on CUDA, plain fp32 on CPU.

:class:`FragmentViews` moves a fragment's parameters to and from one flat fp32 numpy
vector, the form in which :mod:`atoll.protocol.engine` and the wire see them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from atoll.node.data import Batcher
from atoll.node.documents import DocumentBatcher, MicroBatch
from atoll.node.settings import InnerConfig
from atoll.protocol.errors import ConfigError
from atoll.protocol.fragments import FragmentPlan

__all__ = [
    "FragmentViews",
    "InnerConfig",
    "Replica",
    "StepTimer",
    "evaluate",
    "lr_at",
    "resolve_device",
]

log = logging.getLogger(__name__)


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Learning rate at 0-based ``step``: linear warmup, then cosine to ``min_lr_ratio``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch sees no CUDA GPU")
    return dev


class StepTimer:
    """Seconds spent in forward, backward and optimizer steps (compute utilisation's numerator)."""

    def __init__(self) -> None:
        self.compute_s = 0.0

    @contextlib.contextmanager
    def measure(self, device: torch.device) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.compute_s += time.perf_counter() - t0


class FragmentViews:
    """Flat fp32 numpy views of a model's fragments, in the plan's tensor order."""

    def __init__(self, model: nn.Module, plan: FragmentPlan) -> None:
        params = dict(model.named_parameters())
        missing = [n for f in plan.fragments for n in f.names if n not in params]
        if missing:
            raise ConfigError(f"fragment plan names unknown parameters: {missing[:3]}")
        self.plan = plan
        self._params: list[list[nn.Parameter]] = [
            [params[n] for n in f.names] for f in plan.fragments
        ]

    def __len__(self) -> int:
        return len(self._params)

    def numel(self, p: int) -> int:
        return sum(t.numel() for t in self._params[p])

    @torch.no_grad()
    def get(self, p: int) -> np.ndarray:
        """A copy of fragment ``p``'s parameters as one float32 vector."""
        flat = torch.cat([t.detach().reshape(-1).float() for t in self._params[p]])
        return flat.cpu().numpy()

    @torch.no_grad()
    def set(self, p: int, values: np.ndarray) -> None:
        """Overwrite fragment ``p``'s parameters from a float32 vector."""
        arr = np.ascontiguousarray(values, dtype=np.float32)
        if not arr.flags.writeable:  # torch wants writable memory even to read it
            arr = arr.copy()
        src = torch.from_numpy(arr)
        if src.numel() != self.numel(p):
            raise ConfigError(f"fragment {p}: {src.numel()} values, expected {self.numel(p)}")
        offset = 0
        for t in self._params[p]:
            n = t.numel()
            t.copy_(src[offset : offset + n].view_as(t))
            offset += n


class Replica:
    """One model replica and its inner optimizer: a simulated worker or a peer's trainer."""

    def __init__(
        self,
        model: nn.Module,
        inner: InnerConfig,
        batcher: Batcher,
        replica_id: int,
        device: torch.device,
    ) -> None:
        self.model = model.to(device)
        self.inner = inner
        self.batcher = batcher
        self.replica_id = replica_id
        self.device = device
        self.timer = StepTimer()
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": inner.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=inner.lr,
            betas=(inner.beta1, inner.beta2),
            fused=True,  # one kernel for all tensors, on CPU and CUDA
        )

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(
        self, step: int, batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> float:
        """One inner step on this replica's deterministic batch (or on ``batches``); the loss.

        With a :class:`~atoll.node.documents.DocumentBatcher` and no ``batches``, the step
        accumulates the gradients of the batch's micro-batches (:meth:`_accumulate`).
        """
        micro: list[MicroBatch] | None = None
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
        if batches is not None:
            pairs = batches
        elif isinstance(self.batcher, DocumentBatcher):
            micro = self.batcher.micro_batches(self.replica_id, step)
        else:
            pairs = [self.batcher.batch(self.replica_id, step)]
        lr = lr_at(step, self.inner)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        with self.timer.measure(self.device):
            if micro is not None:
                loss = self._accumulate(micro)
            else:
                x = torch.cat([b[0] for b in pairs]).to(self.device, non_blocking=True)
                y = torch.cat([b[1] for b in pairs]).to(self.device, non_blocking=True)
                with self._autocast():
                    loss = self.model.loss(x, y)  # type: ignore[operator]
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            if self.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
            self.optimizer.step()
            value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(
                f"replica {self.replica_id}: loss became {value} at step {step}"
            )
        return value

    def _accumulate(self, micro: Sequence[MicroBatch]) -> torch.Tensor:
        """Forward and backward of each micro-batch, its mean loss weighted by its share of
        the batch's tokens: the gradients add up to those of the per-token mean over the
        whole batch, however it was cut. Returns that mean (detached)."""
        total = sum(mb.tokens for mb in micro)
        self.optimizer.zero_grad(set_to_none=True)
        value = torch.zeros((), device=self.device)
        for mb in micro:
            x = mb.inputs.to(self.device, non_blocking=True)
            y = mb.targets.to(self.device, non_blocking=True)
            with self._autocast():
                loss = self.model.loss(x, y) * (mb.tokens / total)  # type: ignore[operator]
            loss.backward()
            value += loss.detach().float()
        return value


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    """Mean validation loss in nats per byte."""
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for x, y in batches:
            ctx = (
                torch.autocast("cuda", dtype=torch.bfloat16)
                if device.type == "cuda"
                else contextlib.nullcontext()
            )
            with ctx:
                total += float(model.loss(x.to(device), y.to(device)))  # type: ignore[operator]
    finally:
        model.train(was_training)
    return total / max(1, len(batches))

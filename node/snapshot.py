"""What a node's checkpoint holds, and how a running node saves and resumes one.

A node's state lives in two processes (docs/DESIGN.md, "Concurrency"): the trainer holds
the model and its inner optimizer (AdamW); the network process holds the
:class:`~atoll.protocol.engine.OuterEngine`: every fragment's global copy, outer
momentum, error-feedback residual, version and token mark. One checkpoint holds both, in
one :class:`~atoll.node.checkpoint.CheckpointStore` entry:

- tensors ``model/<name>`` (the model's state dict), ``inner/<i>/<key>`` (AdamW's state
  of parameter ``i``), ``engine/<p>/global``, ``engine/<p>/momentum`` and, with error
  feedback, ``engine/<p>/residual``;
- metadata: the run id, the peer id, the model, the inner step (the learning-rate
  schedule and the data position are functions of it: a batch is a function of the peer
  and the step), the tokens trained on, every fragment's version and state digest, the
  engine's scalars (:func:`engine_arrays`) and the node's counters.

Consistency: a save is taken at a step when no sync is in flight, so every round the
engine applied has been merged into the model. The trainer copies its own state (the
only part of a save that stalls training, measured in :attr:`NodeCheckpoints.stalls`),
asks the network process for the engine's (``["snapshot", path]`` on the bridge: the
engine is copied before the next command is read, and written to a staging file off the
event loop), trains on, and hands both to a writer thread once the engine's part is in.

Resuming (:func:`resume_point`, which verifies the checkpoint once) restores the model
and AdamW here and hands the engine's part to the network process (``resume=`` of the
swarm worker), which loads it before it joins, then catches up only the fragments whose
copy the swarm moved past.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from atoll.node.checkpoint import CheckpointError, CheckpointStore, Loaded, load_checkpoint
from atoll.protocol.statesync import state_digest

if TYPE_CHECKING:
    import torch

    from atoll.node.net.bridge import NetworkBridge

__all__ = [
    "KIND",
    "EnginePart",
    "NodeCheckpoints",
    "ResumePoint",
    "engine_arrays",
    "engine_state",
    "load_engine_part",
    "read_engine_file",
    "restore_trainer",
    "resume_point",
    "trainer_arrays",
    "write_engine_file",
]

log = logging.getLogger(__name__)

KIND = "atoll-node"
"""``meta["kind"]`` of a node checkpoint (a store may hold other kinds one day)."""
_MODEL = "model/"
_INNER = "inner/"
_ENGINE = "engine/"
_STAGING = ".staging"


# -- the engine's part (network process) ----------------------------------------------------
def engine_arrays(state: Mapping[str, Any]) -> tuple[dict[str, npt.NDArray[Any]], dict[str, Any]]:
    """:meth:`OuterEngine.state_dict <atoll.protocol.engine.OuterEngine.state_dict>` as
    named arrays and plain-JSON scalars (the inverse of :func:`engine_state`)."""
    tensors: dict[str, npt.NDArray[Any]] = {}
    frags = []
    for p, f in enumerate(state["fragments"]):
        opt = f["optimizer"]
        tensors[f"{_ENGINE}{p}/global"] = np.asarray(f["global"], np.float32)
        tensors[f"{_ENGINE}{p}/momentum"] = np.asarray(opt["momentum_buffer"], np.float32)
        if f["residual"] is not None:
            tensors[f"{_ENGINE}{p}/residual"] = np.asarray(f["residual"], np.float32)
        frags.append(
            {
                "version": int(f["version"]),
                "tokens_mark": int(f["tokens_mark"]),
                "numel": int(opt["numel"]),
                "steps": int(opt["steps"]),
                "residual": f["residual"] is not None,
            }
        )
    return tensors, {"tokens": int(state["tokens"]), "fragments": frags}


def engine_state(
    tensors: Mapping[str, npt.NDArray[Any]], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """The engine's state dict from :func:`engine_arrays`' output; CheckpointError when a
    part is missing or malformed (the engine's own load checks shapes and values)."""
    try:
        frags = []
        for p, f in enumerate(meta["fragments"]):
            residual = tensors[f"{_ENGINE}{p}/residual"] if f["residual"] else None
            frags.append(
                {
                    "global": tensors[f"{_ENGINE}{p}/global"],
                    "optimizer": {
                        "numel": int(f["numel"]),
                        "steps": int(f["steps"]),
                        "momentum_buffer": tensors[f"{_ENGINE}{p}/momentum"],
                    },
                    "residual": residual,
                    "version": int(f["version"]),
                    "tokens_mark": int(f["tokens_mark"]),
                }
            )
        return {"tokens": int(meta["tokens"]), "fragments": frags}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's engine part is incomplete: {e!r}") from None


def write_engine_file(path: str | Path, state: Mapping[str, Any]) -> dict[str, Any]:
    """Write the engine's arrays to ``path`` (safetensors); returns the scalars, with every
    fragment's state digest (what the swarm's records and certificates name)."""
    from safetensors.numpy import save_file

    tensors, meta = engine_arrays(state)
    meta["digests"] = [
        state_digest(
            f["version"],
            f["steps"],
            tensors[f"{_ENGINE}{p}/global"],
            tensors[f"{_ENGINE}{p}/momentum"],
        )
        for p, f in enumerate(meta["fragments"])
    ]
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(target))
    return meta


EnginePart = tuple[dict[str, Any], list[list[str]], list[str]]
"""What the network process resumes from: the engine's state dict, the certificate
seals (base64, per fragment) and this node's own attestation of each state ("" where
none)."""


def load_engine_part(folder: str | Path) -> EnginePart:
    """The :data:`EnginePart` kept in the node checkpoint ``folder``, verified;
    CheckpointError when it does not verify."""
    return _engine_part(load_checkpoint(folder))


def _engine_part(loaded: Loaded) -> EnginePart:
    folder = loaded.path
    try:
        part = loaded.meta["engine"]
        seals = [[str(s) for s in per] for per in part.get("seals", [])]
        own = [str(s) for s in part.get("own_seals", [])]
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{folder}: no engine part ({e!r})") from None
    return engine_state(loaded.tensors, part), seals, own


def read_engine_file(path: str | Path) -> dict[str, npt.NDArray[Any]]:
    """The arrays :func:`write_engine_file` wrote."""
    from safetensors.numpy import load_file

    return dict(load_file(str(path)))


# -- the trainer's part -----------------------------------------------------------------------
def trainer_arrays(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies (on the CPU) of the model's state dict and the optimizer's per-parameter
    state, named as the module docstring says."""
    import torch

    out: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        out[_MODEL + name] = value.detach().to("cpu", copy=True)
    for index, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                out[f"{_INNER}{index}/{key}"] = value.detach().to("cpu", copy=True)
            else:  # a plain number (some optimizers keep the step as an int)
                out[f"{_INNER}{index}/{key}"] = torch.tensor(value)
    return out


def restore_trainer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: Mapping[str, npt.NDArray[Any]],
) -> None:
    """Load :func:`trainer_arrays`' output back; CheckpointError when it does not fit this
    model (another model, another size). The optimizer's hyperparameters stay its own
    (they come from the manifest); only its per-parameter state is restored."""
    import torch

    device = next(model.parameters()).device
    model_state = {
        k[len(_MODEL) :]: torch.from_numpy(np.array(v))
        for k, v in tensors.items()
        if k.startswith(_MODEL)
    }
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith(_INNER):
            index, _, key = k[len(_INNER) :].partition("/")
            per_param.setdefault(int(index), {})[key] = torch.from_numpy(np.array(v))
    try:
        model.load_state_dict(model_state, strict=True)
        saved = optimizer.state_dict()
        n_params = sum(len(g["params"]) for g in saved["param_groups"])
        if any(i >= n_params for i in per_param):
            raise ValueError("optimizer state for more parameters than the model has")
        saved["state"] = per_param
        optimizer.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"the checkpoint does not fit this model: {e}") from None
    model.to(device)


# -- resuming -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ResumePoint:
    """A verified node checkpoint that fits this run and peer."""

    loaded: Loaded
    step: int
    tokens: int
    versions: tuple[int, ...]

    @property
    def path(self) -> Path:
        return self.loaded.path

    def engine_globals(self) -> list[npt.NDArray[np.float32]]:
        """Every fragment's saved global copy."""
        return [
            np.asarray(self.loaded.tensors[f"{_ENGINE}{p}/global"], np.float32)
            for p in range(len(self.versions))
        ]

    def engine_part(self) -> EnginePart:
        """What the network process resumes from (read from this checkpoint, which was
        verified once already)."""
        return _engine_part(self.loaded)

    def describe(self) -> str:
        versions = ", ".join(f"v{v}" for v in self.versions)
        return f"resumed {self.path.name}: step {self.step}, fragments at {versions}"


def resume_point(
    store: CheckpointStore, *, run_id: str, peer_id: str, fragments: int
) -> ResumePoint | None:
    """The newest checkpoint of ``store`` that verifies and belongs to this run and peer,
    or None. One that verifies but belongs elsewhere (another run's manifest, another
    identity, another fragment plan) is refused with CheckpointError naming what differs:
    resuming it would mix runs, and starting over silently would drop it."""
    loaded = store.latest()
    if loaded is None:
        return None
    meta = loaded.meta
    if meta.get("kind") != KIND:
        raise CheckpointError(f"{loaded.path} is not a node checkpoint")
    for key, want in (("run_id", run_id), ("peer_id", peer_id)):
        if meta.get(key) != want:
            raise CheckpointError(
                f"{loaded.path} belongs to {key} {str(meta.get(key))[:16]}, not this node's "
                f"{want[:16]}: point --checkpoint-dir elsewhere or pass --no-resume"
            )
    try:
        versions = tuple(int(v) for v in meta["versions"])
        step, tokens = int(meta["step"]), int(meta["tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{loaded.path}: malformed metadata ({e!r})") from None
    if len(versions) != fragments:
        raise CheckpointError(
            f"{loaded.path} has {len(versions)} fragments, this run plans {fragments}"
        )
    engine_state(loaded.tensors, meta["engine"])  # complete, or a clear error now
    return ResumePoint(loaded, step, tokens, versions)


# -- saving while training ----------------------------------------------------------------
@dataclass
class _Pending:
    path: Path
    step: int
    tensors: dict[str, Any]
    meta: dict[str, Any]
    asked_at: float


@dataclass
class CheckpointStats:
    saved: int = 0
    failed: int = 0
    stalls: list[float] = field(default_factory=list)
    """seconds each save stopped the training loop (copying the trainer's state)"""
    last_path: str = ""
    last_error: str = ""


class NodeCheckpoints:
    """Periodic checkpoints of a running node into one store (see the module docstring).

    :meth:`poll` is called once per training step: it starts a save when one is due and
    the loop has no sync in flight, and hands a save whose engine part arrived to the
    writer thread. :meth:`final` writes one at once (at the end of a run, or when the node
    is stopped) and waits for it. A failing save is logged and counted; it never stops
    training.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        every_s: float,
        identity: Mapping[str, Any],
        clock: Callable[[], float] = time.monotonic,
        engine_wait_s: float = 30.0,
    ) -> None:
        self.store = store
        self.every_s = every_s
        self.identity = dict(identity)
        self.clock = clock
        self.engine_wait_s = engine_wait_s
        self.stats = CheckpointStats()
        self._last = clock()
        self._pending: _Pending | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="atoll-ckpt")
        self._writing: concurrent.futures.Future[Path | None] | None = None
        (store.folder / _STAGING).mkdir(parents=True, exist_ok=True)

    def _staging_path(self, step: int) -> Path:
        return self.store.folder / _STAGING / f"engine-{step}-{secrets.token_hex(4)}.safetensors"

    def due(self) -> bool:
        return (
            self.every_s > 0
            and self._pending is None
            and (self._writing is None or self._writing.done())
            and self.clock() - self._last >= self.every_s
        )

    def poll(
        self,
        bridge: NetworkBridge,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        tokens: int,
        quiet: bool,
        meta: Callable[[], dict[str, Any]],
    ) -> None:
        """Once per step: begin a due save at a ``quiet`` step (no sync in flight), and
        pass a save whose engine part came back to the writer."""
        pending = self._pending
        if pending is not None:
            reply = bridge.snapshot_reply(str(pending.path))
            if reply is not None:
                self._pending = None
                self._last = self.clock()
                if reply.ok:
                    pending.meta["engine"] = reply.meta
                    self._writing = self._writer.submit(self._write, pending)
                else:
                    self._failed(f"the network process could not copy its state: {reply.detail}")
            elif self.clock() - pending.asked_at > self.engine_wait_s:
                self._pending = None
                self._last = self.clock()
                self._failed(f"no engine state within {self.engine_wait_s:.0f} s")
            return
        if quiet and self.due():
            self._begin(bridge, model, optimizer, step=step, tokens=tokens, meta=meta())

    def _begin(
        self,
        bridge: NetworkBridge,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        tokens: int,
        meta: dict[str, Any],
    ) -> _Pending:
        t0 = time.perf_counter()
        tensors = trainer_arrays(model, optimizer)
        path = self._staging_path(step)
        bridge.request_snapshot(str(path))
        self.stats.stalls.append(time.perf_counter() - t0)
        full = {"kind": KIND, **self.identity, **meta, "step": step, "tokens": tokens}
        self._pending = _Pending(path, step, tensors, full, self.clock())
        return self._pending

    def final(
        self,
        bridge: NetworkBridge,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        tokens: int,
        meta: dict[str, Any],
        timeout_s: float,
    ) -> Path | None:
        """Write a checkpoint now and wait for it (at most about ``timeout_s``); its
        folder, or None when it failed (logged)."""
        deadline = time.monotonic() + timeout_s
        self._finish_writing(timeout_s)
        self._pending = None  # a periodic save still waiting is superseded by this one
        from atoll.node.net.bridge import NetworkProcessError

        try:
            pending = self._begin(bridge, model, optimizer, step=step, tokens=tokens, meta=meta)
        except NetworkProcessError as e:
            self._failed(f"the network process is gone: {e}")
            return None
        reply = bridge.snapshot(str(pending.path), max(0.1, deadline - time.monotonic()))
        self._pending = None
        if not reply.ok:
            self._failed(f"the network process could not copy its state: {reply.detail}")
            return None
        pending.meta["engine"] = reply.meta
        return self._write(pending)

    def _write(self, pending: _Pending) -> Path | None:
        try:
            tensors = dict(pending.tensors)
            tensors.update(read_engine_file(pending.path))
            # the engine's own word on what it held when it was copied
            pending.meta["versions"] = [f["version"] for f in pending.meta["engine"]["fragments"]]
            pending.meta["digests"] = list(pending.meta["engine"].get("digests", []))
            path = self.store.save(tensors, pending.meta)
        except (OSError, CheckpointError, KeyError, ValueError) as e:
            self._failed(f"{type(e).__name__}: {e}")
            return None
        finally:
            pending.path.unlink(missing_ok=True)
        self.stats.saved += 1
        self.stats.last_path = str(path)
        return path

    def _failed(self, why: str) -> None:
        self.stats.failed += 1
        self.stats.last_error = why
        log.warning("checkpoint not written: %s", why)

    def _finish_writing(self, timeout_s: float) -> None:
        if self._writing is not None:
            try:
                self._writing.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                log.warning("a checkpoint still being written after %.0f s", timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait for a save being written, then stop the writer; drop the staging files."""
        self._finish_writing(timeout_s)
        self._writer.shutdown(wait=False)
        shutil.rmtree(self.store.folder / _STAGING, ignore_errors=True)

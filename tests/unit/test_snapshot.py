"""What a node checkpoint holds (atoll.node.snapshot): the engine's part round-trips
exactly, the trainer's part restores a model and AdamW that train on bit for bit like
the originals, and a checkpoint of another run, peer or plan is refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from atoll.node.checkpoint import CheckpointError, CheckpointStore
from atoll.node.data import Batcher, Corpus
from atoll.node.model import build
from atoll.node.snapshot import (
    KIND,
    engine_arrays,
    engine_state,
    load_engine_part,
    read_engine_file,
    restore_trainer,
    resume_point,
    trainer_arrays,
    write_engine_file,
)
from atoll.node.train import InnerConfig, Replica
from atoll.protocol.engine import EngineConfig, OuterEngine
from atoll.protocol.schedule import Schedule

SIZES = [300, 41, 128]


def _engine(error_feedback: bool = False, seed: int = 1) -> OuterEngine:
    config = EngineConfig(H=6, tau=0, alpha=0.0, codec="e3m0", error_feedback=error_feedback)
    rng = np.random.default_rng(seed)
    inits = [rng.standard_normal(n, dtype=np.float32) for n in SIZES]
    return OuterEngine(config, Schedule(6, len(SIZES)), inits, seed=seed)


def _advance(engine: OuterEngine, rounds: int, seed: int = 5) -> None:
    """Apply ``rounds`` outer steps to every fragment (a group of one)."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for p in range(engine.num_fragments):
            local = engine.global_params(p) + rng.standard_normal(SIZES[p], dtype=np.float32)
            engine.add_tokens(100)
            request = engine.begin(p, local, step=0)
            averaged = engine.codec.decode(request.payload, SIZES[p])
            engine.deliver(p, averaged, request.round)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_engine_part_round_trips_exactly(tmp_path: Path, error_feedback: bool) -> None:
    engine = _engine(error_feedback)
    _advance(engine, 3)
    meta = write_engine_file(tmp_path / "e.safetensors", engine.state_dict())
    restored = _engine(error_feedback, seed=9)  # other initial values: all replaced
    restored.load_state_dict(engine_state(read_engine_file(tmp_path / "e.safetensors"), meta))
    for p in range(len(SIZES)):
        assert restored.version(p) == engine.version(p) == 3
        assert restored.digest(p) == engine.digest(p) == meta["digests"][p]
        np.testing.assert_array_equal(restored.global_params(p), engine.global_params(p))
    # the restored engine goes on exactly like the original
    _advance(engine, 1, seed=11)
    _advance(restored, 1, seed=11)
    assert [restored.digest(p) for p in range(3)] == [engine.digest(p) for p in range(3)]


def test_an_incomplete_engine_part_is_refused() -> None:
    tensors, meta = engine_arrays(_engine().state_dict())
    del tensors["engine/1/momentum"]
    with pytest.raises(CheckpointError, match="incomplete"):
        engine_state(tensors, meta)


def _replica(seed: int = 0) -> Replica:
    torch.manual_seed(seed)
    model, seq_len = build("micro", seed)
    data = np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint8)
    corpus = Corpus("random", data[:36_000], data[36_000:], "0" * 64)
    batcher = Batcher(corpus, seq_len, 2, seed=0)
    return Replica(
        model, InnerConfig(lr=1e-3, warmup=2, total_steps=50), batcher, 0, torch.device("cpu")
    )


def _as_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in tensors.items()}


def test_trainer_part_restores_a_replica_that_trains_on_identically() -> None:
    a = _replica()
    for step in range(4):
        a.train_step(step)
    saved = _as_numpy(trainer_arrays(a.model, a.optimizer))
    b = _replica(seed=3)  # other weights, no optimizer state
    restore_trainer(b.model, b.optimizer, saved)
    assert [a.train_step(s) for s in (4, 5)] == [b.train_step(s) for s in (4, 5)]
    for (name, pa), pb in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name


def test_trainer_part_of_another_model_is_refused() -> None:
    a = _replica()
    saved = _as_numpy(trainer_arrays(a.model, a.optimizer))
    saved["model/extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        restore_trainer(_replica().model, _replica().optimizer, saved)


def _save_node_checkpoint(store: CheckpointStore, **meta_changes: object) -> None:
    engine = _engine()
    _advance(engine, 2)
    tensors, part = engine_arrays(engine.state_dict())
    meta = {
        "kind": KIND,
        "run_id": "r" * 64,
        "peer_id": "peer-a",
        "step": 17,
        "tokens": 1234,
        "versions": [2, 2, 2],
        "engine": part,
        **meta_changes,
    }
    store.save(tensors, meta)


def test_resume_point_reads_the_newest_checkpoint_of_this_run_and_peer(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert resume_point(store, run_id="r" * 64, peer_id="peer-a", fragments=3) is None
    _save_node_checkpoint(store)
    point = resume_point(store, run_id="r" * 64, peer_id="peer-a", fragments=3)
    assert point is not None
    assert (point.step, point.tokens, point.versions) == (17, 1234, (2, 2, 2))
    assert "step 17" in point.describe()
    state, seals, own = load_engine_part(point.path)
    assert [f["version"] for f in state["fragments"]] == [2, 2, 2]
    assert seals == [] and own == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"run_id": "s" * 64}, "belongs to run_id"),
        ({"peer_id": "peer-b"}, "belongs to peer_id"),
        ({"fragments": 4}, "has 3 fragments, this run plans 4"),
    ],
)
def test_a_checkpoint_of_another_run_peer_or_plan_is_refused(
    tmp_path: Path, kwargs: dict[str, object], match: str
) -> None:
    store = CheckpointStore(tmp_path)
    _save_node_checkpoint(store)
    args: dict[str, object] = {"run_id": "r" * 64, "peer_id": "peer-a", "fragments": 3, **kwargs}
    with pytest.raises(CheckpointError, match=match):
        resume_point(store, **args)  # type: ignore[arg-type]

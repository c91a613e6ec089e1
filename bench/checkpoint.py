"""What a node checkpoint costs: the stall of the training loop against a training step.

For each model preset: the time of one inner step, the trainer's copy of its state (the
only part of a save that stops training, :func:`atoll.node.snapshot.trainer_arrays`),
the engine's part written to its staging file (in the network process in a real node),
and the whole save into a :class:`~atoll.node.checkpoint.CheckpointStore` (in the
writer thread in a real node: training goes on meanwhile), with the checkpoint's size.

    .venv/bin/python bench/checkpoint.py --models tiny,small --json runs/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atoll.node.checkpoint import CheckpointStore
from atoll.node.data import Batcher, Corpus
from atoll.node.model import build, tensor_specs
from atoll.node.snapshot import read_engine_file, trainer_arrays, write_engine_file
from atoll.node.train import FragmentViews, InnerConfig, Replica
from atoll.protocol.engine import EngineConfig, OuterEngine
from atoll.protocol.fragments import plan_fragments
from atoll.protocol.schedule import Schedule


def _timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(preset: str, repeat: int, batch_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, seq_len = build(preset, 0)
    data = np.random.default_rng(0).integers(0, 256, 400_000, dtype=np.uint8)
    batcher = Batcher(
        Corpus("random", data[:360_000], data[360_000:], "0" * 64), seq_len, batch_size
    )
    rep = Replica(model, InnerConfig(total_steps=100), batcher, 0, torch.device("cpu"))
    step_s, _ = _timed(lambda: rep.train_step(0), repeat)
    plan = plan_fragments(tensor_specs(model), blocks_per_fragment=2)
    views = FragmentViews(model, plan)
    engine = OuterEngine(
        EngineConfig(H=100, tau=5),
        Schedule(100, len(plan)),
        [views.get(p) for p in range(len(plan))],
    )
    stall_s, trainer = _timed(lambda: trainer_arrays(rep.model, rep.optimizer), repeat)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "engine.safetensors"
        engine_s, meta = _timed(lambda: write_engine_file(staging, engine.state_dict()), repeat)
        store = CheckpointStore(Path(tmp) / "ckpts", keep=2)

        def save() -> Path:
            tensors = dict(trainer)
            tensors.update(read_engine_file(staging))
            return store.save(tensors, {"kind": "bench", "engine": meta})

        save_s, path = _timed(save, repeat)
        size = sum(f.stat().st_size for f in path.iterdir())
    return {
        "model": preset,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": step_s,
        "stall_s": stall_s,
        "stall_over_step": stall_s / step_s,
        "engine_part_s": engine_s,
        "save_s": save_s,
        "checkpoint_mb": size / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small", help="presets, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="median of this many of each")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(m, args.repeat, args.batch_size) for m in args.models.split(",") if m]
    print(
        f"{'model':8} {'params':>8} {'step s':>8} {'stall s':>8} {'stall/step':>10} "
        f"{'engine s':>9} {'save s':>7} {'MB':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:8} {r['params'] / 1e6:7.2f}M {r['step_s']:8.3f} {r['stall_s']:8.4f} "
            f"{r['stall_over_step']:10.3f} {r['engine_part_s']:9.3f} {r['save_s']:7.3f} "
            f"{r['checkpoint_mb']:7.1f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"machine": "see docs/BENCHMARKS.md", "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

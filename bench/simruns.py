"""What the simulator benchmarks share (``attacks_sim.py``, ``latework.py``): the live
attack benchmark's run settings, and simulated runs in parallel processes.

Imported by those scripts from their own folder (a script's folder is first on its
import path); not a benchmark itself.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from atoll.node.data import load_corpus
from atoll.node.simulate import SimConfig, SimResult, simulate

_CORPUS: Any = None


def base_config(args: Any, seed: int) -> SimConfig:
    """The live attack benchmark's manifest as a simulated run (micro, batch 4, lr 3e-3,
    warmup 5, τ 2, α 0.5, e3m0) with ``args``'s replicas, steps, H, preset and eval
    batches."""
    return SimConfig(
        algo="streaming",
        replicas=args.replicas,
        steps=args.steps,
        batch_size=4,
        preset=args.preset,
        seed=seed,
        lr=3e-3,
        warmup=5,
        H=args.H,
        tau=2,
        alpha=0.5,
        codec="e3m0",
        eval_batches=args.eval_batches,
        log_every=max(1, args.steps // 4),
        device="cpu",
    )


def _worker_init(threads: int) -> None:
    global _CORPUS
    torch.set_num_threads(threads)
    import logging

    logging.getLogger("atoll.protocol.strikes").setLevel(logging.ERROR)  # one per replica
    _CORPUS = load_corpus("stdlib")


def _worker_run(label: str, cfg: SimConfig) -> tuple[str, SimResult | str]:
    """The run's result, or why it diverged (an unprotected attack can make the loss
    NaN: the trainer refuses to go on)."""
    print(f"--- start: {label}", file=sys.stderr, flush=True)
    try:
        return label, simulate(cfg, corpus=_CORPUS)
    except FloatingPointError as e:
        return label, str(e)


def run_all(
    runs: list[tuple[str, SimConfig]],
    *,
    jobs: int,
    json_path: str,
    argv: list[str] | None,
    summarise: Callable[[dict[str, SimResult | str]], dict[str, Any]],
) -> dict[str, Any]:
    """Run every ``(label, config)`` in ``jobs`` processes (one torch thread each on two
    cores); after each result, ``summarise`` (all results so far, by label) gives the
    document's fields, and the document is written to ``json_path`` (partial results
    survive an interrupted run). Returns the last document."""
    doc: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "argv": sys.argv[1:] if argv is None else argv,
    }
    t0 = time.perf_counter()
    results: dict[str, SimResult | str] = {}
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    with ProcessPoolExecutor(
        max(1, jobs), mp_context=ctx, initializer=_worker_init, initargs=(threads,)
    ) as ex:
        futures = [ex.submit(_worker_run, label, cfg) for label, cfg in runs]
        for fut in futures:
            label, r = fut.result()
            results[label] = r
            doc.update(summarise(results))
            doc["total_wall_s"] = time.perf_counter() - t0
            with open(json_path, "w") as f:
                json.dump(doc, f, indent=2)
    return doc

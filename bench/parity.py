#!/usr/bin/env python3
"""Loss parity of DiLoCo and Streaming DiLoCo against data-parallel training.

Same model, data and token budget for every run; M simulated replicas in one process
(``atoll.node.simulate``). Each run records ``algo``, ``eval_loss`` (of the global
parameters, nats/byte), ``tokens``, ``bytes_per_replica`` (encoded sizes under a
bandwidth-optimal all-reduce), ``wall_s`` and its ``config``; ``summary`` holds the
derived figures the targets are stated in.

    python bench/parity.py --json parity.json            # ddp; diloco and streaming at H=30, 100
    python bench/parity.py --quick --json quick.json     # smoke size, < 2 min on 2 cores
    python bench/parity.py --long --json long.json       # the gap at 1x, 2x, 4x the budget
    python bench/parity.py --sweep-lr --json lr.json     # inner-lr sweep per method
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from atoll.node.cli import format_table
from atoll.node.data import load_corpus
from atoll.node.simulate import SimConfig, SimResult, simulate

log = logging.getLogger("bench.parity")

# inner learning rates per method, from the sweep recorded in docs/BENCHMARKS.md
LR = {"ddp": 2e-3, "diloco": 3e-3, "streaming": 3e-3}


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def plan(args: argparse.Namespace) -> list[tuple[str, SimConfig]]:
    base = SimConfig(
        replicas=args.replicas,
        steps=args.steps,
        batch_size=args.batch_size,
        preset=args.preset,
        device=args.device,
        seed=args.seed,
        eval_batches=args.eval_batches,
        log_every=max(1, args.steps // 10),
    )
    runs: list[tuple[str, SimConfig]] = []
    if args.quick:
        base = base.with_(
            preset="micro", replicas=2, steps=150, warmup=15, eval_batches=4, log_every=50
        )
        return [
            ("ddp", base.with_(algo="ddp", lr=LR["ddp"])),
            ("diloco H=30", base.with_(algo="diloco", H=30, lr=LR["diloco"])),
            (
                "streaming H=30",
                base.with_(algo="streaming", H=30, lr=LR["streaming"], blocks_per_fragment=1),
            ),
        ]
    if args.sweep_lr:
        for algo, lrs in (
            ("ddp", (1e-3, 2e-3, 3e-3)),
            ("diloco", (2e-3, 3e-3, 4e-3)),
            ("streaming", (3e-3, 4e-3)),
        ):
            for lr in lrs:
                runs.append((f"{algo} lr={lr:g}", base.with_(algo=algo, lr=lr, H=30)))
        return runs
    if args.ablation:
        # what makes streaming differ from vanilla DiLoCo at H=30: the 4-bit codec, or the
        # fragments with overlap and merge
        s = base.with_(algo="streaming", H=30, lr=LR["streaming"])
        return [
            ("streaming H=30 fp32", s.with_(codec="fp32")),
            ("streaming H=30 tau=0 alpha=0", s.with_(tau=0, alpha=0.0)),
        ]
    if args.long:
        for mult in args.mults:
            cfg = base.with_(steps=args.steps * mult, log_every=max(1, args.steps * mult // 10))
            runs.append((f"ddp {mult}x", cfg.with_(algo="ddp", lr=LR["ddp"])))
            runs.append(
                (f"streaming H=30 {mult}x", cfg.with_(algo="streaming", H=30, lr=LR["streaming"]))
            )
        return runs
    runs.append(("ddp", base.with_(algo="ddp", lr=LR["ddp"])))
    for H in args.H:
        runs.append((f"diloco H={H}", base.with_(algo="diloco", H=H, lr=LR["diloco"])))
        runs.append((f"streaming H={H}", base.with_(algo="streaming", H=H, lr=LR["streaming"])))
    return runs


def _progress(label: str) -> Any:
    def report(p: Any) -> None:
        print(
            f"  [{label}] step {p.step}/{p.steps} loss {p.loss:.4f} "
            f"{p.tokens_per_s / 1e3:.1f} ktok/s",
            file=sys.stderr,
            flush=True,
        )

    return report


_CORPUS: Any = None


def _worker_init(threads: int) -> None:
    global _CORPUS
    torch.set_num_threads(threads)
    _CORPUS = load_corpus("stdlib")


def _worker_run(label: str, cfg: SimConfig) -> SimResult:
    print(f"--- start: {label}", file=sys.stderr, flush=True)
    return simulate(cfg, corpus=_CORPUS, progress=_progress(label))


def summarize(labelled: list[tuple[str, SimResult]]) -> dict[str, Any]:
    by = dict(labelled)
    out: dict[str, Any] = {}
    ddp = next((r for label, r in labelled if r.algo == "ddp"), None)
    for label, r in labelled:
        if r.algo == "streaming" and label.startswith("streaming H="):
            key = label.split(" ", 1)[1]
            dil = by.get(f"diloco {key}")
            if dil is not None:
                out[f"streaming_vs_diloco_{key}"] = r.eval_loss / dil.eval_loss - 1
            out[f"bytes_ratio_{key.replace(' ', '_')}"] = r.bytes_ratio
        if ddp is not None and r is not ddp:
            out[f"gap_to_ddp[{label}]"] = r.eval_loss / ddp.eval_loss - 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", required=True, help="write results here")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smoke size: micro model, < 2 minutes")
    mode.add_argument(
        "--long", action="store_true", help="ddp and streaming H=30 at 1x, 2x, 4x the budget"
    )
    mode.add_argument(
        "--ablation", action="store_true", help="streaming H=30 with fp32, and with tau=0 alpha=0"
    )
    mode.add_argument("--sweep-lr", action="store_true", help="inner learning-rate sweep at H=30")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--H", type=int, nargs="+", default=[30, 100])
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--mults", type=int, nargs="+", default=[1, 2, 4], help="--long: budget multiples"
    )
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (CPU only)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")

    corpus = load_corpus("stdlib")
    runs = plan(args)
    doc: dict[str, Any] = {
        "machine": machine(),
        "corpus": corpus.describe(),
        "argv": sys.argv[1:],
        "jobs": args.jobs,
        "worker_threads": max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None,
        "runs": [],
    }
    results: list[tuple[str, SimResult]] = []
    t0 = time.perf_counter()

    def record(label: str, r: SimResult) -> None:
        r.config["label"] = label
        results.append((label, r))
        doc["runs"].append({"label": label, **r.as_dict()})
        doc["summary"] = summarize(results)
        doc["total_wall_s"] = time.perf_counter() - t0
        with open(args.json, "w") as f:  # rewritten after every run: partial results survive
            json.dump(doc, f, indent=2)

    if args.jobs > 1:
        # runs in parallel processes, one torch thread each: on a small model this beats
        # one run on all cores (less threading overhead per op); wall_s is then per run
        # under a shared machine, compare runs of one invocation only
        ctx = multiprocessing.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        with ProcessPoolExecutor(
            args.jobs, mp_context=ctx, initializer=_worker_init, initargs=(threads,)
        ) as ex:
            futures = [ex.submit(_worker_run, label, cfg) for label, cfg in runs]
            for (label, _), fut in zip(runs, futures, strict=True):
                record(label, fut.result())
    else:
        for i, (label, cfg) in enumerate(runs, 1):
            print(f"--- run {i}/{len(runs)}: {label}", file=sys.stderr, flush=True)
            record(label, simulate(cfg, corpus=corpus, progress=_progress(label)))
    print(format_table([r for _, r in results]))
    print(json.dumps(doc["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

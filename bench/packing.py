#!/usr/bin/env python3
"""Tokens per second of document batches: plain micro-batches against Karmarkar-Karp's.

A corpus of mixed lengths is built locally: the bytes of the standard library's source
(the ``stdlib`` corpus, separators removed) cut into documents whose lengths follow a
log-normal law (``--median``, ``--sigma``, seed 0), so that most are short and a few are
longer than the model's context (those are cut to it, ``atoll.node.documents``). The
model (``--preset``, with ``--seq-len`` as its context) trains on document batches of
``batch_size × seq_len`` tokens, each split into ``--micro-batches`` micro-batches (one
comparison per count given) padded to their own longest document, once per packing
(``plain``: arrival order, equal counts; ``kk:linear`` and ``kk:quadratic``:
Karmarkar-Karp balanced by that cost). The packings train side by side in one process, a
step of each in turn (the order rotating), from the same initial weights on the same
batches, so that they share the machine equally.

    python bench/packing.py --json runs/packing.json
    python bench/packing.py --steps 4 --warmup 1 --seq-len 128 --json quick.json

The JSON report holds, per micro-batch count and packing: ``tokens_per_s`` (predicted,
non-padding tokens per second of training step, packing included, from the median step
time; ``tokens_per_s_mean`` from the total), ``ratio`` (that over plain's),
``positions_per_step`` (what the model computes, padding included),
``padding_fraction`` (padding positions over all positions computed),
``mb_padded_spread`` and ``mb_time_spread`` (heaviest micro-batch over the mean, in
positions and in measured seconds of forward and backward, averaged over steps),
``step_s`` and the losses; ``loss_gap`` is the largest difference of a step's loss to
plain's (the packings compute the same gradient up to rounding, so it stays small).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from atoll.node.data import Corpus, stdlib_corpus
from atoll.node.documents import DocumentBatcher, MicroBatch
from atoll.node.model import ModelConfig, build_model, model_config
from atoll.node.train import InnerConfig, Replica

log = logging.getLogger("bench.packing")

MODES = ("plain", "kk:linear", "kk:quadratic")


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def mixed_corpus(median: float, sigma: float, seed: int = 0) -> Corpus:
    """The stdlib corpus's text cut into documents of log-normal lengths (at least 2)."""
    base = stdlib_corpus()
    text = base.train[base.train != 0]
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    total = 0
    while total < text.size:
        chunk = np.maximum(2, rng.lognormal(np.log(median), sigma, 65536).astype(np.int64))
        lengths.extend(chunk.tolist())
        total += int(chunk.sum())
    ends = np.cumsum(lengths)
    ends = ends[ends <= text.size]
    train = np.insert(text[: ends[-1]], ends[:-1], 0)  # a 0 byte after each document
    digest = hashlib.sha256(train.tobytes())
    digest.update(b"|val|")
    digest.update(base.val.tobytes())
    name = f"{base.name}-lognormal-{median:g}-{sigma:g}"
    return Corpus(name, train, base.val, digest.hexdigest())


def micro_seconds(rep: Replica, micro: list[MicroBatch]) -> list[float]:
    """Seconds of forward and backward of each micro-batch (gradients thrown away)."""
    out = []
    total = sum(mb.tokens for mb in micro)
    for mb in micro:
        t0 = time.perf_counter()
        loss = rep.model.loss(mb.inputs, mb.targets) * (mb.tokens / total)  # type: ignore[operator]
        loss.backward()
        out.append(time.perf_counter() - t0)
    rep.optimizer.zero_grad(set_to_none=True)
    return out


def compare(
    corpus: Corpus, cfg: ModelConfig, micro_batches: int, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Train one replica per packing, a step of each in turn; their figures."""
    inner = InnerConfig(warmup=max(1, args.warmup), total_steps=args.warmup + args.steps)
    reps: dict[str, Replica] = {}
    batchers: dict[str, DocumentBatcher] = {}
    for mode in args.modes:
        packing, _, cost = mode.partition(":")
        batchers[mode] = DocumentBatcher(
            corpus,
            cfg.seq_len,
            args.batch_size,
            args.seed,
            micro_batches=micro_batches,
            packing=packing,
            cost=cost or "linear",
        )
        model = build_model(cfg, args.seed)
        reps[mode] = Replica(model, inner, batchers[mode], 0, torch.device("cpu"))

    step_s: dict[str, list[float]] = {m: [] for m in args.modes}
    losses: dict[str, list[float]] = {m: [] for m in args.modes}
    for step in range(args.warmup + args.steps):
        turn = step % len(args.modes)
        for mode in args.modes[turn:] + args.modes[:turn]:
            t0 = time.perf_counter()
            losses[mode].append(reps[mode].train_step(step))
            if step >= args.warmup:
                step_s[mode].append(time.perf_counter() - t0)
        times = "  ".join(f"{m} {step_s[m][-1] if step_s[m] else 0:.2f}s" for m in args.modes)
        log.info("k=%d step %d  %s", micro_batches, step, times)

    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        useful = padded = 0
        spreads, counts = [], []
        for step in range(args.warmup, args.warmup + args.steps):
            micro = batchers[mode].micro_batches(0, step)
            sizes = [mb.padded_tokens for mb in micro]
            useful += sum(mb.tokens for mb in micro)
            padded += sum(sizes)
            spreads.append(max(sizes) / statistics.fmean(sizes))
            counts.append(len(micro))
        timing = []
        for step in range(args.timing_steps):
            secs = micro_seconds(reps[mode], batchers[mode].micro_batches(0, step))
            timing.append(max(secs) / statistics.fmean(secs))
        seconds = sum(step_s[mode])
        gaps = [abs(a - b) for a, b in zip(losses[mode], losses["plain"], strict=True)]
        median_s = statistics.median(step_s[mode])
        results[mode] = {
            "tokens_per_s": round(useful / len(step_s[mode]) / median_s, 1),
            "tokens_per_s_mean": round(useful / seconds, 1),
            "positions_per_s": round(padded / seconds, 1),
            "padding_fraction": round(1 - useful / padded, 4),
            "mb_padded_spread": round(statistics.fmean(spreads), 3),
            "mb_time_spread": round(statistics.fmean(timing), 3),
            "micro_batches": round(statistics.fmean(counts), 2),
            "positions_per_step": round(padded / len(step_s[mode])),
            "step_s": round(seconds / len(step_s[mode]), 4),
            "step_s_median": round(median_s, 4),
            "first_loss": round(losses[mode][0], 5),
            "last_loss": round(losses[mode][-1], 5),
            "loss_gap": round(max(gaps), 6),
        }
    for r in results.values():
        r["ratio"] = round(r["tokens_per_s"] / results["plain"]["tokens_per_s"], 3)
    return results


def table(by_k: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The figures as a markdown table."""
    out = [
        "| micro-batches | packing | tokens/s | vs plain | positions / step | padding | "
        "heaviest mb / mean (positions) | (seconds) | median step s | last loss |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, results in by_k.items():
        for mode, r in results.items():
            out.append(
                f"| {k} | {mode} | {r['tokens_per_s']:,.0f} | {r['ratio']:.3f} | "
                f"{r['positions_per_step']:,} | {r['padding_fraction']:.3f} | "
                f"{r['mb_padded_spread']:.2f} | {r['mb_time_spread']:.2f} | "
                f"{r['step_s_median']:.3f} | {r['last_loss']:.4f} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    p.add_argument("--seq-len", type=int, default=256, help="model context = document cap")
    p.add_argument("--batch-size", type=int, default=16, help="budget: batch × seq-len tokens")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 16])
    p.add_argument("--steps", type=int, default=8, help="timed steps per packing")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--timing-steps", type=int, default=2, help="steps of per-micro-batch timing")
    p.add_argument("--median", type=float, default=48.0, help="median document length")
    p.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma of the lengths")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if "plain" not in args.modes:
        p.error("--modes must include plain (the ratios are against it)")

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    corpus = mixed_corpus(args.median, args.sigma)
    cfg = replace(model_config(args.preset), seq_len=args.seq_len)
    sample = DocumentBatcher(corpus, cfg.seq_len, args.batch_size, args.seed)
    lengths = np.array([d.size - 1 for s in range(20) for d in sample.documents(0, s)])
    by_k = {str(k): compare(corpus, cfg, k, args) for k in args.micro_batches}
    print(table(by_k))
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "seq_len": cfg.seq_len},
        "corpus": {
            "name": corpus.name,
            "sha256": corpus.fingerprint,
            "documents": sample.documents_in_corpus,
            "documents_per_batch": round(lengths.size / 20, 1),
            "batch_length_mean": round(float(lengths.mean()), 1),
            "batch_length_percentiles": {
                str(q): float(np.percentile(lengths, q)) for q in (10, 50, 90, 99)
            },
        },
        "machine": machine(),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "by_micro_batches": by_k,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

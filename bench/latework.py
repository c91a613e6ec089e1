"""Late work kept or dropped: what offering a late peer's Δ at the newer state is worth,
in eval loss and bytes, against the plain rebase that drops it.

A peer that misses a fragment's round (a slow link, a short cut, a busy machine) meets
the swarm at its next sync one version behind. It copies the newer state either way;
then it either offers its Δ there, at a staleness discount, and joins the swarm's round
at once (``keep``, the default: :mod:`atoll.protocol.sync`, "Late work", at a quarter
of its token weight; ``full``: at its whole weight, as before that default), or drops
it and ends the sync with the copy (``drop``, ``keep_late`` off). The simulator runs both,
deterministically, on the same replicas, data and draws (:mod:`atoll.node.simattack`):
``--late`` replicas each miss every slot with probability ``--late-prob``; a run with no
late replica is the reference.

Per run: the final eval loss of replica 0's global model (never late) and its ratio to
the reference; bytes per replica (every round's all-reduce plus the state copies), and
its ratio to the reference; the slots the late replicas missed, and how many of their
syncs after a copy kept or dropped Δ; rounds applied, summed over the replicas.

    .venv/bin/python bench/latework.py --json docs/results/latework.json
    .venv/bin/python bench/latework.py --quick --json /tmp/l.json      # smoke size
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from simruns import base_config, run_all

from atoll.node.simulate import SimConfig, SimResult


def plan(args: argparse.Namespace) -> list[tuple[str, SimConfig]]:
    """Every run: label and config (the attack benchmark's budget, no attacker)."""
    runs: list[tuple[str, SimConfig]] = []
    for seed in args.seeds:
        base = base_config(args, seed)
        # the reference: the same late replicas, never late (its rounds run through the
        # same machines, so its counts are comparable)
        runs.append((f"seed {seed} none 0", base.with_(late=args.late, late_prob=0.0)))
        for prob in args.probs:
            late = base.with_(late=args.late, late_prob=prob)
            runs.append((f"seed {seed} keep {prob}", late))
            runs.append((f"seed {seed} full {prob}", late.with_(late_weight=1.0)))
            runs.append((f"seed {seed} drop {prob}", late.with_(keep_late=False)))
    return runs


def row(label: str, r: SimResult, ref: SimResult | None) -> dict[str, Any]:
    _, seed, mode, prob = label.split(" ")
    stats = r.attack or {}
    out: dict[str, Any] = {
        "seed": int(seed),
        "mode": mode,
        "late_prob": float(prob),
        "eval_loss": r.eval_loss,
        "bytes_per_replica": r.bytes_per_replica,
        "rounds_applied": stats.get("honest_applied"),
        "late_missed": stats.get("late_missed"),
        "late_kept": stats.get("late_kept"),
        "late_dropped": stats.get("late_dropped"),
        "fetch_bytes": stats.get("fetch_bytes"),
        "wall_s": r.wall_s,
    }
    if ref is not None and mode != "none":
        out["eval_vs_ref"] = r.eval_loss / ref.eval_loss
        out["bytes_vs_ref"] = r.bytes_per_replica / ref.bytes_per_replica
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'seed':>4} {'mode':<5} {'p':>5} {'eval':>7} {'vs ref':>7} {'MB/rep':>7} "
        f"{'vs ref':>7} {'applied':>7} {'missed':>6} {'kept':>5} {'dropped':>7}"
    ]
    for r in rows:
        ev = f"{r['eval_vs_ref']:.4f}" if "eval_vs_ref" in r else ""
        by = f"{r['bytes_vs_ref']:.3f}" if "bytes_vs_ref" in r else ""
        lines.append(
            f"{r['seed']:>4} {r['mode']:<5} {r['late_prob']:>5} {r['eval_loss']:>7.4f} "
            f"{ev:>7} {r['bytes_per_replica'] / 1e6:>7.3f} {by:>7} "
            f"{r['rounds_applied'] or 0:>7} {r['late_missed'] or 0:>6} "
            f"{r['late_kept'] or 0:>5} {r['late_dropped'] or 0:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", required=True, help="write the result here")
    ap.add_argument("--quick", action="store_true", help="smoke size: 4 replicas, 40 steps")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--late", type=int, default=3, help="late replicas (1 to --late)")
    ap.add_argument("--probs", default="0.25,0.5", help="each late replica's miss probability")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel processes")
    args = ap.parse_args(argv)
    if args.quick:
        args.replicas, args.late, args.steps, args.seeds, args.probs = 4, 1, 40, "0", "0.5"
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.probs = [float(p) for p in args.probs.split(",") if p]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    runs = plan(args)

    def summarise(results: dict[str, SimResult | str]) -> dict[str, Any]:
        rows = []
        for lab, _ in runs:
            r, ref = results.get(lab), results.get(f"seed {lab.split(' ')[1]} none 0")
            if isinstance(r, SimResult):
                rows.append(row(lab, r, ref if isinstance(ref, SimResult) else None))
        return {"runs": rows}

    doc = run_all(runs, jobs=args.jobs, json_path=args.json, argv=argv, summarise=summarise)
    print(table(doc["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

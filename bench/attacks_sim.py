"""Attacks in the simulator: what each attack does to the eval loss, with and without the
protections, free of the run-to-run noise of a live swarm.

The live benchmark (``bench/attacks.py``) measures bans, disrupted rounds and forged
states on real processes, but which groups form there changes from run to run, and the
honest-only eval loss of one command moved by 6% between runs: more than the 2% the
attacks are judged by. Here ``atoll simulate`` runs the same replicas with every round
through the real all-reduce machines, checks, strikes and regroups
(:mod:`atoll.node.simattack`), deterministically: an attack run differs from its
honest-only run by the attack alone, and a second seed shows how much the figure moves
with the data and the initialisation.

For each seed, each mode and each attack (``forge`` acts on state records, not rounds,
and is measured live only): an attack run with ``--attackers`` hostile replicas of
``--replicas``, and per (seed, mode) one honest-only run of the same budget.

- ``robust``: ``rule = --rule`` (trimmed mean by default), ``checks`` (parts sealed) and
  ``verify_owners`` on;
- ``mean``: the plain token-weighted mean; only what every round checks (decoding,
  size, finite values, the run's weight caps).

Per run: the final eval loss of replica 0's global model (honest) and its ratio to the
honest-only run of the same seed and mode, the honest replicas' rounds applied and
disrupted, rounds sought again, rounds applied with an attacker in the group, and per
attacker the rounds it took part in until every honest replica banned it. Targets, with
protections: eval loss within 2% of honest-only for every attack; every attacker of a
detectable attack banned within 3 of its rounds; no round applied with a hostile owner.
With no attacker: the protections cost at most 0.5% of eval loss against the plain mean.

    .venv/bin/python bench/attacks_sim.py --json docs/results/attacks-sim.json
    .venv/bin/python bench/attacks_sim.py --quick --json /tmp/a.json      # smoke size
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any

from attacks import ALL_ATTACKS  # the live benchmark's attacks (bench/attacks.py)
from simruns import base_config, run_all

from atoll.node.simulate import SimConfig, SimResult

ATTACKS = [a for a in ALL_ATTACKS if a != "forge"]
ATTACKS.insert(ATTACKS.index("weight:100") + 1, "weight:4")
"""the live benchmark's attacks but ``forge`` (it acts on state records, not rounds),
and a weight claim inside both group bounds"""
DETECTABLE = ("nan", "huge", "scaled", "weight", "equivocate", "owner")
"""attacks a check proves (the rest stay inside the spread, left to the robust rule)"""


def plan(args: argparse.Namespace) -> list[tuple[str, SimConfig]]:
    """Every run: label and config."""
    runs: list[tuple[str, SimConfig]] = []
    for seed in args.seeds:
        base = base_config(args, seed)
        for mode in args.modes:
            cfg = base.with_(rule=args.rule, checks=True, verify_owners=True)
            if mode == "mean":
                cfg = base.with_(rule="mean", checks=False, verify_owners=False)
            runs.append((f"seed {seed} {mode} none", cfg))
            for attack in args.attacks:
                runs.append(
                    (
                        f"seed {seed} {mode} {attack}",
                        cfg.with_(attack=attack, attackers=args.attackers),
                    )
                )
    return runs


def row(label: str, r: SimResult | str, honest: SimResult | str | None) -> dict[str, Any]:
    """One run's figures (``honest``: the honest-only run of its seed and mode); a run
    that diverged has an infinite eval loss and says why."""
    _, seed, mode, attack = label.split(" ")
    if isinstance(r, str):
        return {
            "seed": int(seed),
            "mode": mode,
            "attack": attack,
            "eval_loss": math.inf,
            "vs_honest": math.inf,
            "diverged": r,
        }
    stats = r.attack or {}
    out: dict[str, Any] = {
        "seed": int(seed),
        "mode": mode,
        "attack": attack,
        "eval_loss": r.eval_loss,
        "wall_s": r.wall_s,
        **{k: v for k, v in stats.items() if k not in ("attack", "bans")},
    }
    if isinstance(honest, SimResult) and attack != "none":
        out["vs_honest"] = r.eval_loss / honest.eval_loss
    return out


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pass or fail of each target over ``rows`` (robust mode only)."""
    robust = [r for r in rows if r["mode"] == "robust" and r["attack"] != "none"]
    eval_ok = [r for r in robust if r.get("vs_honest", 9) <= 1.02]
    detect = [r for r in robust if r["attack"].split(":")[0] in DETECTABLE]
    banned_ok = [
        r
        for r in detect
        if len(r.get("rounds_until_banned", {})) == r.get("attackers")
        and max(r["rounds_until_banned"].values()) <= 3
    ]
    owners = [r for r in robust if r["attack"] == "owner"]
    cost: dict[int, float] = {}
    by = {(r["seed"], r["mode"]): r for r in rows if r["attack"] == "none"}
    for (seed, mode), r in by.items():
        if mode == "robust" and (seed, "mean") in by:
            cost[seed] = r["eval_loss"] / by[(seed, "mean")]["eval_loss"]
    return {
        "eval_within_2pct": f"{len(eval_ok)}/{len(robust)}",
        "eval_misses": [
            (r["seed"], r["attack"], round(r["vs_honest"], 4)) for r in robust if r not in eval_ok
        ],
        "detectable_banned_within_3": f"{len(banned_ok)}/{len(detect)}",
        "owner_rounds_applied": sum(r.get("applied_with_attacker", 0) for r in owners),
        "protections_eval_cost": cost,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'seed':>4} {'mode':<7} {'attack':<11} {'eval':>7} {'vs honest':>9} "
        f"{'applied':>7} {'disrupt':>7} {'again':>5} {'w/att':>5} {'banned after':>14}"
    ]
    for r in rows:
        vs = f"{r['vs_honest']:.4f}" if "vs_honest" in r else ""
        banned = ",".join(str(v) for v in r.get("rounds_until_banned", {}).values())
        lines.append(
            f"{r['seed']:>4} {r['mode']:<7} {r['attack']:<11} {r['eval_loss']:>7.4f} {vs:>9} "
            f"{r.get('honest_applied', ''):>7} {r.get('honest_disrupted', ''):>7} "
            f"{r.get('sought_again', ''):>5} {r.get('applied_with_attacker', ''):>5} "
            f"{banned:>14}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", required=True, help="write the result here")
    ap.add_argument("--quick", action="store_true", help="smoke size: 4 replicas, 30 steps")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--attackers", type=int, default=2)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--modes", default="robust,mean")
    ap.add_argument("--rule", default="trimmed_mean", help="the robust mode's rule")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel processes")
    args = ap.parse_args(argv)
    if args.quick:
        args.replicas, args.attackers, args.steps, args.seeds = 4, 1, 30, "0"
        args.attacks = "nan,alie"
    args.attacks = [a for a in args.attacks.split(",") if a]
    args.modes = [m for m in args.modes.split(",") if m]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    for m in args.modes:
        if m not in ("robust", "mean"):
            ap.error(f"modes are robust and mean, not {m!r}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    runs = plan(args)  # checks every config before the first run

    def summarise(results: dict[str, SimResult | str]) -> dict[str, Any]:
        rows = []
        for lab, _ in runs:
            if lab in results:
                _, seed, mode, _ = lab.split(" ")
                rows.append(row(lab, results[lab], results.get(f"seed {seed} {mode} none")))
        return {"runs": rows, "targets": targets(rows)}

    doc = run_all(runs, jobs=args.jobs, json_path=args.json, argv=argv, summarise=summarise)
    print(table(doc["runs"]))
    print(json.dumps(doc["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attacks on a live swarm: hostile nodes, one attack at a time, with and without the
protections.

Runs a bootstrap peer and N ``atoll node`` processes on 127.0.0.1 (default 8, 2 of them
hostile through attack injection, ``ATOLL_ATTACK``; :mod:`atoll.node.net.attacks`) on the
``micro`` preset for a few syncs, once per (attack, mode):

- ``robust``: the manifest's ``[robust]`` table with ``rule = "trimmed_mean"`` (or
  ``--rule centered_clip``),
  ``checks = true`` (which also seals every part, so a refused part is proven to every
  member) and ``verify_owners = true`` (the protections);
- ``mean``: the plain token-weighted mean, no checks (the protections off);

plus an honest-only run of the same budget (every node honest) in each mode.

    .venv/bin/python bench/attacks.py --json docs/results/attacks.json
    .venv/bin/python bench/attacks.py --nodes 5 --attackers 1 --attacks huge,forge --modes robust

Per run, from the nodes' JSON summaries (``--json``) and logs (``atoll node -v``, time
stamped): the honest nodes' mean final eval loss and its ratio to the honest-only run of
the same mode; rounds disrupted (failed rounds of honest nodes, summed); rounds sought
again (a round failed on a member's proven fault and the slot's group formed anew
without it; the honest nodes' syncer lines, summed); per attacker,
which honest nodes banned it (their WARNING lines ``banned peer <id> for <s> s: <reason>``)
and how many of its own rounds (slots where it was in a group) it had taken part in when
the last honest node banned it; whether any honest node's state ever followed a forged
version (a version of 10^6 in its history); whether the honest nodes end on one copy.

Targets, pass/fail per run with protections: eval loss within 2% of
honest-only; every attacker of a detectable attack (nan, huge, scaled, weight,
equivocate, forge, owner) banned by every honest node within 3 of its rounds; no honest
node following a forged version; no honest node applying a round in which a hostile
owner took part (each member owns a chunk, so such a round committed its chunk). With
no attacker: the protections cost at most 5% of round time and 0.5% of eval loss against
the plain mean.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from atoll.node.net.attacks import FORGED_VERSION

DETECTABLE = ("nan", "huge", "scaled", "weight", "equivocate", "forge", "owner")
"""attacks a check or a certificate proves (the rest stay inside the spread)"""

ALL_ATTACKS = [
    "nan",
    "huge",
    "signflip",
    "scaled:10",
    "noise",
    "alie",
    "weight:100",
    "stale",
    "forge",
    "equivocate",
    "owner",
]

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_SLOT = re.compile(r"fragment (\d+) slot (-?\d+): (.*?); the slot's declarations")
_BAN = re.compile(r"banned peer (\S+) for (\d+) s: (.*)")
CLI = [sys.executable, "-m", "atoll.node.cli"]


def manifest(args: argparse.Namespace, mode: str) -> str:
    """The run's manifest; ``mode`` robust turns the protections on."""
    text = f"""name = "atoll-attacks"
model = "{args.preset}"
batch_size = 4
lr = 3e-3
warmup = 5
total_steps = {args.steps}
H = {args.H}
tau = 2
alpha = 0.5
codec = "e3m0"
seed = {args.seed}

[group]
min_quorum = 2
max_size = {args.nodes}
grace_s = 3.0

[timeouts]
matchmaking_s = {10.0 * args.timeout_scale}
part_s = {12.0 * args.timeout_scale}
round_s = {25.0 * args.timeout_scale}
apply_wait_s = {3.0 * args.timeout_scale}
"""
    if mode == "robust":
        text += f'\n[robust]\nrule = "{args.rule}"\nchecks = true\nverify_owners = true\n'
    return text


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True, env=env
    )


def _stop(proc: subprocess.Popen[str], timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run_swarm(
    args: argparse.Namespace, work: Path, mode: str, attack: str, attackers: int
) -> list[dict[str, Any]]:
    """One run: returns per node ``{"hostile", "summary", "log"}``."""
    work.mkdir(parents=True, exist_ok=True)
    run = work / "run.toml"
    run.write_text(manifest(args, mode))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ATOLL_ATTACK", None)
    if args.slowdown > 1.0:  # every trainer leaves the cores to the network processes
        env["ATOLL_SLOWDOWN"] = str(args.slowdown)
    addr_file = work / "bootstrap.addr"
    boot = _start(
        [
            *CLI,
            "bootstrap",
            "--identity",
            str(work / "bootstrap.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--addr-file",
            str(addr_file),
        ],
        work / "bootstrap.log",
        env,
    )
    procs: list[tuple[subprocess.Popen[str], bool]] = []
    try:
        deadline = time.monotonic() + 60
        while not (addr_file.exists() and addr_file.read_text().strip()):
            if time.monotonic() > deadline or boot.poll() is not None:
                raise RuntimeError("the bootstrap peer did not start")
            time.sleep(0.2)
        addr = addr_file.read_text().split()[0]
        for i in range(args.nodes):
            hostile = i >= args.nodes - attackers
            node_env = {**env, "ATOLL_ATTACK": attack} if hostile else env
            cmd = [
                *CLI,
                "-v",
                "node",
                "--run",
                str(run),
                "--join",
                addr,
                "--identity",
                str(work / f"node{i}.key"),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--steps",
                str(args.steps),
                "--progress",
                "none",
                "--threads",
                "1",
                "--wait-peers",
                str(args.nodes - 1),
                "--eval-batches",
                "4",
                "--json",
                str(work / f"node{i}.json"),
            ]
            procs.append((_start(cmd, work / f"node{i}.log", node_env), hostile))
        end = time.monotonic() + args.run_timeout_s
        for proc, _ in procs:
            try:
                proc.wait(max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc, _ in procs:
            _stop(proc, 30)
        _stop(boot, 10)
    out = []
    for i, (_, hostile) in enumerate(procs):
        path = work / f"node{i}.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        out.append({"hostile": hostile, "summary": summary, "log": work / f"node{i}.log"})
    return out


def _read_run(work: Path, n: int, attackers: int) -> list[dict[str, Any]]:
    """The nodes of a run already in ``work`` (``--analyse-only``)."""
    out = []
    for i in range(n):
        path = work / f"node{i}.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        out.append(
            {"hostile": i >= n - attackers, "summary": summary, "log": work / f"node{i}.log"}
        )
    return out


def _rounds_of(log: Path) -> list[float]:
    """Times of the slots where the node was in a group (applied or failed)."""
    times = []
    for line in log.read_text(errors="replace").splitlines():
        s = _SLOT.search(line)
        t = _stamp(line)
        if s is not None and t is not None and s.group(3).split(":")[0] in ("applied", "failed"):
            times.append(t)
    return times


_AGAIN = "seeking the slot's group again"
"""a syncer's line: a round failed on a member it banned, and the slot is sought again"""
_MEMBERS = re.compile(r"fragment \d+ slot -?\d+: applied; .*; members: ([^;]*)(?:; round .*)?$")


def _applied_with(log: Path, peers: set[str]) -> int:
    """How many rounds the node applied with one of ``peers`` (last 6 characters of
    their ids) among the group's members."""
    n = 0
    for line in log.read_text(errors="replace").splitlines():
        m = _MEMBERS.search(line)
        if m is not None and peers & {p.strip() for p in m.group(1).split(",")}:
            n += 1
    return n


def _bans_in(log: Path) -> list[tuple[float, str, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        b = _BAN.search(line)
        t = _stamp(line)
        if b is not None and t is not None:
            out.append((t, b.group(1), b.group(3)))
    return out


def analyse(nodes: list[dict[str, Any]], attack: str) -> dict[str, Any]:
    honest = [n for n in nodes if not n["hostile"]]
    hostile = [n for n in nodes if n["hostile"]]
    done = [n["summary"] for n in honest if n["summary"] is not None]
    evals = [s["eval_loss"] for s in done if s.get("eval_loss") is not None]
    round_s = [x for s in done for x in s["info"].get("round_s", [])]
    followed_forged = any(
        v >= FORGED_VERSION for s in done for _, v, _, _ in s["info"].get("history", [])
    )
    per_attacker = []
    honest_bans = [_bans_in(n["log"]) for n in honest]
    for a in hostile:
        peer = (a["summary"] or {}).get("peer_id") or (a["summary"] or {}).get("info", {}).get(
            "peer_id"
        )
        firsts = [min((t for t, p, _ in bans if p == peer), default=None) for bans in honest_bans]
        banned_by = sum(t is not None for t in firsts)
        rounds_until = None
        if peer and firsts and all(t is not None for t in firsts):
            last = max(t for t in firsts if t is not None)
            rounds_until = sum(1 for t in _rounds_of(a["log"]) if t <= last)
        reasons = sorted({r.split(":")[0] for bans in honest_bans for _, p, r in bans if p == peer})
        per_attacker.append(
            {
                "peer": peer,
                "banned_by": banned_by,
                "of_honest": len(honest),
                "rounds_until_banned_by_all": rounds_until,
                "ban_reasons": reasons,
            }
        )
    wrongly_banned = sorted(
        {
            p
            for bans in honest_bans
            for _, p, _ in bans
            if p not in {x["peer"] for x in per_attacker}
        }
    )
    hostile_ids = {x["peer"][-6:] for x in per_attacker if x["peer"]}
    applied_with_attackers = sum(
        _applied_with(n["log"], hostile_ids) for n in honest if n["log"].exists()
    )
    crashed = sum(
        "loss became nan" in n["log"].read_text(errors="replace")
        for n in honest
        if n["log"].exists()
    )
    return {
        "attack": attack,
        "honest_nodes": len(honest),
        "summaries": len(done),
        "honest_diverged": crashed,
        "eval_loss": sum(evals) / len(evals) if evals else None,
        "rounds_applied": sum(s.get("rounds_applied") or 0 for s in done),
        "rounds_disrupted": sum(s.get("rounds_failed") or 0 for s in done),
        "rounds_sought_again": sum(
            n["log"].read_text(errors="replace").count(_AGAIN) for n in honest if n["log"].exists()
        ),
        "mean_round_s": sum(round_s) / len(round_s) if round_s else None,
        "attackers": per_attacker,
        "honest_banned": wrongly_banned,
        "followed_forged": followed_forged,
        "applied_with_attackers": applied_with_attackers,
        "one_copy": len({s.get("global_digest") for s in done}) == 1 and len(done) == len(honest),
    }


def targets(r: dict[str, Any], honest: dict[str, Any] | None) -> dict[str, Any]:
    """Pass/fail of the targets for one protected run."""
    out: dict[str, Any] = {}
    if honest and honest.get("eval_loss") and r.get("eval_loss"):
        r["eval_ratio"] = r["eval_loss"] / honest["eval_loss"]
        out["eval_within_2pct"] = r["eval_ratio"] <= 1.02
    name = r["attack"].split(":")[0]
    if name in DETECTABLE and r["attackers"]:
        out["banned_within_3_rounds"] = all(
            a["rounds_until_banned_by_all"] is not None and a["rounds_until_banned_by_all"] <= 3
            for a in r["attackers"]
        )
    out["no_forged_state_followed"] = not r["followed_forged"]
    if name == "owner":  # every member owns a chunk: a round it was in took its chunk
        out["no_hostile_chunk_committed"] = r["applied_with_attackers"] == 0
    out["no_honest_peer_banned"] = not r["honest_banned"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--attackers", type=int, default=2)
    ap.add_argument("--attacks", default=",".join(ALL_ATTACKS))
    ap.add_argument("--modes", default="robust,mean", help="robust, mean or both")
    ap.add_argument("--no-honest", action="store_true", help="skip the honest-only runs")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-timeout-s", type=float, default=300.0)
    ap.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="every node sleeps (S - 1) times each step's compute time (ATOLL_SLOWDOWN): "
        "on a machine with fewer cores than node processes, the network processes then "
        "get the CPU they need",
    )
    ap.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        help="multiply the manifest's timeouts (a loaded machine)",
    )
    ap.add_argument(
        "--rule",
        default="trimmed_mean",
        choices=("trimmed_mean", "centered_clip"),
        help="the robust mode's combining rule (the manifest's [robust] rule)",
    )
    ap.add_argument("--workdir", help="keep the nodes' files and logs here")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument(
        "--analyse-only", action="store_true", help="read the runs already in --workdir"
    )
    args = ap.parse_args(argv)
    if not 0 <= args.attackers < args.nodes:
        ap.error("--attackers must be below --nodes")
    modes = [m for m in args.modes.split(",") if m]
    attacks = [a for a in args.attacks.split(",") if a]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="atoll-attacks-"))
    t0 = time.time()
    runs: list[dict[str, Any]] = []
    honest_of: dict[str, dict[str, Any]] = {}
    plan = [] if args.no_honest else [(m, "none", 0) for m in modes]
    plan += [(m, a, args.attackers) for a in attacks for m in modes]
    for mode, attack, attackers in plan:
        start = time.time()
        print(f"bench/attacks.py: {attack} with {mode} ...", file=sys.stderr, flush=True)
        where = work / f"{attack.replace(':', '_')}-{mode}"
        if args.analyse_only:
            nodes = _read_run(where, args.nodes, attackers)
        else:
            nodes = run_swarm(args, where, mode, attack, attackers)
        r = {"mode": mode, **analyse(nodes, attack), "wall_s": round(time.time() - start, 1)}
        if attack == "none":
            honest_of[mode] = r
        else:
            r["targets"] = targets(r, honest_of.get(mode)) if mode == "robust" else {}
            if mode == "mean" and honest_of.get("mean", {}).get("eval_loss") and r["eval_loss"]:
                r["eval_ratio"] = r["eval_loss"] / honest_of["mean"]["eval_loss"]
        runs.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    cost: dict[str, Any] = {}
    if "robust" in honest_of and "mean" in honest_of:
        a, b = honest_of["robust"], honest_of["mean"]
        if a["mean_round_s"] and b["mean_round_s"]:
            cost["round_time_ratio"] = a["mean_round_s"] / b["mean_round_s"]
            cost["round_time_within_5pct"] = cost["round_time_ratio"] <= 1.05
        if a["eval_loss"] and b["eval_loss"]:
            cost["eval_ratio"] = a["eval_loss"] / b["eval_loss"]
            cost["eval_within_half_pct"] = cost["eval_ratio"] <= 1.005
    result = {
        "command": "bench/attacks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "config": {
            k: getattr(args, k)
            for k in (
                "nodes",
                "attackers",
                "steps",
                "H",
                "preset",
                "seed",
                "modes",
                "slowdown",
                "timeout_scale",
                "rule",
            )
        },
        "wall_s": round(time.time() - t0, 1),
        "runs": runs,
        "protection_cost_without_attackers": cost,
        "not_run": sorted(
            set(a.split(":")[0] for a in ALL_ATTACKS) - {a.split(":")[0] for a in attacks}
        ),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

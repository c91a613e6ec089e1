"""Faults in a live swarm: a silent cut, two partitions and a slow uplink, on a schedule.

Runs ``atoll demo``'s swarm (a bootstrap peer and N ``atoll node`` processes, the 'tiny'
preset) with every process in a network namespace of its own, and injects a seeded fault
schedule while the nodes train:

==================  ====================================================================
phase               fault
==================  ====================================================================
warm-up             none: the fault-free round rate of every node
cut                 one node blackholed silently (no RST, no ICMP) for longer than the
                    round timeout, then healed
partition-even      N/2 | N/2, then healed
partition-lone      (N-1) | 1, then healed
asymmetric          one node's upload at 1 Mbit/s, then back to the link's rate
recover             none, after each of the above (the last one lasts until the end)
==================  ====================================================================

    sudo .venv/bin/python bench/faults.py --json runs/faults.json           # NetLab
    wanlab up 4 --rate 50mbit --delay 40ms                                   # as root
    sudo .venv/bin/python bench/faults.py --wanlab /path/to/wanlab --json runs/faults-wan.json

By default the lab is :class:`atoll.node.netlab.NetLab` (built and removed here): every
node behind a 50 Mbit/s link each way (tbf), *rate only*: a fixed delay needs netem, which
kernels built without it lack; the JSON says so. The bootstrap has its own unshaped
namespace and sides with the first (largest) group of a partition. With ``--wanlab`` the
schedule runs on wanlab instead (a separate network-namespace tool, not part of atoll; the
lab must be up with at least N nodes; rate, delay and loss as it was brought up): node i in
its namespace i, the bootstrap in node 0's (so node 0 is never the one cut).

Figures, read from the nodes' logs (``atoll node -v``: the syncer's line per slot, the
rebase and apply-wait lines, all time-stamped) and their JSON summaries (the history of
every global copy each node held: fragment, version, digest and the round's
``slot/leader``):

- per phase and node: rounds applied per minute, and against the warm-up's rate;
  rebases; apply-deadline waits (the trainer's waits that ran out);
- per heal: seconds to the first round with every node in it, and per fragment which of
  its rounds after the heal that was (rounds of the recovery phase only: none there is
  null), counted twice: over the rounds committed after the heal, and over those whose
  group formed after it (the commit time less the round's logged duration; a round
  still running at the heal was formed without the other side and cannot include it);
- forks: one slot of one fragment applied by two groups (different leaders), inside a
  partition (or within one round timeout after its heal) and outside, separately;
- whether every node ends on one global copy (``global_digest``), and hangs (a node that
  had not exited ``--hang-s`` after the first node finished).

Targets (pass/fail): during the cut the others keep >= 80% of their fault-free round
rate; each partition side holding a quorum keeps committing (>= 2 rounds of its own);
every node in one round again within 2 rounds (of each fragment, formed after the heal,
counted by slot: two sides' groups of one slot are one round of the swarm) after each
heal; no fork outside partitions; one copy at the end; no hang.

The schedule lasts about 8 minutes (``--warmup-s 60 --fault-s 50 --recover-s 60``; the cut
1.5 round timeouts, 60 s): a recovery phase holds about three rounds of each fragment.
The nodes train ``--steps`` steps, by default enough for the schedule and 30 s more at
``--step-rate`` steps per second (2.4: the fastest seen of 4 nodes with their network
processes on 2 idle cores, 1.4-2.3 on other days; a slower machine trains on past the
schedule's end without faults, a faster one would leave the last phases without nodes
and the end-of-run copies without the peers that left); a phase the run did not reach is
marked ``cut_short``.
After the last step every node settles (up to twice matchmaking plus round timeout), so a
run takes the schedule, that and the start: 11 minutes on a fast day, up to 18 on a
slow one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from atoll.node.demo import DemoConfig, run_demo
from atoll.node.netlab import NetLab, available

log = logging.getLogger("bench.faults")

MIN_QUORUM = 2  # the demo's manifest
ASYM_UP = "1mbit"
START_TIMEOUT_S = 300.0  # every node training, on a busy 2-core machine

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_SLOT = re.compile(r"fragment (\d+) slot (-?\d+): (.*?); the slot's declarations")
_REBASED = re.compile(r"fragment (\d+) rebased to version (\d+)")
_WAIT = re.compile(r"fragment (\d+): no result within")
_TOOK = re.compile(r"; round (\d+(?:\.\d+)?) s$")
_TRAINS = re.compile(r"trains from step (\d+)")


# -- the labs ----------------------------------------------------------------------------------
class Faults(Protocol):
    """What the schedule does to the network (node indices are the demo's)."""

    def cut(self, i: int) -> None: ...
    def heal(self, i: int) -> None: ...
    def partition(self, groups: Sequence[Sequence[int]]) -> None: ...
    def heal_all(self) -> None: ...
    def shape(self, i: int, up: str, down: str) -> None: ...
    def kill(self, i: int) -> None: ...


class LabFaults:
    """Faults on a :class:`NetLab` of ``nodes + 1`` namespaces (the last: the bootstrap)."""

    def __init__(self, lab: NetLab, nodes: int) -> None:
        self.lab = lab
        self.nodes = nodes

    def cut(self, i: int) -> None:
        self.lab.cut(i)

    def heal(self, i: int) -> None:
        self.lab.heal(i)

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        # the bootstrap sides with the first group: every machine is on one side
        self.lab.partition([[*groups[0], self.nodes], *groups[1:]])

    def heal_all(self) -> None:
        self.lab.heal_all()

    def shape(self, i: int, up: str, down: str) -> None:
        self.lab.shape(i, rate_up=up, rate_down=down)

    def kill(self, i: int) -> None:
        for pid in self.lab.pids(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class WanlabFaults:
    """Faults through the wanlab tool (its lab must be up)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _do(self, *args: str) -> None:
        cmd = [self.path, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")

    def cut(self, i: int) -> None:
        self._do("cut", str(i))

    def heal(self, i: int) -> None:
        self._do("heal", str(i))

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        self._do("partition", *(",".join(map(str, g)) for g in groups))

    def heal_all(self) -> None:
        self._do("heal")

    def shape(self, i: int, up: str, down: str) -> None:
        self._do("shape", str(i), "--up", up, "--down", down)

    def kill(self, i: int) -> None:
        self._do("kill", str(i))


# -- the schedule ------------------------------------------------------------------------------
@dataclass
class Phase:
    """One phase of the schedule, and when it really ran (wall clock, ``time.time``)."""

    name: str
    fault: str
    """none, cut, partition or asymmetric"""
    seconds: float
    nodes: list[list[int]] = field(default_factory=list)
    """cut and asymmetric: [[node]]; partition: the groups"""
    start: float | None = None
    end: float | None = None
    cut_short: bool = False
    """the run ended (or failed) before the phase's planned end"""


def plan(
    n: int,
    seed: int,
    *,
    warmup_s: float,
    fault_s: float,
    recover_s: float,
    cut_s: float,
    spare: Sequence[int] = (),
) -> list[Phase]:
    """The seeded schedule for ``n`` nodes; nodes in ``spare`` are never the one cut."""
    rng = random.Random(seed)
    nodes = list(range(n))
    cut = rng.choice([i for i in nodes if i not in spare])
    order = nodes[:]
    rng.shuffle(order)
    even = [sorted(order[: n // 2]), sorted(order[n // 2 :])]
    lone = rng.choice(nodes)
    asym = rng.choice(nodes)
    return [
        Phase("warm-up", "none", warmup_s),
        Phase("cut", "cut", cut_s, [[cut]]),
        Phase("recover-cut", "none", recover_s),
        Phase("partition-even", "partition", fault_s, even),
        Phase("recover-even", "none", recover_s),
        Phase("partition-lone", "partition", fault_s, [[i for i in nodes if i != lone], [lone]]),
        Phase("recover-lone", "none", recover_s),
        Phase("asymmetric", "asymmetric", fault_s, [[asym]]),
        Phase("recover-end", "none", recover_s),
    ]


class Runner(threading.Thread):
    """Runs the schedule once every node trains, then watches for hangs."""

    def __init__(
        self,
        faults: Faults,
        phases: list[Phase],
        work: Path,
        n: int,
        *,
        rate: str,
        hang_s: float,
    ) -> None:
        super().__init__(name="fault-schedule", daemon=True)
        self.faults = faults
        self.phases = phases
        self.work = work
        self.n = n
        self.rate = rate
        self.hang_s = hang_s
        self.done = threading.Event()
        """set when the demo returned"""
        self.trained_at: float | None = None
        self.hung: list[int] = []
        self.error: str | None = None

    def _all_training(self) -> bool:
        for i in range(self.n):
            path = self.work / f"node{i}.log"
            if not path.exists() or "trains from step" not in path.read_text(errors="replace"):
                return False
        return True

    def _finished(self) -> list[int]:
        return [i for i in range(self.n) if (self.work / f"node{i}.json").exists()]

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            log.exception("the fault schedule failed")
            try:
                self.faults.heal_all()
            except Exception:
                log.exception("healing after the failure failed too")

    def _run(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._all_training():
            if self.done.wait(0.5) or time.monotonic() > deadline:
                self.error = "the nodes did not all start training"
                return
        self.trained_at = time.time()
        log.info("every node trains: the fault schedule starts")
        for k, phase in enumerate(self.phases):
            phase.start = time.time()
            self._apply(phase)
            last = k == len(self.phases) - 1
            ended = self.done.wait(None if last else phase.seconds)
            self._undo(phase)
            phase.end = time.time()
            if ended and not last:
                phase.cut_short = True
                break
            if last and phase.end - phase.start < phase.seconds:
                phase.cut_short = True
        # (the last phase ends with the demo; the hang watch runs from the main thread)

    def watch(self) -> None:
        """Until the demo returns: a node not done ``hang_s`` after the first one finished
        is killed and counted as hung."""
        first: float | None = None
        while not self.done.wait(2.0):
            finished = self._finished()
            if finished and first is None:
                first = time.monotonic()
            if first is not None and time.monotonic() - first > self.hang_s:
                self.hung = [i for i in range(self.n) if i not in finished]
                for i in self.hung:
                    log.warning(
                        "node %d did not finish %.0f s after the first: killed", i, self.hang_s
                    )
                    self.faults.kill(i)
                return

    def _apply(self, phase: Phase) -> None:
        log.info("phase %s (%s %s) for %.0f s", phase.name, phase.fault, phase.nodes, phase.seconds)
        if phase.fault == "cut":
            self.faults.cut(phase.nodes[0][0])
        elif phase.fault == "partition":
            self.faults.partition(phase.nodes)
        elif phase.fault == "asymmetric":
            self.faults.shape(phase.nodes[0][0], ASYM_UP, self.rate)

    def _undo(self, phase: Phase) -> None:
        if phase.fault == "cut":
            self.faults.heal(phase.nodes[0][0])
        elif phase.fault == "partition":
            self.faults.heal_all()
        elif phase.fault == "asymmetric":
            self.faults.shape(phase.nodes[0][0], self.rate, self.rate)


# -- reading the run ---------------------------------------------------------------------------
@dataclass
class Events:
    """One node's time-stamped events, from its log."""

    applied: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, fragment, slot) of every round it applied"""
    formed: dict[tuple[int, int], float] = field(default_factory=dict)
    """(fragment, slot) -> when the group of the round it applied formed: the commit's
    time less the round's logged duration (forming to commit; older logs do not state it)"""
    rebases: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    """apply-deadline waits that ran out"""


def read_log(path: Path) -> Events:
    ev = Events()
    if not path.exists():
        return ev
    for line in path.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if (s := _SLOT.search(line)) is not None:
            if s.group(3) == "applied":
                ev.applied.append((t, int(s.group(1)), int(s.group(2))))
                if (took := _TOOK.search(line)) is not None:
                    ev.formed[int(s.group(1)), int(s.group(2))] = t - float(took.group(1))
        elif _REBASED.search(line):
            ev.rebases.append(t)
        elif _WAIT.search(line):
            ev.waits.append(t)
    return ev


@dataclass
class Round:
    """One committed round: a group's commit of one slot of one fragment."""

    fragment: int
    slot: int
    leader: str
    members: dict[int, float] = field(default_factory=dict)
    """node -> when it logged the commit"""
    digests: set[str] = field(default_factory=set)
    formed: dict[int, float] = field(default_factory=dict)
    """node -> when its group formed, by its log (older logs do not say)"""

    @property
    def time(self) -> float:
        return min(self.members.values())

    @property
    def formed_at(self) -> float | None:
        """When the group formed (the earliest member's account), None if no log says."""
        return min(self.formed.values()) if self.formed else None


def rounds_of(events: list[Events], summaries: list[dict[str, Any] | None]) -> list[Round]:
    """Every committed round, from the nodes' logged commits joined with their histories
    (the same fragment and slot, in order), sorted by time."""
    found: dict[tuple[int, int, str], Round] = {}
    for i, (ev, s) in enumerate(zip(events, summaries, strict=True)):
        history = (s or {}).get("info", {}).get("history", [])
        pending: dict[tuple[int, int], list[tuple[str, str]]] = {}
        for p, _version, digest, how in history:
            if how == "rebase":
                continue
            at, _, leader = str(how).partition("/")
            pending.setdefault((int(p), int(at)), []).append((leader, digest))
        for t, p, slot in ev.applied:
            queue = pending.get((p, slot))
            leader, digest = queue.pop(0) if queue else ("?", "")
            r = found.setdefault((p, slot, leader), Round(p, slot, leader))
            r.members[i] = t
            if (formed := ev.formed.get((p, slot))) is not None:
                r.formed[i] = formed
            if digest:
                r.digests.add(digest)
    return sorted(found.values(), key=lambda r: r.time)


def _in(t: float, start: float, end: float) -> bool:
    return start <= t < end


def analyse(
    phases: list[Phase],
    events: list[Events],
    summaries: list[dict[str, Any] | None],
    *,
    round_timeout_s: float,
    fragments: int,
) -> dict[str, Any]:
    """The figures and targets of the module docstring."""
    n = len(events)
    rounds = rounds_of(events, summaries)
    ran = [ph for ph in phases if ph.start is not None and ph.end is not None]
    base: dict[int, float] = {}
    out_phases = []
    for ph in ran:
        assert ph.start is not None and ph.end is not None
        minutes = max(ph.end - ph.start, 1e-9) / 60
        per_min = {
            i: sum(_in(t, ph.start, ph.end) for t, _, _ in events[i].applied) / minutes
            for i in range(n)
        }
        if ph.name == "warm-up":
            base = per_min
        inside = [r for r in rounds if _in(r.time, ph.start, ph.end)]
        entry: dict[str, Any] = {
            "name": ph.name,
            "fault": ph.fault,
            "nodes": ph.nodes,
            "start": ph.start,
            "end": ph.end,
            "seconds": round(ph.end - ph.start, 1),
            "cut_short": ph.cut_short,
            "rounds_per_min": {i: round(v, 2) for i, v in per_min.items()},
            "vs_fault_free": {
                i: round(per_min[i] / base[i], 3) if base.get(i) else None for i in range(n)
            },
            "rebases": {
                i: sum(_in(t, ph.start, ph.end) for t in events[i].rebases) for i in range(n)
            },
            "apply_waits": {
                i: sum(_in(t, ph.start, ph.end) for t in events[i].waits) for i in range(n)
            },
            "rounds": len(inside),
            "full_rounds": sum(len(r.members) == n for r in inside),
            "group_sizes": [len(r.members) for r in inside],
        }
        if ph.fault == "partition":
            entry["sides"] = [
                {
                    "nodes": side,
                    "quorum": len(side) >= MIN_QUORUM,
                    "rounds": sum(set(r.members) <= set(side) for r in inside),
                }
                for side in ph.nodes
            ]
        if ph.fault != "none":
            after = ran[ran.index(ph) + 1] if ran.index(ph) + 1 < len(ran) else None
            until = after.end if after is not None and after.fault == "none" else None
            entry["heal"] = _after_heal(rounds, ph.end, n, fragments, until)
        out_phases.append(entry)

    forks = _forks(rounds, ran, round_timeout_s)
    digests = [(s or {}).get("global_digest") for s in summaries]
    by_name = {p["name"]: p for p in out_phases}
    targets = _targets(by_name, phases, forks, digests)
    return {
        "phases": out_phases,
        "fault_free_rounds_per_min": {i: round(v, 2) for i, v in base.items()},
        "forks": forks,
        "global_digests": digests,
        "one_copy": targets["one copy at the end"]["pass"],
        "rounds": [
            {
                "fragment": r.fragment,
                "slot": r.slot,
                "leader": r.leader[-6:],
                "members": sorted(r.members),
                "time": round(r.time, 3),
                "formed": round(r.formed_at, 3) if r.formed_at is not None else None,
                "digests": sorted(d[:12] for d in r.digests),
            }
            for r in rounds
        ],
        "targets": targets,
    }


def _after_heal(
    rounds: list[Round], healed: float, n: int, fragments: int, until: float | None
) -> dict[str, Any]:
    """The first round of every node after the heal at ``healed``, and per fragment which
    of its rounds that was; only rounds up to ``until`` (the end of the recovery phase,
    before the next fault) count: a full round that comes only after another fault is
    None, not a late number.

    Two counts per fragment: of the rounds *committed* after the heal
    (``rounds_to_full_per_fragment``), and of those whose group *formed* after it
    (``..._formed_after``, the target's count). A group formed before the heal could not
    hold a peer on the other side of the cut; its round, still running at the heal, is
    none of the rounds the swarm had to regroup in. After a 2|2 split both sides' rounds
    often commit in the first seconds after the heal; rounds are short (0.2-1 s from
    forming to commit on a 50 Mbit/s, 40 ms link), so most of them formed after the heal
    too, before the sides saw each other, and both counts keep them. A round no log gives a
    forming time for counts as formed after the heal (as the commit count does).

    The target's count (``slots_to_full_per_fragment``) takes the rounds formed after the
    heal by slot: the swarm's rounds of a fragment are its slots, and the two groups in
    which a split's sides commit the same slot, formed in the moment before they saw each
    other, are one round of the swarm, split (the fork count names them)."""
    after = [r for r in rounds if r.time >= healed and (until is None or r.time <= until)]
    full = next((r for r in after if len(r.members) == n), None)

    def which(counted: list[Round]) -> dict[int, int | None]:
        per_fragment: dict[int, int | None] = {}
        for p in range(fragments):
            mine = [r for r in counted if r.fragment == p]
            per_fragment[p] = next((k for k, r in enumerate(mine, 1) if len(r.members) == n), None)
        return per_fragment

    def slots(counted: list[Round]) -> dict[int, int | None]:
        per_fragment: dict[int, int | None] = {}
        for p in range(fragments):
            seen: list[int] = []
            per_fragment[p] = None
            for r in (r for r in counted if r.fragment == p):
                if r.slot not in seen:
                    seen.append(r.slot)
                if len(r.members) == n:
                    per_fragment[p] = seen.index(r.slot) + 1
                    break
        return per_fragment

    formed_after = [r for r in after if r.formed_at is None or r.formed_at >= healed]
    return {
        "slots_to_full_per_fragment": slots(formed_after),
        "seconds_to_full_round": round(full.time - healed, 1) if full else None,
        "rounds_to_full_per_fragment": which(after),
        "rounds_to_full_per_fragment_formed_after": which(formed_after),
        "rounds_formed_before_the_heal": len(after) - len(formed_after),
    }


def _forks(rounds: list[Round], phases: list[Phase], round_timeout_s: float) -> dict[str, Any]:
    by_slot: dict[tuple[int, int], list[Round]] = {}
    for r in rounds:
        by_slot.setdefault((r.fragment, r.slot), []).append(r)
    windows = [
        (ph.start, ph.end + round_timeout_s)
        for ph in phases
        if ph.fault == "partition" and ph.start is not None and ph.end is not None
    ]
    inside: list[dict[str, Any]] = []
    outside: list[dict[str, Any]] = []
    for (p, slot), group in sorted(by_slot.items()):
        if len(group) < 2:
            continue
        t = min(r.time for r in group)
        fork = {
            "fragment": p,
            "slot": slot,
            "time": round(t, 3),
            "groups": [sorted(r.members) for r in group],
        }
        (inside if any(a <= t < b for a, b in windows) else outside).append(fork)
    return {"inside_partitions": inside, "outside_partitions": outside}


def _targets(
    by_name: dict[str, dict[str, Any]],
    phases: list[Phase],
    forks: dict[str, Any],
    digests: list[str | None],
) -> dict[str, dict[str, Any]]:
    """Each target of the module docstring: passed or not, and the figures behind it.
    ``digests``: each node's final global digest (None: the node reported none)."""
    targets: dict[str, dict[str, Any]] = {}
    cut = by_name.get("cut")
    if cut is not None:
        victim = cut["nodes"][0][0]
        others = {i: v for i, v in cut["vs_fault_free"].items() if i != victim}
        ok = all(v is not None and v >= 0.8 for v in others.values())
        targets["cut: others keep >= 80% of their round rate"] = {"pass": ok, "detail": others}
    sides = []
    for name in ("partition-even", "partition-lone"):
        ph = by_name.get(name)
        if ph is not None:
            sides += [(name, s) for s in ph["sides"] if s["quorum"]]
    if sides:
        targets["partitions: every quorum side keeps committing (>= 2 rounds)"] = {
            "pass": all(s["rounds"] >= 2 for _, s in sides),
            "detail": {f"{name} {s['nodes']}": s["rounds"] for name, s in sides},
        }
    heals = {p["name"]: p["heal"] for p in by_name.values() if "heal" in p}
    if heals:
        ok = all(
            all(k is not None and k <= 2 for k in h["slots_to_full_per_fragment"].values())
            for h in heals.values()
        )
        targets["heals: every node in one round within 2 rounds"] = {"pass": ok, "detail": heals}
    targets["no fork outside partitions"] = {
        "pass": not forks["outside_partitions"],
        "detail": len(forks["outside_partitions"]),
    }
    copies = {d for d in digests if d is not None}
    targets["one copy at the end"] = {
        "pass": None not in digests and len(copies) == 1,
        "detail": {"copies": len(copies), "nodes without one": digests.count(None)},
    }
    short = [ph.name for ph in phases if ph.cut_short and ph.name != "recover-end"]
    targets["every phase ran to its end"] = {"pass": not short, "detail": short}
    return targets


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4, help="2 to 6 (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="picks the nodes each fault hits")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--H", type=int, default=30)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--codec", default="e3m0")
    ap.add_argument(
        "--rate",
        default="50mbit",
        help="every node's link, each way (with --wanlab: the rate the lab was brought up "
        "with; the slow uplink's node returns to it)",
    )
    ap.add_argument("--timeouts-scale", type=float, default=1.0)
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--fault-s", type=float, default=50.0)
    ap.add_argument("--recover-s", type=float, default=60.0)
    ap.add_argument("--steps", type=int, help="steps per node (default: from --step-rate)")
    ap.add_argument("--step-rate", type=float, default=2.4, help="expected steps/s per node")
    ap.add_argument("--hang-s", type=float, help="default: the end-of-run settle bound + 120")
    ap.add_argument("--wanlab", help="path of the wanlab tool (its lab must be up)")
    ap.add_argument("--workdir", help="keep the nodes' files and logs here")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not 2 <= args.nodes <= 6:
        ap.error("--nodes must be 2 to 6")
    if args.wanlab is None and (why := available()) is not None:
        print(f"bench/faults.py: {why}", file=sys.stderr)
        return 2

    scale = args.timeouts_scale
    round_s, matchmaking_s = 40.0 * scale, 15.0 * scale  # the demo's manifest
    cut_s = max(args.fault_s, 1.5 * round_s)
    phases = plan(
        args.nodes,
        args.seed,
        warmup_s=args.warmup_s,
        fault_s=args.fault_s,
        recover_s=args.recover_s,
        cut_s=cut_s,
        spare=(0,) if args.wanlab else (),
    )
    planned_s = sum(ph.seconds for ph in phases)
    # the schedule plus 30 s: nodes that train faster cut the last phases short (reported)
    steps = args.steps or math.ceil(args.step_rate * (planned_s + 30) / args.H) * args.H
    hang_s = args.hang_s or 2 * (matchmaking_s + round_s) + 120.0
    keep = args.workdir is not None
    work = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="atoll-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("node*.json"):
        old.unlink()
    log.info(
        "%d nodes, %d steps; schedule %.0f s: %s",
        args.nodes,
        steps,
        planned_s,
        ", ".join(f"{ph.name} {ph.seconds:.0f} s {ph.nodes or ''}" for ph in phases),
    )

    t0 = time.time()
    lab: NetLab | None = None
    try:
        if args.wanlab:
            faults: Faults = WanlabFaults(args.wanlab)
            faults.heal_all()
        else:
            lab = NetLab(args.nodes + 1)
            for i in range(args.nodes):
                lab.shape(i, rate_up=args.rate, rate_down=args.rate)
            faults = LabFaults(lab, args.nodes)
        cfg = DemoConfig(
            nodes=args.nodes,
            steps=steps,
            preset=args.preset,
            H=args.H,
            tau=args.tau,
            codec=args.codec,
            batch_size=args.batch_size,
            workdir=str(work),
            wanlab=args.wanlab,
            lab=lab,
            timeouts_scale=scale,
            refresh_s=15.0,
        )
        runner = Runner(faults, phases, work, args.nodes, rate=args.rate, hang_s=hang_s)
        runner.start()
        watcher = threading.Thread(target=runner.watch, name="hang-watch", daemon=True)
        watcher.start()
        try:
            summary = run_demo(cfg)
        finally:
            runner.done.set()
            runner.join(60)
            watcher.join(10)
        events = [read_log(work / f"node{i}.log") for i in range(args.nodes)]
        summaries = [_load(work / f"node{i}.json") for i in range(args.nodes)]
        figures = analyse(
            phases,
            events,
            summaries,
            round_timeout_s=round_s,
            fragments=_fragments(summaries),
        )
    finally:
        if lab is not None:
            lab.close()
    exits = [n["exit_code"] for n in summary["nodes"]]
    hangs = sorted(set(runner.hung) | {i for i, s in enumerate(summaries) if s is None})
    figures["targets"]["no hang"] = {"pass": not hangs, "detail": hangs}
    if runner.error:
        figures["targets"]["the schedule ran"] = {"pass": False, "detail": runner.error}
    result = {
        "bench": "faults",
        "command": " ".join([sys.executable, *sys.argv]),
        "mode": "wanlab" if args.wanlab else "netlab",
        "network": (
            {"lab": "wanlab", "link": "as `wanlab up` set it", "asymmetric_up": ASYM_UP}
            if args.wanlab
            else {
                "lab": "NetLab",
                "rate_each_way": args.rate,
                "delay": None,
                "note": "rate only (tbf): no delay, netem is absent from this kernel",
                "asymmetric_up": ASYM_UP,
                "bootstrap": "own namespace, unshaped; sides with the first group",
            }
        ),
        "seed": args.seed,
        "started": t0,
        "wall_s": round(time.time() - t0, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg(),
        },
        "config": {
            "nodes": args.nodes,
            "steps": steps,
            "preset": args.preset,
            "H": args.H,
            "tau": args.tau,
            "round_timeout_s": round_s,
            "hang_s": hang_s,
        },
        "schedule": [asdict(ph) for ph in phases],
        "training_started": runner.trained_at,
        "exit_codes": exits,
        "hangs": hangs,
        **figures,
        "nodes": [
            {
                k: (s or {}).get(k)
                for k in (
                    "steps",
                    "final_step",
                    "wall_s",
                    "rounds_applied",
                    "rounds_failed",
                    "rounds_alone",
                    "rebases",
                    "waits_run_out",
                    "met_already",
                    "steps_jumped",
                    "net_wait_s",
                    "eval_loss",
                    "settled",
                    "settle_detail",
                    "global_digest",
                )
            }
            for s in summaries
        ],
        "summary": summary,
    }
    _print(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(t["pass"] for t in result["targets"].values()) else 1


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data


def _fragments(summaries: list[dict[str, Any] | None]) -> int:
    seen = {int(h[0]) for s in summaries if s for h in s.get("info", {}).get("history", [])}
    return max(seen) + 1 if seen else 1


def _print(r: dict[str, Any]) -> None:
    print(f"\nfaults ({r['mode']}, seed {r['seed']}): {r['wall_s']:.0f} s")
    print(f"  fault-free rounds/min per node: {r['fault_free_rounds_per_min']}")
    for p in r["phases"]:
        short = " (cut short)" if p["cut_short"] else ""
        print(
            f"  {p['name']:<15}{p['seconds']:>6.0f} s{short} {p['nodes'] or ''}: rounds/min "
            f"{p['rounds_per_min']}, vs fault-free {p['vs_fault_free']}; rounds {p['rounds']} "
            f"({p['full_rounds']} full); rebases {p['rebases']}; apply waits {p['apply_waits']}"
        )
        if "sides" in p:
            print(f"  {'':<15}sides: {p['sides']}")
        if "heal" in p:
            print(f"  {'':<15}after the heal: {p['heal']}")
    print(f"  forks: {r['forks']}")
    print(f"  one copy at the end: {r['one_copy']}; hangs: {r['hangs']}")
    for name, t in r["targets"].items():
        print(f"  [{'pass' if t['pass'] else 'FAIL'}] {name}: {t['detail']}")


if __name__ == "__main__":
    sys.exit(main())

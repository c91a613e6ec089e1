"""A real swarm under network faults: the demo's bootstrap and 4 ``atoll node`` processes,
each in a namespace of a :class:`~atoll.node.netlab.NetLab` (the bootstrap in a fifth).

One run, with a schedule that a thread drives while the nodes train (short timeouts:
round 16 s), read afterwards from the nodes' logs (their time-stamped "fragment P slot S:
applied" lines) and JSON summaries (the history of every global copy each held, with the
round's ``slot/leader``):

1. every node applies a first round;
2. node 3 is cut silently (no RST, no ICMP) for longer than the round timeout: the other
   three must still apply rounds meanwhile; then it is healed and must rejoin (a round it
   shares with another node);
3. a 2|2 partition (the bootstrap with nodes 0 and 1), then healed; the nodes train on
   for a while and are then asked to finish (SIGUSR1: at a time, not a step count, so
   that a fast machine does not end the run before the faults are over): every node must
   end on one global copy (``global_digest``), and every process must exit 0.

Each step waits on what the logs show, with deadlines. Skipped, with the reason, where
the lab cannot be built.
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from atoll.node import netlab
from atoll.node.demo import DemoConfig, run_demo

REASON = netlab.available()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(900),
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

NODES = 4
VICTIM = 3
SIDES = [[0, 1], [2, 3]]
SCALE = 0.4  # the demo's timeouts x 0.4: matchmaking 6 s, part 8 s, round 16 s
ROUND_S = 40.0 * SCALE
CUT_S = 1.5 * ROUND_S  # at least; longer until the others applied 2 rounds (at most 60 s)
PARTITION_S = 20.0  # at least; longer until each side applied a round (at most 60 s)
TAIL_S = 30.0  # the nodes must train on at least this long after the partition heals
FINISH_S = TAIL_S + 15.0  # then they are asked to finish
STEPS = 3000  # more than the schedule takes on any machine: the schedule ends the run
H = 24  # a sync every 8 steps (3 fragments)

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_APPLIED = re.compile(r"fragment (\d+) slot (\d+): applied;")


def applied(work: Path, i: int) -> list[tuple[float, int, int]]:
    """(time, fragment, slot) of every round node ``i`` logged as applied."""
    path = work / f"node{i}.log"
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        m, a = _STAMP.match(line), _APPLIED.search(line)
        if m and a:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((t, int(a.group(1)), int(a.group(2))))
    return out


def ended(work: Path, i: int) -> float | None:
    """When node ``i`` logged the end of its run."""
    path = work / f"node{i}.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        m = _STAMP.match(line)
        if m and "end of run" in line:
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def training(work: Path, i: int) -> bool:
    path = work / f"node{i}.log"
    return path.exists() and "trains from step" in path.read_text(errors="replace")


class Schedule(threading.Thread):
    """Drives the faults while the demo runs; ``marks`` holds when each one happened."""

    def __init__(self, lab: netlab.NetLab, work: Path) -> None:
        super().__init__(name="faults", daemon=True)
        self.lab = lab
        self.work = work
        self.marks: dict[str, float] = {}
        self.notes: list[str] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        """set when the demo returned"""
        self.finish = threading.Event()
        """set when the nodes are to finish their run (the schedule is over, or failed)"""

    def run(self) -> None:
        try:
            self._run()
            self._until(lambda: time.time() - self.marks["healed"] >= FINISH_S, 60, "the tail")
        except BaseException as e:
            self.error = e
            self.lab.heal_all()
        finally:
            self.finish.set()

    def _until(self, cond: Callable[[], bool], timeout_s: float, what: str) -> bool:
        """Wait for ``cond`` (polling the logs); False when ``timeout_s`` ran out.
        RuntimeError when the run ended first."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.done.is_set():
                raise RuntimeError(f"the run ended before {what}")
            if time.monotonic() > deadline:
                self.notes.append(f"not within {timeout_s:.0f} s: {what}")
                return False
            self.done.wait(0.5)
        return True

    def _hold(
        self, at_least_s: float, cond: Callable[[], bool], at_most_s: float, what: str
    ) -> None:
        start = time.monotonic()
        self._until(lambda: time.monotonic() - start >= at_least_s, at_least_s + 5, what)
        self._until(cond, at_most_s - at_least_s, what)

    def _since(self, i: int, mark: str) -> list[tuple[float, int, int]]:
        return [a for a in applied(self.work, i) if a[0] >= self.marks[mark]]

    def _run(self) -> None:
        w = self.work
        if not self._until(lambda: all(training(w, i) for i in range(NODES)), 300, "training"):
            raise RuntimeError("the nodes did not all start training")
        self._until(lambda: all(applied(w, i) for i in range(NODES)), 120, "a first round")
        self.lab.cut(VICTIM)
        self.marks["cut"] = time.time()
        others = [i for i in range(NODES) if i != VICTIM]
        self._hold(
            CUT_S,
            lambda: all(len(self._since(i, "cut")) >= 2 for i in others),
            60,
            "2 rounds of the others during the cut",
        )
        self.lab.heal(VICTIM)
        self.marks["heal"] = time.time()

        def rejoined() -> bool:
            mine = {(p, s) for _, p, s in self._since(VICTIM, "heal")}
            return any(mine & {(p, s) for _, p, s in self._since(i, "heal")} for i in others)

        self._until(rejoined, 75, "node 3 in a round again")
        self.lab.partition([[*SIDES[0], NODES], SIDES[1]])  # the bootstrap sides with 0, 1
        self.marks["partition"] = time.time()
        self._hold(
            PARTITION_S,
            lambda: all(any(self._since(i, "partition")) for i in range(NODES)),
            60,
            "a round on each side of the partition",
        )
        self.lab.heal_all()
        self.marks["healed"] = time.time()


@dataclass
class Run:
    marks: dict[str, float]
    notes: list[str]
    work: Path
    summary: dict[str, Any]
    nodes: list[dict[str, Any]] = field(default_factory=list)

    def applied(self, i: int, start: str, end: str) -> list[tuple[float, int, int]]:
        return [a for a in applied(self.work, i) if self.marks[start] <= a[0] < self.marks[end]]

    def round_of(self, i: int, p: int, slot: int) -> str | None:
        """``slot/leader`` of node ``i``'s last commit of fragment ``p``'s slot."""
        found = None
        for q, _, _, how in self.nodes[i]["info"]["history"]:
            if q == p and how != "rebase" and how.split("/")[0] == str(slot):
                found = how
        return found

    def tails(self) -> str:
        return "\n".join(
            f"--- node{i}\n"
            + "\n".join((self.work / f"node{i}.log").read_text().splitlines()[-15:])
            for i in range(NODES)
        )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    work = tmp_path_factory.mktemp("faults")
    with netlab.NetLab(NODES + 1) as lab:
        cfg = DemoConfig(
            nodes=NODES,
            steps=STEPS,
            H=H,
            tau=4,
            lab=lab,
            workdir=str(work),
            timeouts_scale=SCALE,
            refresh_s=5.0,
        )
        schedule = Schedule(lab, work)
        schedule.start()
        try:
            summary = run_demo(cfg, out=io.StringIO(), finish=schedule.finish)
        finally:
            schedule.done.set()
            schedule.join(30)
    if schedule.error is not None:  # the tests say what the marks missing mean
        schedule.notes.append(f"the fault schedule stopped: {schedule.error}")
    result = Run(dict(schedule.marks), schedule.notes, work, summary)
    for i in range(NODES):
        path = work / f"node{i}.json"
        assert path.exists(), f"node{i} wrote no summary:\n{result.tails()}"
        result.nodes.append(json.loads(path.read_text()))
    print("faults run:", json.dumps({"marks": result.marks, "notes": result.notes}))
    return result


def test_the_others_keep_applying_rounds_while_one_node_is_cut_and_it_rejoins(run: Run) -> None:
    marks = run.marks
    assert {"cut", "heal"} <= set(marks), run.notes
    assert marks["heal"] - marks["cut"] > ROUND_S  # longer than the round timeout
    during = {i: run.applied(i, "cut", "heal") for i in range(NODES)}
    counts = {i: len(a) for i, a in during.items()}
    for i in range(NODES):
        if i != VICTIM:
            assert counts[i] >= 1, f"node{i} applied no round during the cut: {counts}, {run.notes}"
    # silent means cut off: past the rounds in flight, the cut node commits nothing
    late = [a for a in during[VICTIM] if a[0] > marks["cut"] + ROUND_S]
    assert not late, late
    # after the heal, before the partition, it commits a round together with another node
    # (the same slot and leader in both histories)
    assert "partition" in marks, run.notes
    shared = []
    for t, p, slot in applied(run.work, VICTIM):
        how = run.round_of(VICTIM, p, slot)
        others = [i for i in range(NODES) if i != VICTIM and run.round_of(i, p, slot) == how]
        if t >= marks["heal"] and how is not None and others:
            shared.append(t - marks["heal"])
    first = f"{shared[0]:.0f} s after the heal" if shared else "never"
    assert shared and shared[0] < marks["partition"] - marks["heal"], (
        f"node {VICTIM} shared no round between the heal and the partition "
        f"({marks['partition'] - marks['heal']:.0f} s); its first shared round: {first}; "
        f"{run.notes}"
    )


def test_after_a_two_two_partition_heals_every_node_ends_on_one_copy(run: Run) -> None:
    assert {"partition", "healed"} <= set(run.marks), run.notes
    ends = [ended(run.work, i) for i in range(NODES)]
    first = min((t for t in ends if t is not None), default=0.0) - run.marks["healed"]
    assert first >= TAIL_S, f"a node ended {first:.0f} s after the heal: too few steps to tell"
    sides = {i: len(run.applied(i, "partition", "healed")) for i in range(NODES)}
    print("rounds applied during the partition:", sides)
    exits = [n["exit_code"] for n in run.summary["nodes"]]
    assert exits == [0] * NODES, exits
    digests = [n["global_digest"] for n in run.nodes]
    settled = [(n.get("settled"), n.get("settle_detail")) for n in run.nodes]
    ends_after = [None if t is None else round(t - run.marks["healed"]) for t in ends]
    assert len(set(digests)) == 1, (
        f"{len(set(digests))} global copies: {[d[:8] for d in digests]}; the nodes ended "
        f"{ends_after} s after the heal; settle: {settled}"
    )

"""Churn: nodes killed and restarted, a slow node and late joiners, on a seeded schedule.

Runs a bootstrap peer and N ``atoll node`` processes on 127.0.0.1 (the 'micro' model, one
torch thread each, short timeouts) twice with one manifest and one token budget
(``total_steps``; every node trains to it):

1. **failure-free**: every node from the start, none killed; node ``slow`` runs with
   ``ATOLL_SLOWDOWN=2`` (``NodeConfig.slowdown``: after each step it sleeps as long as the
   step computed, so it trains half as fast) in this run too, so that the two runs differ
   only by the failures;
2. **churn**: the same nodes, the same slow one, and a schedule drawn from ``--seed`` over
   the failure-free run's training time ``T``: ``--late`` nodes start only at
   ``down x T`` (late joiners), every other node is SIGKILLed (its whole process group,
   the network process too: a crash, no last checkpoint) ``--kills`` times and restarted
   each time after ``down x T / kills`` seconds with the same ``--identity``, so it
   resumes from its newest checkpoint (``--checkpoint-every-s``); every node is down
   ``down`` (20%) of ``T``, and at least ``--min-live`` nodes run at any time. A kill
   planned at ``t`` comes earlier when the node is already as far into its run as
   ``t / T`` of its steps (nodes whose slow or killed peers are away train faster than
   in the failure-free run, and would otherwise end before their kill), though never
   before 1.5 checkpoint periods; a kill of a node with no checkpoint yet waits for its
   first one (on a busy machine it can come late); its restart moves with it.

    .venv/bin/python bench/churn.py --json runs/churn.json
    .venv/bin/python bench/churn.py --quick --json runs/churn-quick.json   # 3 nodes, 2-3 minutes

Definitions (per node, then over all nodes):

- *live seconds*: from each process's start (spawn) to its exit or its kill, summed over
  its lives; a restart's and a late joiner's start-up and catch-up count as live, and so
  does the end-of-run settle; only the cold start of the nodes there from the beginning
  (common to both runs, no cost of churn) is left out: their first life counts from its
  first trained step (``trains from step`` in its log).
- *failure-free rate*: the node's tokens over its live seconds in the failure-free run.
- *useful tokens*: the tokens on the node's chain of kept work: the tokens its last life
  trained plus the ``tokens`` recorded in the checkpoint that life resumed from (which
  holds those of the lives before it up to that checkpoint), less, for every fragment a
  resume fetched from the swarm (the swarm had moved past its copy, so the node's own
  weights of that fragment were replaced), that fragment's share (1/F) of the steps
  since its last sync before the checkpoint. Work trained after a node's last checkpoint
  before a kill is lost, and so is its share in the rounds it missed.
- *goodput*: useful tokens / (live seconds x failure-free rate). The failure-free run's
  is 1 by construction. Caveat: the nodes share the machine's cores, so while some are
  down the others get more CPU and train faster than their failure-free rate; goodput
  may then exceed what a swarm of separate machines would see.
- *eval loss*: the global model (every fragment's global copy, as ``atoll export``
  writes it) of each finished node's last checkpoint, on the validation batches a node
  evaluates at its end; the mean over the nodes that finished, churn against
  failure-free. The nodes' own ``eval_loss`` (their local models) is reported too.
- *rounds*: per life, from the node's log (the syncer's line per slot): ``applied``,
  ``alone`` (no group formed) and ``failed`` (every other outcome); summed per node.
- *time to rejoin*: for every restart and late start, seconds from the spawn to the
  node's first applied round (and to its first trained step, ``trains from step``).
- *catch-up bytes*: ``bytes_down`` of the first progress line of a restarted or late
  life (its catch-up, before any round of its own could finish; a life that trained no
  step: its summary's), and the fragments it fetched.
- *hangs*: a process that was not killed by the schedule and neither exited nor trained
  a step (no progress line) for ``--hang-s`` (start-up, catch-up and the end-of-run
  settle included; the default is the settle's bound plus 60 s): it is killed, counted,
  and its node counts as not finished. Every run is also cut at ``--max-run-s``.
- *checkpoints*: before each restart the bench finds the node's newest checkpoint that
  verifies (digests); the restarted node must log ``resumed <that name>``. Lost: it
  resumed none or another one; torn and used: the one it names does not verify.
- *one copy*: the ``global_digest`` of the nodes that finish together (their runs end
  less than ``FINISH_GAP_S`` apart: a node restarted late can still be training after
  the others left, and then ends on the copy it and its group made since); whether all
  nodes hold one copy is reported too.

The **synchronous baseline** is modelled, not run: data-parallel training among the live
peers, waiting for all of them, under the same schedule and live windows. Each step takes
as long as the slowest live peer's step (its failure-free compute time per step, times
its slowdown; the all-reduce of the micro model over loopback is left out); every kill
costs every live peer the step in progress and a re-sync time ``R`` (the group re-forms
from the survivors); a joiner (restart or late start) trains from ``R`` after its spawn,
and its join costs the others nothing (flattering: a real re-rendezvous stalls them too).
``R`` is the median, over the churn run's restarts and late joins, of the time from the
spawn to the first trained step. Its goodput uses the same denominator.

Targets (pass/fail): goodput >= 92%; eval loss within 2% of the failure-free run; no
hang; no lost or torn checkpoint used; every node that finished on one global copy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from atoll.node.checkpoint import CheckpointStore
from atoll.node.demo import DemoConfig, manifest_text, start_bootstrap, stop_process
from atoll.protocol.schedule import Schedule

log = logging.getLogger("bench.churn")

CLI = [sys.executable, "-m", "atoll.node.cli"]
START_TIMEOUT_S = 300.0  # every initial node training, on a busy 2-core machine
TARGET_GOODPUT = 0.92
TARGET_LOSS = 0.02
FINISH_GAP_S = 15.0
"""nodes whose runs end less than this apart finish together (one group)"""

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_SLOT = re.compile(r"fragment (\d+) slot (-?\d+): (.*?); the slot's declarations")
_REBASED = re.compile(r"fragment (\d+) rebased to version (\d+)")
_RESUMED = re.compile(r"resumed (ckpt-\d+): step (\d+)")
_FETCHED = re.compile(r"copied fragments \[([\d, ]*)\] from the swarm")


# -- the schedule ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    at: float
    """seconds after every initial node trains"""
    action: str
    """start (a late joiner), kill or restart"""
    node: int


@dataclass
class Plan:
    nodes: int
    slow: int
    late: list[int]
    events: list[Event]
    duration_s: float
    down: float
    earliest_s: float = 0.0
    """no kill before this (the schedule's bound, capped at 0.4 of the duration)"""
    min_live: int = 1
    """the fewest nodes up at any time (a kill moved at run time keeps it too)"""


def plan(
    n: int,
    seed: int,
    *,
    duration_s: float,
    down: float = 0.2,
    late: int = 2,
    kills: int = 2,
    min_live: int = 3,
    earliest_s: float = 0.0,
) -> Plan:
    """The seeded schedule over ``duration_s`` seconds of training: every node down
    ``down`` of it (late joiners at the start, the others in ``kills`` outages), at least
    ``min_live`` nodes up at any time, no kill before ``earliest_s`` (capped at 0.4 of the
    duration: time for a node to write its first checkpoint)."""
    rng = random.Random(seed)
    nodes = list(range(n))
    slow = rng.choice(nodes)
    latecomers = sorted(rng.sample(nodes, late))
    join_at = down * duration_s
    earliest = max(0.05 * duration_s, min(earliest_s, 0.4 * duration_s))
    outage = down * duration_s / max(1, kills)
    events = [Event(round(join_at, 1), "start", i) for i in latecomers]
    for _ in range(2000):
        outages: list[tuple[float, float, int]] = []
        for i in nodes:
            if i in latecomers:
                continue
            # kills spread over [0.05 T or earliest_s, 0.75 T] (a churn run can end before
            # T: a restarted node jumps to the swarm's step), one outage per equal part,
            # never overlapping
            lo = earliest
            hi = 0.75 * duration_s
            part = (hi - lo) / max(1, kills)
            for k in range(kills):
                a = lo + k * part
                start = rng.uniform(a, a + part - outage)
                outages.append((start, start + outage, i))
        if _live_enough(outages, latecomers, join_at, n, min_live, duration_s):
            break
    else:
        raise ValueError(f"no schedule keeps {min_live} of {n} nodes up; lower --down")
    for start, end, i in outages:
        events.append(Event(round(start, 1), "kill", i))
        events.append(Event(round(end, 1), "restart", i))
    events.sort(key=lambda e: (e.at, e.action != "kill"))
    return Plan(n, slow, latecomers, events, duration_s, down, earliest, min_live)


def _live_enough(
    outages: list[tuple[float, float, int]],
    late: list[int],
    join_at: float,
    n: int,
    min_live: int,
    duration_s: float,
) -> bool:
    points = sorted({0.0, join_at, *(a for a, _, _ in outages), *(b for _, b, _ in outages)})
    for t in points:
        if t > duration_s:
            continue
        down = {i for a, b, i in outages if a <= t < b}
        down |= {i for i in late if t < join_at}
        if n - len(down) < min_live:
            return False
    return True


# -- the processes -----------------------------------------------------------------------------
@dataclass
class Life:
    """One process of one node, from its spawn to its exit or its kill."""

    index: int
    spawned: float
    log_path: Path
    expected: dict[str, Any] | None = None
    """the newest checkpoint that verified before a restart: name, step, tokens"""
    ended: float | None = None
    how: str = ""
    """killed, exited (with its code) or hung"""
    exit_code: int | None = None
    progress: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    summary: dict[str, Any] | None = None


@dataclass
class Node:
    index: int
    slowdown: float
    lives: list[Life] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None
    err: IO[str] | None = None
    reader: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Swarm:
    """The bootstrap and the nodes of one run, in ``work``."""

    def __init__(self, work: Path, manifest: Path, args: argparse.Namespace, slow: int) -> None:
        self.work = work
        self.manifest = manifest
        self.args = args
        self.nodes = [Node(i, 2.0 if i == slow else 1.0) for i in range(args.nodes)]
        self.boot: subprocess.Popen[str] | None = None
        self.addr = ""

    def start_bootstrap(self) -> None:
        self.boot, self.addr = start_bootstrap(DemoConfig(), self.work)

    def ckpt_dir(self, i: int) -> Path:
        return self.work / "ckpt" / f"node{i}"

    def newest_valid(self, i: int) -> dict[str, Any] | None:
        folder = self.ckpt_dir(i)
        if not folder.exists():
            return None
        loaded = CheckpointStore(folder, read_only=True).latest()
        if loaded is None:
            return None
        return {
            "name": loaded.path.name,
            "step": int(loaded.meta["step"]),
            "tokens": int(loaded.meta["tokens"]),
        }

    def spawn(self, i: int, *, wait_peers: int) -> Life:
        node = self.nodes[i]
        k = len(node.lives)
        life = Life(
            k,
            time.time(),
            self.work / f"node{i}.life{k}.log",
            expected=self.newest_valid(i) if k > 0 else None,
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if node.slowdown > 1.0:
            env["ATOLL_SLOWDOWN"] = str(node.slowdown)
        node.err = life.log_path.open("w")
        # (a fresh session: a kill takes the node's whole process group, network process too)
        node.proc = subprocess.Popen(
            [
                *CLI,
                "-v",
                "node",
                "--run",
                str(self.manifest),
                "--join",
                self.addr,
                "--identity",
                str(self.work / f"node{i}.key"),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--progress",
                "jsonl",
                "--threads",
                "1",
                "--wait-peers",
                str(wait_peers),
                "--log-every",
                "2",
                "--join-timeout-s",
                "90",
                "--checkpoint-dir",
                str(self.ckpt_dir(i)),
                "--checkpoint-every-s",
                str(self.args.checkpoint_every_s),
            ],
            stdout=subprocess.PIPE,
            stderr=node.err,
            text=True,
            env=env,
            start_new_session=True,
        )
        node.lives.append(life)
        node.reader = threading.Thread(target=_read, args=(node.proc, life), daemon=True)
        node.reader.start()
        return life

    def kill(self, i: int, how: str = "killed") -> None:
        node = self.nodes[i]
        if node.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(30)
        self._ended(node, how)

    def _ended(self, node: Node, how: str) -> None:
        life = node.lives[-1]
        if life.ended is not None:
            return
        life.ended = time.time()
        life.how = how
        assert node.proc is not None
        life.exit_code = node.proc.returncode
        if node.reader is not None:
            node.reader.join(5)
        if node.err is not None:
            node.err.close()
        if how != "exited":  # the network process may outlive a trainer that exited
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)

    def reap(self) -> list[int]:
        """Nodes whose process exited since the last call."""
        done = []
        for node in self.nodes:
            exited = node.proc is not None and node.proc.poll() is not None
            if exited and node.lives[-1].ended is None:
                self._ended(node, "exited")
                done.append(node.index)
        return done

    def trains(self, i: int) -> bool:
        lives = self.nodes[i].lives
        if not lives:
            return False
        path = lives[-1].log_path
        return path.exists() and "trains from step" in path.read_text(errors="replace")

    def close(self) -> None:
        for node in self.nodes:
            if node.running:
                self.kill(node.index, "hung")
        if self.boot is not None:
            stop_process(self.boot, 10.0)


def _read(proc: subprocess.Popen[str], life: Life) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "progress" in msg:
            life.progress.append((time.time(), msg["progress"]))
        elif "summary" in msg:
            life.summary = msg["summary"]


def run_swarm(
    name: str,
    args: argparse.Namespace,
    work: Path,
    manifest: Path,
    the_plan: Plan,
    *,
    churn: bool,
) -> tuple[Swarm, dict[str, Any]]:
    """One run: every node (the churn run: every node but the late ones), the schedule
    when ``churn``, then the wait for every node to finish, with the hang watch."""
    work.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(work, manifest, args, the_plan.slow)
    info: dict[str, Any] = {"name": name, "events": [], "hung": [], "error": None}
    initial = [i for i in range(args.nodes) if not churn or i not in the_plan.late]
    try:
        swarm.start_bootstrap()
        t_start = time.time()
        for i in initial:
            swarm.spawn(i, wait_peers=len(initial) - 1)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(swarm.trains(i) for i in initial):
            if time.monotonic() > deadline or swarm.reap():
                raise RuntimeError(f"{name}: the nodes did not all start training")
            time.sleep(0.2)
        t0 = time.time()
        info["started"], info["training_at"] = t_start, t0
        log.info("%s: every node trains (%.0f s after the start)", name, t0 - t_start)
        finished: list[int] = []
        pending = list(the_plan.events) if churn else []
        overall = time.monotonic() + args.max_run_s
        while True:
            finished += swarm.reap()
            now = time.time() - t0
            pending = _bring_forward(swarm, the_plan, pending, now)
            pending = _wait_for_checkpoint(swarm, the_plan, pending, now)
            while pending and pending[0].at <= now:
                ev = pending.pop(0)
                info["events"].append(_do(swarm, ev, now, finished))
            # (a node that exited counts as running until reap() has seen it)
            running = [n.index for n in swarm.nodes if n.lives and n.lives[-1].ended is None]
            if not running and not pending:
                break
            stuck = [i for i in running if time.time() - _last_sign(swarm.nodes[i]) > args.hang_s]
            if time.monotonic() > overall:  # the run's bound: every node left counts as hung
                stuck = running
                pending.clear()
            for i in stuck:
                log.warning("%s: node %d hangs (nothing for %.0f s): killed", name, i, args.hang_s)
                swarm.kill(i, "hung")
                info["hung"].append(i)
            time.sleep(0.2)
        info["ended"] = time.time()
    except Exception as e:
        info["error"] = f"{type(e).__name__}: {e}"
        log.exception("%s failed", name)
    finally:
        swarm.close()
    return swarm, info


def _bring_forward(swarm: Swarm, the_plan: Plan, pending: list[Event], now: float) -> list[Event]:
    """Pending events with a kill moved to ``now`` whose node is already as far into its
    run (its newest progress line's step over its end) as the kill's share of the plan's
    duration, once ``now`` is past the plan's earliest kill and where the outage, moved,
    still leaves ``min_live`` nodes up throughout; the node's restart moves by as much,
    so the outage keeps its length."""
    if now < the_plan.earliest_s or the_plan.duration_s <= 0:
        return pending
    out = list(pending)
    for k, ev in enumerate(out):
        if ev.action != "kill" or ev.at <= now:
            continue
        if any(e.node == ev.node and e.at < ev.at for e in out):
            continue  # only a node's next event may move: not a second kill before a restart
        life = swarm.nodes[ev.node].lives[-1] if swarm.nodes[ev.node].lives else None
        if life is None or life.ended is not None or not life.progress:
            continue
        p = life.progress[-1][1]
        if float(p["step"]) < ev.at / the_plan.duration_s * float(p["end"]):
            continue
        shift = ev.at - now
        moved = _moved(out, k, now)
        if not _keeps_live(swarm, moved, now, the_plan.min_live):
            continue
        log.info(
            "t=%.0f s: node %d is %d/%d steps in: its kill comes %.1f s early",
            now,
            ev.node,
            p["step"],
            p["end"],
            shift,
        )
        out = moved
    out.sort(key=lambda e: (e.at, e.action != "kill"))
    return out


def _wait_for_checkpoint(
    swarm: Swarm, the_plan: Plan, pending: list[Event], now: float
) -> list[Event]:
    """Pending events with every kill that is due of a node with no checkpoint yet put
    off (with its restart) to the first of ``now`` + 0.5 s and the ends of the other
    outages that keeps ``min_live`` nodes up: a restart resumes from a checkpoint, and on
    a busy machine the first one can come later than the schedule's earliest kill."""
    out = list(pending)
    for k, ev in enumerate(out):
        if ev.action != "kill" or ev.at > now:
            continue
        if swarm.newest_valid(ev.node) is not None:
            continue
        ends = sorted({e.at for e in out if e.node != ev.node and e.action != "kill"})
        for t in [now + 0.5, *(t for t in ends if t > now + 0.5)]:
            moved = _moved(out, k, t)
            if _keeps_live(swarm, moved, now, the_plan.min_live):
                break
        log.info("t=%.0f s: node %d has no checkpoint yet: its kill waits", now, ev.node)
        out = moved
    out.sort(key=lambda e: (e.at, e.action != "kill"))
    return out


def _moved(events: list[Event], k: int, t: float) -> list[Event]:
    """``events`` with kill ``k`` at ``t`` and its node's next restart moved as much."""
    ev = events[k]
    shift = t - ev.at
    out = list(events)
    out[k] = Event(round(t, 1), "kill", ev.node)
    for j in range(k + 1, len(out)):
        if out[j].node == ev.node and out[j].action == "restart":
            out[j] = Event(round(out[j].at + shift, 1), "restart", ev.node)
            break
    return out


def _keeps_live(swarm: Swarm, pending: list[Event], now: float, min_live: int) -> bool:
    """Whether ``min_live`` nodes stay up from ``now`` on under ``pending``: a node down
    now (killed, or a late joiner not yet started) is up again at its next start or
    restart; a pending kill takes its node down until its next restart."""
    outages: list[tuple[float, float, int]] = []
    for node in swarm.nodes:
        i = node.index
        ups = sorted(e.at for e in pending if e.node == i and e.action != "kill")
        if not node.running:
            outages.append((now, ups[0] if ups else float("inf"), i))
        for e in pending:
            if e.node == i and e.action == "kill":
                back = [t for t in ups if t >= e.at]
                outages.append((e.at, back[0] if back else float("inf"), i))
    return _live_enough(outages, [], 0.0, len(swarm.nodes), min_live, float("inf"))


def _last_sign(node: Node) -> float:
    """When the node's current life last showed progress (a trained step), or started."""
    life = node.lives[-1]
    return life.progress[-1][0] if life.progress else life.spawned


def _do(swarm: Swarm, ev: Event, now: float, finished: list[int]) -> dict[str, Any]:
    node = swarm.nodes[ev.node]
    done = {**asdict(ev), "done_at": round(now, 1), "skipped": None}
    if ev.action == "kill":
        if not node.running:
            done["skipped"] = "not running"
        else:
            log.info("t=%.0f s: SIGKILL node %d", now, ev.node)
            swarm.kill(ev.node)
    else:
        # a restart after a skipped kill, or a node that finished its run, is not started
        if node.running or (ev.node in finished and node.lives[-1].how == "exited"):
            done["skipped"] = "running or finished"
        else:
            log.info("t=%.0f s: %s node %d", now, ev.action, ev.node)
            swarm.spawn(ev.node, wait_peers=1)
    return done


# -- reading a run -----------------------------------------------------------------------------
@dataclass
class LogFacts:
    trains_at: float | None = None
    first_applied: float | None = None
    applied: int = 0
    alone: int = 0
    failed: int = 0
    rebases: int = 0
    resumed: str | None = None
    resumed_step: int | None = None
    fetched: list[int] = field(default_factory=list)


def read_log(path: Path) -> LogFacts:
    facts = LogFacts()
    if not path.exists():
        return facts
    for line in path.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None
        if (s := _SLOT.search(line)) is not None:
            outcome = s.group(3)
            if outcome == "applied":
                facts.applied += 1
                if facts.first_applied is None:
                    facts.first_applied = t
            elif outcome.startswith("alone") or "no holder served it" in outcome:
                facts.alone += 1
            else:
                facts.failed += 1
        elif _REBASED.search(line):
            facts.rebases += 1
        elif (r := _RESUMED.search(line)) is not None:
            facts.resumed, facts.resumed_step = r.group(1), int(r.group(2))
        elif (f := _FETCHED.search(line)) is not None:
            facts.fetched = [int(x) for x in f.group(1).split(",") if x.strip()]
        elif "trains from step" in line and facts.trains_at is None:
            facts.trains_at = t
    return facts


def _life_tokens(life: Life) -> int:
    if life.summary is not None:
        return int(life.summary["tokens"])
    if not life.progress:
        return 0
    p = life.progress[-1][1]
    return round(float(p["tokens_per_s"]) * float(p["wall_s"]))


def analyse_run(
    swarm: Swarm,
    info: dict[str, Any],
    schedule: Schedule,
    tokens_per_step: int,
    late: tuple[int, ...] = (),
) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    for node in swarm.nodes:
        lives: list[dict[str, Any]] = []
        for life in node.lives:
            facts = read_log(life.log_path)
            end = life.ended or info.get("ended") or time.time()
            # live from the spawn, but an initial node's cold start (common to both runs,
            # not a cost of churn) from its first trained step
            begin = life.spawned
            if life.index == 0 and node.index not in late and facts.trains_at is not None:
                begin = facts.trains_at
            entry: dict[str, Any] = {
                "life": life.index,
                "spawned": round(life.spawned, 3),
                "ended": round(end, 3),
                "how": life.how,
                "exit_code": life.exit_code,
                "live_from": round(begin, 3),
                "live_s": round(end - begin, 2),
                "tokens": _life_tokens(life),
                "steps_trained": (life.summary or {}).get("steps"),
                "rounds_applied": facts.applied,
                "rounds_failed": facts.failed,
                "rounds_alone": facts.alone,
                "rebases": facts.rebases,
                "to_first_step_s": _since(facts.trains_at, life.spawned),
                "to_first_round_s": _since(facts.first_applied, life.spawned),
                "resumed": facts.resumed,
                "resumed_step": facts.resumed_step,
                "fetched": facts.fetched,
                "expected_checkpoint": life.expected,
                "catch_up_bytes_down": (
                    int(life.progress[0][1]["bytes_down"]) if life.progress else None
                ),
                "bytes_down": (int(life.progress[-1][1]["bytes_down"]) if life.progress else None),
            }
            if life.summary is not None:
                s = life.summary
                if entry["catch_up_bytes_down"] is None:  # no step trained: all catch-up
                    entry["catch_up_bytes_down"] = s.get("bytes_down")
                entry.update(
                    eval_loss=s.get("eval_loss"),
                    global_digest=s.get("global_digest"),
                    settled=s.get("settled"),
                    stopped_by=s.get("stopped_by"),
                    final_step=s.get("final_step"),
                    steps_jumped=s.get("steps_jumped"),
                    summary_rounds=[
                        s.get("rounds_applied"),
                        s.get("rounds_failed"),
                        s.get("rounds_alone"),
                    ],
                    summary_bytes_down=s.get("bytes_down"),
                    compute_s=s.get("compute_s"),
                    wall_s=s.get("wall_s"),
                    checkpoint=s.get("checkpoint"),
                )
            lives.append(entry)
        nodes.append(_node_figures(node, lives, schedule, tokens_per_step))
    return {"info": info, "nodes": nodes}


def _since(t: float | None, t0: float) -> float | None:
    return round(t - t0, 2) if t is not None else None


def _node_figures(
    node: Node, lives: list[dict[str, Any]], schedule: Schedule, tokens_per_step: int
) -> dict[str, Any]:
    live_s = sum(v["live_s"] for v in lives)
    trained = sum(v["tokens"] for v in lives)
    last = lives[-1] if lives else None
    useful = 0
    lost_fetched = 0
    checks: list[dict[str, Any]] = []
    if last is not None:
        base = 0
        if last["resumed"] is not None and last["expected_checkpoint"] is not None:
            base = int(last["expected_checkpoint"]["tokens"])
        useful = base + int(last["tokens"])
    for v in lives[1:]:
        exp = v["expected_checkpoint"]
        ok = (exp is None and v["resumed"] is None) or (
            exp is not None and v["resumed"] == exp["name"]
        )
        checks.append(
            {
                "life": v["life"],
                "expected": exp["name"] if exp else None,
                "resumed": v["resumed"],
                "ok": ok,
            }
        )
        if v["resumed"] is not None and v["resumed_step"] is not None:
            c = int(v["resumed_step"])
            for p in v["fetched"]:
                last_sync = c - ((c - schedule.offset(p)) % schedule.H)
                lost_fetched += (c - last_sync) * tokens_per_step // schedule.fragments
    useful = max(0, useful - lost_fetched)
    return {
        "node": node.index,
        "slowdown": node.slowdown,
        "lives": lives,
        "live_s": round(live_s, 1),
        "tokens_trained": trained,
        "tokens_useful": useful,
        "tokens_lost_fetched": lost_fetched,
        "rounds_applied": sum(v["rounds_applied"] for v in lives),
        "rounds_failed": sum(v["rounds_failed"] for v in lives),
        "rounds_alone": sum(v["rounds_alone"] for v in lives),
        "rebases": sum(v["rebases"] for v in lives),
        "resumes": checks,
        "eval_loss": last.get("eval_loss") if last else None,
        "global_digest": last.get("global_digest") if last else None,
        "finished": bool(last and last["how"] == "exited" and last.get("stopped_by") == "steps"),
    }


# -- the synchronous model -----------------------------------------------------------------------
def sync_model(
    the_plan: Plan,
    churn: dict[str, Any],
    ff: dict[str, Any],
    tokens_per_step: int,
    dt: float = 0.05,
) -> dict[str, Any]:
    """Data-parallel among the live peers, waiting for all (see the module's notes)."""
    t0 = float(churn["info"]["training_at"])
    step_s = {nf["node"]: _ff_compute_per_step(nf) * nf["slowdown"] for nf in ff["nodes"]}
    joins = [
        v["to_first_step_s"]
        for nf in churn["nodes"]
        for v in nf["lives"][(0 if nf["node"] in the_plan.late else 1) :]
        if v["to_first_step_s"] is not None
    ]
    resync_s = statistics.median(joins) if joins else 0.0
    # a peer trains from its live window's start (a joiner: R after its spawn) to its end
    windows: dict[int, list[tuple[float, float]]] = {}
    for nf in churn["nodes"]:
        windows[nf["node"]] = [
            (
                float(v["live_from"]) - t0 + (resync_s if v["live_from"] == v["spawned"] else 0),
                float(v["ended"]) - t0,
            )
            for v in nf["lives"]
        ]
    kills = sorted(
        float(e["done_at"])
        for e in churn["info"]["events"]
        if e["action"] == "kill" and not e["skipped"]
    )
    end = max(b for w in windows.values() for _, b in w)
    tokens = dict.fromkeys(windows, 0.0)
    stalled_until, stalled = 0.0, 0.0
    t = 0.0
    while t < end:
        live = [i for i, w in windows.items() if any(a <= t < b for a, b in w)]
        while kills and kills[0] <= t:
            # every live peer loses the step in progress, then re-forms the group
            lost = max((step_s[i] for i in live), default=0.0) + resync_s
            stalled_until = max(stalled_until, kills.pop(0) + lost)
        if live and t >= stalled_until:
            slowest = max(step_s[i] for i in live)
            if slowest > 0:
                for i in live:
                    tokens[i] += dt / slowest * tokens_per_step
        elif live:
            stalled += dt
        t += dt
    rates = {nf["node"]: nf["ff_rate"] for nf in ff["nodes"]}
    per_node = {}
    for nf in churn["nodes"]:
        denom = nf["live_s"] * (rates.get(nf["node"]) or 0.0)
        per_node[nf["node"]] = round(tokens[nf["node"]] / denom, 4) if denom else None
    denom_all = sum(nf["live_s"] * (rates.get(nf["node"]) or 0.0) for nf in churn["nodes"])
    return {
        "modelled": True,
        "resync_s": round(resync_s, 1),
        "step_s": {i: round(v, 4) for i, v in step_s.items()},
        "stalled_s": round(stalled, 1),
        "tokens": {i: int(v) for i, v in tokens.items()},
        "goodput": per_node,
        "goodput_overall": round(sum(tokens.values()) / denom_all, 4) if denom_all else None,
    }


def _ff_compute_per_step(nf: dict[str, Any]) -> float:
    life = nf["lives"][-1]
    steps = life.get("steps_trained") or 0
    return float(life.get("compute_s") or 0.0) / steps if steps else 0.0


# -- main --------------------------------------------------------------------------------------
def _training_s(swarm: Swarm, info: dict[str, Any]) -> float:
    """From every initial node training to the first progress line at the run's end."""
    ends = [
        t
        for node in swarm.nodes
        for life in node.lives
        for t, p in life.progress
        if p["step"] >= p["end"]
    ]
    t0 = float(info["training_at"])
    return (min(ends) if ends else float(info["ended"])) - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=480, help="the run's total_steps")
    ap.add_argument("--H", type=int, default=60)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--codec", default="e3m0")
    ap.add_argument("--timeouts-scale", type=float, default=1.0, help="of the demo's timeouts")
    ap.add_argument("--down", type=float, default=0.2, help="share of the time each node is down")
    ap.add_argument("--late", type=int, default=2, help="late joiners")
    ap.add_argument("--kills", type=int, default=2, help="kills of every other node")
    ap.add_argument("--min-live", type=int, default=3)
    ap.add_argument("--checkpoint-every-s", type=float, default=10.0)
    ap.add_argument("--hang-s", type=float, help="default: the settle bound + 60")
    ap.add_argument("--max-run-s", type=float, default=900.0, help="bound on one run")
    ap.add_argument("--quick", action="store_true", help="3 nodes, a tiny schedule (2-3 min)")
    ap.add_argument("--workdir", help="keep the nodes' files and logs here")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.late, args.kills, args.min_live = 3, 1, 1, 2
        args.steps, args.checkpoint_every_s = 150, 2.5
        args.batch_size, args.H, args.timeouts_scale = 16, 30, 0.5
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    scale = args.timeouts_scale
    if args.hang_s is None:
        args.hang_s = 2 * (15.0 + 40.0) * scale + 60.0
    keep = args.workdir is not None
    work = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="atoll-churn-"))
    if work.exists():
        for sub in ("failure-free", "churn"):
            shutil.rmtree(work / sub, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    cfg = DemoConfig(
        nodes=args.nodes,
        steps=args.steps,
        preset=args.preset,
        H=args.H,
        tau=args.tau,
        codec=args.codec,
        batch_size=args.batch_size,
        timeouts_scale=scale,
    )
    manifest = work / "run.toml"
    manifest.write_text(manifest_text(cfg))
    draw = dict(down=args.down, late=args.late, kills=args.kills, min_live=args.min_live)
    t_begin = time.time()
    ff_plan = plan(args.nodes, args.seed, duration_s=1.0, **draw)  # the slow node, no events
    log.info("failure-free run: %d nodes, node %d slow", args.nodes, ff_plan.slow)
    ff_swarm, ff_info = run_swarm(
        "failure-free", args, work / "failure-free", manifest, ff_plan, churn=False
    )
    duration = _training_s(ff_swarm, ff_info) if ff_info["error"] is None else 0.0
    if ff_info["error"] is not None or duration <= 0:
        print(f"bench/churn.py: the failure-free run failed: {ff_info['error']}", file=sys.stderr)
        return 2
    # no kill before 1.5 checkpoint periods where the schedule allows it: a restart
    # should have a checkpoint to resume from
    try:
        earliest = 1.5 * args.checkpoint_every_s
        the_plan = plan(args.nodes, args.seed, duration_s=duration, earliest_s=earliest, **draw)
    except ValueError:
        the_plan = plan(args.nodes, args.seed, duration_s=duration, **draw)
    log.info(
        "churn run over T = %.0f s: late %s, slow %d; %s",
        duration,
        the_plan.late,
        the_plan.slow,
        ", ".join(f"{e.at:.0f} s {e.action} {e.node}" for e in the_plan.events),
    )
    ch_swarm, ch_info = run_swarm("churn", args, work / "churn", manifest, the_plan, churn=True)
    tokens_per_step = args.batch_size * _seq_len(args.preset)
    fragments = _fragment_count(ff_swarm)
    schedule = Schedule(args.H, fragments)
    ff = analyse_run(ff_swarm, ff_info, schedule, tokens_per_step)
    ch = analyse_run(ch_swarm, ch_info, schedule, tokens_per_step, tuple(the_plan.late))
    _add_global_evals(ff, ff_swarm, work / "failure-free")
    _add_global_evals(ch, ch_swarm, work / "churn")
    result = report(args, the_plan, ff, ch, tokens_per_step, fragments, duration)
    result["wall_s"] = round(time.time() - t_begin, 1)
    result["workdir"] = str(work) if keep else None
    _print(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(t["pass"] for t in result["targets"].values()) else 1


def global_eval(manifest: Path, folder: Path, out: Path, batches: int = 8) -> float | None:
    """Eval loss of the global model (every fragment's global copy) of the newest
    checkpoint in a node's checkpoint ``folder`` (``atoll export``'s model), on the
    validation batches a node evaluates at its end; None without a checkpoint."""
    import torch

    from atoll.node.data import Batcher, load_corpus
    from atoll.node.export import export_model, load_exported
    from atoll.node.train import evaluate
    from atoll.protocol.manifest import RunManifest

    if not folder.exists() or not CheckpointStore(folder, read_only=True).list():
        return None
    run = RunManifest.load(manifest)
    export_model(manifest, folder, out)
    model = load_exported(out)
    batcher = Batcher(load_corpus(run.data), _seq_len(run.model), run.batch_size, run.seed)
    return float(evaluate(model, batcher.val_batches(batches, 16), torch.device("cpu")))


def _add_global_evals(run: dict[str, Any], swarm: Swarm, work: Path) -> None:
    for nf in run["nodes"]:
        folder = swarm.ckpt_dir(nf["node"])
        out = work / "export" / f"node{nf['node']}"
        shutil.rmtree(out, ignore_errors=True)
        nf["global_eval_loss"] = (
            global_eval(swarm.manifest, folder, out) if nf["finished"] else None
        )


def _seq_len(preset: str) -> int:
    from atoll.node.model import PRESETS

    return int(PRESETS[preset].seq_len)


def _fragment_count(swarm: Swarm) -> int:
    for node in swarm.nodes:
        for life in node.lives:
            if life.summary is not None:
                return len(life.summary["info"]["versions"])
    return 1


def report(
    args: argparse.Namespace,
    the_plan: Plan,
    ff: dict[str, Any],
    ch: dict[str, Any],
    tokens_per_step: int,
    fragments: int,
    duration: float,
) -> dict[str, Any]:
    for nf in ff["nodes"]:
        nf["ff_rate"] = nf["tokens_trained"] / nf["live_s"] if nf["live_s"] else 0.0
    rates = {nf["node"]: nf["ff_rate"] for nf in ff["nodes"]}
    per_node: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    for nf in ch["nodes"]:
        could = nf["live_s"] * rates[nf["node"]]
        nf["goodput"] = round(nf["tokens_useful"] / could, 4) if could else None
        per_node.append(
            {
                k: nf[k]
                for k in (
                    "node",
                    "slowdown",
                    "live_s",
                    "tokens_trained",
                    "tokens_useful",
                    "goodput",
                    "rounds_applied",
                    "rounds_failed",
                    "rounds_alone",
                    "rebases",
                    "eval_loss",
                    "global_eval_loss",
                    "finished",
                )
            }
            | {"lives": len(nf["lives"]), "ff_rate": round(rates[nf["node"]], 1)}
        )
        late = nf["node"] in the_plan.late
        for v in nf["lives"][0 if late else 1 :]:
            restarts.append(
                {
                    "node": nf["node"],
                    "life": v["life"],
                    "kind": "late join" if v["life"] == 0 else "restart",
                    "to_first_step_s": v["to_first_step_s"],
                    "to_first_round_s": v["to_first_round_s"],
                    "catch_up_bytes_down": v["catch_up_bytes_down"],
                    "rebases": v["rebases"],
                    "resumed": v["resumed"],
                    "resumed_step": v["resumed_step"],
                    "fetched": v["fetched"],
                }
            )
    could_all = sum(nf["live_s"] * rates[nf["node"]] for nf in ch["nodes"])
    goodput = sum(nf["tokens_useful"] for nf in ch["nodes"]) / could_all if could_all else 0.0
    sync = sync_model(the_plan, ch, ff, tokens_per_step)

    def mean_eval(run: dict[str, Any], key: str) -> float | None:
        xs = [nf[key] for nf in run["nodes"] if nf["finished"] and nf.get(key)]
        return sum(xs) / len(xs) if xs else None

    ev_ff, ev_ch = mean_eval(ff, "global_eval_loss"), mean_eval(ch, "global_eval_loss")
    loss_gap = (ev_ch - ev_ff) / ev_ff if ev_ff and ev_ch else None
    local_ff, local_ch = mean_eval(ff, "eval_loss"), mean_eval(ch, "eval_loss")
    hung = {"failure-free": ff["info"]["hung"], "churn": ch["info"]["hung"]}
    resumes = [r | {"node": nf["node"]} for nf in ch["nodes"] for r in nf["resumes"]]
    bad = [r for r in resumes if not r["ok"]]

    def one_copy(run: dict[str, Any]) -> tuple[bool, list[dict[str, Any]]]:
        """Nodes that finish together (exits less than FINISH_GAP_S apart) and their
        digests; True when every node finished and each such group holds one copy."""
        done = sorted(
            (float(nf["lives"][-1]["ended"]), nf["node"], nf["global_digest"])
            for nf in run["nodes"]
            if nf["finished"]
        )
        groups: list[dict[str, Any]] = []
        last = None
        for t, i, d in done:
            if last is None or t - last > FINISH_GAP_S:
                groups.append({"nodes": [], "digests": [], "exit_s": round(t, 1)})
            groups[-1]["nodes"].append(i)
            groups[-1]["digests"].append(d[:16] if d else None)
            last = t
        for g in groups:
            g["one_copy"] = None not in g["digests"] and len(set(g["digests"])) == 1
            g["exit_s"] = round(g["exit_s"] - float(run["info"]["training_at"]), 1)
        everyone = all(nf["finished"] for nf in run["nodes"])
        return everyone and all(g["one_copy"] for g in groups), groups

    copy_ch, digests_ch = one_copy(ch)
    copy_ff, digests_ff = one_copy(ff)
    all_same = len({nf["global_digest"] for nf in ch["nodes"]}) == 1
    errors = [e for e in (ff["info"]["error"], ch["info"]["error"]) if e]
    skipped = [e for e in ch["info"]["events"] if e["skipped"]]
    rejoin = [r["to_first_round_s"] for r in restarts if r["to_first_round_s"] is not None]
    catch = [r["catch_up_bytes_down"] for r in restarts if r["catch_up_bytes_down"] is not None]
    targets = {
        f"goodput >= {TARGET_GOODPUT:.0%}": {
            "pass": goodput >= TARGET_GOODPUT,
            "detail": round(goodput, 4),
        },
        f"eval loss within {TARGET_LOSS:.0%} of the failure-free run": {
            "pass": loss_gap is not None and abs(loss_gap) <= TARGET_LOSS,
            "detail": round(loss_gap, 4) if loss_gap is not None else None,
        },
        "no hang": {"pass": not hung["failure-free"] and not hung["churn"], "detail": hung},
        "no lost or torn checkpoint used": {"pass": not bad, "detail": bad or len(resumes)},
        "every node ends on one global copy (of those that finish together)": {
            "pass": copy_ch,
            "detail": digests_ch,
        },
        "the runs and the schedule ran": {
            "pass": not errors and not skipped,
            "detail": errors + skipped,
        },
    }
    down_share = {
        nf["node"]: round(1 - min(1.0, nf["live_s"] / max(1e-9, _span(ch, nf))), 3)
        for nf in ch["nodes"]
    }
    return {
        "bench": "churn",
        "command": " ".join([sys.executable, *sys.argv]),
        "quick": args.quick,
        "seed": args.seed,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg(),
        },
        "config": {
            "nodes": args.nodes,
            "preset": args.preset,
            "batch_size": args.batch_size,
            "total_steps": args.steps,
            "H": args.H,
            "tau": args.tau,
            "fragments": fragments,
            "codec": args.codec,
            "timeouts_scale": args.timeouts_scale,
            "checkpoint_every_s": args.checkpoint_every_s,
            "tokens_per_step": tokens_per_step,
            "hang_s": args.hang_s,
        },
        "schedule": {
            "T_s": round(duration, 1),
            "slow": the_plan.slow,
            "late": the_plan.late,
            "down": the_plan.down,
            "events": ch["info"]["events"],
        },
        "down_share": down_share,
        "goodput": round(goodput, 4),
        "eval_loss": {
            "of": "the global model of each finished node's last checkpoint, mean",
            "failure_free": ev_ff,
            "churn": ev_ch,
            "gap": loss_gap,
            "local_model_failure_free": local_ff,
            "local_model_churn": local_ch,
        },
        "per_node": per_node,
        "rejoins": restarts,
        "rejoin_s": {
            "median": statistics.median(rejoin) if rejoin else None,
            "max": max(rejoin) if rejoin else None,
        },
        "catch_up_bytes": {
            "total": sum(catch),
            "per_rejoin_mean": (sum(catch) / len(catch) if catch else None),
        },
        "hangs": hung,
        "checkpoint_resumes": resumes,
        "one_copy": {
            "all_nodes_same": all_same,
            "churn": copy_ch,
            "failure_free": copy_ff,
            "digests_churn": digests_ch,
            "digests_failure_free": digests_ff,
        },
        "synchronous_model": sync,
        "targets": targets,
        "runs": {"failure_free": ff, "churn": ch},
    }


def _span(run: dict[str, Any], nf: dict[str, Any]) -> float:
    """The run's span for a node: from the first spawn of any node to its last end."""
    first = min(v["spawned"] for n in run["nodes"] for v in n["lives"])
    return float(nf["lives"][-1]["ended"]) - float(first)


def _print(r: dict[str, Any]) -> None:
    print(
        f"\nchurn (seed {r['seed']}{', quick' if r['quick'] else ''}): {r['wall_s']:.0f} s; "
        f"T = {r['schedule']['T_s']:.0f} s, slow node {r['schedule']['slow']}, "
        f"late {r['schedule']['late']}"
    )
    sync = r["synchronous_model"]
    print(
        f"{'node':>4} {'lives':>5} {'down':>6} {'live s':>7} {'ff tok/s':>9} {'useful':>8} "
        f"{'goodput':>8} {'sync*':>6} {'applied':>7} {'failed':>6} {'alone':>5} "
        f"{'rebases':>7} {'eval*':>7}"
    )
    for n in r["per_node"]:
        sg = sync["goodput"].get(n["node"])
        ev = f"{n['global_eval_loss']:.4f}" if n["global_eval_loss"] is not None else "-"
        print(
            f"{n['node']:>4} {n['lives']:>5} {r['down_share'][n['node']]:>6.1%} "
            f"{n['live_s']:>7.0f} {n['ff_rate']:>9.0f} {n['tokens_useful']:>8} "
            f"{n['goodput'] or 0:>8.1%} {sg or 0:>6.1%} {n['rounds_applied']:>7} "
            f"{n['rounds_failed']:>6} {n['rounds_alone']:>5} {n['rebases']:>7} {ev:>7}"
            f"{'  (slow)' if n['slowdown'] > 1 else ''}"
        )
    print(
        f"overall goodput {r['goodput']:.1%}; synchronous (modelled) "
        f"{sync['goodput_overall'] or 0:.1%} (re-sync {sync['resync_s']} s)"
    )
    e = r["eval_loss"]
    print(
        f"eval loss (global model): failure-free {e['failure_free']}, churn {e['churn']}, "
        f"gap {e['gap']}; local models {e['local_model_failure_free']} and "
        f"{e['local_model_churn']}"
    )
    for j in r["rejoins"]:
        print(
            f"  node {j['node']} {j['kind']} (life {j['life']}): first step "
            f"{j['to_first_step_s']} s, first round {j['to_first_round_s']} s, catch-up "
            f"{(j['catch_up_bytes_down'] or 0) / 1e3:.0f} kB down, resumed {j['resumed']} "
            f"(step {j['resumed_step']}), fetched {j['fetched']}, rebases {j['rebases']}"
        )
    for name, t in r["targets"].items():
        print(f"  [{'pass' if t['pass'] else 'FAIL'}] {name}: {t['detail']}")


if __name__ == "__main__":
    sys.exit(main())

"""bench/churn.py's schedule at run time: kills brought forward for nodes ahead of the
plan, kills put off until the node has a checkpoint, and never fewer than ``min_live``
nodes up (the helpers the run loop calls every 0.2 s, on a swarm of real processes)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atoll.node.checkpoint import CheckpointStore
from tests.unit.benchload import load_bench

churn = load_bench("churn")


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Any]:
    """Three nodes, each with a live process (a sleeper standing in for ``atoll node``:
    the helpers only ask whether it runs) and an empty first life."""
    s = churn.Swarm(tmp_path, tmp_path / "run.toml", argparse.Namespace(nodes=3), slow=1)
    for node in s.nodes:
        node.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        node.lives.append(churn.Life(0, 0.0, tmp_path / f"node{node.index}.log"))
    yield s
    for node in s.nodes:
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait(10)


def _plan(events: list[Any], *, earliest_s: float = 2.0) -> Any:
    return churn.Plan(3, 1, [], events, 20.0, 0.2, earliest_s, 2)


def _at_step(swarm: Any, i: int, step: int) -> None:
    swarm.nodes[i].lives[-1].progress.append((0.0, {"step": step, "end": 100}))


def _checkpoint(swarm: Any, i: int) -> None:
    store = CheckpointStore(swarm.ckpt_dir(i))
    store.save({"w": np.zeros(4, np.float32)}, {"step": 10, "tokens": 100})


E = churn.Event


def test_a_kill_comes_early_for_a_node_ahead_of_the_plan_and_its_restart_with_it(
    swarm: Any,
) -> None:
    pending = [E(10.0, "kill", 0), E(14.0, "restart", 0)]
    _at_step(swarm, 0, 40)  # 40% in: the kill at 10 s of 20 s is at 50%
    assert churn._bring_forward(swarm, _plan(pending), pending, 5.0) == pending
    _at_step(swarm, 0, 55)
    moved = churn._bring_forward(swarm, _plan(pending), pending, 5.0)
    assert moved == [E(5.0, "kill", 0), E(9.0, "restart", 0)]
    # never before the schedule's earliest kill
    assert churn._bring_forward(swarm, _plan(pending, earliest_s=6.0), pending, 5.0) == pending


def test_only_a_nodes_next_kill_comes_early_never_a_second_one_before_its_restart(
    swarm: Any,
) -> None:
    """A node far ahead of the plan qualifies for both of its kills at once; moving both
    to now made the second kill find the node down (skipped, and its restart with it)."""
    pending = [E(6.0, "kill", 0), E(8.0, "restart", 0), E(10.0, "kill", 0), E(12.0, "restart", 0)]
    _at_step(swarm, 0, 90)  # past both kills' shares of the plan (30% and 50%)
    moved = churn._bring_forward(swarm, _plan(pending), pending, 5.0)
    assert moved == [
        E(5.0, "kill", 0),
        E(7.0, "restart", 0),
        E(10.0, "kill", 0),
        E(12.0, "restart", 0),
    ]


def test_a_kill_is_not_brought_forward_into_another_nodes_outage(swarm: Any) -> None:
    pending = [E(6.0, "kill", 1), E(10.0, "restart", 1), E(12.0, "kill", 0), E(16.0, "restart", 0)]
    _at_step(swarm, 0, 80)
    # at 5 s: node 0's outage moved to 5-9 s would overlap node 1's (6-10 s): two of
    # three down, below min_live 2
    assert churn._bring_forward(swarm, _plan(pending), pending, 5.0) == pending
    # node 1 down now (killed at 6 s, back at 10 s): the same
    swarm.nodes[1].proc.kill()
    swarm.nodes[1].proc.wait(10)
    later = pending[1:]
    assert churn._bring_forward(swarm, _plan(later), later, 7.0) == later
    # once node 1 is back, node 0's kill comes at once
    swarm.nodes[1].proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    last = pending[2:]
    assert churn._bring_forward(swarm, _plan(last), last, 10.5) == [
        E(10.5, "kill", 0),
        E(14.5, "restart", 0),
    ]


def test_a_due_kill_waits_for_the_nodes_first_checkpoint(swarm: Any) -> None:
    pending = [E(3.0, "kill", 0), E(7.0, "restart", 0)]
    waited = churn._wait_for_checkpoint(swarm, _plan(pending), pending, 3.0)
    assert waited == [E(3.5, "kill", 0), E(7.5, "restart", 0)]
    _checkpoint(swarm, 0)
    assert churn._wait_for_checkpoint(swarm, _plan(waited), waited, 3.5) == waited
    # a kill not due yet is left alone, checkpoint or not
    ahead = [E(9.0, "kill", 2), E(13.0, "restart", 2)]
    assert churn._wait_for_checkpoint(swarm, _plan(ahead), ahead, 3.5) == ahead


def test_a_kill_put_off_lands_after_another_outage_rather_than_inside_it(swarm: Any) -> None:
    # node 0 (no checkpoint) is due at 3 s; node 2 goes down at 3.2 s until 7 s: putting
    # node 0 off by 0.5 s would overlap, so it waits until node 2 is back
    pending = [E(3.0, "kill", 0), E(3.2, "kill", 2), E(7.0, "restart", 0), E(7.0, "restart", 2)]
    waited = churn._wait_for_checkpoint(swarm, _plan(pending), pending, 3.0)
    assert E(7.0, "kill", 0) in waited and E(11.0, "restart", 0) in waited, waited
    assert E(3.2, "kill", 2) in waited

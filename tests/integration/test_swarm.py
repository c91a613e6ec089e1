"""The swarm end to end: real ``atoll bootstrap`` and ``atoll node`` processes on 127.0.0.1.

Each test starts its own bootstrap peer and nodes (the ``local_swarm`` fixture of
conftest.py) training the tiny model with syncs every 10 steps, and reads what every node
reports (its JSON summary: losses, rounds, and the (fragment, version, digest) of every
global copy it held).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from atoll.node.net.faults import descendants

CLI = [sys.executable, "-m", "atoll.node.cli"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_four_peers_train_and_hold_bit_identical_global_fragments(local_swarm: Any) -> None:
    swarm = local_swarm
    swarm.start_bootstrap()
    run = swarm.write_manifest("run", swarm.manifest())
    nodes = [swarm.start_node(f"n{i}", run, steps=40, wait_peers=3) for i in range(4)]
    for node in nodes:
        assert node.wait(180) == 0, node.tail()
    for node in nodes:
        s = node.summary
        assert s is not None, node.tail()
        assert s["last_loss"] < s["first_loss"] - 0.5, (node.name, s["first_loss"], s["last_loss"])
        assert s["rounds_applied"] >= 2, node.tail()
        assert s["info"]["peers_seen"] == 3
    # after every completed round, its members hold bit-identical global fragments
    assert swarm.agreeing_rounds(nodes)
    assert max(swarm.members_per_round(nodes).values()) == 4  # some round had all four
    # nodes that finish together settle every fragment: they end on one global copy
    assert all(n.summary["settled"] for n in nodes), [n.summary["settle_detail"] for n in nodes]
    assert len({n.summary["global_digest"] for n in nodes}) == 1


@pytest.mark.parametrize("point", ["start", "part_sent", "parts_sent"])
def test_a_peer_killed_mid_round_leaves_the_others_committed_identical_or_unchanged(
    local_swarm: Any, point: str
) -> None:
    """The victim's network process SIGKILLs itself in its first round of fragment 0 at
    slot 1 or later (the slot it runs one; on a busy machine it can spend slot 1 alone):
    before it sends any part, after its first part, after all of them (ATOLL_FAULT)."""
    swarm = local_swarm
    swarm.start_bootstrap()
    text = swarm.manifest(timeouts={"part_s": 5.0, "round_s": 8.0})
    run = swarm.write_manifest("run", text)
    survivors = [swarm.start_node(f"n{i}", run, steps=40, wait_peers=2) for i in range(2)]
    victim = swarm.start_node(
        "victim", run, steps=40, wait_peers=2, env={"ATOLL_FAULT": f"kill:{point}:0:1"}
    )
    assert victim.wait(180) != 0  # its trainer reports the dead network process
    assert "network process died" in victim.stderr()
    died = re.search(
        r"fault injection: fragment 0 slot (\d+) \(\d+ members\): killing", victim.stderr()
    )
    assert died is not None, victim.tail()
    slot = int(died.group(1))
    for node in survivors:
        assert node.wait(180) == 0, node.tail()
    statuses = []
    for node in survivors:
        # every attempt of fragment 0's round at that slot's version (the victim died in
        # one of them)
        attempts = [
            (st, secs) for p, v, st, secs, _ in node.info()["outcomes"] if (p, v) == (0, slot)
        ]
        assert attempts, node.tail()
        for status, secs in attempts:
            statuses.append(status)
            # never a partial result: applied whole, failed, or not in a group at all
            assert status in ("applied", "failed", "alone", "none"), (node.name, status)
            # bounded: matchmaking plus the round's own timeout, plus the last sends' linger
            assert secs < 6.0 + 8.0 + 10.0, (node.name, secs)
        assert node.summary["rounds_applied"] >= 2  # and the swarm trained on
    assert {"applied", "failed"} & set(statuses)  # the victim died in a round with a survivor
    swarm.agreeing_rounds(survivors)  # committed rounds hold identical bytes


@pytest.mark.timeout(600)
def test_a_peer_frozen_mid_round_costs_the_others_the_measured_deadline(local_swarm: Any) -> None:
    """The victim's network process freezes (SIGSTOP: its connections stay open and
    nothing answers, as over a link that went silent) once its parts of fragment 0's
    round at slot 6 or later are out, after the deadlines had earlier rounds to learn
    from. The survivors, holding every part but never the victim's reduced chunk, fail
    that round whole at the measured deadline, well before the manifest's round_s (40 s
    here: what fixed deadlines would wait), and train on without it."""
    swarm = local_swarm
    swarm.start_bootstrap()
    round_s = 40.0
    run = swarm.write_manifest("run", swarm.manifest(timeouts={"part_s": 20.0, "round_s": round_s}))
    # every node trains until it is stopped: on a busy machine the victim's first rounds
    # at slot 6 can come late, and survivors that stopped at a fixed step would be gone
    survivors = [swarm.start_node(f"n{i}", run, steps=100_000, wait_peers=2) for i in range(2)]
    victim = swarm.start_node(
        "victim", run, steps=100_000, wait_peers=2, env={"ATOLL_FAULT": "stop:parts_sent:0:6:3"}
    )
    try:

        def frozen() -> re.Match[str] | None:
            assert victim.proc.poll() is None, victim.tail()
            return re.search(
                r"fault injection: fragment 0 slot (\d+) \(\d+ members\): freezing", victim.stderr()
            )

        def why() -> str:  # fragment 0's story at the victim, and where the others are
            lines = [x for x in victim.stderr().splitlines() if "fragment 0" in x]
            return "\n".join([*lines[-40:], *(n.tail(10) for n in survivors)])

        ran_out = "fragment 0: the round ran out at its measured deadline"
        slot = int(swarm.wait_until(frozen, 360, why).group(1))
        before = sum(n.stderr().count(ran_out) for n in survivors)  # at least 3 s ahead

        # the survivors get past that slot, and one of them ran out of the round with the
        # victim (a slow victim can freeze in a slot that the survivors had long passed:
        # their steps alone do not say that its round has ended); then the frozen peer
        # goes for good
        def past() -> bool:
            assert all(n.proc.poll() is None for n in survivors), [n.tail() for n in survivors]
            steps = all(n.progress.get("step", 0) >= 10 * (slot + 2) for n in survivors)
            return steps and sum(n.stderr().count(ran_out) for n in survivors) > before

        swarm.wait_until(past, 240, lambda: "\n".join(n.tail() for n in survivors))
    finally:
        for pid in descendants(victim.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        victim.proc.kill()
        victim.proc.wait(30)
    for node in survivors:
        node.proc.send_signal(signal.SIGINT)
    for node in survivors:
        assert node.wait(120) == 0, node.tail()
    failed = []
    for node in survivors:
        for p, v, status, secs, _ in node.info()["outcomes"]:
            if (p, v) == (0, slot) and status == "failed":
                failed.append(secs)
        assert node.summary["rounds_applied"] >= 4, node.tail()
    assert failed, [n.tail() for n in survivors]  # a survivor was in the victim's round
    # the sync's seconds: the round's measured deadline (3 s at least) plus matchmaking
    assert max(failed) < round_s / 2, failed
    assert any("ran out at its measured deadline" in n.stderr() for n in survivors)
    swarm.agreeing_rounds(survivors)


def test_a_late_peer_finds_the_swarm_through_the_dht_and_catches_up(local_swarm: Any) -> None:
    swarm = local_swarm
    swarm.start_bootstrap()
    run = swarm.write_manifest("run", swarm.manifest())
    # the early nodes train until they are stopped, after the late one ends: how many
    # steps the late node's join takes (start-up, certified copies of a swarm that moves
    # on every few seconds) varies with the machine's load, and early nodes that stopped
    # at a fixed step could be gone before it trained beside them
    early = [swarm.start_node(f"n{i}", run, steps=100_000, wait_peers=1) for i in range(2)]
    deadline_steps = 25

    def early_at_step() -> bool:
        assert all(n.proc.poll() is None for n in early), [n.tail() for n in early]
        return min(n.progress.get("step", 0) for n in early) >= deadline_steps

    swarm.wait_until(early_at_step, 240, lambda: "\n".join(n.tail() for n in early), interval_s=0.5)
    late = swarm.start_node("late", run, steps=60)
    try:
        assert late.wait(300) == 0, late.tail()
    finally:
        for node in early:
            node.proc.send_signal(signal.SIGINT)
    for node in early:
        assert node.wait(120) == 0, node.tail()
    s = late.summary
    assert s["start_step"] >= deadline_steps  # it took the swarm's step with the state
    assert s["rebases"] >= 1  # it copied the global fragments it lacked
    assert s["rounds_applied"] >= 1, late.tail()
    assert s["info"]["peers_seen"] == 2
    swarm.agreeing_rounds([*early, late])


@pytest.mark.timeout(900)
def test_two_manifests_do_not_mix_and_wrong_joins_say_why(local_swarm: Any) -> None:
    swarm = local_swarm
    swarm.start_bootstrap()
    run_a = swarm.write_manifest("a", swarm.manifest("run-a"))
    run_b = swarm.write_manifest("b", swarm.manifest("run-b"))
    # every node trains until it is stopped: the wrong join below needs a live peer of run
    # a however long the wrong node's cold start takes (over a minute on a busy 2-core
    # machine, beside four training nodes), and each node stops once it applied a round
    a = [swarm.start_node(f"a{i}", run_a, steps=100_000, wait_peers=1) for i in range(2)]
    b = [swarm.start_node(f"b{i}", run_b, steps=100_000, wait_peers=1) for i in range(2)]

    # a node of run b told to join a node of run a: refused, with the reason
    def address_of_a0() -> str:
        assert a[0].proc.poll() is None, a[0].tail()
        lines = [line for line in a[0].stderr().splitlines() if "listening on" in line]
        return lines[0].split("listening on ")[1].split(",")[0].strip() if lines else ""

    addr_a = swarm.wait_until(address_of_a0, 240, lambda: f"a0 listening:\n{a[0].tail()}")
    wrong = swarm.start_node("wrong", run_b, steps=5, join=[addr_a])
    assert wrong.wait(240) == 2, wrong.tail()
    assert "another run" in wrong.stderr(), wrong.tail()
    assert a[0].proc.poll() is None  # the refusal came from a live peer of run a

    # atoll status lists both runs, each with its two peers, from the bootstrap's records
    # (asked again until all four are published: a publication may take a while)
    out = swarm.tmp / "status.json"

    def both_runs() -> tuple[subprocess.CompletedProcess[str], dict[str, set[str]]] | None:
        done = subprocess.run(
            [*CLI, "status", "--join", swarm.addr, "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        by_run: dict[str, set[str]] = {}
        for p in json.loads(out.read_text())["peers"]:
            by_run.setdefault(p["run_id"], set()).add(p["peer_id"])
        assert all(len(v) <= 2 for v in by_run.values()), done.stdout  # never a third peer
        return (done, by_run) if sorted(len(v) for v in by_run.values()) == [2, 2] else None

    done, _ = swarm.wait_until(
        both_runs, 240, "both runs with their two peers in atoll status", interval_s=2
    )
    assert "2 peer(s)" in done.stdout

    for node in [*a, *b]:
        swarm.wait_until(
            lambda n=node: n.progress.get("rounds_applied", 0) >= 1 or n.proc.poll() is not None,
            300,
            lambda n=node: f"{n.name} applying a round:\n{n.tail()}",
            interval_s=0.5,
        )
    for node in [*a, *b]:
        node.proc.send_signal(signal.SIGINT)
    for node in [*a, *b]:
        assert node.wait(60) == 0, node.tail()
        assert node.summary["info"]["peers_seen"] == 1, node.name  # its own run's peer only
        assert node.summary["rounds_applied"] >= 1, node.tail()
    assert a[0].summary["run_id"] != b[0].summary["run_id"]
    swarm.agreeing_rounds(a)
    swarm.agreeing_rounds(b)


def test_an_unreachable_join_address_fails_with_the_reason(local_swarm: Any) -> None:
    swarm = local_swarm
    run = swarm.write_manifest("run", swarm.manifest())
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWKGJFTEkwV7MauqW5jpfsNoZRAr5BJ1EuKu8mDygbn3c6"
    node = swarm.start_node("n", run, steps=5, join=[dead], extra=("--join-timeout-s", "3"))
    assert node.wait(90) == 2
    err = node.stderr()
    assert "cannot join the swarm" in err and "unreachable" in err, err[-2000:]
    assert "Traceback" not in err


def test_ctrl_c_stops_a_node_cleanly_within_seconds(local_swarm: Any) -> None:
    swarm = local_swarm
    swarm.start_bootstrap()
    run = swarm.write_manifest("run", swarm.manifest())
    node = swarm.start_node("n", run, steps=100_000)

    def stepping() -> bool:
        assert node.proc.poll() is None, node.tail()
        return bool(node.progress.get("step", 0) >= 5)

    swarm.wait_until(stepping, 240, lambda: node.tail())
    node.proc.send_signal(signal.SIGINT)
    t_stop = time.monotonic()
    assert node.wait(30) == 0, node.tail()
    assert time.monotonic() - t_stop < 15
    assert node.summary["stopped_by"] == "SIGINT"
    assert "Traceback" not in node.stderr()


def test_a_finish_request_ends_a_run_with_every_fragment_settled(local_swarm: Any) -> None:
    """SIGUSR1 ends a run at a time of the caller's choosing, not a step count: unlike
    Ctrl+C (a leave), the nodes finish as at their last step, settle every fragment onto
    the swarm's copy, and report the same global copy."""
    swarm = local_swarm
    swarm.start_bootstrap()
    run = swarm.write_manifest("run", swarm.manifest())
    nodes = [swarm.start_node(f"n{i}", run, steps=100_000, wait_peers=1) for i in range(2)]

    def synced() -> bool:
        assert all(n.proc.poll() is None for n in nodes), [n.tail() for n in nodes]
        return all(n.progress.get("step", 0) >= 25 for n in nodes)

    swarm.wait_until(synced, 300, lambda: "\n".join(n.tail() for n in nodes))
    for n in nodes:
        n.proc.send_signal(signal.SIGUSR1)
    for n in nodes:
        assert n.wait(120) == 0, n.tail()
        assert n.summary is not None and n.summary["stopped_by"] == "SIGUSR1", n.tail()
        assert n.summary["settled"], n.tail()
        assert n.summary["steps"] < 100_000
        assert "end of run" in n.stderr() and "Traceback" not in n.stderr()
    assert nodes[0].summary["global_digest"] == nodes[1].summary["global_digest"]
    swarm.agreeing_rounds(nodes)


def test_atoll_demo_runs_a_small_swarm_and_writes_its_summary(tmp_path: Any) -> None:
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [
            *CLI,
            "demo",
            "--nodes",
            "2",
            "--steps",
            "30",
            "--H",
            "10",
            "--tau",
            "3",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and len(summary["nodes"]) == 2
    for node in summary["nodes"]:
        assert node["last_loss"] < node["first_loss"]
        assert node["rounds_applied"] >= 1
    assert summary["bytes_ratio"] > 10  # far fewer bytes than data-parallel
    assert "data-parallel would have sent" in done.stderr


def test_a_second_node_with_the_same_identity_is_refused(local_swarm: Any) -> None:
    swarm = local_swarm
    swarm.start_bootstrap()
    run = swarm.write_manifest("run", swarm.manifest())
    first = swarm.start_node("same", run, steps=100_000)

    def listening() -> bool:
        assert first.proc.poll() is None, first.tail()
        return "listening on" in first.stderr()

    swarm.wait_until(listening, 240, lambda: first.tail())
    same_key = str(swarm.tmp / "same.key")  # the first node's identity file
    second = swarm.start_node("second", run, steps=5, extra=("--identity", same_key))
    assert second.wait(180) == 2
    err = second.stderr()
    assert "already running with identity" in err and "Traceback" not in err, err[-1500:]
    assert first.proc.poll() is None  # the running node is untouched


def test_a_slow_node_trains_at_its_own_pace_beside_fast_ones(local_swarm: Any) -> None:
    """Two nodes at full speed and one three times slower (``ATOLL_SLOWDOWN=3``: it
    sleeps twice each step's compute time, a laptop beside GPUs), 40 steps each. The slow
    node is never held for the others (it trains at its own pace), it reaches groups in
    time and takes part in rounds with both fast nodes, whose rounds leave all members
    with bit-identical copies. What the fast nodes pay for it: they wait for it within
    the grace window at each slot (the waits in their summaries)."""
    swarm = local_swarm
    swarm.start_bootstrap()
    run = swarm.write_manifest("run", swarm.manifest())
    fast = [swarm.start_node(f"fast{i}", run, steps=40, wait_peers=2) for i in range(2)]
    slow = swarm.start_node("slow", run, steps=40, wait_peers=2, env={"ATOLL_SLOWDOWN": "3"})
    nodes = [*fast, slow]
    for node in nodes:
        assert node.wait(220) == 0, node.tail()
    for node in nodes:
        s = node.summary
        assert s is not None, node.tail()
        assert s["last_loss"] < s["first_loss"] - 0.5, (node.name, s["first_loss"], s["last_loss"])
        assert s["rounds_applied"] >= 2, node.tail()
    s = slow.summary
    assert s is not None
    # it slept twice its compute time and waited for the network little beside that
    assert s["compute_s"] * 2.5 <= s["wall_s"], s
    assert s["net_wait_s"] < 0.25 * s["wall_s"], s
    assert swarm.agreeing_rounds(nodes)
    assert max(swarm.members_per_round(nodes).values()) == 3  # rounds with all three

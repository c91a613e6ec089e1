"""Reachability by dial-back, in the NAT lab: ``atoll doctor`` run in a public namespace
finds its port reached by the bootstrap peer; run behind a cone, a symmetric or a double
NAT it finds it is not, and says what to do. Real ``atoll bootstrap`` and ``atoll doctor``
processes in network namespaces; skipped, with the reason, where the lab cannot be built.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atoll.node.natlab import NatLab
from atoll.node.netlab import available

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_why = available()
if _why is not None:
    pytestmark.append(pytest.mark.skip(reason=_why))

CLI = [sys.executable, "-m", "atoll.node.cli"]
KINDS = ("cone", "symmetric", "double")
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatLab, str, Path]]:
    """The lab with a second public node, and a bootstrap peer on public node 0; its
    address."""
    work = tmp_path_factory.mktemp("reach")
    with NatLab(public=2, homes=KINDS) as lab:
        addr_file = work / "bootstrap.addr"
        boot = subprocess.Popen(
            [
                *lab.public_prefix(0),
                *CLI,
                "bootstrap",
                "--identity",
                str(work / "bootstrap.key"),
                "--listen",
                f"/ip4/{lab.public_ip(0)}/tcp/4001",
                "--addr-file",
                str(addr_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(work / "bootstrap.err").open("w"),
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not (addr_file.exists() and addr_file.read_text().strip()):
                assert boot.poll() is None, (work / "bootstrap.err").read_text()
                assert time.monotonic() < deadline, "no bootstrap address in time"
                time.sleep(0.2)
            yield lab, addr_file.read_text().split()[0], work
        finally:
            boot.terminate()
            try:
                boot.wait(10)
            except subprocess.TimeoutExpired:
                boot.kill()
                boot.wait(5)


def _doctor(prefix: list[str], join: str, work: Path) -> tuple[int, dict[str, str]]:
    done = subprocess.run(
        [
            *prefix,
            *CLI,
            "doctor",
            "--listen",
            "/ip4/0.0.0.0/tcp/4002",
            "--join",
            join,
            "--checkpoint-dir",
            str(work / "ck"),
            "--timeout-s",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    lines = {}
    for line in done.stdout.splitlines():
        verdict, _, rest = line.partition("  ")
        name, _, detail = rest.strip().partition(": ")
        lines[name] = f"{verdict.strip()} {detail}"
    assert {"torch", "disk", "port", "reachability", "clock"} <= set(lines), (
        done.stdout + done.stderr
    )
    return done.returncode, lines


def test_a_public_node_is_reachable(swarm: tuple[NatLab, str, Path]) -> None:
    lab, join, work = swarm
    code, lines = _doctor(lab.public_prefix(1), join, work)
    assert code == 0
    assert lines["reachability"].startswith(
        "ok reachable: peers dialed this node back at port 4002"
    )
    assert f"seen as {lab.public_ip(1)}:" in lines["reachability"]
    assert lines["clock"].startswith("ok ")


@pytest.mark.parametrize("h", range(len(KINDS)), ids=list(KINDS))
def test_a_home_node_behind_a_nat_is_told_it_is_not_reachable(
    swarm: tuple[NatLab, str, Path], h: int
) -> None:
    lab, join, work = swarm
    code, lines = _doctor(lab.home_prefix(h), join, work)
    assert code == 0  # a warning, not a failure: the node can still take part
    reach = lines["reachability"]
    assert reach.startswith("warn not reachable: 1 peers could not dial this node back"), reach
    assert f"seen as {lab.wan_ip(h)}:" in reach and "forward its listen port" in reach


def _node(
    local_swarm: Any, where: list[str], name: str, run: Path, join: str, wait_peers: int = 1
) -> Any:
    """An ``atoll node`` in the lab namespace of command prefix ``where``."""
    return local_swarm.start_node(
        name,
        run,
        steps=40,
        join=[join],
        wait_peers=wait_peers,
        prefix=tuple(where),
        listen="/ip4/0.0.0.0/tcp/4010",
    )


def test_a_home_node_joins_through_the_bootstrap_and_trains_with_a_public_one(
    swarm: tuple[NatLab, str, Path], local_swarm: Any
) -> None:
    """The home node (cone NAT) dials out; the public node answers on the connections
    the home node opened. Both apply rounds together and know which of them is
    reachable."""
    lab, join, work = swarm
    run = work / "home-run.toml"
    run.write_text(local_swarm.manifest("home-run", total_steps=200))
    nodes = {
        "public": _node(local_swarm, lab.public_prefix(1), "public", run, join),
        "home": _node(local_swarm, lab.home_prefix(KINDS.index("cone")), "home", run, join),
    }
    summaries = _train(nodes)
    assert summaries["public"]["info"]["reach"] == "public"
    assert summaries["home"]["info"]["reach"] == "private"
    assert "not reachable" in nodes["home"].stderr()


def _train(nodes: dict[str, Any]) -> dict[str, Any]:
    """Wait for every node to end; their summaries, each with a round applied."""
    for node in nodes.values():
        assert node.wait(400) == 0, node.tail(60)
        assert node.info()["rounds_applied"] >= 1, node.tail(60)
    return {name: node.summary for name, node in nodes.items()}


def test_two_home_nodes_are_never_grouped_together(
    swarm: tuple[NatLab, str, Path], local_swarm: Any
) -> None:
    """Two home nodes (behind a cone and a symmetric NAT) cannot dial each other: a
    group holding both would fail its round for all its members. A home node is grouped
    with the public node only. Which home node gets the public one at a slot is first
    come: idle, each applied 5-6 rounds in 40 steps; on a busy machine one got all."""
    lab, join, work = swarm
    run = work / "two-homes.toml"
    run.write_text(local_swarm.manifest("two-homes", total_steps=200))
    where = {
        "public2": lab.public_prefix(1),
        "cone": lab.home_prefix(KINDS.index("cone")),
        "sym": lab.home_prefix(KINDS.index("symmetric")),
    }
    nodes = {name: _node(local_swarm, w, name, run, join, 2) for name, w in where.items()}
    for node in nodes.values():
        assert node.wait(400) == 0, node.tail(60)
    summaries = {name: node.summary for name, node in nodes.items()}
    assert summaries["public2"]["info"]["rounds_applied"] >= 1, nodes["public2"].tail(60)
    assert max(summaries[n]["info"]["rounds_applied"] for n in ("cone", "sym")) >= 1
    assert {summaries[n]["info"]["reach"] for n in ("cone", "sym")} == {"private"}
    # the logs name each applied round's members by the last 6 characters of their ids
    homes = {summaries[n]["info"]["peer_id"][-6:] for n in ("cone", "sym")}
    groups = [g for node in nodes.values() for g in _members(node.stderr())]
    assert not [g for g in groups if homes <= g], groups


def _members(log: str) -> list[set[str]]:
    """The members of every round a node's log says it applied."""
    return [
        set(m.group(1).split(", ")) for m in re.finditer(r": applied;.*?; members: ([^;]+);", log)
    ]

"""Fixtures of the integration tests: a real local swarm of ``atoll bootstrap`` and
``atoll node`` processes (``local_swarm``).

Every process is a real ``python -m atoll.node.cli`` child on 127.0.0.1 (port 0); the
harness reads the nodes' JSON lines (``--progress jsonl``) and their stderr files.

``wait_until`` (a function here, a fixture for the test modules) waits for a condition
with a deadline, instead of a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CLI = [sys.executable, "-m", "atoll.node.cli"]
START_TIMEOUT_S = 120  # a cold start of a process on a busy 2-core machine


def wait_until(
    cond: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    interval_s: float = 0.1,
) -> Any:
    """Poll ``cond`` until it returns a true value, and return that value; after
    ``timeout_s`` (on ``time.monotonic``) raise AssertionError saying ``what`` was not
    seen (``what`` may be a callable, called only then, to add a log's tail).

    For waits on other processes: give ``timeout_s`` the slack of a busy 2-core machine,
    where a cold start of a node takes a minute. An AssertionError that ``cond`` raises
    (a process that died, say) ends the wait at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"not within {timeout_s} s: {text}")
        time.sleep(interval_s)


def manifest(name: str = "swarm-test", **overrides: Any) -> str:
    """A small, fast run: the tiny model, 4 sequences per step, syncs every 10 steps."""
    top = {
        "name": name,
        "model": "tiny",
        "batch_size": 4,
        "lr": 3e-3,
        "warmup": 5,
        "total_steps": 200,
        "H": 10,
        "tau": 3,
        "blocks_per_fragment": 2,
        **{k: v for k, v in overrides.items() if k not in ("group", "timeouts")},
    }
    group = {"min_quorum": 2, "max_size": 8, "grace_s": 3.0, **overrides.get("group", {})}
    timeouts = {
        "matchmaking_s": 6.0,
        "part_s": 8.0,
        "round_s": 15.0,
        "apply_wait_s": 3.0,
        **overrides.get("timeouts", {}),
    }

    def value(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {value(v)}" for k, v in top.items()]
    lines += ["", "[group]", *(f"{k} = {value(v)}" for k, v in group.items())]
    lines += ["", "[timeouts]", *(f"{k} = {value(v)}" for k, v in timeouts.items())]
    return "\n".join(lines) + "\n"


@dataclass
class NodeProc:
    name: str
    proc: subprocess.Popen[str]
    err_path: Path
    progress: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    reader: threading.Thread | None = None

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(
                f"{self.name} did not finish in {timeout_s} s:\n{self.tail()}"
            ) from None
        if self.reader is not None:
            self.reader.join(5)
        return code

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.stderr().splitlines()[-n:])

    def info(self) -> dict[str, Any]:
        assert self.summary is not None, f"{self.name} wrote no summary:\n{self.tail()}"
        info: dict[str, Any] = self.summary["info"]
        return info


def _read(node: NodeProc) -> None:
    assert node.proc.stdout is not None
    for line in node.proc.stdout:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "progress" in msg:
            node.progress = msg["progress"]
        elif "summary" in msg:
            node.summary = msg["summary"]


class LocalSwarm:
    """A bootstrap peer plus nodes, all stopped (and killed if need be) on close."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.nodes: list[NodeProc] = []
        self.boot: subprocess.Popen[str] | None = None
        self.addr = ""

    def start_bootstrap(self) -> str:
        addr_file = self.tmp / "bootstrap.addr"
        self.boot = subprocess.Popen(
            [
                *CLI,
                "bootstrap",
                "--identity",
                str(self.tmp / "bootstrap.key"),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--addr-file",
                str(addr_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / "bootstrap.err").open("w"),
            text=True,
        )
        boot = self.boot

        def started() -> str:
            text = addr_file.read_text() if addr_file.exists() else ""
            assert text.strip() or boot.poll() is None, (self.tmp / "bootstrap.err").read_text()
            return text.strip()

        text = wait_until(started, START_TIMEOUT_S, "the bootstrap peer's address file")
        self.addr = text.split()[0]
        return self.addr

    def write_manifest(self, name: str, text: str) -> Path:
        path = self.tmp / f"{name}.toml"
        path.write_text(text)
        return path

    def start_node(
        self,
        name: str,
        run: Path,
        *,
        steps: int,
        join: list[str] | None = None,
        wait_peers: int = 0,
        env: dict[str, str] | None = None,
        extra: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
        listen: str = "/ip4/127.0.0.1/tcp/0",
    ) -> NodeProc:
        """An ``atoll node`` process; ``prefix`` runs it inside a network namespace (a
        lab's ``ip netns exec ...``), listening on ``listen``."""
        err = self.tmp / f"{name}.err"
        args = [
            *prefix,
            *CLI,
            "-v",
            "node",
            "--run",
            str(run),
            "--identity",
            str(self.tmp / f"{name}.key"),
            "--listen",
            listen,
            "--steps",
            str(steps),
            "--progress",
            "jsonl",
            "--log-every",
            "5",
            "--threads",
            "1",
            "--eval-batches",
            "2",
            "--wait-peers",
            str(wait_peers),
            "--join-timeout-s",
            "60",
            *extra,
        ]
        joins = join if join is not None else ([self.addr] if self.addr else [])
        for addr in joins:
            args += ["--join", addr]
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=err.open("w"),
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        node = NodeProc(name, proc, err)
        node.reader = threading.Thread(target=_read, args=(node,), daemon=True)
        node.reader.start()
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGINT)
        for node in self.nodes:
            try:
                node.proc.wait(20)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)
        if self.boot is not None and self.boot.poll() is None:
            self.boot.send_signal(signal.SIGINT)
            try:
                self.boot.wait(10)
            except subprocess.TimeoutExpired:
                self.boot.kill()
                self.boot.wait(5)


def agreeing_rounds(nodes: list[NodeProc]) -> dict[tuple[int, str], str]:
    """Every completed round (fragment, "slot/leader") with the one digest its members
    hold after it; AssertionError when two members of one group hold different bytes."""
    seen: dict[tuple[int, str], tuple[str, str]] = {}
    for node in nodes:
        for p, version, digest, round_id in node.info()["history"]:
            if round_id == "rebase":
                continue
            key = (p, round_id)
            if key in seen:
                other, digest0 = seen[key]
                assert digest == digest0, (
                    f"fragment {p} round {round_id} (version {version}): {node.name} holds "
                    f"{digest}, {other} holds {digest0}"
                )
            else:
                seen[key] = (node.name, digest)
    return {k: d for k, (_, d) in seen.items()}


def members_per_round(nodes: list[NodeProc]) -> dict[tuple[int, str], int]:
    """(fragment, "slot/leader") of every completed round and how many nodes committed it."""
    count: dict[tuple[int, str], int] = {}
    for node in nodes:
        for p, _, _, round_id in node.info()["history"]:
            if round_id != "rebase":
                count[(p, round_id)] = count.get((p, round_id), 0) + 1
    return count


# the tests reach the helpers through the fixture (test modules cannot import conftest)
LocalSwarm.manifest = staticmethod(manifest)  # type: ignore[attr-defined]
LocalSwarm.agreeing_rounds = staticmethod(agreeing_rounds)  # type: ignore[attr-defined]
LocalSwarm.members_per_round = staticmethod(members_per_round)  # type: ignore[attr-defined]
LocalSwarm.wait_until = staticmethod(wait_until)  # type: ignore[attr-defined]


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    """A :class:`LocalSwarm` in ``tmp_path``; every process is stopped at the end."""
    swarm = LocalSwarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    """:func:`wait_until`, for test modules (they cannot import conftest)."""
    return wait_until

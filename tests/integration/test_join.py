"""Joining through ``--join`` addresses on 127.0.0.1: told within the join timeout, one line.

Two levels: :func:`~atoll.node.net.join.join_swarm` on a real host and DHT in one trio
loop, against real sockets (a port nobody listens on, a listener that never answers, a
peer of another run, a private run that refuses this node, a good peer next to a dead
one), and a real ``atoll node`` process whose join fails. Every bound is a deadline on the
monotonic clock, loose enough for a busy 2-core machine; no fixed sleeps.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import trio

from atoll.dht.kad import AtollDHT
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier, SystemClock
from atoll.node.net.host import AtollHost, HostConfig, open_host
from atoll.node.net.join import JoinFailed, join_swarm
from atoll.protocol.errors import AtollError, ConfigError
from atoll.security.identity import Identity, generate
from atoll.security.membership import Membership, issue

pytestmark = pytest.mark.integration

RUN = "a1" * 32
OTHER_RUN = "b2" * 32
CONFIG = HostConfig(dial_timeout_s=20.0, hello_timeout_s=20.0, send_timeout_s=30.0)
DIAL_S = 20.0  # the manifest's dial_s: longer than every join timeout below
SLACK_S = 3.0  # what a busy 2-core machine may add to a deadline (asserted: timeout + this)
CLI = [sys.executable, "-m", "atoll.node.cli"]
START_TIMEOUT_S = 180  # a cold start of a node (torch, the model, libp2p) on a busy machine


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port of 127.0.0.1 held by a socket that does not listen: every dial is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextmanager
def silent_port() -> Iterator[int]:
    """A port of 127.0.0.1 whose listener takes TCP connections and never says a word."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def _addr(port: int) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{generate().peer_id}"


def _cert(org: Identity, peer: str) -> bytes:
    now = int(time.time())
    return issue(org, peer, issued_at=now - 60, expires_at=now + 3600)


@asynccontextmanager
async def node(
    identity: Identity | None = None,
    run_id: str = RUN,
    *,
    membership: Membership | None = None,
    certificate: bytes | None = None,
) -> AsyncIterator[tuple[AtollHost, AtollDHT]]:
    """A node's host and DHT on 127.0.0.1, as the swarm worker opens them."""
    me = identity or generate()
    async with (
        open_host(me, run_id, CONFIG, membership=membership, certificate=certificate) as host,
        AtollDHT.start(
            host.libp2p_host,
            run_id=run_id,
            verifier=EnvelopeVerifier(membership),
            signer=EnvelopeSigner(me, certificate),
            clock=SystemClock(),
            timeout_s=10.0,
        ) as dht,
    ):
        yield host, dht


async def _timed_join(
    host: AtollHost, dht: AtollDHT, addrs: list[str], timeout_s: float
) -> tuple[float, Any]:
    """(seconds the join took, what it returned or the AtollError it raised)."""
    t0 = time.monotonic()
    try:
        result: Any = await join_swarm(host, dht, addrs, timeout_s=timeout_s, dial_s=DIAL_S)
    except AtollError as e:
        result = e
    return time.monotonic() - t0, result


def _assert_names_each_address_once(text: str, addrs: list[str]) -> list[str]:
    """One line per address, each address (and its peer id) named once in all the text."""
    lines = text.splitlines()
    assert len(lines) == len(addrs), text
    for line, addr in zip(lines, addrs, strict=True):
        assert addr in line, line
        assert text.count(addr) == 1, text
        assert text.count(addr.rsplit("/p2p/", 1)[1]) == 1, text
    return lines


def _warnings_naming(caplog: pytest.LogCaptureFixture, names: list[str]) -> list[str]:
    """The WARNING-or-worse lines (what a user sees by default) that name any of ``names``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and any(n in r.getMessage() for n in names)
    ]


# -- join_swarm on real sockets -------------------------------------------------------------
@pytest.mark.timeout(120)
def test_an_address_nobody_listens_on_fails_at_the_deadline_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    timeout_s = 3.0

    async def body() -> tuple[float, Any, str]:
        with refusing_port() as port:
            addr = _addr(port)
            async with node() as (host, dht):
                elapsed, error = await _timed_join(host, dht, [addr], timeout_s)
        return elapsed, error, addr

    elapsed, error, addr = trio.run(body)
    assert isinstance(error, JoinFailed), error
    assert timeout_s - 0.05 <= elapsed <= timeout_s + SLACK_S, elapsed  # retried until then
    (line,) = _assert_names_each_address_once(str(error), [addr])
    assert (
        line == f"cannot join the swarm within 3 s through {addr}: unreachable (connection refused)"
    )
    assert not _warnings_naming(caplog, [addr.rsplit("/p2p/", 1)[1]])


@pytest.mark.timeout(120)
def test_a_listener_that_never_answers_is_cut_at_the_deadline() -> None:
    timeout_s = 3.0  # the probe alone would wait DIAL_S + 5 s

    async def body() -> tuple[float, Any, str]:
        with silent_port() as port:
            addr = _addr(port)
            async with node() as (host, dht):
                elapsed, error = await _timed_join(host, dht, [addr], timeout_s)
        return elapsed, error, addr

    elapsed, error, addr = trio.run(body)
    assert isinstance(error, JoinFailed), error
    assert timeout_s - 0.05 <= elapsed <= timeout_s + SLACK_S, elapsed
    (line,) = _assert_names_each_address_once(str(error), [addr])
    assert line.endswith(": unreachable (no answer within 3 s)"), line


@pytest.mark.timeout(120)
def test_a_peer_of_another_run_is_a_final_refusal_told_at_once() -> None:
    timeout_s = 30.0

    async def body() -> tuple[float, Any, str]:
        async with node(run_id=OTHER_RUN) as (other, _), node() as (host, dht):
            addr = other.addrs[0]
            elapsed, error = await _timed_join(host, dht, [addr], timeout_s)
        return elapsed, error, addr

    elapsed, error, addr = trio.run(body)
    assert isinstance(error, ConfigError), error
    assert elapsed < timeout_s / 2, elapsed  # not retried to the deadline
    (line,) = _assert_names_each_address_once(str(error), [addr])
    assert line == (
        f"cannot join the swarm through {addr}: that peer trains another run "
        "(its manifest differs from this one's)"
    )


@pytest.mark.timeout(120)
def test_a_private_run_that_refuses_this_node_is_told_at_once() -> None:
    """A member of a run whose peers hold another manifest (one that revokes it, say):
    they close the stream after its Hello; the join stops there instead of going on
    through a DHT that would refuse it."""
    timeout_s = 30.0
    org, me, peer = generate(), generate(), generate()
    policy = Membership(private=True, org_key=org.public_key)

    async def body() -> tuple[float, Any, str]:
        async with (
            node(peer, OTHER_RUN, membership=policy, certificate=_cert(org, peer.peer_id)) as (
                other,
                _,
            ),
            node(me, membership=policy, certificate=_cert(org, me.peer_id)) as (host, dht),
        ):
            addr = other.addrs[0]
            elapsed, error = await _timed_join(host, dht, [addr], timeout_s)
        return elapsed, error, addr

    elapsed, error, addr = trio.run(body)
    assert isinstance(error, ConfigError), error
    assert elapsed < timeout_s / 2, elapsed
    (line,) = _assert_names_each_address_once(str(error), [addr])
    assert "that peer refused this node" in line and "--cert" in line, line


@pytest.mark.timeout(120)
def test_a_good_peer_next_to_dead_addresses_joins_without_waiting_for_them() -> None:
    timeout_s = 30.0

    async def body() -> tuple[float, Any]:
        with refusing_port() as refused, silent_port() as silent:
            async with node() as (boot, _), node() as (host, dht):
                addrs = [_addr(refused), _addr(silent), boot.addrs[0]]
                return await _timed_join(host, dht, addrs, timeout_s)

    elapsed, joined = trio.run(body)
    assert joined == 1, joined
    assert elapsed < timeout_s / 2, elapsed  # the silent one got its grace, not the timeout


@pytest.mark.timeout(120)
def test_several_failed_addresses_get_one_line_each_within_the_deadline() -> None:
    timeout_s = 3.0

    async def body() -> tuple[float, Any, list[str]]:
        with refusing_port() as refused, silent_port() as silent:
            async with node(run_id=OTHER_RUN) as (other, _), node() as (host, dht):
                addrs = [_addr(refused), _addr(silent), other.addrs[0]]
                elapsed, error = await _timed_join(host, dht, addrs, timeout_s)
        return elapsed, error, addrs

    elapsed, error, addrs = trio.run(body)
    assert isinstance(error, JoinFailed), error
    assert elapsed <= timeout_s + SLACK_S, elapsed
    lines = _assert_names_each_address_once(str(error), addrs)
    assert lines[0].endswith("unreachable (connection refused)"), lines
    assert lines[1].endswith("unreachable (no answer within 3 s)"), lines
    assert "that peer trains another run" in lines[2], lines


# -- a real atoll node process ----------------------------------------------------------------
class _Lines:
    """A process's stderr, line by line, each with the monotonic time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.mark.timeout(START_TIMEOUT_S + 120)
def test_atoll_node_is_told_within_the_join_timeout_in_one_line(local_swarm: Any) -> None:
    timeout_s = 5.0
    run = local_swarm.write_manifest("run", local_swarm.manifest())
    with refusing_port() as port:
        addr = _addr(port)
        argv = [*CLI, "-v", "node", "--run", str(run), "--identity", str(run.with_suffix(".key"))]
        argv += ["--listen", "/ip4/127.0.0.1/tcp/0", "--threads", "1", "--steps", "5"]
        argv += ["--join", addr, "--join-timeout-s", f"{timeout_s:g}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
        lines = _Lines(proc)
        try:
            code = proc.wait(START_TIMEOUT_S + 60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        lines.join(10)
    err = lines.text()
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    began = lines.first("joining the swarm through 1 address")
    told = lines.first("atoll: error:")
    assert began is not None and told is not None, err[-3000:]
    print(
        f"join began {began - lines.lines[0][0]:.1f} s after the first line; told "
        f"{told - began:.2f} s after it began (--join-timeout-s {timeout_s:g})"
    )
    assert timeout_s - 0.5 <= told - began <= timeout_s + SLACK_S, err[-3000:]
    peer = addr.rsplit("/p2p/", 1)[1]
    warnings = [line for _, line in lines.lines if " WARNING " in line and peer in line]
    assert not warnings, warnings  # what a user sees without -v: the error line only
    assert "killing it" not in err, err[-3000:]  # a worker that said why is let exit quietly
    errors = [line for _, line in lines.lines if line.startswith("atoll: error:")]
    assert errors == [
        f"atoll: error: cannot join the swarm within 5 s through {addr}: "
        "unreachable (connection refused)"
    ], err[-3000:]

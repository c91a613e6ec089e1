"""The network-namespace lab (:mod:`atoll.node.netlab`) with real sockets.

Small Python programs run inside the lab's namespaces (``lab.prefix(i)``): a server that
reads a connection to its end and answers with the byte count, and a client that prints
how its connection ended (``ok``, ``refused``, ``timeout``). A silent fault must give
``timeout`` where an open network gives ``ok`` or ``refused``. Skipped, with the reason,
where the lab cannot be built (not root, no iptables, namespaces not permitted).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from atoll.node import netlab
from atoll.node.netlab import LabError, NetLab

REASON = netlab.available()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

PORT = 7000  # every namespace has its own ports
CLOSED = 7001  # nothing listens here
CONNECT_S = 1.5  # a silent peer: the client gives up after this

SERVER = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen(16)
while True:
    c, _ = s.accept()
    n = 0
    while data := c.recv(65536):
        n += len(data)
    c.sendall(str(n).encode())
    c.close()
"""

CLIENT = """
import socket, sys, time
host, port, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
t0 = time.monotonic()
try:
    c = socket.create_connection((host, port), timeout=timeout)
    c.settimeout(30)
    c.sendall(b"x" * size)
    c.shutdown(socket.SHUT_WR)
    got = c.recv(64).decode()
    print("ok" if got == str(size) else f"wrong answer {got!r}", time.monotonic() - t0)
except ConnectionRefusedError:
    print("refused", time.monotonic() - t0)
except TimeoutError:
    print("timeout", time.monotonic() - t0)
except OSError as e:
    print(f"error {e}", time.monotonic() - t0)
"""


def connect(lab: NetLab, src: int, dst: int, port: int = PORT, size: int = 5) -> tuple[str, float]:
    """How a connection from node ``src`` to node ``dst`` ends, and its seconds."""
    argv = [lab.ip(dst), str(port), str(size), str(CONNECT_S)]
    done = subprocess.run(
        [*lab.prefix(src), sys.executable, "-c", CLIENT, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    word, _, seconds = done.stdout.strip().rpartition(" ")
    return word, float(seconds)


@pytest.fixture
def lab(wait_until: Callable[..., Any]) -> Iterator[NetLab]:
    """Three nodes, each with the counting server listening."""
    with NetLab(3) as lab:
        servers = [
            subprocess.Popen([*lab.prefix(i), sys.executable, "-c", SERVER]) for i in range(3)
        ]
        try:
            for i in range(3):
                wait_until(lambda i=i: connect(lab, (i + 1) % 3, i)[0] == "ok", 20, f"server {i}")
            yield lab
        finally:
            for s in servers:
                s.kill()
                s.wait(10)


def test_namespaces_exchange_tcp_and_a_closed_port_refuses(lab: NetLab) -> None:
    assert connect(lab, 0, 1, size=200_000)[0] == "ok"
    assert connect(lab, 2, 0)[0] == "ok"
    assert connect(lab, 0, 1, port=CLOSED)[0] == "refused"  # the network answers with RST
    assert lab.ip(0) != lab.ip(1) and lab.ip(0).startswith("10.231.")


def test_a_cut_node_is_silent_until_healed(lab: NetLab) -> None:
    lab.cut(1)
    # no RST, no ICMP: the connect just times out, to an open port and a closed one alike
    word, seconds = connect(lab, 0, 1)
    assert word == "timeout" and seconds >= CONNECT_S - 0.1
    assert connect(lab, 0, 1, port=CLOSED)[0] == "timeout"
    assert connect(lab, 1, 2)[0] == "timeout"  # nothing leaves it either
    assert connect(lab, 0, 2)[0] == "ok"  # the others are untouched
    lab.heal(1)
    assert connect(lab, 0, 1)[0] == "ok"
    assert connect(lab, 1, 2)[0] == "ok"


def test_a_partition_blocks_across_groups_only(lab: NetLab) -> None:
    lab.partition([[0], [1, 2]])
    assert connect(lab, 0, 1)[0] == "timeout"
    assert connect(lab, 2, 0, port=CLOSED)[0] == "timeout"
    assert connect(lab, 1, 2)[0] == "ok"
    assert connect(lab, 2, 1)[0] == "ok"
    lab.heal_all()
    assert connect(lab, 0, 1)[0] == "ok"
    assert connect(lab, 2, 0)[0] == "ok"


def test_shape_limits_the_rate(lab: NetLab) -> None:
    size = 1_000_000  # 8 Mbit: 2 s at 4 Mbit/s
    fast = connect(lab, 0, 1, size=size)[1]
    lab.shape(1, rate_up="100mbit", rate_down="4mbit")
    word, slow = connect(lab, 0, 1, size=size)
    assert word == "ok"
    assert 1.6 < slow < 6.0, (fast, slow)
    assert connect(lab, 1, 0, size=size)[1] < 1.5  # its upload is not the bottleneck
    lab.shape(1)
    assert connect(lab, 0, 1, size=size)[1] < 1.5


def _lab_namespaces(lab: NetLab) -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines()} & {*lab.names, lab.switch}


def test_close_ends_processes_and_leaves_no_namespace() -> None:
    lab = NetLab(2)
    assert _lab_namespaces(lab) == {*lab.names, lab.switch}
    sleeper = subprocess.Popen([*lab.prefix(1), "sleep", "600"])
    deadline = time.monotonic() + 10
    while not lab.pids(1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lab.pids(1) == [sleeper.pid]
    lab.close()
    assert sleeper.wait(10) != 0  # ended by the lab
    assert _lab_namespaces(lab) == set()
    lab.close()  # idempotent
    with pytest.raises(LabError, match="closed"):
        lab.cut(0)


def test_close_runs_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="inside"), NetLab(2) as lab:
        lab.cut(0)
        raise RuntimeError("inside the lab")
    assert _lab_namespaces(lab) == set()


def test_bad_arguments_are_lab_errors() -> None:
    with pytest.raises(LabError, match="1 to"):
        NetLab(0)
    with pytest.raises(LabError, match="bad rate"):
        netlab.parse_rate("fast")
    assert netlab.parse_rate("1.5Mbit") == 1_500_000
    with NetLab(2) as lab:
        with pytest.raises(LabError, match="no node 2"):
            lab.cut(2)
        with pytest.raises(LabError, match="two groups"):
            lab.partition([[0, 1], [1]])

"""The NAT lab: home nodes behind cone, symmetric and double NAT routers, built of network
namespaces, reach public nodes and are seen at their router's address; nobody dials
them; two cone homes punch a direct TCP connection (a simultaneous open) and a symmetric
one cannot. Real sockets in real namespaces; needs root and iptables (skipped otherwise,
with the reason). Every wait has a deadline."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from atoll.node.natlab import NatLab
from atoll.node.netlab import LabError, available, list_namespaces

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

_why = available()
if _why is not None:
    pytestmark.append(pytest.mark.skip(reason=_why))

KINDS = ("cone", "symmetric", "double", "cone")

# a TCP server on two ports that prints (port, peer address, peer port) per connection
SERVER = """
import json, selectors, socket, sys
sel = selectors.DefaultSelector()
for port in (7000, 7001):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen()
    sel.register(s, selectors.EVENT_READ)
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        c, (host, port) = key.fileobj.accept()
        print(json.dumps([key.fileobj.getsockname()[1], host, port]), flush=True)
        c.close()
"""

# connect from local port sys.argv[2] to sys.argv[1] at 7000, then at 7001
CLIENT = """
import socket, sys
for port in (7000, 7001):
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.settimeout(5)
    c.bind(("0.0.0.0", int(sys.argv[2])))
    c.connect((sys.argv[1], port))
    c.close()
"""

# try to connect to sys.argv[1]:sys.argv[2] within 2 s; print the outcome
DIAL = """
import socket, sys
c = socket.socket()
c.settimeout(2)
try:
    c.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""

# a TCP simultaneous open: bind port sys.argv[2], dial sys.argv[1]:sys.argv[2] again and
# again until connected or the deadline; print the peer address seen or "failed"
PUNCH = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.bind(("0.0.0.0", int(sys.argv[2])))
    c.settimeout(1.0)
    try:
        c.connect((sys.argv[1], int(sys.argv[2])))
    except OSError:
        c.close()
        time.sleep(0.05)
        continue
    print("direct", c.getpeername()[0], c.getsockname()[0], flush=True)
    c.close()
    break
else:
    print("failed", flush=True)
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[NatLab]:
    with NatLab(public=1, homes=KINDS) as built:
        yield built


def _python(prefix: list[str], code: str, *args: str, timeout: float = 30) -> str:
    done = subprocess.run(
        [*prefix, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_home_nodes_dial_out_and_are_seen_at_their_routers_address(lab: NatLab) -> None:
    server = subprocess.Popen(
        [*lab.public_prefix(0), sys.executable, "-c", SERVER],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        for h, kind in enumerate(lab.kinds):
            local = 41000 + h
            _python(lab.home_prefix(h), CLIENT, lab.public_ip(0), str(local))
            seen = [json.loads(server.stdout.readline()) for _ in range(2)]
            assert [s[0] for s in seen] == [7000, 7001]
            # the server sees the home's outer router, never the home's own address
            assert {s[1] for s in seen} == {lab.wan_ip(h)} != {lab.home_ip(h)}
            ports = [s[2] for s in seen]
            if kind == "symmetric":  # a fresh random port per connection
                assert ports[0] != ports[1], ports
            else:  # one mapping for every destination, the port kept
                assert ports == [local, local], (kind, ports)
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.parametrize("h", range(len(KINDS)), ids=list(KINDS))
def test_a_public_node_cannot_dial_a_home_node(lab: NatLab, h: int) -> None:
    """Unsolicited connections are dropped silently at the router (a timeout, as from a
    home router), and the home's private address is not routed."""
    listener = subprocess.Popen(
        [*lab.home_prefix(h), sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert listener.stdout is not None
        assert listener.stdout.readline().strip() == "ready"
        assert _python(lab.public_prefix(0), DIAL, lab.wan_ip(h), "7000") == "TimeoutError"
        assert _python(lab.public_prefix(0), DIAL, lab.home_ip(h), "7000") == "OSError"
    finally:
        listener.kill()
        listener.wait(10)


def _punch(lab: NatLab, a: int, b: int, port: int) -> tuple[str, str]:
    """Homes ``a`` and ``b`` dial each other's router address at ``port`` from ``port``
    at once, for 10 s; what each printed."""
    procs = [
        subprocess.Popen(
            [*lab.home_prefix(x), sys.executable, "-c", PUNCH, lab.wan_ip(y), str(port), "10"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for x, y in ((a, b), (b, a))
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err[-2000:]
        outs.append(out.strip())
    return outs[0], outs[1]


def test_two_cone_homes_punch_a_direct_connection(lab: NatLab) -> None:
    cones = [h for h, k in enumerate(lab.kinds) if k == "cone"]
    first, second = _punch(lab, cones[0], cones[1], 42000)
    # each side's connection runs between the homes' routers: direct, no relay between
    assert first.split()[:2] == ["direct", lab.wan_ip(cones[1])], first
    assert second.split()[:2] == ["direct", lab.wan_ip(cones[0])], second


def test_a_symmetric_home_cannot_punch_to_a_cone_home(lab: NatLab) -> None:
    symmetric = lab.kinds.index("symmetric")
    first, second = _punch(lab, symmetric, lab.kinds.index("cone"), 42001)
    assert (first, second) == ("failed", "failed")


def test_the_lab_is_removed_after_an_error_in_its_block() -> None:
    with pytest.raises(RuntimeError), NatLab(public=1, homes=("double",)) as small:
        names = list(small.lab.namespaces)
        assert set(names) <= set(list_namespaces())
        raise RuntimeError("the test body failed")
    assert not set(names) & set(list_namespaces())
    with pytest.raises(LabError, match="closed"):
        small.home_prefix(0)


def test_bad_settings_are_refused_with_a_clear_error() -> None:
    with pytest.raises(LabError, match="unknown NAT kinds"):
        NatLab(public=1, homes=("full-cone",))
    with pytest.raises(LabError, match="at least one public node"):
        NatLab(public=0, homes=("cone",))

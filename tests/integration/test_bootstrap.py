"""``atoll bootstrap`` as a real process on 127.0.0.1 (port 0).

The bootstrap runs from the CLI's ``main`` under a launcher that reports, after ``main``
returns, whether torch was ever imported: the whole life of the process (start, serving
peers, stop on a signal) is checked, not only the imports of start-up. Peers are the DHT
node processes of ``test_dht_kad.py`` (that file run as a script).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from atoll.dht.keys import peer_key
from atoll.dht.records import PeerRecord
from atoll.protocol.messages import encode_message
from atoll.security.identity import generate

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve()
ATOLL = Path(sys.executable).with_name("atoll")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT_S = 60  # a cold start imports libp2p on a busy 2-core machine
STOP_LIMIT_S = 5.0  # what an operator may wait for after Ctrl+C or SIGTERM
OTHER_RUN = "beef" * 16
# main() of the CLI, then one line saying whether torch was ever imported in the process
LAUNCHER = (
    "import sys\n"
    "from atoll.node.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(f'torch imported: {\"torch\" in sys.modules}', file=sys.stderr, flush=True)\n"
    "sys.exit(code)\n"
)


def _load_dht_helpers() -> ModuleType:
    """test_dht_kad.py as a module, for its node processes and their client."""
    name = "atoll_test_dht_kad_helpers"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE.with_name("test_dht_kad.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


kad = _load_dht_helpers()


def _env() -> dict[str, str]:
    """This environment without ATOLL_* settings (they would change the flags' meaning)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


@dataclass
class Bootstrap:
    node: kad.Node  # the process, its stderr log, a line reader
    key: Path
    addr_file: Path
    addrs: list[str]

    @property
    def peer_id(self) -> str:
        return self.addrs[0].rsplit("/p2p/", 1)[1]


def start_bootstrap(tmp: Path, name: str, key: Path, *extra: str) -> Bootstrap:
    """A bootstrap on a port of 127.0.0.1 the OS picks; waits for its ``bootstrap:`` line."""
    addr_file = tmp / f"{name}.addr"
    argv = [sys.executable, "-c", LAUNCHER, "bootstrap", "--listen", LOOPBACK]
    argv += ["--identity", str(key), "--addr-file", str(addr_file), *extra]
    log_path = tmp / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file, env=_env()
        )
    node = kad.Node(proc, log_path, None)
    try:
        line = node.line(START_TIMEOUT_S)
    except BaseException:
        stop(node, signal.SIGKILL)
        raise
    assert line.startswith("bootstrap: "), line
    return Bootstrap(node, key, addr_file, [line.removeprefix("bootstrap: ")])


def stop(node: kad.Node, signum: int = signal.SIGTERM) -> tuple[int, float]:
    """Send ``signum``; the exit status and the seconds it took to exit."""
    t0 = time.monotonic()
    if node.proc.poll() is None:
        node.proc.send_signal(signum)
        try:
            node.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(timeout=15)
    elapsed = time.monotonic() - t0
    print(f"--- {node.log_path.name} ---\n{node.log()}")  # shown when a test fails
    return node.proc.returncode, elapsed


def atoll(*args: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ATOLL), *args], capture_output=True, text=True, timeout=timeout, env=_env()
    )


@pytest.fixture(scope="module")
def boot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bootstrap]:
    tmp = tmp_path_factory.mktemp("bootstrap")
    b = start_bootstrap(tmp, "boot", tmp / "keys" / "bootstrap.key")
    try:
        yield b
    finally:
        stop(b.node)


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_it_prints_its_full_address_and_writes_it_to_the_addr_file(boot: Bootstrap) -> None:
    (addr,) = boot.addrs
    prefix, _, peer = addr.partition("/p2p/")
    assert prefix.startswith("/ip4/127.0.0.1/tcp/") and int(prefix.rsplit("/", 1)[1]) > 0, addr
    assert peer.startswith("12D3KooW") and len(peer) == 52, addr
    assert boot.addr_file.read_text() == addr + "\n"
    assert boot.key.stat().st_mode & 0o777 == 0o600
    assert not list(boot.addr_file.parent.glob(".*.tmp"))  # the temporary file was renamed


@pytest.mark.timeout(120)
def test_a_second_bootstrap_with_the_same_identity_or_port_is_refused_in_one_line(
    boot: Bootstrap, tmp_path: Path
) -> None:
    same_key = atoll("bootstrap", "--listen", LOOPBACK, "--identity", str(boot.key))
    assert same_key.returncode == 2, same_key
    lines = same_key.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: "), same_key.stderr
    assert str(boot.key) in lines[0] and f"pid {boot.node.proc.pid}" in lines[0], lines
    assert not same_key.stdout

    # py-libp2p listens with SO_REUSEPORT: without a check, a second process would share
    # the port and take half the peers' connections under another peer id
    port_addr = boot.addrs[0].partition("/p2p/")[0]
    same_port = atoll("bootstrap", "--listen", port_addr, "--identity", str(tmp_path / "k2"))
    assert same_port.returncode == 2, same_port
    lines = same_port.stderr.strip().splitlines()
    assert len(lines) == 1 and port_addr in lines[0] and "in use" in lines[0], lines
    assert boot.node.proc.poll() is None  # the first one serves on


@pytest.mark.timeout(240)
def test_peers_that_know_only_the_bootstrap_find_each_others_records(
    boot: Bootstrap, tmp_path: Path
) -> None:
    """A and B of one run, C of another: each knows only the bootstrap's address."""
    args = ["node", "--bootstrap", boot.addrs[0]]
    nodes = [
        kad.spawn(tmp_path / "a.log", *args, "--peer-record", identity=generate()),
        kad.spawn(tmp_path / "b.log", *args, "--peer-record", identity=generate()),
        kad.spawn(tmp_path / "c.log", *args, "--run", OTHER_RUN, identity=generate()),
    ]
    try:
        a, b, c = (kad.await_start(n) for n in nodes)
        now = time.time()
        own = PeerRecord(
            c.peer_id, OTHER_RUN, (c.addr,), "atoll-test/0", 0.0, (), (), False, now, now + 300
        )
        put = c.call("put", record=encode_message(own).hex())  # C's run, its own record
        assert "error" not in put, put
        for node in (a, b, c):
            assert node.started["answered"] == 1, node.started
            assert boot.peer_id in node.started["table"], node.started
        for reader, publisher, run in ((b, a, kad.RUN), (a, b, kad.RUN), (a, c, OTHER_RUN)):
            out = reader.call("get", key=peer_key(run, publisher.peer_id))
            assert out.get("record"), out
            record = kad.record_of(out["record"])
            assert isinstance(record, PeerRecord), record
            assert (record.peer_id, record.run_id) == (publisher.peer_id, run)
            assert record.addrs == (publisher.addr,)
        print(f"\nstart-up: {json.dumps([n.started for n in (a, b, c)])}")
    finally:
        for node in nodes:
            node.stop()
    assert boot.node.proc.poll() is None


@pytest.mark.timeout(180)
def test_sigterm_and_sigint_stop_it_cleanly_and_a_restart_keeps_the_peer_id(
    tmp_path: Path,
) -> None:
    key = tmp_path / "ids" / "boot.key"
    first = start_bootstrap(tmp_path, "first", key)
    code, took = stop(first.node, signal.SIGTERM)
    assert (code, took < STOP_LIMIT_S) == (0, True), (code, took)
    log = first.node.log()
    assert "atoll bootstrap: stopped (SIGTERM)" in log and "Traceback" not in log, log
    assert log.rstrip().endswith("torch imported: False"), log

    again = start_bootstrap(tmp_path, "again", key)  # the lock was let go
    code, took_int = stop(again.node, signal.SIGINT)
    assert (code, took_int < STOP_LIMIT_S) == (0, True), (code, took_int)
    log = again.node.log()
    assert "stopped (SIGINT)" in log and "Traceback" not in log, log
    assert again.peer_id == first.peer_id
    assert key.stat().st_mode & 0o777 == 0o600
    print(f"\nstopped in {took:.2f} s (SIGTERM), {took_int:.2f} s (SIGINT)")


@pytest.mark.timeout(120)
def test_the_cli_imports_no_torch_for_bootstrap_or_version() -> None:
    code = (
        "import sys\n"
        "from atoll.node import cli\n"
        "args = cli.build_parser().parse_args(['bootstrap', '--listen', '/ip4/127.0.0.1/tcp/0'])\n"
        "assert args.func.__name__ == '_cmd_bootstrap'\n"
        "import atoll.node.bootstrap\n"
        "assert cli.main(['version']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False", out.stdout

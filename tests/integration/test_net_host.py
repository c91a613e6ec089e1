"""The network host between real processes on 127.0.0.1 (port 0): echo, refusals, faults.

Run as a script, this file is the peer the tests talk to: an echo server in a process of
its own (``python tests/integration/test_net_host.py serve --run RUN --seed HEX``) that
prints ``LISTENING <multiaddr>``, sends every message it receives back to its sender and
exits on stdin EOF or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.network.exceptions import SwarmException
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from atoll.node.net.host import (
    AGENT,
    ATOLL_PROTOCOL,
    AtollHost,
    HostConfig,
    VersionMismatch,
    WrongRun,
    open_host,
)
from atoll.protocol.allreduce import Abort, Part
from atoll.protocol.errors import PeerUnavailable
from atoll.protocol.messages import PROTOCOL_VERSION, Hello, decode_message, encode_message, frame
from atoll.security.identity import Identity, generate

pytestmark = pytest.mark.integration

RUN = "5eed" * 16
OTHER_RUN = "0dd5" * 16
HERE = Path(__file__).resolve()
CONFIG = HostConfig(dial_timeout_s=10, hello_timeout_s=5, send_timeout_s=20)
START_TIMEOUT_S = 60  # a cold start imports libp2p and numpy on a busy 2-core machine
log = logging.getLogger("atoll.tests.net")


# -- the echo server (this file run as a script) --------------------------------------------
async def _serve(identity: Identity, run_id: str) -> None:
    async with open_host(identity, run_id, CONFIG) as host, trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_stdin_eof, nursery.cancel_scope)
        await nursery.start(_stop_on_sigterm, nursery.cancel_scope)
        print(f"LISTENING {host.addrs[0]}", flush=True)
        while True:
            peer, msg = await host.receive()
            try:
                await host.send(peer, msg)
            except (PeerUnavailable, WrongRun, VersionMismatch) as e:
                log.warning("echo to %s failed: %s", peer, e)


async def _stop_on_stdin_eof(scope: trio.CancelScope) -> None:
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        while await stdin.receive_some():
            pass
    scope.cancel()


async def _stop_on_sigterm(
    scope: trio.CancelScope, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            scope.cancel()
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["serve"])
    parser.add_argument("--run", required=True)
    parser.add_argument("--seed", required=True, help="32-byte Ed25519 seed, hex")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trio.run(_serve, Identity.from_private_bytes(bytes.fromhex(args.seed)), args.run)


# -- the server process, seen from the tests ------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    addr: str
    peer_id: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the server's signal to exit
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
                raise AssertionError(f"server did not exit on stdin EOF:\n{self.log()}") from None
        print(f"--- server {self.peer_id} log ---\n{self.log()}")  # shown when a test fails


def start_server(run_id: str, log_path: Path) -> Server:
    identity = generate()
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE),
            "serve",
            "--run",
            run_id,
            "--seed",
            identity.private_bytes().hex(),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log_file,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log_file.close()
    try:
        line = _read_line(proc, START_TIMEOUT_S)
        assert line.startswith("LISTENING /ip4/127.0.0.1/tcp/"), line
        addr = line.split()[1]
        assert addr.endswith(f"/p2p/{identity.peer_id}"), addr
    except BaseException:
        proc.kill()
        proc.wait(timeout=15)
        print(log_path.read_text(errors="replace"))
        raise
    return Server(proc, addr, identity.peer_id, log_path)


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no line from the server within {timeout_s} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError(f"server exited with {proc.wait(timeout=15)} before its address")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(RUN, tmp_path_factory.mktemp("net") / "server.log")
    yield srv
    srv.stop()


async def assert_echo(host: AtollHost, peer: str, text: str = "ping") -> None:
    msg = Abort(RUN, 0, 1, host.peer_id, text)
    await host.send(peer, msg)
    assert await host.receive(timeout_s=20) == (peer, msg)


async def echo_as_new_member(server: Server) -> None:
    """A fresh node of the server's run connects and gets an echo: the server still serves."""
    async with open_host(generate(), RUN, CONFIG) as member:
        assert await member.connect(server.addr) == server.peer_id
        await assert_echo(member, server.peer_id, "still serving?")


# -- raw libp2p hosts, to act as peers atoll would never be ---------------------------------
@asynccontextmanager
async def raw_host(plaintext: bool = False) -> AsyncIterator[tuple[BasicHost, str]]:
    """A bare py-libp2p host (Noise, or plaintext only) with no atoll handler."""
    kp = create_new_key_pair()
    if plaintext:
        sec = {TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)}
    else:
        sec = {NOISE_PROTOCOL_ID: NoiseTransport(kp, create_new_x25519_key_pair().private_key)}
    host = new_host(key_pair=kp, sec_opt=sec, muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux})
    assert isinstance(host, BasicHost)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        try:
            yield host, str(ID.from_pubkey(kp.public_key))
        finally:
            with trio.CancelScope(shield=True):
                await host.close()  # leaving run() alone leaves dialed sockets open


# -- the tests ------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_two_processes_echo_an_8mb_message_intact(server: Server) -> None:
    payload = random.Random(7).randbytes(8 << 20)

    async def body() -> None:
        async with open_host(generate(), RUN, CONFIG) as client:
            with trio.fail_after(150):
                t0 = time.perf_counter()
                assert await client.connect(server.addr) == server.peer_id
                connect_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                assert await client.connect(server.addr) == server.peer_id  # reused
                reconnect_s = time.perf_counter() - t0
                await assert_echo(client, server.peer_id)
                big = Part(RUN, 3, 7, client.peer_id, 1, 2.5, payload)
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    await client.send(server.peer_id, big)
                    peer, echoed = await client.receive(timeout_s=60)
                    times.append(time.perf_counter() - t0)
                    assert peer == server.peer_id
                    assert isinstance(echoed, Part) and echoed == big
                sent = client.bytes_sent[server.peer_id]
                received = client.bytes_received[server.peer_id]
                assert sent >= 3 * len(payload) and received >= 3 * len(payload)
                best = min(times)
                print(
                    f"\nconnect {connect_s * 1e3:.0f} ms, again {reconnect_s * 1e3:.1f} ms; "
                    f"8 MiB echo round trips: {', '.join(f'{t:.3f}' for t in times)} s; "
                    f"best {2 * len(payload) / best / 1e6:.0f} MB/s moved (both ways), "
                    f"bytes sent {sent}, received {received}"
                )

    trio.run(body)


@pytest.mark.timeout(120)
def test_a_peer_of_another_run_gets_wrong_run_and_the_server_keeps_serving(
    server: Server,
) -> None:
    async def body() -> None:
        with trio.fail_after(100):
            async with open_host(generate(), OTHER_RUN, CONFIG) as stranger:
                with pytest.raises(WrongRun, match=f"does not serve run {OTHER_RUN}") as err:
                    await stranger.connect(server.addr)
                assert err.value.peer_id == server.peer_id and err.value.run_id == OTHER_RUN
                assert not isinstance(err.value, PeerUnavailable)  # not retryable
                with pytest.raises(WrongRun):  # send() opens a stream and is refused too
                    await stranger.send(server.peer_id, Abort(OTHER_RUN, 0, 0, "x", "y"))
                stranger_id = stranger.peer_id
            await echo_as_new_member(server)
        assert f"refusing a stream from peer {stranger_id}: peer {stranger_id} serves run" in (
            server.log()
        )

    trio.run(body)


@pytest.mark.timeout(120)
def test_a_plaintext_dialer_cannot_connect(server: Server) -> None:
    async def body() -> None:
        with trio.fail_after(100):
            async with raw_host(plaintext=True) as (host, _):
                with pytest.raises(SwarmException):
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(server.addr)))
                assert not host.get_network().get_connections(ID.from_base58(server.peer_id))
            await echo_as_new_member(server)

    trio.run(body)


@pytest.mark.timeout(60)
def test_a_peer_speaking_another_protocol_version_gets_version_mismatch() -> None:
    async def other_version(stream: INetStream) -> None:
        await stream.reset()

    async def body() -> None:
        with trio.fail_after(50):
            async with raw_host() as (peer, peer_id), open_host(generate(), RUN, CONFIG) as me:
                peer.set_stream_handler(TProtocol("/atoll/2/msg"), other_version)
                with pytest.raises(VersionMismatch, match="it serves /atoll/2/msg") as err:
                    await me.connect(f"{peer.get_addrs()[0]}")
                assert err.value.peer_id == peer_id and err.value.offered == ("/atoll/2/msg",)

    trio.run(body)


@pytest.mark.timeout(180)
def test_send_to_a_killed_peer_raises_peer_unavailable_in_time(tmp_path: Path) -> None:
    victim = start_server(RUN, tmp_path / "victim.log")
    config = HostConfig(dial_timeout_s=5, hello_timeout_s=5, send_timeout_s=5)

    async def body() -> None:
        async with open_host(generate(), RUN, config) as client:
            with trio.fail_after(60):
                peer = await client.connect(victim.addr)
                await assert_echo(client, peer)
            victim.proc.kill()  # SIGKILL: no goodbye on any stream
            victim.proc.wait(timeout=15)
            outcomes = []
            # the first write after the kill may still land in the kernel's socket buffer;
            # every send must end within its timeout, and the peer must be seen as gone
            with trio.fail_after(4 * (config.send_timeout_s + 2)):
                for _ in range(3):
                    t0 = time.perf_counter()
                    try:
                        await client.send(peer, Abort(RUN, 0, 1, client.peer_id, "anyone?"))
                        outcomes.append(("sent", time.perf_counter() - t0))
                    except PeerUnavailable as e:
                        outcomes.append((str(e), time.perf_counter() - t0))
                    await trio.sleep(0.2)
                with pytest.raises(PeerUnavailable):
                    await client.connect(victim.addr)
            print(f"\nsends after SIGKILL: {outcomes}")
            assert outcomes[-1][0] != "sent"
            assert all(dt < config.send_timeout_s + 1 for _, dt in outcomes)

    try:
        trio.run(body)
    finally:
        victim.stop()


@pytest.mark.timeout(120)
def test_garbage_on_a_stream_gets_it_reset_and_the_server_keeps_serving(server: Server) -> None:
    async def body() -> None:
        with trio.fail_after(100):
            pid = ID.from_base58(server.peer_id)
            liar = frame(encode_message(Hello(PROTOCOL_VERSION, RUN, server.peer_id, AGENT)))
            garbage = frame(b"\xc1 not msgpack")
            oversized = struct.pack(">I", 0xFFFFFFFF)
            async with raw_host() as (host, me):
                hello = frame(encode_message(Hello(PROTOCOL_VERSION, RUN, me, AGENT)))
                await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(server.addr)))

                async def refused(first: bytes, then: bytes | None = None) -> None:
                    stream = await host.new_stream(pid, [ATOLL_PROTOCOL])
                    await stream.write(first)
                    if then is not None:  # a good Hello first: read the answer, then misbehave
                        reply = decode_message((await stream.read(4096))[4:])
                        assert isinstance(reply, Hello) and reply.peer_id == server.peer_id
                        await stream.write(then)
                    with trio.fail_after(10), pytest.raises((StreamReset, StreamEOF)):
                        data = await stream.read(4096)
                        raise AssertionError(f"the server answered {data!r}")

                await refused(garbage)  # not a Hello, not even msgpack
                await refused(liar)  # a Hello naming another peer than the connection's
                await refused(oversized)  # a first frame announced at 4 GiB
                await refused(hello, garbage)
                await refused(hello, oversized)
                await refused(hello, frame(encode_message(Abort(RUN, 0, 1, me, "ok"))) + garbage)
            await echo_as_new_member(server)
        text = server.log()
        assert text.count("hostile input, stream from peer") >= 5, text
        assert "a Hello naming peer" in text

    trio.run(body)


if __name__ == "__main__":
    main()

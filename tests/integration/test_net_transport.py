"""The lean Noise session and yamux muxer (atoll.node.net.transport) on real sockets.

Three kinds of checks:
- the wire, message by message, against the ``noise`` library's own cipher states (the
  reference py-libp2p uses), over a TCP connection on 127.0.0.1;
- hostile and broken input: a flipped bit, a runt message, a connection that ends inside a
  message;
- interoperation with stock py-libp2p (its Noise session and yamux, none of atoll's code)
  in a process of its own, in both roles: atoll dials it, and it dials atoll; both ways
  move data larger than one yamux frame.

Run as a script, this file is that stock peer: ``python tests/integration/test_net_transport.py
stock`` prints ``LISTENING <multiaddr>``, echoes every stream of :data:`ECHO` back, reads
one multiaddr from stdin, dials it, sends :data:`STOCK_BYTES` pattern bytes on an
:data:`ECHO` stream, checks the echo, prints ``STOCK-DIAL-OK`` and exits on stdin EOF.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.security.secure_session import SecureSession
from noise.connection import NoiseConnection
from noise.exceptions import NoiseInvalidMessage
from noise.state import CipherState

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve()
ECHO = "/atoll-test/echo/1.0.0"
STOCK_BYTES = 3 * 1048576 + 12345  # over three of atoll's largest yamux frames
START_TIMEOUT_S = 60


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def echo(stream: Any) -> None:
    """Send back what arrives on a libp2p stream until it ends, then close it."""
    while True:
        try:
            data = await stream.read(1 << 20)
        except Exception:  # EOF or reset: the other side is done
            break
        if not data:
            break
        await stream.write(data)
    await stream.close()


# -- the stock py-libp2p peer (this file run as a script) -----------------------------------
async def _stock_main() -> None:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as x25519_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX
    from libp2p.stream_muxer.yamux.yamux import Yamux

    assert "atoll.node.net.transport" not in sys.modules
    kp = create_new_key_pair()
    host = new_host(
        key_pair=kp,
        sec_opt={NOISE: NoiseTransport(kp, x25519_pair().private_key)},
        muxer_opt={TProtocol(YAMUX): Yamux},
    )

    host.set_stream_handler(TProtocol(ECHO), echo)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        addr = f"{host.get_addrs()[0]}"
        if "/p2p/" not in addr:
            addr += f"/p2p/{host.get_id()}"
        print(f"LISTENING {addr}", flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        line = b""
        while not line.endswith(b"\n"):
            chunk = await stdin.receive_some()
            if not chunk:
                return
            line += chunk
        info = info_from_p2p_addr(multiaddr.Multiaddr(line.decode().strip()))
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [TProtocol(ECHO)])
        payload = pattern(STOCK_BYTES, 2)
        back = bytearray()

        async def send() -> None:
            await stream.write(payload)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while len(back) < len(payload):
                data = await stream.read(1 << 20)
                if not data:
                    break
                back += data
        print("STOCK-DIAL-OK" if bytes(back) == payload else "STOCK-DIAL-BAD", flush=True)
        while await stdin.receive_some():
            pass
        await host.close()


# -- a lean session pair on a real TCP connection -------------------------------------------
def cipher_state(key: bytes, nonce: int) -> CipherState:
    """A ChaCha20-Poly1305 cipher state of the ``noise`` library, keyed, at ``nonce``."""
    proto = NoiseConnection.from_name(b"Noise_XX_25519_ChaChaPoly_SHA256").noise_protocol
    state = CipherState(proto)
    state.initialize_key(key)
    state.set_nonce(nonce)
    return state


def bare_session() -> SecureSession:
    from libp2p.crypto.ed25519 import create_new_key_pair

    kp = create_new_key_pair()
    pid = ID.from_pubkey(kp.public_key)
    return SecureSession(
        local_peer=pid,
        local_private_key=kp.private_key,
        remote_peer=pid,
        remote_permanent_pubkey=kp.public_key,
        is_initiator=True,
        conn=None,  # type: ignore[arg-type]  # unused: the lean session does its own I/O
    )


@asynccontextmanager
async def tcp_pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    try:
        yield client, server
    finally:
        for s in (client, server, *listeners):
            await s.aclose()


def lean(stream: trio.SocketStream, tx: CipherState, rx: CipherState) -> object:
    from atoll.node.net.transport import LeanNoiseSession

    raw = RawConnection(TrioTCPStream(stream), initiator=True)
    return LeanNoiseSession(bare_session(), raw, tx, rx)


KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))
SIZES = [0, 1, 12, 65519, 65520, 3 * 65519 + 5, 1048292 + 12, 2_500_000]


def reference_messages(data: bytes, key: bytes, nonce: int) -> bytes:
    """``data`` sealed by the ``noise`` library, one message per 65,519 bytes, framed."""
    ref = cipher_state(key, nonce)
    out = bytearray()
    pieces = [data[i : i + 65519] for i in range(0, len(data), 65519)] or [b""]
    for piece in pieces:
        sealed = ref.encrypt_with_ad(None, piece)
        out += len(sealed).to_bytes(2, "big") + sealed
    return bytes(out)


def test_writes_are_the_reference_noise_messages() -> None:
    async def body() -> None:
        async with tcp_pair() as (a, b):
            session = lean(a, cipher_state(KEY_A, 7), cipher_state(KEY_B, 0))
            nonce = 7
            for size in SIZES:
                data = pattern(size, size)
                expected = reference_messages(data, KEY_A, nonce)
                nonce += max(1, -(-size // 65519))
                got = bytearray()
                with trio.fail_after(20):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(session.write, data)  # type: ignore[attr-defined]
                        while len(got) < len(expected):
                            got += await b.receive_some()
                assert bytes(got) == expected, size

    trio.run(body)


def test_reads_reference_messages_cut_anywhere() -> None:
    async def body() -> None:
        async with tcp_pair() as (a, b):
            session = lean(a, cipher_state(KEY_A, 0), cipher_state(KEY_B, 3))
            datas = [pattern(size, 100 + size) for size in SIZES]
            wire = reference_messages(datas[0], KEY_B, 3)
            nonce = 3 + 1
            for data in datas[1:]:
                wire += reference_messages(data, KEY_B, nonce)
                nonce += max(1, -(-len(data) // 65519))
            rng = random.Random(5)

            async def send() -> None:  # in pieces of any size, some tiny, some large
                pos = 0
                while pos < len(wire):
                    step = rng.choice([1, 2, 3, 17, 4096, 65537, 300_000])
                    await b.send_all(wire[pos : pos + step])
                    pos += step

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send)
                    # read(n) of exact sizes, of a size across messages, and read()
                    assert await session.read(len(datas[1])) == datas[1]  # type: ignore[attr-defined]
                    assert await session.read(len(datas[2])) == datas[2]  # type: ignore[attr-defined]
                    first = await session.read(100)  # type: ignore[attr-defined]
                    rest = await session.read(len(datas[3]) - 100)  # type: ignore[attr-defined]
                    assert first + rest == datas[3]
                    joined = datas[4] + datas[5] + datas[6] + datas[7]
                    got = await session.read(len(joined))  # type: ignore[attr-defined]
                    assert got == joined  # several messages in one read, decrypted in place

    trio.run(body)


@asynccontextmanager
async def reading_session() -> AsyncIterator[tuple[Any, trio.SocketStream]]:
    """A lean session reading what the other end of its TCP connection sends."""
    async with tcp_pair() as (a, b):
        yield lean(a, cipher_state(KEY_A, 0), cipher_state(KEY_B, 0)), b


def test_a_read_without_a_size_returns_one_message_and_skips_empty_ones() -> None:
    async def body() -> None:
        async with reading_session() as (session, b):
            wire = reference_messages(b"first", KEY_B, 0) + reference_messages(b"", KEY_B, 1)
            wire += reference_messages(b"second", KEY_B, 2)
            await b.send_all(wire)
            with trio.fail_after(10):
                assert await session.read() == b"first"
                assert await session.read(3) == b"sec"  # part of a message ...
                assert await session.read() == b"ond"  # ... and the rest of it
                await b.aclose()
                with pytest.raises(IncompleteReadError):
                    await session.read()

    trio.run(body)


def test_a_cancelled_write_still_sends_whole_messages() -> None:
    """Cancelled while its 8 MB wait in a full socket, a write finishes its messages: the
    reader gets them intact, and the connection carries the next write."""

    async def body() -> None:
        async with tcp_pair() as (a, b):
            writer = lean(a, cipher_state(KEY_A, 0), cipher_state(KEY_B, 0))
            reader = lean(b, cipher_state(KEY_B, 0), cipher_state(KEY_A, 0))
            big, after = pattern(8 << 20, 8), b"after the cancelled write"
            scopes: list[trio.CancelScope] = []
            cancelled = []

            async def write() -> None:
                with trio.move_on_after(0.05) as scope:
                    scopes.append(scope)
                    await writer.write(big)  # type: ignore[attr-defined]  # blocks: no reader yet
                    await trio.sleep(0)  # the cancellation lands here, after the write
                cancelled.append(scope.cancelled_caught)
                await writer.write(after)  # type: ignore[attr-defined]

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write)
                    while not (scopes and scopes[0].cancel_called):
                        await trio.sleep(0.01)  # until the writer's deadline has passed
                    assert not cancelled  # it was cancelled while blocked: no reader yet
                    assert await reader.read(len(big)) == big  # type: ignore[attr-defined]
                    assert await reader.read(len(after)) == after  # type: ignore[attr-defined]
            assert cancelled == [True]

    trio.run(body)


def test_a_write_stuck_past_its_deadline_closes_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from atoll.node.net import transport

    monkeypatch.setattr(transport, "WRITE_GRACE_S", 0.3)

    async def body() -> None:
        async with tcp_pair() as (a, _b):  # the peer never reads
            writer = lean(a, cipher_state(KEY_A, 0), cipher_state(KEY_B, 0))
            data = pattern(32 << 20, 9)  # made before the clock starts: 0.1 s and more
            with pytest.raises(ConnectionClosedError, match="outlasted"):
                with trio.move_on_after(0.2) as scope:
                    await writer.write(data)  # type: ignore[attr-defined]
            # closed by the session's own bound, on trio's clock: the writer's deadline
            # plus the grace, not before (even when sealing 32 MB outlasts the deadline
            # on a busy machine), and not long after
            late = trio.current_time() - (scope.deadline + transport.WRITE_GRACE_S)
            assert 0 <= late < 5, late
            with pytest.raises(ConnectionClosedError):  # and for good
                await writer.write(b"more")  # type: ignore[attr-defined]

    trio.run(body)


def test_a_write_whose_deadline_passed_unnoticed_is_still_sent() -> None:
    """The writer's deadline passes before the write's first checkpoint (here a blocking
    sleep; on a busy machine, any CPU-bound stretch): trio notices it inside the write,
    after the nonces are taken. The messages still go out whole, the writer is cancelled
    after the write, and the connection carries the next one."""

    async def body() -> None:
        async with tcp_pair() as (a, b):
            writer = lean(a, cipher_state(KEY_A, 0), cipher_state(KEY_B, 0))
            reader = lean(b, cipher_state(KEY_B, 0), cipher_state(KEY_A, 0))
            with trio.move_on_after(0.01) as scope:
                time.sleep(0.05)  # no checkpoint: the deadline passes unnoticed
                await writer.write(b"sealed after the deadline")  # type: ignore[attr-defined]
                await trio.sleep(0)  # the cancellation lands here, after the write
            assert scope.cancelled_caught
            await writer.write(b"next")  # type: ignore[attr-defined]
            with trio.fail_after(10):
                assert await reader.read(25) == b"sealed after the deadline"  # type: ignore[attr-defined]
                assert await reader.read(4) == b"next"  # type: ignore[attr-defined]

    trio.run(body)


def test_a_flipped_bit_fails_the_session_for_good() -> None:
    async def body() -> None:
        async with reading_session() as (session, b):
            wire = bytearray(reference_messages(b"hello, swarm" * 100, KEY_B, 0))
            wire[40] ^= 0x04
            await b.send_all(bytes(wire) + reference_messages(b"next", KEY_B, 1))
            with trio.fail_after(10):
                with pytest.raises(NoiseInvalidMessage, match="authentication"):
                    await session.read(1200)
                with pytest.raises(NoiseInvalidMessage):  # the nonces are out of step now
                    await session.read(4)  # type: ignore[attr-defined]

    trio.run(body)


def test_a_runt_message_is_refused() -> None:
    async def body() -> None:
        async with reading_session() as (session, b):
            await b.send_all(b"\x00\x05hello")  # shorter than a tag: no Noise message
            with trio.fail_after(10), pytest.raises(NoiseInvalidMessage, match="shorter"):
                await session.read(5)  # type: ignore[attr-defined]

    trio.run(body)


def test_a_connection_ending_inside_a_message_ends_the_read() -> None:
    async def body() -> None:
        async with reading_session() as (session, b):
            whole = reference_messages(b"x" * 10, KEY_B, 0)
            half = reference_messages(b"y" * 1000, KEY_B, 1)[:500]
            await b.send_all(whole + half)
            await b.aclose()
            with trio.fail_after(10):
                # what arrived whole is returned; then the end, not a hang
                assert await session.read(1010) == b"x" * 10  # type: ignore[attr-defined]
                with pytest.raises(IncompleteReadError):
                    await session.read(1)  # type: ignore[attr-defined]

    trio.run(body)


# -- interoperation with stock py-libp2p ----------------------------------------------------
def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The stock peer's next stdout line, waited for at most ``timeout_s``."""
    assert proc.stdout is not None
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout_s)
    if not got:
        raise TimeoutError(f"no line from the stock peer within {timeout_s} s")
    if not got[0]:
        raise EOFError(f"the stock peer exited with {proc.wait(timeout=15)}")
    return got[0].decode().strip()


@pytest.mark.timeout(240)
def test_stock_py_libp2p_and_atoll_move_data_both_ways(tmp_path: Path) -> None:
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from atoll.node.net.host import HostConfig, open_libp2p_host
    from atoll.node.net.transport import FRAME_PAYLOAD, LeanNoiseSession
    from atoll.security.identity import generate

    log_path = tmp_path / "stock.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(HERE), "stock"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
        )
    sessions: list[object] = []

    async def noting_echo(stream: Any) -> None:
        sessions.append(stream.muxed_conn.secured_conn)
        await echo(stream)

    async def body() -> None:
        config = HostConfig(dial_timeout_s=30, hello_timeout_s=30, send_timeout_s=60)
        identity = generate()
        async with open_libp2p_host(identity, config) as host:
            host.set_stream_handler(TProtocol(ECHO), noting_echo)
            stock_addr = _read_line(proc, START_TIMEOUT_S).split()[1]
            info = info_from_p2p_addr(multiaddr.Multiaddr(stock_addr))
            with trio.fail_after(120):
                # atoll dials stock py-libp2p and sends more than a yamux frame
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [TProtocol(ECHO)])
                assert isinstance(stream.muxed_conn.secured_conn, LeanNoiseSession)
                payload = pattern(3 * FRAME_PAYLOAD + 999, 1)
                back = bytearray()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream.write, payload)
                    while len(back) < len(payload):
                        data = await stream.read(1 << 20)
                        assert data, "the stock peer closed the stream early"
                        back += data
                assert bytes(back) == payload
                await stream.close()
                # stock py-libp2p dials atoll (atoll answers the handshake) and is echoed
                mine = f"{host.get_addrs()[0]}"
                if "/p2p/" not in mine:
                    mine += f"/p2p/{identity.peer_id}"
                assert proc.stdin is not None
                proc.stdin.write(mine.encode() + b"\n")
                proc.stdin.flush()
                line = await trio.to_thread.run_sync(_read_line, proc, 100)
                assert line == "STOCK-DIAL-OK", line
                assert any(isinstance(s, LeanNoiseSession) for s in sessions)

    try:
        trio.run(body)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        print(log_path.read_text(errors="replace"))


if __name__ == "__main__" and sys.argv[1:] == ["stock"]:
    trio.run(_stock_main)

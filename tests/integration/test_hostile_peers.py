"""Hostile peers against the frame reader of atoll.node.net.transport.

- many connections on 127.0.0.1, each holding most of a large frame unfinished: the
  process never holds more than the shared :class:`FrameBudget`, the connections over it
  are reset, and an honest connection sending whole frames meanwhile loses nothing;
- a peer trickling a frame a byte a second is cut off; one slow but steady is not, nor
  is a stream idle between frames (trio's MockClock: no real waiting);
- the same against an :class:`~atoll.node.net.host.AtollHost` over real libp2p
  connections: admitted peers each holding most of a large frame never make the host
  hold more than its ``frame_budget_bytes``, and an honest peer's messages still arrive;
  a peer that opens a stream and never says Hello is reset after ``hello_timeout_s``.
"""

from __future__ import annotations

import contextlib
import logging
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import multiaddr
import pytest
import trio
import trio.testing
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from atoll.node.net.host import (
    AGENT,
    ATOLL_PROTOCOL,
    MAX_PENDING_STREAMS,
    AtollHost,
    HostConfig,
    open_host,
)
from atoll.node.net.transport import (
    FRAME_START_S,
    MIN_FRAME_RATE,
    FrameBudget,
    FrameBudgetExceeded,
    read_frames,
)
from atoll.protocol.allreduce import Abort, Part
from atoll.protocol.errors import ConfigError, ExchangeTimeout, PeerUnavailable
from atoll.protocol.messages import (
    PROTOCOL_VERSION,
    Hello,
    decode_message,
    encode_message,
    frame,
    frame_header,
)
from atoll.security.identity import generate

pytestmark = pytest.mark.integration

MiB = 1 << 20


class _Reads:
    """A trio byte stream read the way libp2p streams are: ``read(n)``, b"" at the end."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream

    async def read(self, n: int | None = None) -> bytes:
        try:
            return bytes(await self.stream.receive_some(n))
        except trio.BrokenResourceError:
            return b""


async def _until(predicate: Any, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until ``predicate()`` holds, checking at each step."""
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


def test_unfinished_frames_of_many_peers_stay_within_the_budget() -> None:
    budget = FrameBudget(4 * MiB)
    attackers = 12
    frames: dict[str, list[int]] = {}
    outcome: dict[str, str] = {}
    peak_used = 0
    # one buffer for every attacker: the test's own sends must not blur the measurement
    partial = frame_header(4 * MiB) + b"\xa5" * MiB

    async def serve(conn: trio.SocketStream, peer: str) -> None:
        nonlocal peak_used

        async def on_frame(body: bytes) -> None:
            frames.setdefault(peer, []).append(len(body))

        def on_bytes(n: int) -> None:
            nonlocal peak_used
            peak_used = max(peak_used, budget.used)

        try:
            await read_frames(
                _Reads(conn),
                peer=peer,
                budget=budget,
                on_frame=on_frame,
                max_bytes=4 * MiB,
                on_bytes=on_bytes,
                read_bytes=64 << 10,
            )
            outcome[peer] = "ended"
        except FrameBudgetExceeded:
            outcome[peer] = "reset"
        finally:
            peak_used = max(peak_used, budget.used)
            await conn.aclose()  # the reset

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        count = 0
        async with trio.open_nursery() as nursery:

            async def accept() -> None:
                nonlocal count
                while True:
                    conn = await listeners[0].accept()
                    peer = "honest" if count == attackers else f"attacker-{count}"
                    count += 1
                    nursery.start_soon(serve, conn, peer)

            nursery.start_soon(accept)
            hold = trio.Event()
            clients: list[trio.SocketStream] = []

            async def attack() -> None:
                conn = await trio.open_tcp_stream("127.0.0.1", port)
                clients.append(conn)
                try:
                    await conn.send_all(partial)
                    await hold.wait()  # and never finish the frame
                except trio.BrokenResourceError:
                    pass  # reset by the node

            for _ in range(attackers):
                nursery.start_soon(attack)
                await _until(lambda: count == len(clients), 10)
            # every attacker is either holding its megabyte or was reset
            await _until(
                lambda: (
                    sum(1 for p, o in outcome.items() if o == "reset") >= attackers - 4
                    and budget.used >= 3 * MiB
                ),
                20,
            )
            honest = await trio.open_tcp_stream("127.0.0.1", port)
            body = b"\x5a" * (MiB // 2)
            for _ in range(5):
                await honest.send_all(frame_header(len(body)) + body)
            await _until(lambda: len(frames.get("honest", [])) == 5, 20)
            await honest.aclose()
            await _until(lambda: outcome.get("honest") == "ended", 10)
            hold.set()
            for conn in clients:
                await conn.aclose()
            nursery.cancel_scope.cancel()

    tracemalloc.start()
    try:
        trio.run(main)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert frames["honest"] == [MiB // 2] * 5
    assert outcome["honest"] == "ended"
    assert sum(1 for o in outcome.values() if o == "reset") >= attackers - 4
    assert peak_used <= budget.limit
    assert budget.used == 0
    # 12 MiB of unfinished frames were offered; the process held about the budget
    assert peak < budget.limit + 4 * MiB, peak


def test_the_largest_holder_is_evicted_for_a_smaller_one() -> None:
    budget = FrameBudget(100)
    evicted: list[str] = []
    big = budget.join("big", lambda: evicted.append("big"))
    small = budget.join("small", lambda: evicted.append("small"))
    budget.charge(big, 80)
    budget.charge(small, 15)
    budget.charge(small, 40)  # does not fit: the larger holder makes room
    assert evicted == ["big"] and budget.used == 40
    with pytest.raises(FrameBudgetExceeded):
        budget.charge(big, 1)  # an evicted stream is done
    other = budget.join("other", lambda: evicted.append("other"))
    budget.charge(other, 30)
    with pytest.raises(FrameBudgetExceeded):
        budget.charge(other, 70)  # it would hold the most: it is the one refused
    assert budget.used == 70 and evicted == ["big"]
    budget.leave(small)
    budget.leave(other)
    assert budget.used == 0


async def _pair() -> tuple[trio.abc.SendStream, _Reads]:
    send, receive = trio.testing.memory_stream_one_way_pair()
    return send, _Reads(receive)


def _mock(fn: Any) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_peer_trickling_a_byte_a_second_is_cut_off() -> None:
    async def main() -> None:
        send, stream = await _pair()
        budget = FrameBudget()

        async def trickle() -> None:
            await send.send_all(frame_header(1000))
            for _ in range(1000):
                await trio.sleep(1.0)
                await send.send_all(b"x")

        async def on_frame(body: bytes) -> None:
            raise AssertionError("no frame was expected")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            start = trio.current_time()
            with pytest.raises(ExchangeTimeout, match="slower than"):
                await read_frames(stream, peer="trickler", budget=budget, on_frame=on_frame)
            took = trio.current_time() - start
            nursery.cancel_scope.cancel()
        assert FRAME_START_S <= took <= FRAME_START_S + 2
        assert budget.used == 0

    _mock(main)


def test_a_slow_but_steady_peer_and_an_idle_one_are_not_cut_off() -> None:
    async def main() -> None:
        steady_send, steady = await _pair()
        idle_send, idle = await _pair()
        budget = FrameBudget()
        got: list[int] = []
        size = 8 * MiB
        piece = MIN_FRAME_RATE  # a second's worth at exactly the slowest rate allowed

        async def on_frame(body: bytes) -> None:
            got.append(len(body))

        async def steady_sender() -> None:
            await trio.sleep(3600.0)  # idle an hour first: normal between rounds
            await steady_send.send_all(frame_header(size))
            for _ in range(size // piece):
                await trio.sleep(1.0)
                await steady_send.send_all(b"y" * piece)
            await steady_send.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(steady_sender)
            nursery.start_soon(
                lambda: read_frames(idle, peer="idle", budget=budget, on_frame=on_frame)
            )
            await read_frames(steady, peer="steady", budget=budget, on_frame=on_frame)
            assert got == [size]
            await idle_send.aclose()
        assert budget.used == 0

    _mock(main)


# -- the same against a host, over real libp2p connections ---------------------------------
RUN = "b0d9" * 16


@asynccontextmanager
async def _raw_peer() -> AsyncIterator[tuple[BasicHost, str]]:
    """A bare py-libp2p host (Noise, yamux) that speaks atoll's stream protocol by hand."""
    kp = create_new_key_pair()
    sec = {NOISE_PROTOCOL_ID: NoiseTransport(kp, create_new_x25519_key_pair().private_key)}
    host = new_host(key_pair=kp, sec_opt=sec, muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux})
    assert isinstance(host, BasicHost)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        try:
            yield host, str(ID.from_pubkey(kp.public_key))
        finally:
            with trio.CancelScope(shield=True):
                await host.close()


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        data = await stream.read(n - len(buf))
        assert data, "the stream ended"
        buf += data
    return buf


async def _open_stream(raw: BasicHost, node: AtollHost, hello_as: str | None) -> INetStream:
    """A stream from ``raw`` to ``node``; when ``hello_as`` is a peer id, admitted with a
    Hello of that peer (whose answer is read)."""
    await raw.connect(info_from_p2p_addr(multiaddr.Multiaddr(node.addrs[0])))
    stream = await raw.new_stream(ID.from_base58(node.peer_id), [ATOLL_PROTOCOL])
    if hello_as is not None:
        await stream.write(frame(encode_message(Hello(PROTOCOL_VERSION, RUN, hello_as, AGENT))))
        size = int.from_bytes(await _read_exactly(stream, 4), "big")
        assert isinstance(decode_message(await _read_exactly(stream, size)), Hello)
    return stream


async def _ended(stream: INetStream) -> None:
    """Wait until the node resets (or closes) ``stream``; it must send nothing first."""
    try:
        data = await stream.read(4096)
    except (StreamReset, StreamEOF):
        return
    assert not data, f"the node wrote {data!r}"


@pytest.mark.timeout(240)
def test_a_host_holds_no_more_than_its_frame_budget_across_peers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="atoll")
    config = HostConfig(
        hello_timeout_s=20,
        send_timeout_s=60,
        max_frame_bytes=2 * MiB,
        frame_budget_bytes=4 * MiB,
    )
    attackers = 6
    partial = frame_header(2 * MiB) + b"\xa5" * (3 * MiB // 2)  # never finished
    reset: list[str] = []
    ids: list[str] = []
    peak_used = 0

    async def main() -> None:
        nonlocal peak_used
        with trio.fail_after(200):
            async with open_host(generate(), RUN, config) as node:
                budget = node.frame_budget
                charge = budget.charge

                def charge_and_measure(holder: Any, nbytes: int) -> None:
                    nonlocal peak_used
                    try:
                        charge(holder, nbytes)
                    finally:
                        peak_used = max(peak_used, budget.used)

                budget.charge = charge_and_measure  # type: ignore[method-assign]
                async with trio.open_nursery() as nursery, AsyncExitStack() as stack:

                    async def attack(stream: INetStream, me: str) -> None:
                        with contextlib.suppress(StreamReset, StreamEOF):
                            await stream.write(partial)  # may be reset while writing
                        await _ended(stream)
                        reset.append(me)

                    for _ in range(attackers):
                        raw, me = await stack.enter_async_context(_raw_peer())
                        ids.append(me)
                        stream = await _open_stream(raw, node, me)
                        nursery.start_soon(attack, stream, me)
                    # every attacker's 1.5 MiB arrived: held, or its stream was reset
                    await _until(
                        lambda: (
                            all(node.bytes_received[p] >= 3 * MiB // 2 for p in ids)
                            and len(reset) >= attackers - 2
                        ),
                        120,
                    )
                    assert budget.used <= budget.limit
                    # an honest peer meanwhile: small messages and a frame of 1 MiB
                    async with open_host(generate(), RUN, config) as honest:
                        assert await honest.connect(node.addrs[0]) == node.peer_id
                        sent = [Abort(RUN, 0, i, honest.peer_id, f"m{i}") for i in range(5)]
                        sent.append(Part(RUN, 0, 5, honest.peer_id, 1, 1.0, b"\x5a" * MiB))
                        for msg in sent:
                            await honest.send(node.peer_id, msg)
                        got = [await node.receive(timeout_s=60) for _ in sent]
                        assert got == [(honest.peer_id, msg) for msg in sent]
                    nursery.cancel_scope.cancel()
                assert budget.evictions >= attackers - 2
            assert budget.used == 0  # every stream gave its share back

    trio.run(main)
    assert peak_used <= 4 * MiB
    held = [r.getMessage() for r in caplog.records if "bytes of unfinished frames" in r.message]
    assert len(held) >= attackers - 2
    assert all(any(p in line for p in ids) for line in held)


@pytest.mark.timeout(120)
def test_a_stream_without_a_hello_is_reset_after_the_hello_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="atoll")
    config = HostConfig(hello_timeout_s=3, send_timeout_s=20)

    async def main() -> None:
        with trio.fail_after(100):
            async with (
                open_host(generate(), RUN, config) as node,
                open_host(generate(), RUN, config) as honest,
                _raw_peer() as (raw, _),
            ):
                silent = await _open_stream(raw, node, None)  # opens, then says nothing
                half = await _open_stream(raw, node, None)
                await half.write(b"\x00\x00")  # half a frame header, then nothing
                opened = trio.current_time()
                # the host serves an honest peer while the two streams hang
                assert await honest.connect(node.addrs[0]) == node.peer_id
                first = Abort(RUN, 0, 1, honest.peer_id, "before")
                await honest.send(node.peer_id, first)
                assert await node.receive(timeout_s=20) == (honest.peer_id, first)
                await _ended(silent)
                await _ended(half)
                waited = trio.current_time() - opened
                # the connection of the silent peer stays up: only its streams are reset
                assert raw.get_network().get_connections(ID.from_base58(node.peer_id))
                later = Abort(RUN, 0, 2, honest.peer_id, "after")
                await honest.send(node.peer_id, later)
                assert await node.receive(timeout_s=20) == (honest.peer_id, later)
        assert config.hello_timeout_s - 0.5 <= waited <= config.hello_timeout_s + 15

    trio.run(main)
    refusals = [r.getMessage() for r in caplog.records if "sent no Hello within 3 s" in r.message]
    assert len(refusals) == 2, refusals


def test_the_frame_budget_setting_is_checked() -> None:
    assert HostConfig().frame_budget_bytes == 256 * MiB
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="frame_budget_bytes"):
            HostConfig(frame_budget_bytes=bad)  # type: ignore[arg-type]


# -- connections: dialers that are not, or claim to be someone else -------------------------
def _port_of(node: AtollHost) -> int:
    return int(multiaddr.Multiaddr(node.addrs[0]).value_for_protocol("tcp"))


async def _until_closed(conn: trio.SocketStream, timeout_s: float) -> None:
    """Read ``conn`` until the host closes it (whatever it wrote first), within the bound."""
    with trio.fail_after(timeout_s):
        while True:
            try:
                if not await conn.receive_some(4096):
                    return
            except trio.BrokenResourceError:
                return


def _multistream(*lines: str) -> bytes:
    """multistream-select lines as a dialer writes them: varint length, text, newline."""
    out = b""
    for line in lines:
        body = (line + "\n").encode()
        assert len(body) < 0x80
        out += bytes([len(body)]) + body
    return out


@pytest.mark.timeout(120)
def test_plaintext_garbage_and_silent_dialers_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="atoll")
    config = HostConfig(dial_timeout_s=3, hello_timeout_s=3, send_timeout_s=20)
    attacks = {
        # a dialer asking for the plaintext security py-libp2p offers by default
        "plaintext": _multistream("/multistream/1.0.0", "/plaintext/2.0.0"),
        # a Noise proposal, then a first handshake message of random bytes
        "noise-garbage": _multistream("/multistream/1.0.0", "/noise") + b"\x00\x20" + b"\x8f" * 32,
        "random": bytes(range(256)) * 16,
        "http": b"GET / HTTP/1.1\r\nHost: atoll\r\n\r\n",
        "silent": b"",  # connects, then says nothing: only the handshake bound ends it
    }
    took: dict[str, float] = {}

    async def main() -> None:
        with trio.fail_after(100):
            async with (
                open_host(generate(), RUN, config) as node,
                open_host(generate(), RUN, config) as honest,
            ):
                assert await honest.connect(node.addrs[0]) == node.peer_id
                port = _port_of(node)
                caplog.clear()

                async def attack(name: str, data: bytes) -> None:
                    conn = await trio.open_tcp_stream("127.0.0.1", port)
                    start = trio.current_time()
                    with contextlib.suppress(trio.BrokenResourceError):
                        if data:
                            await conn.send_all(data)
                    await _until_closed(conn, config.dial_timeout_s + 30)
                    took[name] = trio.current_time() - start
                    await conn.aclose()

                async with trio.open_nursery() as nursery:
                    for name, data in attacks.items():
                        nursery.start_soon(attack, name, data)
                    # meanwhile the honest peer's messages keep arriving
                    for i in range(5):
                        msg = Abort(RUN, 0, i, honest.peer_id, f"during {i}")
                        await honest.send(node.peer_id, msg)
                        assert await node.receive(timeout_s=20) == (honest.peer_id, msg)
                later = Abort(RUN, 0, 9, honest.peer_id, "after")
                await honest.send(node.peer_id, later)
                assert await node.receive(timeout_s=20) == (honest.peer_id, later)
                # no connection was registered for any of them: only the honest peer's
                peers = {str(p) for p in node.libp2p_host.get_network().get_connections_map()}
                assert peers <= {honest.peer_id}

    trio.run(main)
    # the silent one waited out the handshake bound; the others were dropped at most then
    assert config.dial_timeout_s - 0.5 <= took["silent"] <= config.dial_timeout_s + 30
    assert all(t <= config.dial_timeout_s + 30 for t in took.values()), took
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) <= len(attacks), [r.getMessage() for r in loud]


@pytest.mark.timeout(120)
def test_a_hello_naming_another_peer_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="atoll")
    config = HostConfig(hello_timeout_s=5, send_timeout_s=20)

    async def main() -> None:
        with trio.fail_after(100):
            async with (
                open_host(generate(), RUN, config) as node,
                open_host(generate(), RUN, config) as honest,
                _raw_peer() as (raw, liar),
            ):
                # the liar's connection is its own (Noise); its Hello names the honest peer
                stream = await _open_stream(raw, node, None)
                lie = Hello(PROTOCOL_VERSION, RUN, honest.peer_id, AGENT)
                await stream.write(frame(encode_message(lie)))
                await _ended(stream)  # reset without an answer
                assert not node.admitted(liar) and not node.admitted(honest.peer_id)
                assert node.bytes_sent[liar] == 0
                # the honest peer itself is admitted and heard as usual
                assert await honest.connect(node.addrs[0]) == node.peer_id
                msg = Abort(RUN, 0, 1, honest.peer_id, "me")
                await honest.send(node.peer_id, msg)
                assert await node.receive(timeout_s=20) == (honest.peer_id, msg)
                assert node.admitted(honest.peer_id) and not node.admitted(liar)

    trio.run(main)
    refused = [r.getMessage() for r in caplog.records if "naming peer" in r.getMessage()]
    assert len(refused) == 1 and refused[0].startswith("refusing a stream from peer")


class _Impersonating(NoiseTransport):
    """A Noise transport that shows ``victim``'s identity key in its handshake, with a
    signature made by its own key (the only one it holds)."""

    def __init__(self, key_pair: Any, victim: Any) -> None:
        super().__init__(key_pair, create_new_x25519_key_pair().private_key)
        self.victim = victim

    def get_pattern(self) -> Any:
        pattern = super().get_pattern()
        make = pattern.make_handshake_payload
        victim = self.victim

        def forged(*args: Any, **kwargs: Any) -> Any:
            payload = make(*args, **kwargs)
            payload.id_pubkey = victim
            return payload

        pattern.make_handshake_payload = forged  # type: ignore[method-assign]
        return pattern


@pytest.mark.timeout(120)
def test_a_dialer_showing_another_peers_key_is_refused() -> None:
    config = HostConfig(dial_timeout_s=5, hello_timeout_s=5, send_timeout_s=20)

    async def main() -> None:
        with trio.fail_after(100):
            victim = generate()
            async with (
                open_host(generate(), RUN, config) as node,
                open_host(victim, RUN, config) as honest,
                open_host(generate(), RUN, config) as misdirected,
            ):
                victim_key = create_new_key_pair(victim.private_bytes()).public_key
                kp = create_new_key_pair()
                host = new_host(
                    key_pair=kp,
                    sec_opt={NOISE_PROTOCOL_ID: _Impersonating(kp, victim_key)},
                    muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
                )
                assert isinstance(host, BasicHost)
                async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                    try:
                        # (1) it dials the node showing the victim's key: the node's
                        # Noise check of the signature fails, no connection results
                        with pytest.raises(Exception):  # noqa: B017  libp2p's dial errors
                            with trio.fail_after(30):
                                await host.connect(
                                    info_from_p2p_addr(multiaddr.Multiaddr(node.addrs[0]))
                                )
                    finally:
                        with trio.CancelScope(shield=True):
                            await host.close()
                network = node.libp2p_host.get_network()
                assert not network.get_connections(ID.from_base58(victim.peer_id))
                assert not node.admitted(victim.peer_id)
                # (2) a dialer expecting another peer at the node's address: its Noise
                # check of the node's key fails, and the node admits nobody from it
                elsewhere = node.addrs[0].rsplit("/p2p/", 1)[0] + f"/p2p/{honest.peer_id}"
                with pytest.raises(PeerUnavailable):
                    await misdirected.connect(elsewhere)
                assert not node.admitted(misdirected.peer_id)
                assert not misdirected.admitted(node.peer_id)
                # the real owner of the key is heard as itself
                assert await honest.connect(node.addrs[0]) == node.peer_id
                msg = Abort(RUN, 0, 1, honest.peer_id, "the real one")
                await honest.send(node.peer_id, msg)
                assert await node.receive(timeout_s=20) == (honest.peer_id, msg)

    trio.run(main)


# -- connections: peers that hold streams without using them ---------------------------------
@pytest.mark.timeout(120)
def test_sends_to_a_peer_that_never_reads_time_out_alone() -> None:
    config = HostConfig(hello_timeout_s=5, send_timeout_s=4)
    big = b"\x33" * (2 * MiB)  # well over yamux's window: the write must wait for reads
    release = trio.Event()
    outcome: list[str] = []

    async def main() -> None:
        with trio.fail_after(100):
            async with (
                open_host(generate(), RUN, config) as node,
                open_host(generate(), RUN, config) as honest,
                _raw_peer() as (raw, stuck),
            ):

                async def never_read(stream: INetStream) -> None:
                    size = int.from_bytes(await _read_exactly(stream, 4), "big")
                    await _read_exactly(stream, size)  # the node's Hello
                    hello = Hello(PROTOCOL_VERSION, RUN, stuck, AGENT)
                    await stream.write(frame(encode_message(hello)))
                    await release.wait()  # and never read again

                raw.set_stream_handler(ATOLL_PROTOCOL, never_read)
                assert await node.connect(str(raw.get_addrs()[0])) == stuck
                assert await honest.connect(node.addrs[0]) == node.peer_id

                async def send_to_stuck() -> None:
                    # yamux buffers up to its window (which grows to 16 MiB) unread: send
                    # past it; the send that no longer fits fails within its bound
                    for i in range(32):
                        start = trio.current_time()
                        try:
                            await node.send(stuck, Part(RUN, 0, i, node.peer_id, 1, 1.0, big))
                        except PeerUnavailable:
                            outcome.append(f"failed after {trio.current_time() - start:.1f} s")
                            return
                    outcome.append("sent")

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send_to_stuck)
                    # while that send waits, the node's sends to the honest peer go through
                    for i in range(5):
                        with trio.fail_after(10):
                            await node.send(honest.peer_id, Abort(RUN, 0, i, node.peer_id, "x"))
                        got = await honest.receive(timeout_s=10)
                        assert got == (node.peer_id, Abort(RUN, 0, i, node.peer_id, "x"))
                release.set()

    trio.run(main)
    assert len(outcome) == 1 and outcome[0].startswith("failed after"), outcome
    assert float(outcome[0].split()[2]) <= config.send_timeout_s + 2


@pytest.mark.timeout(120)
def test_a_peer_holding_many_silent_streams_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="atoll")
    # a long Hello bound: the silent streams are not reset by it during the test
    config = HostConfig(hello_timeout_s=60, send_timeout_s=20)
    flood = 5 * MAX_PENDING_STREAMS
    opened: list[INetStream] = []

    async def main() -> None:
        with trio.fail_after(100):
            async with (
                open_host(generate(), RUN, config) as node,
                open_host(generate(), RUN, config) as honest,
                _raw_peer() as (raw, hog),
            ):
                ended = 0
                for _ in range(flood):
                    try:
                        opened.append(await _open_stream(raw, node, None))
                    except Exception:  # reset during negotiation: refused all the same
                        ended += 1
                # the first ones still wait for their Hello; every later one was reset
                assert len(opened) >= MAX_PENDING_STREAMS
                for stream in opened[MAX_PENDING_STREAMS:]:
                    with trio.fail_after(20):
                        await _ended(stream)
                for stream in opened[:MAX_PENDING_STREAMS]:
                    with trio.move_on_after(0.2) as waiting:
                        await _ended(stream)
                    assert waiting.cancelled_caught, "a stream within the bound was reset"
                assert ended + len(opened) == flood
                # an honest peer's streams, both ways, still open and carry messages
                assert await honest.connect(node.addrs[0]) == node.peer_id
                for i in range(3):
                    msg = Abort(RUN, 0, i, honest.peer_id, "in")
                    await honest.send(node.peer_id, msg)
                    assert await node.receive(timeout_s=20) == (honest.peer_id, msg)
                    back = Abort(RUN, 0, i, node.peer_id, "out")
                    await node.send(honest.peer_id, back)
                    assert await honest.receive(timeout_s=20) == (node.peer_id, back)
                # a hog that says its Hello on a stream is served like anyone
                for stream in opened:
                    with contextlib.suppress(Exception):
                        await stream.reset()
                await _until(lambda: not node._pending, 20)
                stream = await _open_stream(raw, node, hog)
                await stream.write(frame(encode_message(Abort(RUN, 0, 7, hog, "now"))))
                assert await node.receive(timeout_s=20) == (hog, Abort(RUN, 0, 7, hog, "now"))

    trio.run(main)
    warned = [r for r in caplog.records if "streams without a Hello" in r.getMessage()]
    assert len(warned) == 1

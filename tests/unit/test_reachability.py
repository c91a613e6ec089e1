"""Dial-back reachability: the sans-IO rules (what a server may dial, the verdict) and
the stream protocol between two real libp2p hosts on 127.0.0.1."""

from __future__ import annotations

import pytest
import trio

from atoll.node.net.dialback import GREETING, ask_dialback, greets, serve_dialback
from atoll.node.net.host import HostConfig, open_libp2p_host
from atoll.protocol.errors import CodecError, ConfigError, PeerUnavailable
from atoll.protocol.messages import decode_message, encode_message
from atoll.protocol.reachability import (
    MAX_PORTS,
    DialBackReply,
    DialBackRequest,
    dialable,
    verdict,
)
from atoll.security.identity import generate


def test_a_server_dials_only_the_address_it_saw_at_valid_ports() -> None:
    assert dialable("203.0.113.7", [4001, 4001, 0, 70000, 4002]) == [
        ("203.0.113.7", 4001),
        ("203.0.113.7", 4002),
    ]
    assert len(dialable("203.0.113.7", list(range(1000, 1010)))) == MAX_PORTS
    assert dialable("not an address", [4001]) == []
    assert dialable("0.0.0.0", [4001]) == []
    assert dialable("224.0.0.1", [4001]) == []
    assert dialable("203.0.113.7", [True, 4001]) == [("203.0.113.7", 4001)]  # type: ignore[list-item]


def _reply(ip: str, port: int, reached: tuple[int, ...], wall: float) -> DialBackReply:
    return DialBackReply(b"n" * 16, ip, port, reached, wall)


def test_the_verdict_of_the_replies() -> None:
    public = verdict([_reply("198.51.100.2", 5000, (4001,), 100.0)], local_wall_s=[99.0])
    assert public.reach == "public" and public.reached == (4001,) and public.skew_s == 1.0
    assert "reachable: peers dialed this node back at port 4001" in public.line()
    private = verdict(
        [_reply("198.51.100.2", 5000, (), 10.0), _reply("198.51.100.2", 5001, (), 12.0)],
        local_wall_s=[11.0, 11.0],
    )
    assert private.reach == "private" and private.answered == 2
    assert private.observed == ("198.51.100.2:5000", "198.51.100.2:5001")
    assert private.skew_s == -1.0  # the lower median
    assert "not reachable" in private.line() and "forward its listen port" in private.line()
    nobody = verdict([], local_wall_s=[])
    assert nobody.reach == "unknown" and nobody.skew_s is None
    assert "no peer answered" in nobody.line()


def test_dial_back_messages_round_trip_and_are_bounded() -> None:
    request = DialBackRequest(b"x" * 16, (4001, 4002))
    assert decode_message(encode_message(request)) == request
    reply = _reply("198.51.100.2", 5000, (4001,), 1.5)
    assert decode_message(encode_message(reply)) == reply
    with pytest.raises(CodecError):
        encode_message(DialBackRequest(b"x", tuple(range(1, 2 + MAX_PORTS))))


def test_greets_knows_a_libp2p_listener_from_other_listeners() -> None:
    async def main() -> None:
        async def serve(stream: trio.SocketStream, data: bytes | None) -> None:
            if data is not None:
                await stream.send_all(data)
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            ports = {}
            for name, data in (
                ("libp2p", b"\x13" + GREETING),
                ("http", b"HTTP/1.1 400 Bad Request\r\n\r\n"),
                ("silent", None),
            ):
                listeners = await nursery.start(trio.serve_tcp, lambda s, d=data: serve(s, d), 0)
                ports[name] = listeners[0].socket.getsockname()[1]
            with trio.fail_after(10):
                assert await greets("127.0.0.1", ports["libp2p"], 2.0)
                assert not await greets("127.0.0.1", ports["http"], 2.0)
                assert not await greets("127.0.0.1", ports["silent"], 0.5)
                free = trio.socket.socket()
                await free.bind(("127.0.0.1", 0))
                closed = free.getsockname()[1]
                free.close()
                assert not await greets("127.0.0.1", closed, 2.0)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_node_asks_a_peer_to_dial_it_back() -> None:
    """Two libp2p hosts on 127.0.0.1: the server reaches the asker's listen port on a
    fresh connection, not a port where nothing listens, and says where it saw it."""

    async def main() -> None:
        config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))
        async with (
            open_libp2p_host(generate(), config) as server,
            open_libp2p_host(generate(), config) as asker,
        ):
            serve_dialback(server, wall=lambda: 1234.5)
            addr = f"{server.get_addrs()[0]}"
            port = int(asker.get_addrs()[0].value_for_protocol("tcp"))
            free = trio.socket.socket()
            await free.bind(("127.0.0.1", 0))
            nobody = free.getsockname()[1]
            free.close()
            with trio.fail_after(30):
                reply = await ask_dialback(asker, addr, [port, nobody], timeout_s=20)
            assert reply.reached == (port,)
            assert reply.observed_ip == "127.0.0.1" and reply.wall_s == 1234.5
            with pytest.raises(ConfigError):
                await ask_dialback(asker, "not-an-addr", [port])
            # a peer that does not serve the protocol
            plain = f"{asker.get_addrs()[0]}"
            with trio.fail_after(30), pytest.raises(PeerUnavailable):
                await ask_dialback(server, plain, [port], timeout_s=20)

    trio.run(main)

"""Hostile peers against the frame reader of atoll.node.net.transport.

- many connections on 127.0.0.1, each holding most of a large frame unfinished: the
  process never holds more than the shared :class:`FrameBudget`, the connections over it
  are reset, and an honest connection sending whole frames meanwhile loses nothing;
- a peer trickling a frame a byte a second is cut off; one slow but steady is not, nor
  is a stream idle between frames (trio's MockClock: no real waiting).
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import trio
import trio.testing

from atoll.node.net.transport import (
    FRAME_START_S,
    MIN_FRAME_RATE,
    FrameBudget,
    FrameBudgetExceeded,
    read_frames,
)
from atoll.protocol.errors import ExchangeTimeout
from atoll.protocol.messages import frame_header

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

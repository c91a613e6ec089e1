"""Matchmaking's sends (``_Runner`` in atoll.node.net.rounds): a send that failed on a
reset connection is tried once more; one that timed out is not (the silent peer would
hold it for a second bound), and the peer is reported lost after one bound."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from atoll.node.net.memory import MemoryNetwork
from atoll.node.net.rounds import _Runner
from atoll.protocol.held import Held
from atoll.protocol.liveness import Liveness


def test_a_timed_out_send_is_not_tried_again_a_refused_one_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="atoll.node.net.rounds")

    async def main() -> None:
        # one message in flight at most, delivered after 100 s: the next send waits for
        # room and times out after 2 s
        async with (
            MemoryNetwork.open(delay_s=100.0, max_in_flight=1, send_timeout_s=2.0) as net,
            trio.open_nursery() as nursery,
        ):
            a = net.transport("peer-a")
            net.transport("peer-b")
            send, events = trio.open_memory_channel[object](16)
            liveness = Liveness()
            runner = _Runner(a, nursery, send, liveness=liveness)
            msg = Held("peer-a", "run", 0, 1.0)
            runner.send("peer-b", msg)  # takes the room
            t0 = trio.current_time()
            runner.send("peer-b", msg)
            assert await events.receive() == ("lost", "peer-b")
            assert trio.current_time() - t0 == pytest.approx(2.0, abs=0.01)  # one bound
            assert not [r for r in caplog.records if "once more" in r.message]
            runner.send("peer-nobody", msg)  # refused at once: tried again, then lost
            assert await events.receive() == ("lost", "peer-nobody")
            assert len([r for r in caplog.records if "once more" in r.message]) == 1
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

"""The Mailbox: routing of incoming messages to open rounds, holding, dropping, expiry."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from atoll.node.net.rounds import Mailbox, key_of
from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import statesync as ss


def _part(sender: str = "peer-a", chunk: int = 0, payload: bytes = b"", rnd: int = 4) -> ar.Part:
    return ar.Part("run", 1, rnd, sender, chunk, 1.0, payload)


def _join(
    sender: str = "peer-a", slot: int = 9, version: int = 3, step: int = -1
) -> mm.JoinRequest:
    return mm.JoinRequest(sender, "run", 1, slot, version, "d" * 32, 1.0, step)


async def _refused(
    box: Mailbox, requester: Any, request: mm.JoinRequest, nursery: trio.Nursery
) -> mm.Disband:
    """Route ``request`` to ``box`` (the node "node") and return the Disband the node
    answers it with at once (``requester``: the sender's memory transport)."""
    box.route(request.sender, request, nursery)
    with trio.fail_after(5):
        sender, answer = await requester.receive()
    assert sender == "node" and isinstance(answer, mm.Disband)
    return answer


AR_KEY = ("ar", "run", 1, 4, "")  # a round of no named group
MM_KEY = ("mm", "run", 1, 9)


def _mailbox(**kw: Any) -> Mailbox:
    return Mailbox(None, **kw)  # type: ignore[arg-type]  # route/open/close never use the host


def _run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def _drain(ch: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(ch.receive_nowait())
        except trio.WouldBlock:
            return out


def test_key_of() -> None:
    assert key_of(_part()) == AR_KEY
    assert key_of(ar.Reduced("run", 1, 4, "peer-b", 0, 2.0, b"")) == AR_KEY
    assert key_of(ar.Abort("run", 1, 4, "peer-b", "x")) == AR_KEY
    # a later group's round of the same version is another key
    assert key_of(ar.Abort("run", 1, 4, "peer-b", "x", group="g2")) == ("ar", "run", 1, 4, "g2")
    assert key_of(_join()) == MM_KEY
    assert key_of(mm.Disband("peer-a", "run", 1, 9, 3, "d" * 32, "bye")) == MM_KEY
    chunk = ss.StateChunk("peer-s", "run", 1, 3, "d" * 32, 0, 100, b"x")
    assert key_of(chunk) == ("state", "run", 1, "peer-s")
    assert key_of(ss.StateRequest("peer-a", "run", 1)) is None
    assert key_of(object()) is None


def test_a_message_for_an_open_key_is_delivered() -> None:
    async def main() -> None:
        box = _mailbox()
        send, recv = trio.open_memory_channel[Any](10)
        other_send, other_recv = trio.open_memory_channel[Any](10)
        box.open(AR_KEY, send)
        box.open(MM_KEY, other_send)
        async with trio.open_nursery() as nursery:
            p = _part()
            j = _join()
            box.route("peer-a", p, nursery)
            box.route("peer-a", j, nursery)
        assert _drain(recv) == [("msg", p)]
        assert _drain(other_recv) == [("msg", j)]
        assert box.dropped == 0

    _run(main)


def test_messages_for_an_unopened_key_are_held_and_delivered_in_order_on_open() -> None:
    async def main() -> None:
        box = _mailbox()
        async with trio.open_nursery() as nursery:
            parts = [_part("peer-a", 0), _part("peer-b", 1), _part("peer-c", 2)]
            for p in parts:
                box.route(p.sender, p, nursery)
            box.route("peer-a", _join(), nursery)  # held under another key
            await trio.sleep(1.0)
            send, recv = trio.open_memory_channel[Any](10)
            box.open(AR_KEY, send)
            assert _drain(recv) == [("msg", p) for p in parts]
            late = _part("peer-d", 3)
            box.route("peer-d", late, nursery)
            assert _drain(recv) == [("msg", late)]
            mm_send, mm_recv = trio.open_memory_channel[Any](10)
            box.open(MM_KEY, mm_send)
            assert _drain(mm_recv) == [("msg", _join())]
        assert box.dropped == 0

    _run(main)


@pytest.mark.parametrize(
    "msg",
    [
        _part("peer-x"),
        _join("peer-x"),
        ss.StateRequest("peer-x", "run", 1),
        ss.StateChunk("peer-x", "run", 1, 3, "d" * 32, 0, 100, b"x"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_a_message_with_a_forged_sender_is_dropped(msg: object) -> None:
    requests: list[tuple[str, object]] = []

    async def on_request(sender: str, m: object) -> None:
        requests.append((sender, m))

    async def main() -> None:
        box = _mailbox(on_request=on_request)
        send, recv = trio.open_memory_channel[Any](10)
        box.open(key_of(msg) or AR_KEY, send)
        async with trio.open_nursery() as nursery:
            box.route("peer-a", msg, nursery)  # authenticated as peer-a, claims peer-x
        assert _drain(recv) == []
        assert requests == []
        assert box.dropped == 1
        # nothing was held either: opening again delivers nothing
        box.close(key_of(msg) or AR_KEY)
        send2, recv2 = trio.open_memory_channel[Any](10)
        box.open(key_of(msg) or AR_KEY, send2)
        assert _drain(recv2) == []

    _run(main)


def test_a_message_for_a_just_closed_key_is_dropped_then_held_again() -> None:
    async def main() -> None:
        box = _mailbox(closed_s=2.0, hold_s=30.0)
        send, recv = trio.open_memory_channel[Any](10)
        box.open(AR_KEY, send)
        async with trio.open_nursery() as nursery:
            box.close(AR_KEY)
            await trio.sleep(1.9)
            box.route("peer-a", _part(chunk=0), nursery)
            assert box.dropped == 1
            assert _drain(recv) == []
            await trio.sleep(0.2)  # past closed_s
            again = _part(chunk=1)
            box.route("peer-a", again, nursery)
            assert box.dropped == 1
            send2, recv2 = trio.open_memory_channel[Any](10)
            box.open(AR_KEY, send2)
            assert _drain(recv2) == [("msg", again)]
            assert _drain(recv) == []

    _run(main)


def test_a_request_for_a_slot_between_two_attempts_is_held_for_the_next() -> None:
    """A matchmaking slot just closed (its attempt ended) may be tried again at once: a
    peer's request that arrives in between is held for the next attempt, not dropped."""

    async def main() -> None:
        box = _mailbox(closed_s=2.0, hold_s=30.0)
        send, recv = trio.open_memory_channel[Any](10)
        box.open(MM_KEY, send)
        box.close(MM_KEY)
        async with trio.open_nursery() as nursery:
            await trio.sleep(0.5)
            j = _join()
            box.route("peer-a", j, nursery)
            assert box.dropped == 0 and box.held_by("peer-a")[0] == 1
            send2, recv2 = trio.open_memory_channel[Any](10)
            box.open(MM_KEY, send2)
            assert _drain(recv2) == [("msg", j)] and _drain(recv) == []

    _run(main)


def test_reopening_a_closed_key_delivers_again() -> None:
    async def main() -> None:
        box = _mailbox(closed_s=5.0)
        send, recv = trio.open_memory_channel[Any](10)
        box.open(AR_KEY, send)
        box.close(AR_KEY)
        async with trio.open_nursery() as nursery:
            box.open(AR_KEY, send)  # the same round opened again at once
            p = _part()
            box.route("peer-a", p, nursery)
        assert _drain(recv) == [("msg", p)]
        assert box.dropped == 0

    _run(main)


def test_held_messages_expire_after_hold_s() -> None:
    async def main() -> None:
        box = _mailbox(hold_s=5.0)
        async with trio.open_nursery() as nursery:
            box.route("peer-a", _part(chunk=0), nursery)
            box.route("peer-a", _part(chunk=1), nursery)
            await trio.sleep(4.0)
            kept = _join()
            box.route("peer-a", kept, nursery)  # not yet expired: nothing dropped
            assert box.dropped == 0
            await trio.sleep(1.5)  # the parts are 5.5 s old, the join 1.5 s
            box.route("peer-b", _join("peer-b", slot=10), nursery)  # any routing expires
            assert box.dropped == 2
            send, recv = trio.open_memory_channel[Any](10)
            box.open(AR_KEY, send)
            assert _drain(recv) == []
            mm_send, mm_recv = trio.open_memory_channel[Any](10)
            box.open(MM_KEY, mm_send)
            assert _drain(mm_recv) == [("msg", kept)]

    _run(main)


def test_open_does_not_deliver_messages_older_than_hold_s() -> None:
    async def main() -> None:
        box = _mailbox(hold_s=5.0)
        async with trio.open_nursery() as nursery:
            box.route("peer-a", _part(), nursery)
        await trio.sleep(60.0)
        send, recv = trio.open_memory_channel[Any](10)
        box.open(AR_KEY, send)
        assert _drain(recv) == []

    _run(main)


def test_the_hold_budget_in_messages_is_enforced() -> None:
    async def main() -> None:
        box = _mailbox(hold_messages=3)
        async with trio.open_nursery() as nursery:
            parts = [_part(chunk=i) for i in range(3)]
            for p in parts:
                box.route("peer-a", p, nursery)
            assert box.dropped == 0
            box.route("peer-a", _part(chunk=3), nursery)
            box.route("peer-a", _join(), nursery)  # the budget is shared by all keys
            assert box.dropped == 2
            send, recv = trio.open_memory_channel[Any](10)
            box.open(AR_KEY, send)
            assert _drain(recv) == [("msg", p) for p in parts]
            # delivering the held messages frees the budget
            j = _join()
            for _ in range(3):
                box.route("peer-a", j, nursery)
            assert box.dropped == 2
            mm_send, mm_recv = trio.open_memory_channel[Any](10)
            box.open(MM_KEY, mm_send)
            assert len(_drain(mm_recv)) == 3

    _run(main)


def test_the_hold_budget_in_bytes_is_enforced() -> None:
    async def main() -> None:
        # each message counts 256 bytes plus its payload
        box = _mailbox(hold_bytes=2 * (256 + 1000) + 100)
        async with trio.open_nursery() as nursery:
            big = [_part(chunk=i, payload=bytes(1000)) for i in range(2)]
            for p in big:
                box.route("peer-a", p, nursery)
            assert box.dropped == 0
            box.route("peer-a", _part(chunk=2, payload=bytes(1000)), nursery)
            assert box.dropped == 1
            box.route("peer-a", _join(), nursery)  # 256 bytes: no room either
            assert box.dropped == 2
            small = _part(chunk=3, payload=b"")
            box.route("peer-a", _part(chunk=3, payload=bytes(100)), nursery)
            assert box.dropped == 3
            send, recv = trio.open_memory_channel[Any](10)
            box.open(AR_KEY, send)
            assert _drain(recv) == [("msg", p) for p in big]
            box.route("peer-a", small, nursery)  # open now: delivered, not held
            assert _drain(recv) == [("msg", small)]
            # the bytes were freed on open: two large ones fit again under another round
            for i in range(2):
                box.route("peer-a", _part(chunk=i, payload=bytes(1000), rnd=5), nursery)
            assert box.dropped == 3

    _run(main)


def test_expiry_frees_the_hold_budget() -> None:
    async def main() -> None:
        box = _mailbox(hold_messages=2, hold_s=1.0)
        async with trio.open_nursery() as nursery:
            box.route("peer-a", _part(chunk=0), nursery)
            box.route("peer-a", _part(chunk=1), nursery)
            await trio.sleep(2.0)
            j = _join()
            box.route("peer-a", j, nursery)  # the parts expire first, then j is held
            assert box.dropped == 2
            box.route("peer-a", j, nursery)
            assert box.dropped == 2
            send, recv = trio.open_memory_channel[Any](10)
            box.open(MM_KEY, send)
            assert _drain(recv) == [("msg", j), ("msg", j)]

    _run(main)


def test_a_message_no_round_takes_goes_to_on_request() -> None:
    got: list[tuple[str, object]] = []

    async def on_request(sender: str, msg: object) -> None:
        await trio.sleep(0.1)
        got.append((sender, msg))

    async def main() -> None:
        box = _mailbox(on_request=on_request)
        req = ss.StateRequest("peer-a", "run", 1)
        async with trio.open_nursery() as nursery:
            box.route("peer-a", req, nursery)
            box.route("peer-b", ss.StateRequest("peer-b", "run", 2), nursery)
            assert got == []  # each runs in its own task
        # one task each, in no fixed order
        assert sorted(got, key=lambda g: g[0]) == [
            ("peer-a", req),
            ("peer-b", ss.StateRequest("peer-b", "run", 2)),
        ]
        assert box.dropped == 0
        # and is neither held nor delivered to a round
        send, recv = trio.open_memory_channel[Any](10)
        box.open(AR_KEY, send)
        assert _drain(recv) == []

    _run(main)


def test_without_on_request_such_a_message_is_ignored() -> None:
    async def main() -> None:
        box = _mailbox()
        async with trio.open_nursery() as nursery:
            box.route("peer-a", ss.StateRequest("peer-a", "run", 1), nursery)
        assert box.dropped == 0

    _run(main)


def test_a_full_round_channel_drops_and_a_closed_one_unregisters() -> None:
    async def main() -> None:
        box = _mailbox()
        send, recv = trio.open_memory_channel[Any](1)
        box.open(AR_KEY, send)
        async with trio.open_nursery() as nursery:
            first = _part(chunk=0)
            box.route("peer-a", first, nursery)
            box.route("peer-a", _part(chunk=1), nursery)  # the round is not reading
            assert box.dropped == 1
            assert _drain(recv) == [("msg", first)]
            await recv.aclose()
            box.route("peer-a", _part(chunk=2), nursery)  # the round went away
            later = _part(chunk=3)
            box.route("peer-a", later, nursery)  # so this one is held for a new opener
            send2, recv2 = trio.open_memory_channel[Any](10)
            box.open(AR_KEY, send2)
            assert _drain(recv2) == [("msg", later)]

    _run(main)


def test_one_peer_flooding_early_messages_cannot_crowd_out_the_others() -> None:
    async def main() -> None:
        box = _mailbox(hold_peer_messages=3, hold_messages=10)
        async with trio.open_nursery() as nursery:
            for rnd in range(100):  # a flood of early messages for rounds never opened
                box.route("mallory", _part("mallory", rnd=rnd), nursery)
            box.route("peer-a", _part("peer-a"), nursery)
        assert box.held_by("mallory") == (3, 3 * 256)
        assert box.dropped == 97
        send, recv = trio.open_memory_channel[Any](10)
        box.open(AR_KEY, send)  # round 4: peer-a's part (mallory's share held rounds 0-2)
        assert [m.sender for _, m in _drain(recv)] == ["peer-a"]
        assert box.held_by("peer-a") == (0, 0)
        box.open(("ar", "run", 1, 0, ""), send)
        assert [m.sender for _, m in _drain(recv)] == ["mallory"]
        assert box.held_by("mallory") == (2, 2 * 256)

    _run(main)


def test_a_peer_over_its_share_of_held_bytes_is_dropped() -> None:
    async def main() -> None:
        box = _mailbox(hold_peer_bytes=3000)
        async with trio.open_nursery() as nursery:
            box.route("mallory", _part("mallory", chunk=0, payload=b"x" * 2000), nursery)
            box.route("mallory", _part("mallory", chunk=1, payload=b"x" * 2000), nursery)
            box.route("peer-a", _part("peer-a", payload=b"x" * 2000), nursery)
        assert box.held_by("mallory") == (1, 2256)
        assert box.held_by("peer-a") == (1, 2256)
        assert box.dropped == 1

    _run(main)


def test_expiry_frees_each_peers_share() -> None:
    async def main() -> None:
        box = _mailbox(hold_s=5.0, hold_peer_messages=2)
        async with trio.open_nursery() as nursery:
            for rnd in range(2):
                box.route("mallory", _part("mallory", rnd=rnd), nursery)
            await trio.sleep(6.0)
            box.route("mallory", _part("mallory", rnd=7), nursery)
        assert box.held_by("mallory") == (1, 256)

    _run(main)


def test_requests_in_progress_are_bounded_per_peer_and_overall() -> None:
    async def main() -> None:
        release = trio.Event()
        served: list[str] = []

        async def on_request(sender: str, msg: object) -> None:
            served.append(sender)
            await release.wait()

        box = _mailbox(on_request=on_request, requests=5, requests_per_peer=2)
        async with trio.open_nursery() as nursery:
            for _ in range(50):  # a flood of requests that each take long to serve
                box.route("mallory", ss.StateRequest("mallory", "run", 1), nursery)
            for peer in ("peer-a", "peer-b", "peer-c", "peer-d"):
                box.route(peer, ss.StateRequest(peer, "run", 1), nursery)
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(served) == ["mallory", "mallory", "peer-a", "peer-b", "peer-c"]
            assert box.dropped == 48 + 1
            release.set()
        async with trio.open_nursery() as nursery:  # finished requests gave their room back
            box.route("peer-d", ss.StateRequest("peer-d", "run", 1), nursery)
        assert served[-1] == "peer-d"

    _run(main)


def test_a_join_request_for_a_slot_this_node_is_past_is_refused_at_once() -> None:
    """A peer late to a slot asks a node whose version moved past it (it applied that
    round): the mailbox answers with a Disband naming its version, its own step and the
    requester's, instead of holding the request for a round that will never open here (the
    requester waited for an answer until its leader bound, peer after peer). A request
    for a slot the node has not reached is held as before."""
    from atoll.node.net.memory import MemoryNetwork

    async def main() -> None:
        async with MemoryNetwork.open(run_id="run") as net:
            late, node = net.transport("late"), net.transport("node")
            box = Mailbox(node, passed=lambda fragment, slot: (10, 95) if slot < 10 else None)
            async with trio.open_nursery() as nursery:
                answer = await _refused(box, late, _join("late", version=9, step=120), nursery)
                assert answer.reason == "slot closed: this node is at version 10"
                assert (answer.slot, answer.version, answer.for_step) == (9, 9, 120)
                assert answer.step == 95  # where this node's trainer is
                box.route("late", _join("late", slot=10), nursery)
                assert box.held_by("late")[0] == 1

    _run(main)


def test_a_join_request_out_of_step_for_a_slot_not_open_here_is_refused_at_once() -> None:
    """A peer whose step is far from this node's asks it at a slot this node is not at
    now (out of step, the two never sync a fragment at the same time): when the node's
    rule refuses it, the mailbox answers with an out-of-step Disband naming the node's
    step and the requester's, instead of holding the request; a request the rule lets
    pass is held as before, and one for an open slot goes to its matchmaker."""
    from atoll.node.net.memory import MemoryNetwork

    def rule(sender: str, request: mm.JoinRequest) -> tuple[str, int] | None:
        far = abs(request.step - 20) > 60
        return (f"out of step: step {request.step} is far from 20", 20) if far else None

    async def main() -> None:
        async with MemoryNetwork.open(run_id="run") as net:
            wrong, node = net.transport("wrong"), net.transport("node")
            box = Mailbox(node, passed=lambda fragment, slot: None, out_of_step=rule)
            async with trio.open_nursery() as nursery:
                request = _join("wrong", version=9, step=140)
                answer = await _refused(box, wrong, request, nursery)
                assert answer.reason.startswith(mm.OUT_OF_STEP)
                assert (answer.step, answer.for_step) == (20, 140)
                assert box.held_by("wrong")[0] == 0
                box.route("wrong", _join("wrong", version=9, step=30), nursery)
                assert box.held_by("wrong")[0] == 1
                channel, receive = trio.open_memory_channel[Any](10)
                box.open(("mm", "run", 1, 9), channel)
                box.route("wrong", request, nursery)  # at the slot: the matchmaker decides
                assert ("msg", request) in _drain(receive)

    _run(main)


def test_an_earlier_attempt_closing_a_key_does_not_cut_off_a_later_one() -> None:
    """A group formed ahead of a sync is let go while the sync's own matchmaking of the
    same slot has already opened the key: the earlier attempt's close (it runs as its
    task unwinds) leaves the later one's channel in place; the later one's own close
    does close the key."""

    async def main() -> None:
        box = _mailbox()
        first, first_recv = trio.open_memory_channel[Any](10)
        later, later_recv = trio.open_memory_channel[Any](10)
        box.open(MM_KEY, first)
        box.open(MM_KEY, later)
        box.close(MM_KEY, first)
        async with trio.open_nursery() as nursery:
            j = _join()
            box.route("peer-a", j, nursery)
            assert _drain(later_recv) == [("msg", j)] and _drain(first_recv) == []
            box.close(MM_KEY, later)
            box.route("peer-a", _join(), nursery)
            assert _drain(later_recv) == [] and box.held_by("peer-a")[0] == 1

    _run(main)

"""atoll.dht.quorum: requests to several peers, done at a quorum, never waiting on a silent
peer past its bound; run on trio's MockClock, so every completion time is exact.

The fake peers answer (with a value, or with nothing that counts), fail at once (a refused
connection), raise, or hang forever (a silent link) after a set delay.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing

from atoll.dht.quorum import Reply, Tally, ask, majority, without_skipped
from atoll.protocol.errors import ConfigError
from atoll.protocol.liveness import Liveness

RPC_S = 3.0


@dataclass(frozen=True)
class Peer:
    """A fake peer: after ``delay_s`` it does ``kind`` (answer, nothing, fail, reset,
    raise, hang) with ``value``."""

    kind: str
    delay_s: float = 0.01
    value: Any = "ack"


def calls(peers: dict[str, Peer]) -> Callable[[str], Awaitable[Reply[Any]]]:
    async def call(name: str) -> Reply[Any]:
        peer = peers[name]
        await trio.sleep(peer.delay_s)
        if peer.kind == "answer":
            return Reply(peer.value)
        if peer.kind == "nothing":
            return Reply(None)
        if peer.kind == "fail":
            return Reply(answered=False, reason="connection refused")
        if peer.kind == "reset":
            return Reply(answered=False, refused=True, reason="reset the stream")
        if peer.kind == "raise":
            raise OSError("the stream broke")
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    return call


def run(body: Callable[[], Awaitable[Any]]) -> Any:
    """``body`` under a MockClock that jumps to the next deadline whenever all tasks wait."""
    return trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))


async def ask_all(
    peers: dict[str, Peer], liveness: Liveness, **kwargs: Any
) -> tuple[Tally[str, Any], float]:
    """``ask`` of every fake peer with the default bound; the tally and the return time."""
    kwargs.setdefault("need", majority(len(peers)))
    kwargs.setdefault("rpc_timeout_s", RPC_S)
    t0 = trio.current_time()
    tally = await ask(list(peers), calls(peers), liveness=liveness, **kwargs)
    return tally, trio.current_time() - t0


# -- writes: done at the quorum -------------------------------------------------------------------
def test_a_write_is_done_at_a_majority_and_the_silent_peer_is_marked_in_the_background() -> None:
    peers = {"a": Peer("answer"), "b": Peer("answer"), "c": Peer("answer"), "s": Peer("hang")}
    liveness = Liveness()

    async def body() -> tuple[Tally[str, Any], float, float]:
        t0 = trio.current_time()
        async with trio.open_nursery() as background:
            tally, took = await ask_all(peers, liveness, background=background)
            # returned at the third acknowledgement; the silent peer's store goes on
            assert not liveness.suspected("s", trio.current_time())
        return tally, took, trio.current_time() - t0

    tally, took, background_done = run(body)
    assert took == pytest.approx(0.01)
    assert tally.need == 3 and tally.reached and not tally.timed_out
    assert sorted(p for p, _ in tally.values) == ["a", "b", "c"]
    assert (tally.answered, tally.failed, tally.pending) == (3, (), 1)
    # the store to the silent peer ran out its own bound, once, and marked it
    assert background_done == pytest.approx(RPC_S)
    assert liveness.suspects(background_done) == {"s": f"no answer within {RPC_S:g} s"}
    assert all(liveness.heard_at(p) == pytest.approx(0.01) for p in "abc")


def test_without_a_background_nursery_the_rest_is_cancelled_and_marks_nobody() -> None:
    peers = {"a": Peer("answer"), "b": Peer("answer"), "s": Peer("hang")}
    liveness = Liveness()

    async def body() -> float:
        await ask_all(peers, liveness)
        await trio.sleep(2 * RPC_S)  # long past the bound: nothing is left running
        return trio.current_time()

    now = run(body)
    assert liveness.suspects(now) == {} and liveness.heard_at("s") is None


def test_fewer_answers_than_the_quorum_end_when_every_peer_is_done() -> None:
    peers = {"a": Peer("answer"), "b": Peer("fail"), "c": Peer("nothing", 0.02)}
    liveness = Liveness()

    async def body() -> tuple[Tally[str, Any], float]:
        return await ask_all(peers, liveness)

    tally, took = run(body)
    assert took == pytest.approx(0.02)  # nothing more to wait for: no timeout either
    assert not tally.reached and not tally.timed_out
    assert (tally.answered, tally.failed, tally.pending) == (2, ("b",), 0)
    assert [p for p, _ in tally.values] == ["a"]
    assert liveness.suspects(took) == {"b": "connection refused"}
    assert liveness.heard_at("c") == pytest.approx(0.02)  # answered, with nothing that counts


def test_a_request_that_raises_counts_as_no_answer() -> None:
    peers = {"a": Peer("answer"), "r": Peer("raise")}
    liveness = Liveness()

    async def body() -> tuple[Tally[str, Any], float]:
        return await ask_all(peers, liveness)

    tally, took = run(body)
    assert tally.failed == ("r",) and not tally.reached
    assert liveness.suspects(took) == {"r": "OSError: the stream broke"}


# -- a silent peer: its bound once, then nothing ------------------------------------------------
def test_a_hanging_peer_costs_the_bound_once_and_nothing_once_suspected() -> None:
    peers = {"a": Peer("answer"), "b": Peer("answer", 0.02), "s": Peer("hang")}
    liveness = Liveness(hold_s=30.0, max_hold_s=60.0)

    async def body() -> list[tuple[Tally[str, Any], float]]:
        out = []
        for _ in range(3):  # as providers are read: every asked peer, answered or timed out
            asked = without_skipped(list(peers), liveness, trio.current_time())
            subset = {p: peers[p] for p in asked}
            out.append(await ask_all(subset, liveness, need=len(subset)))
        return out

    (first, t1), (second, t2), (third, t3) = run(body)
    assert t1 == pytest.approx(RPC_S)  # one silent peer: one bound, not the operation's
    assert first.failed == ("s",) and first.asked == 3
    assert t2 == pytest.approx(0.02) and t3 == pytest.approx(0.02)  # suspected: not asked
    assert second.asked == third.asked == 2 and second.reached


def test_once_every_peer_is_suspected_they_are_asked_anyway() -> None:
    liveness = Liveness()
    liveness.failed("a", 0.0)
    liveness.failed("b", 0.0)
    assert without_skipped(["a", "b"], liveness, 1.0) == ["a", "b"]
    assert without_skipped(["a", "b", "c"], liveness, 1.0) == ["c"]
    assert without_skipped(["a", "b"], liveness, 6.0) == ["a", "b"]  # the hold has passed


def test_a_probe_after_the_hold_brings_the_peer_back() -> None:
    peers = {"a": Peer("answer"), "s": Peer("hang")}
    liveness = Liveness(hold_s=5.0)

    async def body() -> tuple[bool, bool, bool]:
        await ask_all(peers, liveness, need=2)  # s fails at RPC_S: suspected until RPC_S + 5
        await trio.sleep(5.0)
        now = trio.current_time()
        was_suspected = liveness.suspected("s", now)
        asked = without_skipped(list(peers), liveness, now)
        peers["s"] = Peer("answer")  # the link is back
        tally, _ = await ask_all({p: peers[p] for p in asked}, liveness, need=2)
        return was_suspected, liveness.suspected("s", trio.current_time()), tally.reached

    was_suspected, still, reached = run(body)
    assert (was_suspected, still, reached) == (False, False, True)
    assert not liveness.silent("s")
    # when it came back is kept (deadlines measured before then do not count for it);
    # a peer that never went silent has no such time
    back = liveness.returned_at("s")
    assert back is not None and back >= RPC_S + 5.0
    assert liveness.returned_at("a") is None


def test_a_peer_that_resets_requests_is_skipped_by_the_dht_but_stays_live() -> None:
    """A reset is no answer for the tally, and the DHT skips the peer for a hold; but the
    peer is talking, so it is neither suspected nor silent (groups count it, its
    connections stay), and anything heard from it ends the skip at once."""
    peers = {"a": Peer("answer"), "b": Peer("answer", 0.02), "r": Peer("reset")}
    liveness = Liveness(hold_s=5.0, max_hold_s=20.0)
    dropped: list[str] = []
    liveness.on_suspect = lambda peer, _n: dropped.append(peer)

    async def body() -> list[Any]:
        seen: list[Any] = []
        tally, _ = await ask_all(peers, liveness, need=3)
        now = trio.current_time()
        seen.append((tally.failed, tally.reached, liveness.skipped("r", now)))
        seen.append(without_skipped(list(peers), liveness, now))
        await trio.sleep(5.0)  # the hold has passed: asked again, reset again
        seen.append(without_skipped(list(peers), liveness, trio.current_time()))
        await ask_all({"r": peers["r"]}, liveness, need=1)
        t = trio.current_time()
        seen.append((liveness.skipped("r", t + 4.9), liveness.skipped("r", t + 5.1)))
        liveness.heard("r", t + 1.0)  # a message of its own: the DHT asks it again
        seen.append(liveness.skipped("r", t + 1.0))
        return seen

    first, after, later, again, heard = run(body)
    assert first == (("r",), False, True)
    assert after == ["a", "b"] and later == ["a", "b", "r"]
    assert again == (True, False)  # the same hold, not a longer one
    assert heard is False
    assert not liveness.suspected("r", 0.0) and not liveness.silent("r")
    assert liveness.suspicions == 0 and dropped == [] and liveness.skips == 2


def test_a_silent_peer_that_also_resets_stays_silent() -> None:
    """A refusal proves nothing about a peer that failed since it was last heard: it stays
    silent (and suspected for its hold) until it answers."""
    liveness = Liveness()
    liveness.failed("s", 0.0)
    liveness.refused("s", 1.0)
    assert liveness.silent("s") and liveness.suspected("s", 1.0) and liveness.skipped("s", 1.0)
    assert liveness.refused_since("s", 1.0) and not liveness.refused_since("s", 1.5)
    liveness.heard("s", 3.0)
    assert not liveness.silent("s") and not liveness.skipped("s", 3.0)


# -- reads: the quorum, then a grace ------------------------------------------------------------
def test_a_read_waits_a_grace_after_the_quorum_for_answers_in_flight() -> None:
    peers = {
        "a": Peer("answer", 0.01, "old"),
        "b": Peer("answer", 0.02, "old"),
        "c": Peer("answer", 0.05, "newest"),  # within the grace
        "d": Peer("answer", 1.0, "late"),  # past it
        "s": Peer("hang"),
    }
    liveness = Liveness()

    async def body() -> tuple[Tally[str, Any], float]:
        return await ask_all(peers, liveness, need=2, grace_s=0.2)

    tally, took = run(body)
    assert took == pytest.approx(0.02 + 0.2)  # the quorum at 0.02, then the grace
    assert [v for _, v in tally.values] == ["old", "old", "newest"]
    assert tally.reached and tally.pending == 2 and not tally.timed_out


def test_the_grace_ends_early_when_every_peer_is_done() -> None:
    peers = {"a": Peer("answer", 0.01), "b": Peer("answer", 0.03)}

    async def body() -> tuple[Tally[str, Any], float]:
        return await ask_all(peers, Liveness(), need=1, grace_s=0.5)

    tally, took = run(body)
    assert took == pytest.approx(0.03) and len(tally.values) == 2


# -- the operation's deadline, the queue -----------------------------------------------------------
def test_the_deadline_ends_it_before_the_quorum() -> None:
    peers = {"a": Peer("answer", 5.0), "b": Peer("answer", 5.0)}
    liveness = Liveness()

    async def body() -> tuple[Tally[str, Any], float]:
        deadline = trio.current_time() + 2.0
        return await ask_all(peers, liveness, rpc_timeout_s=10.0, deadline=deadline)

    tally, took = run(body)
    assert took == pytest.approx(2.0)
    assert tally.timed_out and not tally.reached and tally.pending == 2
    assert liveness.suspects(took) == {}  # cut short by the caller, not silent


def test_the_bound_starts_when_a_request_leaves_the_queue() -> None:
    peers = {name: Peer("answer", 1.0) for name in "abcd"}
    liveness = Liveness()

    async def body() -> tuple[Tally[str, Any], float]:
        return await ask_all(peers, liveness, need=4, rpc_timeout_s=1.5, concurrency=2)

    tally, took = run(body)
    assert took == pytest.approx(2.0)  # two at a time; the queued two did not time out
    assert len(tally.values) == 4 and tally.failed == ()


def test_nobody_to_ask_returns_at_once() -> None:
    async def body() -> tuple[Tally[str, Any], float]:
        return await ask_all({}, Liveness(), need=0)

    tally, took = run(body)
    assert took == 0 and tally.asked == 0 and tally.reached and not tally.timed_out


def test_a_closed_background_nursery_falls_back_to_cancelling() -> None:
    peers = {"a": Peer("answer"), "s": Peer("hang")}
    liveness = Liveness()

    async def body() -> tuple[Tally[str, Any], float]:
        async with trio.open_nursery() as closed:
            pass
        return await ask_all(peers, liveness, need=1, background=closed)

    tally, took = run(body)
    assert took == pytest.approx(0.01) and tally.pending == 1


# -- the rules' arithmetic and checks -------------------------------------------------------------
def test_majority() -> None:
    assert [majority(n) for n in range(7)] == [0, 1, 2, 2, 3, 3, 4]
    assert majority(20) == 11
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError):
            majority(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"need": 3},
        {"need": -1},
        {"need": 1, "rpc_timeout_s": 0},
        {"need": 1, "rpc_timeout_s": math.inf},
        {"need": 1, "grace_s": -1},
        {"need": 1, "concurrency": 0},
    ],
)
def test_ask_refuses_bad_arguments(kwargs: dict[str, Any]) -> None:
    peers = {"a": Peer("answer"), "b": Peer("answer")}

    async def body() -> None:
        await ask_all(peers, Liveness(), **kwargs)

    with pytest.raises(ConfigError):
        run(body)

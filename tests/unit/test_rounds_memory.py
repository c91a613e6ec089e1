"""The round drivers (node/net/rounds.py) end to end on the in-memory network, fake clock.

Every test runs 4 to 8 peers' mailboxes, matchmaking and all-reduce (or a state transfer)
in one trio loop under ``MockClock(autojump_threshold=0)``: the timeouts are the swarm's
(seconds) and cost no real time. The harness is ``tests/unit/conftest.py``
(``rounds_harness``). What is checked is what the design promises: every member that
commits holds the reference average bit for bit; a fault ends the round Failed (or Alone)
within its deadline, never in a mix of different committed bytes, never in a hang.
"""

from __future__ import annotations

import dataclasses
import time
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio

from atoll.dht.records import ReadyRecord
from atoll.node.net.memory import MemoryNetwork
from atoll.node.net.rounds import Mailbox, fetch_state, serve_state
from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import statesync as ss
from atoll.protocol.errors import CodecError, ConfigError, ExchangeTimeout, PeerUnavailable
from atoll.protocol.manifest import GroupSettings


@pytest.fixture
def h(rounds_harness: ModuleType) -> ModuleType:
    return rounds_harness


def _survivors(results: dict[str, Any], dead: set[str]) -> list[Any]:
    return [r for p, r in results.items() if p not in dead]


def _check_consistent(h: ModuleType, setup: Any, peers: list[Any], results: dict[str, Any]) -> None:
    """Whoever committed holds its group's reference average; members of one group that
    committed hold the same bytes; nobody ends without an outcome it should have."""
    by_peer = {c.peer: c for c in peers}
    for r in results.values():
        assert r.found is not None and r.ended_at is not None, r
        if r.done:
            assert r.averaged == h.expected_average(setup, r.members, by_peer), r.peer


# --------------------------------------------------------------------------------------
# a healthy round
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["e3m0", "fp32"])
def test_four_peers_form_one_group_and_commit_the_reference_average(
    h: ModuleType, codec: str
) -> None:
    setup = h.RoundSetup(codec=codec, numel=4000)
    peers = h.contributors(setup, 4, seed=1)

    async def main() -> None:
        async with MemoryNetwork.open(seed=1) as net:
            results = await h.run_peers(net, setup, peers)
        members = {r.members for r in results.values()}
        assert len(members) == 1
        (group,) = members
        assert sorted(group) == sorted(c.peer for c in peers)
        expected = h.expected_average(setup, group, {c.peer: c for c in peers})
        for r in results.values():
            assert r.done, r.outcome
            assert r.averaged == expected
        # the leader closed the group at max_size... no: 4 < 8, so after the grace window
        assert all(r.ended_at <= setup.matchmaking_s for r in results.values())
        assert net.overflowed == 0 and net.vanished == 0

    h.run_mock(main)


def test_a_slot_joined_only_if_present_is_left_at_once_when_nobody_declared_it(
    h: ModuleType,
) -> None:
    """A peer that moved to a newer slot mid-sync (``alone_unless_seen_s``): alone there,
    it withdraws at the first view after the bound instead of waiting out matchmaking;
    with company it forms its group as usual."""
    setup = h.RoundSetup(alone_unless_seen_s=2.0)

    async def main() -> None:
        async with MemoryNetwork.open(seed=1) as net:
            lone = await h.run_peers(net, setup, h.contributors(setup, 1, seed=1))
            company = await h.run_peers(net, setup, h.contributors(setup, 3, seed=2))
        (r,) = lone.values()
        assert isinstance(r.found, mm.Alone) and r.found.withdrawn, r.found
        assert "nobody else is at slot 7" in r.found.reason
        assert 2.0 <= r.ended_at <= 2.0 + 2 * setup.poll_s < setup.matchmaking_s
        assert len({r.members for r in company.values()}) == 1
        assert all(r.done and len(r.members) == 3 for r in company.values())

    h.run_mock(main)


class _DeafBoard:
    """A ready board whose every read fails (a DHT right after a cut heals): stores
    succeed, lookups time out."""

    def __init__(self, board: Any) -> None:
        self.board = board

    async def announce_ready(self, record: ReadyRecord, /) -> None:
        await self.board.announce_ready(record)

    async def find_ready(self, fragment: int, slot: int, /) -> list[ReadyRecord]:
        await trio.sleep(0.3)
        raise ExchangeTimeout("find_ready: no closest peer answered")


def test_a_lost_copy_withdraws_on_the_clock_when_the_board_never_answers(
    h: ModuleType,
) -> None:
    """The swarm's copy moved past this sync's (``outdated`` answers a reason from 2 s
    on) while the board's reads all fail: the sync withdraws within a poll interval of
    the answer, not at the matchmaking deadline."""
    setup = h.RoundSetup(matchmaking_s=20.0)
    asked: list[float] = []

    def outdated() -> str | None:
        asked.append(trio.current_time())
        return "the swarm follows version 9" if trio.current_time() >= 2.0 else None

    async def main() -> None:
        found, ended = await h.lone_matchmaking(setup, seed=3, board=_DeafBoard, outdated=outdated)
        assert isinstance(found, mm.Alone) and found.withdrawn, found
        assert "the swarm follows version 9" in found.reason
        assert 2.0 <= ended <= 2.0 + 2 * setup.poll_s
        assert len(asked) >= 4  # asked on the clock although no view ever came

    h.run_mock(main)


# --------------------------------------------------------------------------------------
# peers killed or silenced
# --------------------------------------------------------------------------------------
def test_a_peer_killed_after_joining_before_its_group_formed_never_commits_with_it(
    h: ModuleType,
) -> None:
    """A member dies after its JoinAccept. If the leader lists it, the others learn it when
    their parts to it are refused and roll back together, long before any deadline; if the
    leader heard of it first (a send to it was refused), the others commit without it."""
    setup = h.RoundSetup()
    peers = h.contributors(setup, 4, seed=2)
    killed: list[str] = []

    async def main() -> None:
        async with MemoryNetwork.open(seed=2) as net:

            def kill_the_first_joiner(sender: str, to: str, msg: object) -> None:
                if isinstance(msg, mm.JoinAccept) and not killed:
                    killed.append(to)
                    net.kill(to)

            net.on_deliver = kill_the_first_joiner
            results = await h.run_peers(net, setup, peers)
        (victim,) = killed
        assert isinstance(results[victim].found, mm.Alone)  # its GroupFormed never came
        survivors = _survivors(results, {victim})
        # one leader's list at most (a survivor that joined after it closed ends Alone,
        # which trio's scheduling order makes rare but possible)
        assert len({r.members for r in survivors if r.members}) <= 1
        late = sum(1 for r in survivors if not r.members)  # those that ended Alone
        for r in survivors:
            if victim in r.members:
                assert isinstance(r.outcome, ar.Failed), r.outcome
                assert victim in r.outcome.reason
                assert r.ended_at < setup.matchmaking_s  # refused: no deadline waited out
            elif r.members:
                # every survivor that did not end alone, and nobody else
                assert r.done and len(r.members) == len(survivors) - late, r
            else:
                assert isinstance(r.found, mm.Alone) and r.outcome is None, r
        assert any(r.members for r in survivors)  # the others did form a group
        _check_consistent(h, setup, peers, results)

    h.run_mock(main)


def test_the_leader_killed_after_forming_leaves_nobody_committed(h: ModuleType) -> None:
    """The leader dies right after its first GroupFormed arrived: that member fails its
    round (the leader refuses its parts), the others never learn their group and are Alone
    at the matchmaking deadline."""
    setup = h.RoundSetup(group=dataclasses.replace(h.RoundSetup().group, max_size=4))
    peers = h.contributors(setup, 4, seed=3)
    seen: list[tuple[str, str]] = []

    async def main() -> None:
        async with MemoryNetwork.open(seed=3) as net:

            def kill_the_leader(sender: str, to: str, msg: object) -> None:
                if isinstance(msg, mm.GroupFormed) and not seen:
                    seen.append((sender, to))
                    net.kill(sender)

            net.on_deliver = kill_the_leader
            results = await h.run_peers(net, setup, peers)
        ((leader, informed),) = seen
        survivors = _survivors(results, {leader})
        assert len(survivors) == 3
        assert not any(r.done for r in survivors)
        assert leader in results[informed].members
        assert isinstance(results[informed].outcome, ar.Failed)
        for r in survivors:
            if r.peer != informed:
                assert isinstance(r.found, mm.Alone), r.found
                assert r.outcome is None
            assert r.ended_at <= setup.matchmaking_s + setup.part_s

    h.run_mock(main)


def _run_with_victim(
    h: ModuleType,
    setup: Any,
    peers: list[Any],
    fault: str,
    victim: str,
    on: type,
    *,
    seed: int = 0,
) -> tuple[dict[str, Any], list[str], MemoryNetwork]:
    """Run the peers; ``fault`` ("kill" or "silence") hits ``victim`` right after its first
    message of type ``on`` was delivered; returns the results and who got that message."""
    got: list[str] = []
    out: dict[str, Any] = {}

    async def main() -> None:
        async with MemoryNetwork.open(seed=seed) as net:

            def hit(sender: str, to: str, msg: object) -> None:
                if sender == victim and isinstance(msg, on) and not got:
                    got.append(to)
                    getattr(net, fault)(victim)

            net.on_deliver = hit
            out.update(await h.run_peers(net, setup, peers))
            out["net"] = net

    h.run_mock(main)
    net = out.pop("net")
    assert got, f"{victim} never sent a {on.__name__}"
    return out, got, net


@pytest.mark.parametrize("codec", ["e3m0", "fp32"])
def test_a_peer_killed_during_the_reduce_scatter_fails_every_survivor(
    h: ModuleType, codec: str
) -> None:
    setup = h.RoundSetup(codec=codec, group=dataclasses.replace(h.RoundSetup().group, max_size=5))
    peers = h.contributors(setup, 5, seed=4)
    results, _, _ = _run_with_victim(h, setup, peers, "kill", "peer-2", ar.Part)
    survivors = _survivors(results, {"peer-2"})
    assert all("peer-2" in r.members for r in survivors)
    for r in survivors:
        # nobody can hold peer-2's reduced chunk: it died before it could send one
        assert isinstance(r.outcome, ar.Failed), r.outcome
        assert r.ended_at - r.reduce_started_at < setup.part_s  # refused, not timed out


def test_a_peer_killed_during_the_all_gather_never_splits_the_survivors(
    h: ModuleType,
) -> None:
    setup = h.RoundSetup(group=dataclasses.replace(h.RoundSetup().group, max_size=5))
    peers = h.contributors(setup, 5, seed=5)
    results, got, _ = _run_with_victim(h, setup, peers, "kill", "peer-1", ar.Reduced)
    survivors = _survivors(results, {"peer-1"})
    _check_consistent(h, setup, peers, results)
    for r in survivors:
        assert r.outcome is not None
        if r.peer not in got:  # never saw peer-1's chunk: cannot have committed
            assert isinstance(r.outcome, ar.Failed), (r.peer, r.outcome)
    # whoever committed holds the same bytes as every other committer
    assert len({r.averaged for r in survivors if r.done}) <= 1


def test_a_silenced_peer_fails_the_round_at_the_phase_deadline(h: ModuleType) -> None:
    """A peer that stops answering mid-round (its sends still "succeed") is only noticed
    by the deadline: every survivor fails at the reduce-scatter's deadline, not later."""
    setup = h.RoundSetup(part_s=8.0, round_s=30.0)
    peers = h.contributors(setup, 4, seed=6)
    results, _, net = _run_with_victim(h, setup, peers, "silence", "peer-3", ar.Part)
    survivors = _survivors(results, {"peer-3"})
    assert all("peer-3" in r.members for r in survivors)
    for r in survivors:
        assert isinstance(r.outcome, ar.Failed), r.outcome
        took = r.ended_at - r.reduce_started_at
        assert setup.part_s - 0.01 <= took <= setup.part_s + 0.5, took
        # the failure names whom nothing came from (for the driver's liveness): never a
        # survivor
        assert set(r.outcome.missing) <= {"peer-3"}, r.outcome
    assert any(r.outcome.missing == ("peer-3",) for r in survivors)
    assert net.vanished > 0


# --------------------------------------------------------------------------------------
# a bad network
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_delayed_reordered_and_duplicated_messages_still_commit_identical_bytes(
    h: ModuleType, seed: int
) -> None:
    # the leader closes at 6 members (the swarm caps max_size at the live peers); the grace
    # window is long enough for the slowest join over the slowest link
    setup = h.RoundSetup(numel=5000, group=GroupSettings(min_quorum=2, max_size=6, grace_s=3.0))
    peers = h.contributors(setup, 6, seed=10 + seed)

    async def main() -> None:
        async with MemoryNetwork.open(seed=seed, delay_s=0.05, reorder_s=0.3, duplicate=0.3) as net:
            net.link_delay_s[("peer-0", "peer-1")] = 0.8
            results = await h.run_peers(net, setup, peers)
        assert net.duplicated > 0
        (group,) = {r.members for r in results.values()}
        assert len(group) == 6
        expected = h.expected_average(setup, group, {c.peer: c for c in peers})
        for r in results.values():
            assert r.done, r.outcome
            assert r.averaged == expected

    h.run_mock(main)


def test_two_views_of_one_slot_form_two_valid_groups(h: ModuleType) -> None:
    """Each half of 8 peers sees only its half's ready records: two groups form in the
    same slot and each commits its own members' reference average."""
    setup = h.RoundSetup(group=dataclasses.replace(h.RoundSetup().group, max_size=4))
    base = h.contributors(setup, 8, seed=7)
    halves = [{c.peer for c in base[:4]}, {c.peer for c in base[4:]}]

    async def main() -> None:
        async with MemoryNetwork.open(seed=7) as net:
            peers = [
                dataclasses.replace(c, board=net.board.view(halves[i // 4]))
                for i, c in enumerate(base)
            ]
            results = await h.run_peers(net, setup, peers)
        groups = {r.members for r in results.values()}
        assert {frozenset(g) for g in groups} == {frozenset(half) for half in halves}
        by_peer = {c.peer: c for c in base}
        averages = set()
        for group in groups:
            expected = h.expected_average(setup, group, by_peer)
            averages.add(expected)
            for peer in group:
                assert results[peer].done and results[peer].averaged == expected
        assert len(averages) == 2

    h.run_mock(main)


# --------------------------------------------------------------------------------------
# state transfer
# --------------------------------------------------------------------------------------
RUN = "memory-run"


def _state(numel: int, seed: int = 0) -> ss.FragmentState:
    rng = np.random.default_rng(seed)
    return ss.FragmentState(
        version=9,
        optimizer_steps=4,
        step=1200,
        global_params=rng.standard_normal(numel).astype(np.float32),
        momentum=rng.standard_normal(numel).astype(np.float32),
    )


async def _serve(net: MemoryNetwork, peer: str, state: ss.FragmentState, nursery: Any) -> None:
    transport = net.transport(peer)

    async def on_request(sender: str, msg: object) -> None:
        if isinstance(msg, ss.StateRequest):
            await serve_state(transport, sender, msg, state)

    nursery.start_soon(Mailbox(transport, on_request=on_request).run)


async def _fetcher(net: MemoryNetwork, peer: str, nursery: Any) -> tuple[Any, Mailbox]:
    transport = net.transport(peer)
    mailbox = Mailbox(transport)
    nursery.start_soon(mailbox.run)
    return transport, mailbox


def test_a_state_transfer_completes(h: ModuleType) -> None:
    state = _state(3000)

    async def main() -> None:
        async with MemoryNetwork.open() as net, trio.open_nursery() as nursery:
            await _serve(net, "server", state, nursery)
            transport, mailbox = await _fetcher(net, "joiner", nursery)
            got = await fetch_state(transport, mailbox, "server", RUN, 1, 3000, timeout_s=20.0)
            nursery.cancel_scope.cancel()
        assert (got.version, got.step, got.digest()) == (9, 1200, state.digest())
        assert np.array_equal(got.global_params, state.global_params)

    h.run_mock(main)


def test_a_server_killed_mid_transfer_times_the_fetch_out(h: ModuleType) -> None:
    numel = ss.CHUNK_BYTES // 8 + 1000  # two chunks
    state = _state(numel)
    first: list[object] = []

    async def main() -> None:
        async with MemoryNetwork.open() as net, trio.open_nursery() as nursery:

            def kill_after_the_first_chunk(sender: str, to: str, msg: object) -> None:
                if isinstance(msg, ss.StateChunk) and not first:
                    first.append(msg)
                    net.kill(sender)

            net.on_deliver = kill_after_the_first_chunk
            await _serve(net, "server", state, nursery)
            transport, mailbox = await _fetcher(net, "joiner", nursery)
            start = trio.current_time()
            with pytest.raises(ExchangeTimeout):
                await fetch_state(transport, mailbox, "server", RUN, 1, numel, timeout_s=20.0)
            assert trio.current_time() - start == pytest.approx(20.0)
            nursery.cancel_scope.cancel()
        assert len(first) == 1

    h.run_mock(main)


def test_a_dead_server_fails_the_fetch_at_once(h: ModuleType) -> None:
    async def main() -> None:
        async with MemoryNetwork.open() as net, trio.open_nursery() as nursery:
            await _serve(net, "server", _state(100), nursery)
            transport, mailbox = await _fetcher(net, "joiner", nursery)
            net.kill("server")
            start = trio.current_time()
            with pytest.raises(PeerUnavailable):
                await fetch_state(transport, mailbox, "server", RUN, 1, 100, timeout_s=20.0)
            assert trio.current_time() == start
            nursery.cancel_scope.cancel()

    h.run_mock(main)


# --------------------------------------------------------------------------------------
# the memory network itself
# --------------------------------------------------------------------------------------
def _part(sender: str, chunk: int = 0) -> ar.Part:
    return ar.Part(RUN, 1, 7, sender, chunk, 1.0, bytes(8))


def test_messages_arrive_decoded_in_order_after_the_delay(h: ModuleType) -> None:
    async def main() -> None:
        async with MemoryNetwork.open(delay_s=0.5) as net:
            a, b = net.transport("a"), net.transport("b")
            sent = [_part("a", i) for i in range(5)]
            for m in sent:
                await a.send("b", m)
            assert trio.current_time() == 0.0  # a send does not wait for the delivery
            got = [await b.receive() for _ in sent]
            assert trio.current_time() == pytest.approx(0.5)
        assert got == [("a", m) for m in sent]
        assert all(m is not g for m, (_, g) in zip(sent, got, strict=True))  # copies
        assert (net.sent, net.delivered) == (5, 5)

    h.run_mock(main)


def test_a_killed_peer_refuses_sends_and_its_receive_ends(h: ModuleType) -> None:
    async def main() -> None:
        async with MemoryNetwork.open() as net:
            a, b = net.transport("a"), net.transport("b")
            await a.send("b", _part("a"))  # unread when b dies: lost
            with trio.move_on_after(1.0):
                await trio.sleep_forever()  # (the fake clock jumps)
            net.kill("b")
            with pytest.raises(trio.EndOfChannel):
                await b.receive()
            with pytest.raises(PeerUnavailable):
                await a.send("b", _part("a"))
            with pytest.raises(PeerUnavailable):
                await b.send("a", _part("b"))
            net.revive("b")
            await a.send("b", _part("a", 1))
            assert await b.receive() == ("a", _part("a", 1))

    h.run_mock(main)


def test_a_silenced_peer_accepts_sends_and_hears_nothing(h: ModuleType) -> None:
    async def main() -> None:
        async with MemoryNetwork.open() as net:
            a, b = net.transport("a"), net.transport("b")
            net.silence("b")
            await a.send("b", _part("a"))
            await b.send("a", _part("b"))
            for t in (a, b):
                with trio.move_on_after(5.0) as scope:
                    await t.receive()
                assert scope.cancelled_caught
            assert net.vanished == 2
            with pytest.raises(ExchangeTimeout):
                await a.receive(timeout_s=1.0)
            net.revive("b")
            await b.send("a", _part("b"))
            assert await a.receive() == ("b", _part("b"))

    h.run_mock(main)


def test_sends_that_cannot_go_raise(h: ModuleType) -> None:
    async def main() -> None:
        async with MemoryNetwork.open() as net:
            a = net.transport("a")
            with pytest.raises(PeerUnavailable):
                await a.send("nobody", _part("a"))
            with pytest.raises(ConfigError):
                await a.send("a", _part("a"))
            with pytest.raises(CodecError):  # what the live host could not encode either
                await a.send("nobody", object())
            assert net.transport("a") is a

    h.run_mock(main)


def test_duplicates_and_reordering_are_seeded(h: ModuleType) -> None:
    async def trace(seed: int) -> list[int]:
        async with MemoryNetwork.open(seed=seed, reorder_s=1.0, duplicate=0.5) as net:
            a, b = net.transport("a"), net.transport("b")
            for i in range(20):
                await a.send("b", _part("a", i))
            out: list[int] = []
            while True:
                with trio.move_on_after(2.0) as scope:
                    _, msg = await b.receive()
                    assert isinstance(msg, ar.Part)
                    out.append(msg.chunk)
                if scope.cancelled_caught:
                    return out

    results: dict[int, list[list[int]]] = {}

    async def main() -> None:
        for seed in (1, 1, 2):
            results.setdefault(seed, []).append(await trace(seed))

    h.run_mock(main)
    (one, again), (two,) = results[1], results[2]
    assert one == again != two
    assert sorted(set(one)) == list(range(20)) and len(one) > 20  # duplicates
    assert one != sorted(one)  # reordered


def test_the_board_expires_records_and_views_filter_them(h: ModuleType) -> None:
    now = [100.0]
    wall = lambda: now[0]  # noqa: E731

    def record(peer: str, expires_at: float) -> Any:
        d = mm.Declaration(RUN, 1, 7, peer, 7, "ab" * 16, 1.0, now[0])
        return ReadyRecord.from_declaration(d, issued_at=now[0], expires_at=expires_at)

    async def main() -> None:
        async with MemoryNetwork.open(wall=wall) as net:
            await net.board.announce_ready(record("b", 110.0))
            await net.board.announce_ready(record("a", 105.0))
            await net.board.announce_ready(
                dataclasses.replace(record("c", 120.0), run_id="other-run")
            )
            assert [r.peer_id for r in await net.board.find_ready(1, 7)] == ["a", "b"]
            assert [r.peer_id for r in await net.board.view({"b"}).find_ready(1, 7)] == ["b"]
            assert await net.board.find_ready(1, 8) == []
            now[0] = 106.0
            assert [r.peer_id for r in await net.board.find_ready(1, 7)] == ["b"]
            await net.board.announce_ready(record("a", 200.0))  # announced again
            assert [r.peer_id for r in await net.board.find_ready(1, 7)] == ["a", "b"]

    h.run_mock(main)


def test_a_real_round_takes_little_real_time(h: ModuleType) -> None:
    """The point of the fake clock: a round with second-long deadlines in milliseconds."""
    setup = h.RoundSetup()
    peers = h.contributors(setup, 4, seed=8)
    started = time.perf_counter()

    async def main() -> None:
        async with MemoryNetwork.open() as net:
            net.silence(net.transport("peer-0").peer_id)  # deadlines are waited out
            await h.run_peers(net, setup, peers)

    h.run_mock(main)
    assert time.perf_counter() - started < 1.0

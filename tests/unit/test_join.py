"""join_swarm's one deadline and its message, with a scripted host and DHT on trio's MockClock.

Each address's peer is scripted: refuse the dial at once, never answer, answer after a
while, refuse for good (another run). The clock is virtual, so the bounds are exact: a
failed join ends at its deadline to the millisecond, however long a dial would have taken.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any, cast

import pytest
import trio
import trio.testing

from atoll.node.net import join
from atoll.node.net.host import VersionMismatch, WrongRun
from atoll.protocol.errors import ConfigError, PeerUnavailable
from atoll.protocol.messages import PROTOCOL_VERSION
from atoll.security.membership import NotAMember

ME = "12D3KooWMe"
RUN = "ab" * 32


def _addr(port: int, peer: str) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"


REFUSED = _addr(9, "12D3KooWRefused")
SILENT = _addr(10, "12D3KooWSilent")
GOOD = _addr(11, "12D3KooWGood")
OTHER_RUN = _addr(12, "12D3KooWOtherRun")
SLOW = _addr(13, "12D3KooWSlow")


def _refused(addr: str) -> PeerUnavailable:
    """What the host raises for a refused dial: py-libp2p's wrappers around the OS error."""
    os_error = ConnectionRefusedError(errno.ECONNREFUSED, "Error connecting: Connection refused")
    inner = RuntimeError("fail to open connection")
    inner.__cause__ = os_error
    multi = RuntimeError([inner])  # py-libp2p's MultiError keeps its errors in a list
    dial = RuntimeError(f"unable to connect to {addr.rsplit('/', 1)[1]}")
    dial.__cause__ = multi
    error = PeerUnavailable(f"cannot connect to peer {addr.rsplit('/', 1)[1]} at {addr}: x")
    error.__cause__ = dial
    return error


class _Host:
    """A host whose every peer follows a script (see the module docstring)."""

    def __init__(self) -> None:
        self.dials: dict[str, list[float]] = {}

    @property
    def peer_id(self) -> str:
        return ME

    async def connect(self, addr: str) -> str:
        self.dials.setdefault(addr, []).append(trio.current_time())
        peer = addr.rsplit("/p2p/", 1)[1]
        if addr == REFUSED:
            await trio.sleep(0.7)  # py-libp2p tries a refused dial 3 times
            raise _refused(addr)
        if addr == SILENT:
            await trio.sleep_forever()
        if addr == OTHER_RUN:
            await trio.sleep(0.1)
            raise WrongRun(peer, RUN, f"peer {peer} at {addr} does not serve run {RUN}")
        if addr == SLOW:
            await trio.sleep(3.0)
        return peer


class _DHT:
    def __init__(self) -> None:
        self.bootstraps: list[str] = []

    async def bootstrap(self, addrs: list[str]) -> int:
        self.bootstraps.extend(addrs)
        await trio.sleep(0.05)
        return len(addrs)


def _run(body: Callable[[], Any]) -> Any:
    return trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))


async def _join(
    host: _Host, addrs: list[str], timeout_s: float, dht: _DHT | None = None
) -> tuple[float, Any]:
    """(seconds the join took, its result or the exception it raised)."""
    t0 = trio.current_time()
    try:
        result: Any = await join.join_swarm(
            cast(Any, host), cast(Any, dht or _DHT()), addrs, timeout_s=timeout_s, dial_s=10.0
        )
    except Exception as e:
        result = e
    return trio.current_time() - t0, result


def _assert_one_line_per_address(text: str, addrs: list[str]) -> list[str]:
    lines = text.splitlines()
    assert len(lines) == len(addrs), text
    for line, addr in zip(lines, addrs, strict=True):
        assert text.count(addr) == 1, text  # named once in the whole message
        assert text.count(addr.rsplit("/p2p/", 1)[1]) == 1, text  # its peer id too
        assert addr in line, line
    return lines


def test_an_unreachable_address_is_retried_and_the_join_fails_at_its_deadline() -> None:
    host = _Host()
    elapsed, error = _run(lambda: _join(host, [REFUSED], 5.0))
    assert isinstance(error, join.JoinFailed)
    assert elapsed == pytest.approx(5.0, abs=1e-6)
    # tries at 0, 0.7 + 1, 2.4 + 2 (each dial 0.7 s): the one at 4.4 is cut at 5
    assert host.dials[REFUSED] == pytest.approx([0.0, 1.7, 4.4], abs=1e-6)
    (line,) = _assert_one_line_per_address(str(error), [REFUSED])
    assert (
        line
        == f"cannot join the swarm within 5 s through {REFUSED}: unreachable (connection refused)"
    )


def test_a_dial_that_never_answers_is_cut_at_the_deadline() -> None:
    host = _Host()
    elapsed, error = _run(lambda: _join(host, [SILENT], 3.0))  # the probe's own bound: 15 s
    assert isinstance(error, join.JoinFailed)
    assert elapsed == pytest.approx(3.0, abs=1e-6)
    (line,) = _assert_one_line_per_address(str(error), [SILENT])
    assert line.endswith(": unreachable (no answer within 3 s)"), line


def test_a_final_refusal_fails_at_once_with_a_config_error() -> None:
    host = _Host()
    elapsed, error = _run(lambda: _join(host, [OTHER_RUN], 60.0))
    assert isinstance(error, ConfigError) and not isinstance(error, join.JoinFailed)
    assert elapsed == pytest.approx(0.1, abs=1e-6)
    assert host.dials[OTHER_RUN] == [0.0]  # never tried again
    (line,) = _assert_one_line_per_address(str(error), [OTHER_RUN])
    assert line == (
        f"cannot join the swarm through {OTHER_RUN}: that peer trains another run "
        "(its manifest differs from this one's)"
    )


def test_several_addresses_get_one_line_each_and_share_the_deadline() -> None:
    host = _Host()
    addrs = [REFUSED, SILENT, OTHER_RUN]
    elapsed, error = _run(lambda: _join(host, addrs, 4.0))
    assert isinstance(error, join.JoinFailed)  # not all final: retried to the deadline
    assert elapsed == pytest.approx(4.0, abs=1e-6)  # tried at once, not one after another
    lines = _assert_one_line_per_address(str(error), addrs)
    assert lines[0].endswith("unreachable (connection refused)")
    assert lines[1].endswith("unreachable (no answer within 4 s)")
    assert lines[2].endswith("that peer trains another run (its manifest differs from this one's)")
    assert all(line.startswith("cannot join the swarm within 4 s through ") for line in lines)


def test_the_first_address_that_answers_ends_the_join() -> None:
    host, dht = _Host(), _DHT()
    elapsed, joined = _run(lambda: _join(host, [REFUSED, SILENT, GOOD], 60.0, dht))
    assert joined == 1
    # the good peer's probe and bootstrap, then JOIN_GRACE_S for the dials under way (the
    # silent one is cut there; the refused one ends at 0.7 s and is not tried again)
    assert elapsed == pytest.approx(0.05 + join.JOIN_GRACE_S, abs=1e-6)
    assert dht.bootstraps == [GOOD]


def test_a_slow_peer_still_joins_and_a_later_one_is_not_waited_for() -> None:
    host, dht = _Host(), _DHT()
    elapsed, joined = _run(lambda: _join(host, [REFUSED, SLOW], 60.0, dht))
    assert joined == 1
    # the refused address, waiting to try again at 4.4 s, stops at once
    assert elapsed == pytest.approx(3.05, abs=1e-6)
    assert dht.bootstraps == [SLOW]


def test_a_peer_that_answers_after_the_deadline_is_too_late() -> None:
    host = _Host()
    elapsed, error = _run(lambda: _join(host, [SLOW], 2.0))
    assert isinstance(error, join.JoinFailed)
    assert elapsed == pytest.approx(2.0, abs=1e-6)


def test_a_bootstrap_cut_by_the_deadline_says_the_peer_answered() -> None:
    class StuckDHT(_DHT):
        async def bootstrap(self, addrs: list[str]) -> int:
            await trio.sleep_forever()
            raise AssertionError("unreachable")

    elapsed, error = _run(lambda: _join(_Host(), [GOOD], 2.0, StuckDHT()))
    assert isinstance(error, join.JoinFailed)
    assert elapsed == pytest.approx(2.0, abs=1e-6)
    assert str(error).endswith("it answered, but the DHT bootstrap through it took over 2 s")


PROBED_PEER = "12D3KooWProbed"
PROBED = _addr(14, PROBED_PEER)


@pytest.mark.parametrize(
    ("raised", "reason", "final"),
    [
        (
            NotAMember(ME, f"peer {PROBED_PEER} at {PROBED} closed the stream after the Hello"),
            "that peer refused this node: it does not count it as a member of the run",
            True,
        ),
        (
            NotAMember(PROBED_PEER, f"peer {PROBED_PEER} showed no member certificate"),
            "that peer is not a member of this run: the peer showed no member certificate",
            True,
        ),
        (
            VersionMismatch(PROBED_PEER, "it serves /atoll/2/msg", ("/atoll/2/msg",)),
            "that peer speaks another atoll protocol version (it serves /atoll/2/msg;",
            True,
        ),
        (
            VersionMismatch(PROBED_PEER, f"peer {PROBED_PEER} says protocol version 9", version=9),
            f"that peer speaks atoll protocol version 9, this node {PROTOCOL_VERSION}",
            True,
        ),
        (VersionMismatch(PROBED_PEER, "none"), "it serves no atoll protocol", False),
        (ConfigError(f"{PROBED} is this node's own address"), "the address is this node's", True),
        (
            PeerUnavailable(f"connecting to peer {PROBED_PEER} at {PROBED} timed out after 10 s"),
            "unreachable (connecting to the peer timed out after 10 s)",
            False,
        ),
        (_refused(PROBED), "unreachable (connection refused)", False),
    ],
)
def test_the_probe_names_each_refusal_without_the_address(
    raised: Exception, reason: str, final: bool
) -> None:
    class Refusing(_Host):
        async def connect(self, addr: str) -> str:
            await trio.lowlevel.checkpoint()
            raise raised

    async def body() -> join.Refusal | None:
        return await join.probe(cast(Any, Refusing()), PROBED, 10.0)

    refusal = trio.run(body)
    assert refusal is not None
    assert refusal.reason.startswith(reason), refusal.reason
    assert refusal.final is final
    assert PROBED_PEER not in refusal.reason and "\n" not in refusal.reason


def test_a_bootstrap_peer_passes_the_probe() -> None:
    class Bootstrap(_Host):
        async def connect(self, addr: str) -> str:
            await trio.lowlevel.checkpoint()
            raise VersionMismatch("P", "DHT only", ("/atoll/kad/1.0.0",))

    async def body() -> join.Refusal | None:
        return await join.probe(cast(Any, Bootstrap()), _addr(9, "P"), 10.0)

    assert trio.run(body) is None


def test_an_address_given_twice_is_tried_once_and_named_once() -> None:
    host = _Host()
    _, error = _run(lambda: _join(host, [OTHER_RUN, OTHER_RUN], 5.0))
    assert isinstance(error, ConfigError)
    _assert_one_line_per_address(str(error), [OTHER_RUN])
    assert len(host.dials[OTHER_RUN]) == 1

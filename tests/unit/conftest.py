"""Shared harness of the unit tests: whole rounds of N peers on the in-memory network.

:func:`run_peers` runs every peer's :func:`~atoll.node.net.rounds.run_matchmaking` then
(when it formed a group) :func:`~atoll.node.net.rounds.run_allreduce` concurrently on a
:class:`~atoll.node.net.memory.MemoryNetwork`, each peer with its own
:class:`~atoll.node.net.rounds.Mailbox`, declared the way :class:`~atoll.protocol.sync.FragmentSync`
declares (the slot is the fragment's version), and returns what each peer ended with.
Call it inside ``trio.run(..., clock=trio.testing.MockClock(autojump_threshold=0))``
(:func:`run_mock`).

With ``--import-mode=importlib`` a test module cannot import this file; it gets the
harness from the ``rounds_harness`` fixture (this module).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from atoll.node.net.memory import MemoryNetwork
from atoll.node.net.rounds import Mailbox, run_allreduce, run_matchmaking
from atoll.node.net.seam import ReadyBoard
from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol.codecs import make_codec
from atoll.protocol.manifest import GroupSettings
from atoll.protocol.reduce import Contribution, reduce_encoded

DIGEST = "ab" * 16


@dataclass(frozen=True, slots=True)
class RoundSetup:
    """What every peer of one memory round shares (the manifest's part of a sync)."""

    run_id: str = "memory-run"
    fragment: int = 1
    version: int = 7
    """the fragment's global version: the slot and the round of the all-reduce"""
    numel: int = 3000
    codec: str = "e3m0"
    codec_block: int = 128
    group: GroupSettings = field(
        default_factory=lambda: GroupSettings(min_quorum=2, max_size=8, grace_s=1.0)
    )
    matchmaking_s: float = 6.0
    part_s: float = 8.0
    round_s: float = 15.0
    poll_s: float = 0.5
    linger_s: float = 10.0
    alone_unless_seen_s: float | None = None
    """see :func:`~atoll.node.net.rounds.run_matchmaking`"""

    @property
    def ttl_s(self) -> float:
        """The ready record's lifetime, as the swarm sets it (twice matchmaking, plus)."""
        return 2 * self.matchmaking_s + 5.0


@dataclass(frozen=True, slots=True)
class Contributor:
    """One peer of a memory round: id, encoded delta, token weight, and its DHT view
    (None: the network's whole board)."""

    peer: str
    payload: bytes
    weight: float
    board: ReadyBoard | None = None
    digest: str = DIGEST


@dataclass(slots=True)
class PeerResult:
    """What one peer ended with; times are trio's clock (the fake one under MockClock)."""

    peer: str
    found: mm.Formed | mm.Alone | None = None
    outcome: ar.Done | ar.Failed | None = None
    reduce_started_at: float | None = None
    ended_at: float | None = None

    @property
    def members(self) -> tuple[str, ...]:
        """The group it formed (empty when it did not)."""
        return self.found.members if isinstance(self.found, mm.Formed) else ()

    @property
    def done(self) -> bool:
        """Whether its all-reduce committed."""
        return isinstance(self.outcome, ar.Done)

    @property
    def averaged(self) -> bytes:
        """The committed average's bytes (raises when it did not commit)."""
        assert isinstance(self.outcome, ar.Done), f"{self.peer} ended {self.outcome}"
        return self.outcome.averaged.tobytes()


def contributors(setup: RoundSetup, n: int, *, seed: int = 0) -> list[Contributor]:
    """``n`` peers ``peer-0``... with random deltas (encoded with the setup's codec) and
    integer token weights."""
    codec = make_codec(setup.codec, block=setup.codec_block)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        delta = (rng.standard_normal(setup.numel) * rng.uniform(0.1, 3.0)).astype(np.float32)
        out.append(Contributor(f"peer-{i}", codec.encode(delta), float(rng.integers(1, 5000))))
    return out


def expected_average(
    setup: RoundSetup, members: Sequence[str], by_peer: dict[str, Contributor]
) -> bytes:
    """The reference result of a group: the token-weighted fp32 mean of the members'
    decoded payloads in member order, encoded once and decoded (protocol.reduce)."""
    codec = make_codec(setup.codec, block=setup.codec_block)
    parts = [Contribution(by_peer[m].payload, by_peer[m].weight) for m in members]
    averaged = codec.decode(reduce_encoded(parts, codec, setup.numel), setup.numel)
    return averaged.tobytes()


async def run_peer(
    net: MemoryNetwork,
    setup: RoundSetup,
    me: Contributor,
    result: PeerResult,
    services: trio.Nursery,
) -> None:
    """One peer's sync: its mailbox (in ``services``), matchmaking, then the all-reduce of
    the group it formed. Fills ``result`` as it goes."""
    transport = net.transport(me.peer)
    mailbox = Mailbox(transport)
    services.start_soon(mailbox.run)
    declaration = mm.Declaration(
        setup.run_id,
        setup.fragment,
        setup.version,
        me.peer,
        setup.version,
        me.digest,
        me.weight,
        net.wall(),
    )
    result.found = await run_matchmaking(
        transport,
        mailbox,
        me.board if me.board is not None else net.board,
        declaration,
        setup.group,
        timeout_s=setup.matchmaking_s,
        ttl_s=setup.ttl_s,
        wall=net.wall,
        poll_s=setup.poll_s,
        alone_unless_seen_s=setup.alone_unless_seen_s,
    )
    if isinstance(result.found, mm.Formed):
        spec = ar.RoundSpec(
            result.found.key, result.found.members, setup.numel, setup.codec, setup.codec_block
        )
        result.reduce_started_at = trio.current_time()
        result.outcome = await run_allreduce(
            transport,
            mailbox,
            spec,
            me.payload,
            me.weight,
            phase_timeout_s=setup.part_s,
            round_timeout_s=setup.round_s,
            linger_s=setup.linger_s,
        )
    result.ended_at = trio.current_time()


async def run_peers(
    net: MemoryNetwork, setup: RoundSetup, peers: Sequence[Contributor]
) -> dict[str, PeerResult]:
    """Every peer's :func:`run_peer` at once; returns when all have ended (their
    mailboxes are then stopped)."""
    results = {c.peer: PeerResult(c.peer) for c in peers}
    async with trio.open_nursery() as services:
        async with trio.open_nursery() as rounds:
            for c in peers:
                rounds.start_soon(run_peer, net, setup, c, results[c.peer], services)
        services.cancel_scope.cancel()
    return results


async def lone_matchmaking(
    setup: RoundSetup,
    *,
    seed: int,
    board: Callable[[ReadyBoard], ReadyBoard] | None = None,
    **options: Any,
) -> tuple[mm.Formed | mm.Alone, float]:
    """``peer-0`` alone at slot 7 of a fresh :class:`MemoryNetwork`: its matchmaking
    (``options`` go to :func:`run_matchmaking`; ``board`` wraps the network's board) and
    when it ended."""
    async with MemoryNetwork.open(seed=seed) as net:
        transport = net.transport("peer-0")
        mailbox = Mailbox(transport)
        async with trio.open_nursery() as services:
            services.start_soon(mailbox.run)
            me = mm.Declaration(
                setup.run_id, setup.fragment, 7, "peer-0", 7, DIGEST, 10.0, net.wall()
            )
            found = await run_matchmaking(
                transport,
                mailbox,
                board(net.board) if board is not None else net.board,
                me,
                setup.group,
                timeout_s=setup.matchmaking_s,
                ttl_s=setup.ttl_s,
                wall=net.wall,
                poll_s=setup.poll_s,
                **options,
            )
            ended = trio.current_time()
            services.cancel_scope.cancel()
    return found, ended


def run_mock(main: Callable[[], Awaitable[None]]) -> None:
    """``trio.run(main)`` on a fake clock that jumps whenever every task waits."""
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.fixture
def rounds_harness() -> ModuleType:
    """This module: the memory-round harness, for test modules that cannot import it."""
    return sys.modules[__name__]

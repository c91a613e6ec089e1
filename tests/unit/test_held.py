"""Held trainers (atoll.protocol.held) and the sync that lets its trainer go when the
peers it waits for are held at other fragments' slots (run_matchmaking's
``comes_later``)."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import trio

from atoll.protocol import matchmaking as mm
from atoll.protocol.held import HELD_MAX_S, Held, HeldPeers
from atoll.protocol.messages import decode_message, encode_message


@pytest.fixture
def h(rounds_harness: ModuleType) -> ModuleType:
    return rounds_harness


def test_a_notice_travels_on_the_wire() -> None:
    msg = Held("peer-a", "run", 2, 12.5)
    assert decode_message(encode_message(msg)) == msg


def test_a_peer_is_held_where_it_said_until_its_hold_ends_or_runs_out() -> None:
    held = HeldPeers()
    assert held.note(Held("a", "run", 2, 10.0), now=100.0)
    assert held.held_at("a", now=105.0) == 2
    assert held.elsewhere("a", 0, now=105.0) and not held.elsewhere("a", 2, now=105.0)
    assert held.held_at("a", now=110.0) is None  # ran out
    held.note(Held("a", "run", 1, 10.0), now=200.0)
    held.note(Held("a", "run", 1, 0.0), now=201.0)  # released
    assert not held.elsewhere("a", 0, now=202.0)
    held.note(Held("a", "run", 1, 1e9), now=300.0)  # at most HELD_MAX_S
    assert held.held_at("a", now=300.0 + HELD_MAX_S) is None
    held.note(Held("a", "run", 1, 5.0), now=400.0)
    held.forget("a")
    assert held.held_at("a", now=401.0) is None
    assert not held.elsewhere("nobody", 0, now=0.0)


@pytest.mark.parametrize(
    "msg", [Held("a", "run", -1, 5.0), Held("a", "run", 0, -1.0), Held("a", "run", 0, math.nan)]
)
def test_a_notice_that_makes_no_sense_is_ignored(msg: Held) -> None:
    held = HeldPeers()
    assert not held.note(msg, now=0.0)
    assert held.held_at("a", now=0.0) is None


@pytest.mark.parametrize("elsewhere", [True, False])
def test_a_sync_waiting_only_for_peers_held_elsewhere_lets_its_trainer_go(
    h: ModuleType, elsewhere: bool
) -> None:
    """peer-0 is alone at its slot; peer-1 is due there (its record) but has not
    declared. Its trainer is held with patience. When peer-1's trainer is held at
    another fragment's slot, the trainer is let go within a poll interval, and the
    matchmaking still waits for peer-1 (it ends at the deadline, not at the release).
    When peer-1 is not held elsewhere, the trainer stays held to the end."""
    setup = h.RoundSetup(matchmaking_s=10.0)
    holds: list[tuple[float, float]] = []

    def hold(seconds: float) -> None:
        holds.append((trio.current_time(), seconds))

    async def main() -> None:
        found, ended = await h.lone_matchmaking(
            setup,
            seed=4,
            patience_s=setup.matchmaking_s,
            expected=lambda: ["peer-1"],
            hold=hold,
            comes_later=lambda peer: (
                "held elsewhere" if elsewhere and trio.current_time() >= 3.0 else None
            ),
        )
        assert isinstance(found, mm.Alone), found
        assert holds and holds[0][1] > 0, holds  # held with patience
        assert holds[-1][1] == 0.0 and len(holds) == 2, holds  # let go once, never again
        if elsewhere:
            assert 3.0 <= holds[-1][0] <= 3.0 + 2 * setup.poll_s, holds
            assert ended > holds[-1][0] + setup.matchmaking_s / 2  # the slot stayed open
        else:
            assert holds[-1][0] == pytest.approx(ended, abs=0.01), (holds, ended)

    h.run_mock(main)

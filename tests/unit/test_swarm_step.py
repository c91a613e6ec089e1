"""The swarm's step from the peers' records (PeerTracker.swarm_step): where a node that
resumes from a checkpoint or joins starts, so that it does not wait at slots its peers
passed long ago."""

from __future__ import annotations

from atoll.dht.records import PeerRecord
from atoll.node.net.peers import PeerTracker
from atoll.protocol.matchmaking import GroupSettings

RUN = "ab" * 32
NOW = 1000.0


class _NoDirectory:
    async def find_peers(self) -> list[PeerRecord]:
        return []


def _record(peer: str, step: int, *, training: bool = True) -> PeerRecord:
    return PeerRecord(
        peer, RUN, (), "atoll/test", 0.0, (1,), ("d",), True, NOW, NOW + 120.0, training, step=step
    )


def _tracker(records: list[PeerRecord], banned: set[str] = frozenset()) -> PeerTracker:
    t = PeerTracker(
        "me",
        GroupSettings(min_quorum=2),
        directory=_NoDirectory(),
        wall=lambda: NOW,
        banned=lambda p: p in banned,
    )
    t.note(records)
    return t


def test_the_swarm_step_is_the_lower_median_of_the_trainers_records() -> None:
    assert _tracker([]).swarm_step() == -1
    assert _tracker([_record("a", -1)]).swarm_step() == -1  # an older record: not known
    recs = [_record("a", 300), _record("b", 320), _record("c", 10**9)]  # c lies
    assert _tracker(recs).swarm_step() == 320
    assert _tracker([*recs, _record("d", 310)]).swarm_step() == 310
    # a node that stopped training, a banned peer and this node itself do not count
    assert _tracker([*recs, _record("e", 0, training=False)]).swarm_step() == 320
    assert _tracker(recs, banned={"c"}).swarm_step() == 300
    assert _tracker([*recs, _record("me", 5)]).swarm_step() == 320

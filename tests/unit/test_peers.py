"""PeerTracker: who counts toward a group (records, contact, training) and the majority rule."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from atoll.dht.records import PeerRecord
from atoll.node.net.peers import PeerTracker
from atoll.protocol.errors import ConfigError
from atoll.protocol.liveness import Liveness
from atoll.protocol.manifest import GroupSettings

RUN = "ab" * 32
NOW = 1_000.0


def _record(peer: str, *, version: int = 0, training: bool = True, ttl: float = 60.0) -> PeerRecord:
    return PeerRecord(
        peer,
        RUN,
        (),
        "atoll/test",
        0.0,
        (version,),
        (f"d{version}",),
        True,
        NOW,
        NOW + ttl,
        training,
    )


class _Directory:
    def __init__(self, records: list[PeerRecord]) -> None:
        self.records = records

    async def find_peers(self) -> list[PeerRecord]:
        await trio.lowlevel.checkpoint()
        return self.records


def _tracker(records: list[PeerRecord], group: GroupSettings) -> PeerTracker:
    tracker = PeerTracker("me", group, directory=_Directory(records), wall=lambda: NOW)
    tracker.note(records)
    return tracker


def test_the_quorum_is_a_majority_of_the_peers_that_answer_and_train() -> None:
    peers = [f"p{i}" for i in range(5)]
    tracker = _tracker([_record(p) for p in peers], GroupSettings(2, 8, 1.0))
    assert tracker.group_settings() == GroupSettings(4, 6, 1.0)  # 6 peers: 4 of them
    tracker.liveness.failed("p0", 0.0)
    tracker.liveness.failed("p1", 0.0)
    assert tracker.responsive() == ["p2", "p3", "p4"]
    assert tracker.group_settings() == GroupSettings(3, 4, 1.0)  # 4 answer: 3 of them
    # a silent peer stays out after its hold passed, until it is heard again
    assert not tracker.liveness.suspected("p0", 100.0) and tracker.liveness.silent("p0")
    tracker.liveness.heard("p0", 100.0)
    assert tracker.group_settings() == GroupSettings(3, 5, 1.0)
    # a peer that settles at the end of its run holds its copy but counts toward no quorum
    tracker.note([_record("p2", training=False)])
    assert "p2" in tracker.responsive() and "p2" not in tracker.trainers()
    assert tracker.group_settings() == GroupSettings(3, 4, 1.0)
    assert ("p2", 0, "d0") in tracker.holdings(0)


def test_holdings_leave_out_peers_that_do_not_answer() -> None:
    tracker = _tracker([_record("a", version=3), _record("b", version=5)], GroupSettings())
    tracker.liveness.failed("b", 0.0, "cut off")
    assert tracker.holdings(0) == [("a", 3, "d3")]
    assert tracker.liveness.suspects(1.0) == {"b": "cut off"}


def test_the_peers_expected_at_a_slot_hold_its_version_or_an_earlier_one() -> None:
    records = [
        _record("same", version=4),
        _record("behind", version=3),  # rebases onto version 4 before its round
        _record("past", version=5),  # done with this slot
        _record("far", version=1),  # back from a cut: rebases and joins too
        _record("done", version=4, training=False),  # settles: joins no more groups
        _record("cut", version=4),
    ]
    tracker = _tracker(records, GroupSettings())
    tracker.liveness.failed("cut", 0.0)
    # "same" holds version 4 whatever its copy (a healed split's other side rebases onto
    # this node's copy, which the rule chose, and joins the slot)
    assert sorted(tracker.expected(0, 4)) == ["behind", "far", "same"]
    assert tracker.expected(1, 4) == []  # no such fragment in the records


def test_quorum_one_and_swarms_too_large_for_a_majority_keep_the_manifest_quorum() -> None:
    lone = _tracker([_record("a"), _record("b")], GroupSettings(1, 8, 1.0))
    assert lone.group_settings().min_quorum == 1
    big = _tracker([_record(f"p{i}") for i in range(19)], GroupSettings(2, 8, 1.0))
    assert big.group_settings() == GroupSettings(2, 8, 1.0)  # 20 peers: 11 > 8
    mid = _tracker([_record(f"p{i}") for i in range(9)], GroupSettings(2, 8, 1.0))
    assert mid.group_settings() == GroupSettings(6, 8, 1.0)  # 10 peers: 6 fit in 8


def test_liveness_holds_double_and_cap() -> None:
    live = Liveness(hold_s=5.0, max_hold_s=12.0)
    live.failed("x", 0.0)
    assert live.suspected("x", 4.9) and not live.suspected("x", 5.0)
    live.failed("x", 3.0)  # still held: no extension
    assert not live.suspected("x", 5.0)
    live.failed("x", 5.0)  # second failure in a row: 10 s
    assert live.suspected("x", 14.9) and not live.suspected("x", 15.0)
    live.failed("x", 15.0)  # capped at 12 s
    assert live.suspected("x", 26.9) and not live.suspected("x", 27.0)
    live.heard("x", 30.0)
    assert not live.silent("x") and live.heard_at("x") == 30.0
    live.failed("x", 31.0)  # the doubling starts over
    assert not live.suspected("x", 36.0)
    assert live.suspicions == 4


def test_silent_peers_are_probed_within_their_hold_and_come_back_when_they_answer() -> None:
    async def main() -> None:
        tracker = _tracker(
            [_record("a"), _record("b"), _record("c"), _record("d")], GroupSettings()
        )
        live = tracker.liveness
        now = trio.current_time()
        live.failed("a", now - 10.0)  # hold passed
        live.failed("b", now - 10.0)  # hold passed, still silent
        live.failed("c", now)  # within its hold: probed too (a healed link shows at once)
        asked: list[str] = []

        async def probe(peer: str) -> bool:
            asked.append(peer)
            await trio.sleep(0.5)
            if peer in ("a", "c"):
                live.heard(peer, trio.current_time())
                return True
            live.failed(peer, trio.current_time(), "no answer")
            return False

        assert sorted(await tracker.probe_silent(probe)) == ["a", "c"]
        assert sorted(asked) == ["a", "b", "c"]  # "d" answers: never probed
        assert sorted(tracker.responsive()) == ["a", "c", "d"]
        assert live.suspected("b", trio.current_time())  # held again, for longer

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_listener_hears_each_new_suspicion_with_the_failures_in_a_row() -> None:
    live = Liveness(hold_s=5.0)
    heard: list[tuple[str, int]] = []
    live.on_suspect = lambda peer, n: heard.append((peer, n))
    live.failed("x", 0.0)
    live.failed("x", 1.0)  # within the hold: not a new suspicion
    live.failed("x", 6.0)
    live.heard("x", 7.0)
    live.failed("x", 8.0)
    assert heard == [("x", 1), ("x", 2), ("x", 1)]


def test_a_spell_of_contact_breaks_at_a_failure_or_a_gap_longer_than_gap_s() -> None:
    """The other side of a split that nobody asked anything never failed, but a gap in
    contact longer than gap_s starts a new spell all the same."""
    live = Liveness(hold_s=5.0, gap_s=10.0)
    assert live.in_touch_since("x") is None  # never heard
    for t in (0.0, 8.0, 17.5, 27.0):  # never more than 10 s apart: one spell
        live.heard("x", t)
    assert live.in_touch_since("x") == 0.0 and live.returned_at("x") is None
    live.heard("x", 40.0)  # 13 s of silence, no request failed
    assert live.in_touch_since("x") == 40.0 and live.returned_at("x") is None
    live.failed("x", 41.0)
    assert live.in_touch_since("x") is None  # silent: not in touch
    live.heard("x", 42.0)
    assert live.in_touch_since("x") == 42.0 and live.returned_at("x") == 42.0
    with pytest.raises(ConfigError):
        Liveness(gap_s=0.0)


def test_holdings_keep_only_believed_states_and_report_the_rest() -> None:
    from atoll.protocol.certificate import CertifiedStates

    class _NoSeals:
        def open(self, data: bytes, *, domain: str, max_payload: int) -> tuple[bytes, str]:
            raise AssertionError("nothing to open here")

    reported: list[tuple[str, int, int]] = []
    beliefs = CertifiedStates(
        RUN,
        quorum=2,
        verifier=_NoSeals(),
        seeds=["d0"],
        on_uncertified=lambda *claim: reported.append(claim),
    )
    records = [_record("p0"), _record("p1", version=1), _record("liar", version=10**6)]
    now = [0.0]
    tracker = PeerTracker(
        "me",
        GroupSettings(2, 8, 1.0),
        directory=_Directory(records),
        wall=lambda: NOW,
        beliefs=beliefs,
        clock=lambda: now[0],
    )
    tracker.note(records)
    assert [h[0] for h in tracker.declared(0)] == ["p0", "p1", "liar"]
    assert tracker.holdings(0, mine=(0, "d0")) == [("p0", 0, "d0")]
    assert tracker.holdings(0, mine=(1, "d1")) == [("p0", 0, "d0"), ("p1", 1, "d1")]
    assert reported == []  # within the grace, however far ahead
    now[0] = beliefs.grace_s
    tracker.holdings(0, mine=(1, "d1"))
    tracker.holdings(0, mine=(1, "d1"))
    assert reported == [("liar", 0, 10**6)]  # past its grace: reported, once

"""``atoll status``'s table: one line per peer record, with its reachability."""

from __future__ import annotations

import time

from atoll.dht.records import PeerRecord
from atoll.node.swarmstatus import SwarmView, format_view

RUN = "ab" * 32
PEERS = ("12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "12D3KooWBBBBBBBBBBBBBBBBBBBBBB")


def _record(peer: str, reach: str) -> PeerRecord:
    now = time.time()
    return PeerRecord(
        peer,
        RUN,
        ("/ip4/198.51.100.4/tcp/4001",),
        "atoll/0.1.0",
        1500.0,
        (3, 2),
        ("cd" * 32, "ef" * 32),
        True,
        now,
        now + 300,
        True,
        reach,
    )


def test_the_table_says_which_peers_can_be_dialed() -> None:
    view = SwarmView(
        [_record(PEERS[0], "private"), _record(PEERS[1], "")], ["/ip4/.../p2p/boot"], {}
    )
    text = format_view(view, run_id=RUN, run_name="my-run")
    lines = text.splitlines()
    assert lines[0] == "asked: /ip4/.../p2p/boot"
    assert f"run {RUN[:16]} (my-run): 2 peer(s)" in text
    header = next(line for line in lines if "versions" in line)
    assert header.split() == [
        "peer",
        "tok/s",
        "age",
        "s",
        "versions",
        "reach",
        "agent",
        "addresses",
    ]
    rows = [line.split() for line in lines if "atoll/0.1.0" in line]
    assert [row[4] for row in rows] == ["private", "-"]
    assert [row[3] for row in rows] == ["3,2", "3,2"]


def test_other_runs_are_left_out_when_one_is_asked_for() -> None:
    view = SwarmView([_record(PEERS[0], "public")], ["a"], {"b": "unreachable"})
    text = format_view(view, run_id="cd" * 32)
    assert "no answer from b: unreachable" in text
    assert "no peers of that run in the DHT" in text

"""Tests of the node status the network process sends the trainer: wire round trip, checks."""

from __future__ import annotations

import dataclasses
import json
import logging

import msgpack
import pytest

from atoll.node.net.status import BadStatus, NodeStatus

FULL = NodeStatus(
    peer_id="12D3KooWpeer",
    run_id="ab" * 32,
    addrs=("/ip4/127.0.0.1/tcp/4001",),
    start_step=40,
    joined=2,
    swarm_step=57,
    peers_seen=3,
    dht_peers=4,
    bytes_per_peer={"12D3KooWother": (100, 200)},
    bytes_up=1000,
    bytes_down=2000,
    rounds_applied=5,
    rounds_failed=1,
    rounds_alone=2,
    rebases=1,
    last_sync={0: "v3 applied", 12: "rebased v4"},
    round_s=(0.5, 1.25),
    round_bytes=(300, 400),
    group_sizes=(2, 3),
    versions=(3, 4),
    history=((0, 3, "d0", "3/peer"), (1, 4, "d1", "rebase")),
    outcomes=((0, 3, "applied", 0.5, False), (1, 4, "none", 0.1, True)),
)


def test_every_field_has_a_parser() -> None:
    from atoll.node.net import status

    assert set(status._PARSERS) == {f.name for f in dataclasses.fields(NodeStatus)}


def test_wire_round_trip_through_msgpack() -> None:
    wire = msgpack.unpackb(msgpack.packb(FULL.to_wire()))
    assert NodeStatus.from_wire(wire) == FULL


def test_as_dict_is_json_with_the_field_names() -> None:
    d = json.loads(json.dumps(FULL.as_dict()))
    assert set(d) == {f.name for f in dataclasses.fields(NodeStatus)}
    assert d["last_sync"] == {"0": "v3 applied", "12": "rebased v4"}
    assert d["bytes_per_peer"] == {"12D3KooWother": [100, 200]}
    assert NodeStatus.from_wire(d) == FULL


def test_defaults_and_missing_keys() -> None:
    assert NodeStatus.from_wire({}) == NodeStatus()
    s = NodeStatus.from_wire({"peer_id": "p", "rounds_applied": 2})
    assert (s.peer_id, s.rounds_applied, s.bytes_up, s.addrs) == ("p", 2, 0, ())


def test_partial_update_changes_only_the_named_fields() -> None:
    s = FULL.updated({"swarm_step": 99, "versions": [5, 5]})
    assert s == dataclasses.replace(FULL, swarm_step=99, versions=(5, 5))
    assert FULL.updated({}) is FULL


def test_unknown_keys_are_ignored_with_a_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="atoll.node.net.status"):
        s = NodeStatus.from_wire({"peer_id": "p", "from_the_future": 1})
    assert s == NodeStatus(peer_id="p")
    assert "from_the_future" in caplog.text


@pytest.mark.parametrize(
    "data",
    [
        {"peer_id": 3},
        {"bytes_up": "12"},
        {"bytes_up": True},
        {"bytes_up": 1.5},
        {"addrs": "/ip4/1.2.3.4/tcp/1"},
        {"addrs": [1]},
        {"last_sync": {"x": "v1"}},
        {"last_sync": {"0": 1}},
        {"bytes_per_peer": {"p": [1]}},
        {"round_s": ["fast"]},
        {"history": [[0, 1, "d"]]},
        {"outcomes": [[0, 1, "applied", 0.5, 1]]},
        {"joined": None},
    ],
)
def test_wrong_types_are_a_clear_error(data: dict[str, object]) -> None:
    key = next(iter(data))
    with pytest.raises(BadStatus, match=repr(key)):
        NodeStatus.from_wire(data)


def test_not_a_dict() -> None:
    with pytest.raises(BadStatus, match="dict"):
        NodeStatus.from_wire([1, 2])  # type: ignore[arg-type]


def test_bad_status_is_a_value_error() -> None:
    assert issubclass(BadStatus, ValueError)


def test_status_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.peer_id = "other"  # type: ignore[misc]

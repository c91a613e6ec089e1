"""bench/faults.py's reading of the nodes' logs after a heal: which round of each fragment
first held every node, counted over the rounds committed after the heal and over those
whose group formed after it (a round still running at the heal was formed without the
other side). The log lines are the syncer's own format (``Syncer._log_slot``)."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from tests.unit.benchload import load_bench

T0 = datetime(2026, 12, 5, 8, 0, 0)


faults = load_bench("faults")


def _line(at_s: float, fragment: int, slot: int, members: str, took: float | None) -> str:
    stamp = (T0 + timedelta(seconds=at_s)).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    tail = f"; round {took:.2f} s" if took is not None else ""
    return (
        f"{stamp} net[1] atoll.node.net.syncer INFO fragment {fragment} slot {slot}: applied;"
        f" the slot's declarations: none; members: {members}{tail}"
    )


def _summary(rows: list[tuple[int, int, str]]) -> dict[str, Any]:
    """A node's JSON summary: its history of (fragment, version, digest, "slot/leader")."""
    return {
        "info": {
            "history": [
                [p, slot + 1, f"d{p}{slot}", f"{slot}/{leader}"] for p, slot, leader in rows
            ]
        }
    }


def _heal(tmp_path: Path, took: float | None) -> dict[str, Any]:
    """Two sides {0,1} and {2,3} each commit fragment 0's slot 5 a second after the heal
    (at 10 s), their groups formed 3 s before it; then slot 6 holds all four."""
    logs = {
        0: [(11.0, 0, 5, "AA, BB"), (20.0, 0, 6, "AA, BB, CC, DD")],
        1: [(11.0, 0, 5, "AA, BB"), (20.0, 0, 6, "AA, BB, CC, DD")],
        2: [(11.5, 0, 5, "CC, DD"), (20.0, 0, 6, "AA, BB, CC, DD")],
        3: [(11.5, 0, 5, "CC, DD"), (20.0, 0, 6, "AA, BB, CC, DD")],
    }
    leaders = {0: "AA", 1: "AA", 2: "CC", 3: "CC"}
    events, summaries = [], []
    for i, rows in logs.items():
        path = tmp_path / f"node{i}.log"
        path.write_text(
            "\n".join(_line(t, p, s, m, took if s == 5 else 1.0) for t, p, s, m in rows) + "\n"
        )
        events.append(faults.read_log(path))
        summaries.append(_summary([(0, 5, leaders[i]), (0, 6, "AA")]))
    rounds = faults.rounds_of(events, summaries)
    healed = (T0 + timedelta(seconds=10)).timestamp()
    return faults._after_heal(rounds, healed, 4, 1, None)


def test_rounds_formed_before_the_heal_are_not_counted_as_regrouped(tmp_path: Path) -> None:
    heal = _heal(tmp_path, took=4.0)
    assert heal["rounds_to_full_per_fragment"] == {0: 3}  # both sides' last rounds first
    assert heal["rounds_to_full_per_fragment_formed_after"] == {0: 1}
    assert heal["slots_to_full_per_fragment"] == {0: 1}
    assert heal["rounds_formed_before_the_heal"] == 2
    assert heal["seconds_to_full_round"] == 10.0


def test_a_round_formed_after_the_heal_counts_in_both(tmp_path: Path) -> None:
    heal = _heal(tmp_path, took=0.5)  # formed 0.5 s after the heal
    assert heal["rounds_to_full_per_fragment"] == {0: 3}
    assert heal["rounds_to_full_per_fragment_formed_after"] == {0: 3}
    # the sides' two groups of slot 5 are one round of the swarm, split: slot 6 is its 2nd
    assert heal["slots_to_full_per_fragment"] == {0: 2}
    assert heal["rounds_formed_before_the_heal"] == 0


def test_a_log_without_round_times_counts_every_round(tmp_path: Path) -> None:
    """Logs of older runs state no duration: both counts agree (nothing is dropped)."""
    heal = _heal(tmp_path, took=None)
    assert heal["rounds_to_full_per_fragment_formed_after"] == {0: 3}
    assert heal["rounds_formed_before_the_heal"] == 0

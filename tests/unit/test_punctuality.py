"""Punctuality: a peer due at its slots that missed the last few is no longer waited for
past the grace window, and one slot as a member makes it punctual again."""

from __future__ import annotations

import pytest

from atoll.protocol.errors import ConfigError
from atoll.protocol.punctuality import LATE_AFTER, Punctuality


def test_a_peer_is_late_after_missing_its_last_slots_in_a_row() -> None:
    p = Punctuality()
    for _ in range(LATE_AFTER - 1):
        assert p.ended(0, ["slow", "fast"], ["me", "fast"], now=0.0) == []
        assert not p.late("slow", 0)
    assert p.ended(0, ["slow", "fast"], ["me", "fast"], now=0.0) == ["slow"]  # said once
    assert p.late("slow", 0) and not p.late("fast", 0)
    assert p.keep(0, ["fast", "slow", "new"]) == ["fast", "new"]
    assert p.ended(0, ["slow"], ["me", "fast"], now=0.0) == []  # late already: not said again


def test_one_slot_as_a_member_makes_a_late_peer_punctual_again() -> None:
    p = Punctuality(late_after=2)
    p.ended(0, ["slow"], ["me"], now=0.0)
    p.ended(0, ["slow"], ["me"], now=0.0)
    assert p.late("slow", 0)
    p.ended(0, [], ["me", "slow"], now=0.0)  # it came within the first grace (not waited for)
    assert not p.late("slow", 0)
    p.ended(0, ["slow"], ["me"], now=0.0)
    assert not p.late("slow", 0)  # the count starts again


def test_misses_only_count_in_a_row() -> None:
    p = Punctuality(late_after=2)
    p.ended(0, ["a"], ["me"], now=0.0)
    p.ended(0, ["a"], ["me", "a"], now=0.0)
    p.ended(0, ["a"], ["me"], now=0.0)
    assert not p.late("a", 0)


def test_late_after_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="late_after"):
        Punctuality(late_after=0)


def test_a_peer_that_answers_again_after_a_silence_since_its_last_miss_starts_punctual() -> None:
    """A cut that healed, a restarted node: the misses said nothing of its pace."""
    p = Punctuality(late_after=2)
    back: dict[str, float] = {}
    p.ended(0, ["cut"], ["me"], now=10.0, returned_at=back.get)
    p.ended(0, ["cut"], ["me"], now=20.0, returned_at=back.get)
    assert p.late("cut", 0, back.get)
    back["cut"] = 15.0  # back before its last miss: still late
    assert p.late("cut", 0, back.get)
    back["cut"] = 25.0
    assert not p.late("cut", 0, back.get) and p.keep(0, ["cut"], back.get) == ["cut"]
    p.ended(0, ["cut"], ["me"], now=30.0, returned_at=back.get)
    assert not p.late("cut", 0, back.get)  # one miss since


def test_misses_count_per_fragment() -> None:
    """A node catching up after a cut misses a slot or two of each fragment; only a peer
    that misses the same fragment's slots again and again is late there."""
    p = Punctuality(late_after=2)
    p.ended(0, ["peer"], ["me"], now=0.0)
    p.ended(1, ["peer"], ["me"], now=1.0)
    p.ended(2, ["peer"], ["me"], now=2.0)
    assert not any(p.late("peer", f) for f in range(3))
    p.ended(1, ["peer"], ["me"], now=3.0)
    assert p.late("peer", 1) and not p.late("peer", 0)
    assert p.keep(1, ["peer"]) == [] and p.keep(0, ["peer"]) == ["peer"]
    p.ended(1, [], ["me", "peer"], now=4.0)
    assert not p.late("peer", 1)

"""Punctuality: a peer due at its slots that missed the last few is no longer waited for
past the grace window, and one slot as a member makes it punctual again."""

from __future__ import annotations

import pytest

from atoll.protocol.errors import ConfigError
from atoll.protocol.punctuality import LATE_AFTER, Punctuality


def test_a_peer_is_late_after_missing_its_last_slots_in_a_row() -> None:
    p = Punctuality()
    for _ in range(LATE_AFTER - 1):
        assert p.ended(["slow", "fast"], ["me", "fast"]) == []
        assert not p.late("slow")
    assert p.ended(["slow", "fast"], ["me", "fast"]) == ["slow"]  # said once
    assert p.late("slow") and not p.late("fast")
    assert p.keep(["fast", "slow", "new"]) == ["fast", "new"]
    assert p.ended(["slow"], ["me", "fast"]) == []  # late already: not said again


def test_one_slot_as_a_member_makes_a_late_peer_punctual_again() -> None:
    p = Punctuality(late_after=2)
    p.ended(["slow"], ["me"])
    p.ended(["slow"], ["me"])
    assert p.late("slow")
    p.ended([], ["me", "slow"])  # it came within the first grace (not waited for)
    assert not p.late("slow")
    p.ended(["slow"], ["me"])
    assert not p.late("slow")  # the count starts again


def test_misses_only_count_in_a_row() -> None:
    p = Punctuality(late_after=2)
    p.ended(["a"], ["me"])
    p.ended(["a"], ["me", "a"])
    p.ended(["a"], ["me"])
    assert not p.late("a")


def test_late_after_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="late_after"):
        Punctuality(late_after=0)

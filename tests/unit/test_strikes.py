"""The strike ledger (protocol/strikes.py) on a fake clock."""

from __future__ import annotations

import logging

import pytest

from atoll.protocol.errors import ConfigError
from atoll.protocol.strikes import Ban, Strikes, reason_of_failure, self_accused


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_proven_offence_bans_at_once_and_the_ban_is_logged_exactly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    bans: list[Ban] = []
    ledger = Strikes(clock=clock, on_ban=bans.append)
    with caplog.at_level(logging.WARNING, logger="atoll.protocol.strikes"):
        ban = ledger.strike("peerA", "part", "fragment 0 round 3: norm too large")
    assert ban is not None and bans == [ban]
    assert ban.seconds == 60.0 and ban.nth == 1
    assert ledger.banned("peerA") and not ledger.banned("peerB")
    assert ledger.banned_peers() == ("peerA",)
    assert [r.getMessage() for r in caplog.records] == [
        "banned peer peerA for 60 s: part: fragment 0 round 3: norm too large"
    ]
    assert ledger.total == 1 and ledger.bans_total == 1


def test_weak_strikes_add_up_and_old_ones_are_forgotten() -> None:
    clock = Clock()
    ledger = Strikes(clock=clock, forget_s=100.0, weights={"slow": 1})
    assert ledger.strike("p", "slow") is None
    clock.now += 60
    assert ledger.strike("p", "slow") is None
    assert ledger.points("p") == 2
    clock.now += 50  # the first strike is past forget_s
    assert ledger.points("p") == 1
    assert ledger.strike("p", "slow") is None
    assert ledger.strike("p", "slow") is not None
    assert ledger.banned("p") and ledger.points("p") == 0  # a ban clears the points


def test_an_uncertified_claim_alone_never_bans() -> None:
    """An honest member holds an uncertified state whenever its round committed at fewer
    members than the quorum: those strikes are kept for the record and weigh nothing."""
    clock = Clock()
    ledger = Strikes(clock=clock)
    for _ in range(10):
        assert ledger.strike("p", "uncertified") is None
    assert not ledger.banned("p") and ledger.points("p") == 0 and ledger.total == 10


def test_bans_end_double_on_repeat_and_are_bounded() -> None:
    clock = Clock()
    ledger = Strikes(clock=clock, ban_s=10.0, max_ban_s=35.0)
    lengths = []
    for _ in range(4):
        ban = ledger.strike("p", "forged")
        assert ban is not None
        lengths.append(ban.seconds)
        # strikes during a ban are counted, but do not extend it
        assert ledger.strike("p", "forged") is None
        assert ledger.ban_of("p") == ban
        clock.now = ban.until - 0.001
        assert ledger.banned("p")
        clock.now = ban.until
        assert not ledger.banned("p")
    assert lengths == [10.0, 20.0, 35.0, 35.0]
    assert ledger.bans_total == 4 and ledger.total == 8


def test_reasons_of_a_failed_round() -> None:
    assert reason_of_failure("x sent two different parts (equivocation)") == "equivocation"
    assert reason_of_failure("parts for chunk 1 rejected: x: norm") == "part"


def test_an_abort_naming_its_own_sender_is_a_confession_and_others_are_hearsay() -> None:
    own = "aborted by X: parts for chunk 0 rejected: X: chunk norm 3.8e+05 exceeds 10 x"
    assert self_accused(own) == "X"
    both = "aborted by X: parts for chunk 0 rejected: Y: weight; X: chunk norm too large"
    assert self_accused(both) == "X"
    assert self_accused("aborted by X: part of X rejected: e3m0: invalid block scale") == "X"
    assert self_accused("aborted by X: parts for chunk 0 rejected: Y: norm") is None
    assert self_accused("aborted by X: part of Y rejected: NaN") is None
    assert self_accused("aborted by X: parts for chunk 0 rejected: XY: norm") is None
    assert self_accused("lost X before its part for chunk 1") is None


def test_memory_is_bounded_and_bans_are_kept_longest() -> None:
    clock = Clock()
    ledger = Strikes(clock=clock, max_peers=4)
    ledger.strike("banned", "part")
    for i in range(10):
        ledger.strike(f"weak{i}", "uncertified")
    assert ledger.banned("banned")
    assert len(ledger._peers) <= 5


@pytest.mark.parametrize(
    "kwargs",
    [{"threshold": 0}, {"ban_s": 0.0}, {"ban_s": 10.0, "max_ban_s": 5.0}, {"forget_s": -1}],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Strikes(clock=Clock(), **kwargs)  # type: ignore[arg-type]

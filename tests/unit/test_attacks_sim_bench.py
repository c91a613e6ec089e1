"""bench/attacks_sim.py's judgement of its runs against the issue's targets."""

from __future__ import annotations

import math

from tests.unit.benchload import load_bench

sim = load_bench("attacks_sim")


def _row(seed: int, mode: str, attack: str, **kw: object) -> dict[str, object]:
    return {"seed": seed, "mode": mode, "attack": attack, "attackers": 2, **kw}


def test_the_targets_pass_and_fail_as_the_runs_say() -> None:
    rows = [
        _row(0, "robust", "none", eval_loss=2.50),
        _row(0, "mean", "none", eval_loss=2.49),
        _row(0, "robust", "nan", vs_honest=1.01, rounds_until_banned={"a": 1, "b": 2}),
        _row(0, "robust", "weight:4", vs_honest=0.99, rounds_until_banned={"a": 3, "b": 4}),
        _row(0, "robust", "alie", vs_honest=1.03, rounds_until_banned={}),
        _row(
            0,
            "robust",
            "owner",
            vs_honest=1.0,
            rounds_until_banned={"a": 1},
            applied_with_attacker=1,
        ),
        _row(0, "mean", "huge", eval_loss=math.inf, vs_honest=math.inf, diverged="nan"),
    ]
    t = sim.targets(rows)
    assert t["eval_within_2pct"] == "3/4"
    assert t["eval_misses"] == [(0, "alie", 1.03)]
    # weight x4 took 4 rounds; the owner run banned only one of its two attackers
    assert t["detectable_banned_within_3"] == "1/3"
    assert t["owner_rounds_applied"] == 1
    assert t["protections_eval_cost"] == {0: 2.50 / 2.49}


def test_the_simulated_attacks_are_the_live_ones_but_forge() -> None:
    assert "forge" not in sim.ATTACKS and "weight:4" in sim.ATTACKS
    live = load_bench("attacks")
    assert set(sim.ATTACKS) - {"weight:4"} == set(live.ALL_ATTACKS) - {"forge"}

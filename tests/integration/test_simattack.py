"""Hostile replicas in the simulator (atoll.node.simattack): real training, every round
through the real all-reduce machines, checks, strikes and regroups, in one process."""

from __future__ import annotations

import numpy as np
import pytest

from atoll.node.data import stdlib_corpus
from atoll.node.simattack import run_in_memory
from atoll.node.simulate import SimConfig, simulate
from atoll.protocol.allreduce import AllReduceRound, Done, RoundKey, RoundSpec
from atoll.protocol.engine import SyncRequest, average_requests
from atoll.protocol.errors import ConfigError

pytestmark = pytest.mark.integration

BASE = SimConfig(
    preset="micro",
    replicas=5,
    steps=40,
    batch_size=4,
    lr=3e-3,
    warmup=5,
    H=10,
    tau=2,
    eval_batches=4,
    log_every=40,
    device="cpu",
)
ROBUST = BASE.with_(rule="trimmed_mean", checks=True, verify_owners=True)


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


def test_the_in_memory_round_is_the_reference_reduction() -> None:
    rng = np.random.default_rng(1)
    spec = RoundSpec(RoundKey("r", 0, 0), ("a", "b", "c"), 1000, "e3m0")
    codec = spec.make_codec()
    payloads = [codec.encode(rng.standard_normal(1000).astype(np.float32)) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    machines = {
        m: AllReduceRound(spec, m, p, w, now=0.0, phase_timeout=5.0, round_timeout=10.0)
        for m, p, w in zip(spec.members, payloads, weights, strict=True)
    }
    results = run_in_memory(machines)
    requests = [SyncRequest(0, 0, 0, 0, w, p, 1000) for p, w in zip(payloads, weights, strict=True)]
    expected, _ = average_requests(requests, codec)
    for r in results.values():
        assert isinstance(r, Done)
        assert r.averaged.tobytes() == expected.tobytes()


def test_the_plain_mean_through_the_machines_trains_exactly_as_the_reference(corpus) -> None:
    """With no attacker, the machines' rounds give the reference exchange's model bit for
    bit: a difference between an attack run and its honest-only run is the attack's."""
    plain = simulate(BASE, corpus=corpus)
    through = simulate(BASE.with_(verify_owners=True), corpus=corpus)  # the machine path
    assert through.attack is not None and plain.attack is None
    assert through.global_digests == plain.global_digests
    assert through.eval_loss == plain.eval_loss
    assert through.attack["honest_applied"] == 5 * through.syncs_applied


@pytest.mark.parametrize("attack", ["nan", "huge", "owner", "equivocate"])
def test_a_detectable_attacker_is_banned_and_its_slot_sought_again(corpus, attack) -> None:
    r = simulate(ROBUST.with_(attack=attack, attackers=1), corpus=corpus)
    stats = r.attack
    assert stats is not None
    (hostile,) = stats["bans"]
    assert stats["rounds_until_banned"][hostile] == 1  # banned in its first round
    assert stats["sought_again"] >= 1  # ... whose slot formed again without it
    assert stats["applied_with_attacker"] == 0
    assert stats["honest_applied"] > 0
    # the honest replicas hold one copy (the attacker's own differs)
    assert len(set(r.global_digests[:4])) == 1


def test_without_the_protections_a_huge_part_goes_into_the_mean(corpus) -> None:
    honest = simulate(BASE, corpus=corpus)
    protected = simulate(ROBUST.with_(attack="huge", attackers=1), corpus=corpus)
    assert protected.attack is not None
    assert protected.eval_loss < 1.05 * honest.eval_loss
    try:
        attacked = simulate(BASE.with_(attack="huge", attackers=1), corpus=corpus)
    except FloatingPointError:  # the loss went NaN: the trainer refuses to go on
        return
    assert attacked.attack is not None
    assert attacked.attack["applied_with_attacker"] > 0
    assert not attacked.attack["rounds_until_banned"]
    assert not (attacked.eval_loss < 1.5 * honest.eval_loss)  # the model is wrecked


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="attackers must be in"):
        BASE.with_(attack="nan", attackers=5)
    with pytest.raises(ConfigError, match="need an attack"):
        BASE.with_(attackers=1)
    with pytest.raises(ConfigError, match="must be one of"):
        BASE.with_(rule="median")
    with pytest.raises(ConfigError, match="not simulated"):
        simulate(BASE.with_(steps=1, attack="forge", attackers=1))


def test_a_late_replica_keeps_its_work_or_drops_it(corpus) -> None:
    """A replica that missed a slot copies the newer state at its next sync; kept, its Δ
    joins the swarm's round there; dropped, the copy ends its sync (and every later sync
    of a replica one version behind ends the same way)."""
    late = BASE.with_(late=1, late_prob=0.5)
    kept = simulate(late, corpus=corpus)
    dropped = simulate(late.with_(keep_late=False), corpus=corpus)
    assert kept.attack is not None and dropped.attack is not None
    assert kept.attack["late_missed"] >= 1
    assert kept.attack["late_kept"] >= 1 and kept.attack["late_dropped"] == 0
    assert dropped.attack["late_dropped"] >= 1 and dropped.attack["late_kept"] == 0
    assert dropped.attack["fetch_bytes"] > 0
    assert kept.attack["honest_applied"] > dropped.attack["honest_applied"]
    with pytest.raises(ConfigError, match="late must be in"):
        BASE.with_(late=5)

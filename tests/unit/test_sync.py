"""The sans-IO fragment sync: one owner of begin, rebase, group, commit or roll back."""

from __future__ import annotations

import math

import numpy as np
import pytest

from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import sync as fs
from atoll.protocol.allreduce import RoundKey
from atoll.protocol.engine import EngineConfig, OuterEngine
from atoll.protocol.errors import ConfigError
from atoll.protocol.schedule import Schedule

N = 64
RUN = "r" * 64
ME = "peer-me"
CFG = EngineConfig(
    H=4, tau=1, alpha=0.5, outer_lr=1.0, outer_momentum=0.0, nesterov=False, codec="fp32"
)


def _engine(seed: int = 0, init: float = 0.0) -> OuterEngine:
    return OuterEngine(CFG, Schedule(CFG.H, 2), [np.full(N, init, np.float32)] * 2, seed=seed)


def _sync(engine: OuterEngine, changes: list[tuple[int, str]] | None = None) -> fs.FragmentSync:
    def on_change(p: int, how: str) -> None:
        if changes is not None:
            changes.append((p, how))

    return fs.FragmentSync(engine, 0, peer_id=ME, run_id=RUN, on_change=on_change)


def _local(value: float) -> np.ndarray:
    return np.full(N, value, np.float32)


def _formed(*members: str) -> mm.Formed:
    return mm.Formed(members, members[0], RoundKey(RUN, 0, 0))


def test_a_round_is_declared_then_committed_once() -> None:
    engine, changes = _engine(), []
    sync = _sync(engine, changes)
    request = sync.begin(_local(-1.0), step=3)
    action = sync.plan([], wall_now=123.0)
    assert isinstance(action, fs.FindGroup)
    d = action.declaration
    assert (d.run_id, d.fragment, d.slot, d.peer_id, d.version) == (RUN, 0, 0, ME, 0)
    assert d.digest == engine.digest(0) == sync.digest and d.declared_at == 123.0
    assert sync.phase == "matching"
    action = sync.matched(_formed("leader", ME))
    assert isinstance(action, fs.RunRound) and sync.phase == "reducing"
    assert action.spec.members == ("leader", ME) and action.spec.key == RoundKey(RUN, 0, 0)
    assert action.payload == request.payload and action.weight == request.weight
    done = sync.reduced(ar.Done(np.full(N, 0.5, np.float32)))
    assert isinstance(done, fs.SyncDone)
    assert (done.applied, done.round_status, done.reason, done.round) == (True, "applied", "", 0)
    assert done.members == ("leader", ME) and done.step == 3
    assert engine.version(0) == 1 and engine.pending(0) is None
    np.testing.assert_array_equal(engine.global_params(0), np.full(N, -0.5, np.float32))
    assert changes == [(0, "0/leader")]
    # a later abort cannot undo the commit, and changes nothing
    assert sync.abort("late") is done
    assert engine.stats(0).skipped == 0 and engine.version(0) == 1


@pytest.mark.parametrize(
    ("outcome", "status", "reason"),
    [
        (mm.Alone("nobody came"), "alone", "alone: nobody came"),
        (_formed("a", "b"), "failed", "failed: a group without this peer"),
    ],
)
def test_no_group_rolls_back(outcome: mm.Formed | mm.Alone, status: str, reason: str) -> None:
    engine = _engine()
    sync = _sync(engine)
    sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=0.0)
    done = sync.matched(outcome)
    assert isinstance(done, fs.SyncDone)
    assert (done.applied, done.round_status, done.reason) == (False, status, reason)
    assert engine.pending(0) is None and engine.stats(0).skipped == 1
    assert engine.version(0) == 0


@pytest.mark.parametrize(
    "result",
    [ar.Failed("peer x lost"), ar.Done(np.full(N - 1, 0.5, np.float32))],
    ids=["failed", "wrong-size"],
)
def test_a_failed_or_refused_round_rolls_back(result: ar.Done | ar.Failed) -> None:
    engine, changes = _engine(), []
    sync = _sync(engine, changes)
    sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=0.0)
    sync.matched(_formed(ME, "b"))
    done = sync.reduced(result)
    assert isinstance(done, fs.SyncDone)
    assert not done.applied and done.round_status == "failed"
    assert done.reason.startswith("failed: ")
    assert engine.version(0) == 0 and engine.stats(0).skipped == 1 and changes == []


def test_a_round_failed_on_a_members_fault_may_seek_its_slot_once_more() -> None:
    """regroup: back to matching at the same slot with the same Δ and weight, the slot
    joined only if present; once per sync, and only while a round is under way."""
    engine = _engine()
    sync = _sync(engine)
    request = sync.begin(_local(1.0), step=3)
    first = sync.plan([], wall_now=0.0)
    assert isinstance(first, fs.FindGroup) and not sync.may_regroup
    with pytest.raises(ConfigError, match="regroup"):
        sync.regroup(1.0)
    sync.matched(_formed(ME, "bad", "c"))
    assert sync.may_regroup
    again = sync.regroup(5.0)
    assert isinstance(again, fs.FindGroup) and again.only_if_present
    assert again.declaration.slot == first.declaration.slot
    assert again.declaration.declared_at == 5.0 and sync.phase == "matching"
    assert engine.version(0) == 0 and engine.pending(0) is not None  # nothing applied
    run = sync.matched(_formed(ME, "c"))
    assert isinstance(run, fs.RunRound) and run.spec.members == (ME, "c")
    assert run.payload == request.payload and run.weight == request.weight
    assert not sync.may_regroup  # once per sync
    with pytest.raises(ConfigError, match="regroup"):
        sync.regroup(6.0)
    done = sync.reduced(ar.Done(np.full(N, 0.5, np.float32)))
    assert isinstance(done, fs.SyncDone) and done.applied and done.members == (ME, "c")
    assert engine.version(0) == 1


def test_this_peers_own_weight_is_clipped_to_the_cap_it_is_given_before_any_tamper() -> None:
    engine = _engine()
    engine.add_tokens(40)
    seen: list[float] = []

    def tamper(spec: ar.RoundSpec, payload: bytes, weight: float) -> tuple[bytes, float]:
        seen.append(weight)
        return payload, weight * 10

    sync = fs.FragmentSync(engine, 0, peer_id=ME, run_id=RUN, weight_cap=100.0, tamper=tamper)
    sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=0.0)
    run = sync.matched(_formed(ME, "b"), weight_cap=fs.recent_member_cap(50.0))
    assert isinstance(run, fs.RunRound)
    assert seen == [30.0] and run.weight == 300.0  # 3 of the run's 5 periods, then x10
    assert fs.recent_member_cap(math.inf) == math.inf


def _ahead(step: int = 77) -> tuple[OuterEngine, fs.Holding]:
    """A peer's engine one version ahead, and its holding."""
    other = _engine(seed=1)
    other.begin(0, _local(-2.0), 3)
    other.deliver(0, np.full(N, 2.0, np.float32), 0)
    return other, ("peer-ahead", other.version(0), other.digest(0))


def _two_ahead() -> tuple[OuterEngine, fs.Holding]:
    """A peer's engine two versions ahead, and its holding."""
    other, _ = _ahead()
    other.begin(0, _local(-3.0), 5)
    other.deliver(0, np.full(N, 1.0, np.float32), 1)
    return other, ("peer-ahead", other.version(0), other.digest(0))


def _n_ahead(k: int) -> tuple[OuterEngine, fs.Holding]:
    """A peer's engine ``k`` versions ahead, and its holding."""
    other = _engine(seed=1)
    for v in range(k):
        other.begin(0, _local(-1.0 - v), 3 + v)
        other.deliver(0, np.full(N, 0.5, np.float32), v)
    return other, ("peer-ahead", other.version(0), other.digest(0))


def test_a_peer_a_few_versions_behind_offers_its_delta_at_a_discount() -> None:
    """Two versions behind as its sync starts (cut off for a round): the peer copies the
    state and joins the swarm's round there with its Δ, at half the late weight."""
    engine, changes = _engine(), []
    other, holding = _two_ahead()
    sync = _sync(engine, changes)
    first = sync.begin(_local(1.0), step=3)
    action = sync.plan([holding, ("peer-old", 0, engine.digest(0))], wall_now=0.0)
    assert action == fs.FetchState(0, "peer-ahead", holding[1:], N)
    again = sync.fetched(other.export_fragment(0, step=77))
    assert isinstance(again, fs.FindGroup) and again.declaration.slot == 2
    pending = engine.pending(0)
    assert pending is not None and pending.payload == first.payload
    run = sync.matched(_formed(ME, "b"))
    assert isinstance(run, fs.RunRound) and run.weight == pending.weight * fs.LATE_WEIGHT / 2
    assert engine.digest(0) == other.digest(0) and changes == [(0, "rebase")]


def test_a_peer_far_behind_offers_its_mean_drift_per_missed_version() -> None:
    """Further behind than MAX_STALENESS as its sync starts (back from a long cut): the
    peer copies the state and joins the swarm's round there at once, offering its drift
    since its old copy divided by the versions it missed, at that discount."""
    missed = fs.MAX_STALENESS + 2
    engine, changes = _engine(), []
    other, holding = _n_ahead(missed)
    sync = _sync(engine, changes)
    old = engine.global_params(0).copy()
    local = _local(1.0)
    sync.begin(local, step=3)
    action = sync.plan([holding, ("peer-old", 0, engine.digest(0))], wall_now=0.0)
    assert action == fs.FetchState(0, "peer-ahead", holding[1:], N)
    state = other.export_fragment(0, step=77)
    again = sync.fetched(state)
    assert isinstance(again, fs.FindGroup) and again.declaration.slot == missed
    assert not again.only_if_present
    pending = engine.pending(0)
    assert pending is not None
    # what a peer holding the new copy offers when its local copy is new + drift / missed
    twin = _engine()
    twin.import_fragment(0, state)
    expected = twin.begin(0, twin.global_params(0) + (local - old) / np.float32(missed), 3)
    assert pending.payload == expected.payload
    whole = _engine()
    whole.import_fragment(0, state)
    assert whole.begin(0, whole.global_params(0) + (local - old), 3).payload != pending.payload
    run = sync.matched(_formed(ME, "b"))
    assert isinstance(run, fs.RunRound)
    assert run.weight == pending.weight * fs.LATE_WEIGHT / missed
    assert engine.digest(0) == other.digest(0) and changes == [(0, "rebase")]


def test_a_peer_one_version_behind_rebases_then_offers_its_delta_at_the_new_version() -> None:
    """The chase: one version behind at the start of its sync, the peer copies the state
    and joins the swarm's round at the new version with the very Δ it took (one round
    stale), instead of ending the sync and arriving one version behind again."""
    engine, changes = _engine(), []
    other, holding = _ahead()
    sync = _sync(engine, changes)
    first = sync.begin(_local(1.0), step=3)
    assert isinstance(sync.plan([holding], wall_now=4.0), fs.FetchState)
    action = sync.fetched(other.export_fragment(0, step=77))
    assert isinstance(action, fs.FindGroup)
    d = action.declaration
    assert (d.slot, d.version, d.digest, d.declared_at) == (1, 1, other.digest(0), 4.0)
    pending = engine.pending(0)
    assert pending is not None and pending.round == 1 and pending.weight == first.weight
    # the same pseudo-gradient: the same bytes on the wire (fp32 codec)
    assert pending.payload == first.payload
    spec = sync.matched(_formed(ME, "b"))
    assert isinstance(spec, fs.RunRound) and spec.spec.key.round == 1
    assert spec.weight == first.weight * fs.LATE_WEIGHT  # one round stale
    done = sync.reduced(ar.Done(np.full(N, 1.0, np.float32)), [])
    assert isinstance(done, fs.SyncDone)
    assert done.applied and done.rebased and done.state_step == 77
    assert done.round_status == "applied" and done.round == 1
    assert done.reason == "rebased to version 1, then applied"
    assert engine.version(0) == 2 and changes == [(0, "rebase"), (0, "1/peer-me")]
    # alone at the new version: the rebase still changed the copy
    engine2 = _engine()
    sync2 = _sync(engine2)
    sync2.begin(_local(1.0), step=3)
    sync2.plan([holding], wall_now=0.0)
    sync2.fetched(other.export_fragment(0, step=77))
    done2 = sync2.matched(mm.Alone("timeout"), [])
    assert isinstance(done2, fs.SyncDone) and done2.applied and done2.rebased
    assert done2.reason == "rebased to version 1, then alone: timeout"
    assert engine2.pending(0) is None and engine2.digest(0) == other.digest(0)


def test_a_rebase_nobody_serves_falls_back_to_a_group_then_tries_again() -> None:
    engine = _engine()
    other, holding = _ahead()
    second = ("peer-ahead-2", holding[1], holding[2])
    sync = _sync(engine)
    sync.begin(_local(1.0), step=3)
    first = sync.plan([holding, second], wall_now=5.0)
    assert isinstance(first, fs.FetchState) and first.peer == "peer-ahead"
    # the first holder serves an older state, the second does not answer
    stale = _engine(seed=2).export_fragment(0)
    nxt = sync.fetched(stale)
    assert isinstance(nxt, fs.FetchState) and nxt.peer == "peer-ahead-2"
    action = sync.fetch_failed("timeout")
    assert isinstance(action, fs.FindGroup) and action.declaration.declared_at == 5.0
    assert engine.pending(0) is not None  # the declared Δ is still in flight
    # alone in the slot; the swarm still leads elsewhere: rebase after the round
    after = sync.matched(mm.Alone("timeout"), [holding])
    assert isinstance(after, fs.FetchState) and after.peer == "peer-ahead"
    done = sync.fetched(other.export_fragment(0, step=9))
    assert isinstance(done, fs.SyncDone)
    assert done.rebased and done.applied and done.round_status == "alone"
    assert engine.stats(0).skipped == 1  # the round's skip; the import skipped nothing more


def test_after_a_failed_rebase_following_a_round_the_sync_ends() -> None:
    engine = _engine()
    _, holding = _ahead()
    sync = _sync(engine)
    sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=0.0)
    action = sync.matched(mm.Alone("timeout"), [holding])
    assert isinstance(action, fs.FetchState)
    done = sync.fetch_failed("unreachable")
    assert isinstance(done, fs.SyncDone)
    assert not done.applied and not done.rebased and done.round_status == "alone"


def test_abort_rolls_back_exactly_once_in_every_phase() -> None:
    for phase in ("declared", "matching", "reducing", "rebasing"):
        engine = _engine()
        _, holding = _ahead()
        sync = _sync(engine)
        sync.begin(_local(1.0), step=3)
        if phase == "matching":
            sync.plan([], wall_now=0.0)
        elif phase == "reducing":
            sync.plan([], wall_now=0.0)
            sync.matched(_formed(ME, "b"))
        elif phase == "rebasing":
            sync.plan([holding], wall_now=0.0)
        assert sync.phase == phase
        done = sync.abort("cancelled")
        assert not done.applied and done.round_status == "cancelled"
        assert sync.abort("again") is done
        assert sync.reduced(ar.Done(np.zeros(N, np.float32))) is done
        assert sync.matched(mm.Alone("late")) is done
        assert engine.stats(0).skipped == 1 and engine.pending(0) is None
        assert engine.version(0) == 0


def test_events_out_of_order_are_refused() -> None:
    sync = _sync(_engine())
    with pytest.raises(ConfigError, match="phase 'idle'"):
        sync.matched(mm.Alone("x"))
    sync.begin(_local(1.0), step=0)
    with pytest.raises(ConfigError, match="phase 'declared'"):
        sync.fetched(_engine().export_fragment(0))
    with pytest.raises(ConfigError):
        sync.begin(_local(1.0), step=0)


def test_an_in_process_exchange_may_deliver_straight_after_begin() -> None:
    engine = _engine()
    sync = _sync(engine)
    sync.begin(_local(-1.0), step=0)
    done = sync.reduced(ar.Done(np.full(N, 1.0, np.float32)))
    assert isinstance(done, fs.SyncDone) and done.applied and engine.version(0) == 1


def test_catch_up_copies_the_leading_state_or_does_nothing() -> None:
    engine = _engine()
    assert fs.FragmentSync(engine, 0, peer_id=ME, run_id=RUN).catch_up([], step=0) == (
        fs.SyncDone(0, 0, False, -1, "", "none")
    )
    other, holding = _ahead()
    sync = _sync(engine)
    action = sync.catch_up([holding, (ME, 9, "ignored: this peer's own old record")])
    assert isinstance(action, fs.FetchState) and action.peer == "peer-ahead"
    done = sync.fetched(other.export_fragment(0, step=40))
    assert isinstance(done, fs.SyncDone) and done.rebased and done.state_step == 40
    assert engine.digest(0) == other.digest(0)


def test_a_state_that_does_not_fit_is_one_holder_failing() -> None:
    engine = _engine()
    _, holding = _ahead()
    sync = _sync(engine)
    sync.catch_up([holding])
    wrong = OuterEngine(CFG, Schedule(CFG.H, 1), [np.zeros(N + 1, np.float32)])
    wrong.begin(0, np.full(N + 1, -1.0, np.float32), 0)
    wrong.deliver(0, np.ones(N + 1, np.float32), 0)
    done = sync.fetched(wrong.export_fragment(0))
    assert isinstance(done, fs.SyncDone) and not done.rebased and engine.version(0) == 0


def test_holdings_of_skips_rows_without_the_fragment() -> None:
    rows = [("a", (3, 4), ("d3", "d4")), ("b", (3,), ("d3",)), ("c", (1, 2), ("x", ""))]
    assert fs.holdings_of(1, rows) == [("a", 4, "d4")]


def test_only_the_sync_machine_applies_or_skips_a_round() -> None:
    """One owner: outside the engine itself, no code but protocol/sync.py calls the
    engine's deliver, skip or import_fragment (the simulator, the loopback worker and the
    swarm all go through FragmentSync)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    allowed = {root / "protocol" / "sync.py", root / "protocol" / "engine.py"}
    callers = []
    for folder in ("node", "protocol", "dht", "security", "bench"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("deliver", "skip", "import_fragment")
                    and not (
                        isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"
                    )
                    and path not in allowed
                ):
                    callers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not callers, f"engine deliver/skip/import called outside protocol/sync.py: {callers}"


# --------------------------------------------------------------------------------------
# withdrawing from a slot whose copy lost (a healed split)
# --------------------------------------------------------------------------------------
def _fork(init: float = 0.5) -> tuple[OuterEngine, list[fs.Holding]]:
    """Two peers holding another copy of the same version (the other side of a split):
    more holders than this peer's copy, so the rule picks theirs."""
    other = _engine(seed=3, init=init)
    return other, [(f"peer-side-{i}", other.version(0), other.digest(0)) for i in range(2)]


def test_outdated_names_the_winning_copy_only_while_matching() -> None:
    engine = _engine()
    other, fork = _fork()
    sync = _sync(engine)
    assert sync.outdated(fork) is None  # nothing declared yet
    sync.begin(_local(1.0), step=3)
    assert sync.outdated(fork) is None
    sync.plan([], wall_now=0.0)
    assert sync.outdated([]) is None
    assert sync.outdated([(ME, 0, other.digest(0))]) is None  # this peer's own rows
    assert sync.outdated(fork) == (0, other.digest(0))
    _, ahead = _ahead()
    assert sync.outdated([ahead]) == ahead[1:]
    # one holder each at the same version: the smallest digest wins
    lone = fork[:1]
    expect = (0, other.digest(0)) if other.digest(0) < engine.digest(0) else None
    assert sync.outdated(lone) == expect
    # a state the peer does not believe is never the winner
    engine2 = _engine()
    doubter = fs.FragmentSync(engine2, 0, peer_id=ME, run_id=RUN, believes=lambda v, d: False)
    doubter.begin(_local(1.0), step=3)
    doubter.plan([], wall_now=0.0)
    assert doubter.outdated(fork) is None
    assert doubter.outdated([ahead]) is None


def test_outdated_checks_a_declaration_made_ahead_in_any_phase() -> None:
    """A group formed ahead of the sync declares before the machine begins: with
    ``declared`` the check compares that declaration, idle or not."""
    engine = _engine()
    other, fork = _fork()
    sync = _sync(engine)
    mine = (engine.version(0), engine.digest(0))
    assert sync.outdated(fork) is None  # idle: nothing of its own declared
    assert sync.outdated(fork, declared=mine) == (0, other.digest(0))
    assert sync.outdated([(ME, *mine)], declared=mine) is None  # its own row only
    _, ahead = _ahead()
    assert sync.outdated([ahead], declared=mine) == ahead[1:]


def test_withdrawn_from_a_losing_copy_the_peer_offers_its_delta_at_the_winner() -> None:
    """The split's losing side left its slot early: it copies the winning copy of the same
    version and declares the same slot again on it, with the same pseudo-gradient."""
    engine, changes = _engine(), []
    other, fork = _fork()
    sync = _sync(engine, changes)
    first = sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=7.0)
    action = sync.matched(mm.Alone("withdrawn: lost", withdrawn=True), fork)
    assert action == fs.FetchState(0, "peer-side-0", (0, other.digest(0)), N)
    again = sync.fetched(other.export_fragment(0, step=50))
    assert isinstance(again, fs.FindGroup) and not again.only_if_present  # forming now
    d = again.declaration
    assert (d.slot, d.version, d.digest, d.declared_at) == (0, 0, other.digest(0), 7.0)
    pending = engine.pending(0)
    assert pending is not None and pending.payload == first.payload  # the same Δ (fp32)
    assert changes == [(0, "rebase")]
    # a second withdrawal in the same sync: no second copy, the round is rolled back
    done = sync.matched(mm.Alone("withdrawn: lost again", withdrawn=True), fork)
    assert isinstance(done, fs.SyncDone) and done.round_status == "alone"
    assert done.rebased and engine.pending(0) is None
    assert engine.stats(0).skipped == 2  # the import's skip of Δ, then the round's


def test_withdrawn_for_a_newer_version_the_peer_joins_the_swarms_slot_if_present() -> None:
    """A copy two versions ahead: the peer copies it and offers its Δ there, at half the
    late weight, if somebody is at that slot now (the driver's matchmaking finds out: the
    winners may have committed the slot only a moment ago, and come back a period later);
    alone there, the sync ends rebased with nothing pending."""
    engine = _engine()
    other, ahead = _two_ahead()
    sync = _sync(engine)
    first = sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=0.0)
    action = sync.matched(mm.Alone("withdrawn: behind", withdrawn=True), [ahead])
    assert isinstance(action, fs.FetchState)
    again = sync.fetched(other.export_fragment(0, step=9))
    assert isinstance(again, fs.FindGroup) and again.declaration.slot == 2
    assert again.only_if_present
    run = sync.matched(_formed(ME, "b"))
    assert isinstance(run, fs.RunRound) and run.weight == first.weight * fs.LATE_WEIGHT / 2
    # nobody at the new slot: rebased, alone, the Δ dropped
    lone = _sync(_engine())
    lone.begin(_local(1.0), step=3)
    lone.plan([], wall_now=0.0)
    assert isinstance(
        lone.matched(mm.Alone("withdrawn: behind", withdrawn=True), [ahead]), fs.FetchState
    )
    assert isinstance(lone.fetched(other.export_fragment(0, step=9)), fs.FindGroup)
    done = lone.matched(mm.Alone("nobody else is at slot 2", withdrawn=True), [ahead])
    assert isinstance(done, fs.SyncDone) and done.rebased and done.round_status == "alone"
    assert done.reason == "rebased to version 2, then alone: nobody else is at slot 2"
    assert lone.engine.pending(0) is None and lone.engine.version(0) == 2


def test_withdrawn_for_a_copy_far_ahead_the_round_is_rolled_back_then_rebased() -> None:
    engine = _engine()
    other, ahead = _n_ahead(fs.MAX_STALENESS + 1)
    sync = _sync(engine)
    sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=0.0)
    action = sync.matched(mm.Alone("withdrawn: behind", withdrawn=True), [ahead])
    assert isinstance(action, fs.FetchState)
    done = sync.fetched(other.export_fragment(0, step=9))
    assert isinstance(done, fs.SyncDone) and done.rebased and done.round_status == "alone"
    assert engine.version(0) == fs.MAX_STALENESS + 1 and engine.pending(0) is None


def test_withdrawn_when_nobody_serves_the_winner_the_round_is_rolled_back() -> None:
    engine = _engine()
    _, fork = _fork()
    sync = _sync(engine)
    sync.begin(_local(1.0), step=3)
    sync.plan([], wall_now=0.0)
    action = sync.matched(mm.Alone("withdrawn: lost", withdrawn=True), fork)
    assert isinstance(action, fs.FetchState)
    assert isinstance(sync.fetch_failed("timeout"), fs.FetchState)  # the second holder
    done = sync.fetch_failed("timeout")
    assert isinstance(done, fs.SyncDone)
    assert done.round_status == "alone" and not done.applied and not done.rebased
    assert "no holder served it" in done.reason
    assert engine.pending(0) is None and engine.stats(0).skipped == 1


def test_the_weight_cap_clips_this_peers_weight_and_rides_in_the_spec() -> None:
    engine = _engine()
    sync = fs.FragmentSync(engine, 0, peer_id=ME, run_id=RUN, weight_cap=100.0)
    engine.add_tokens(5000)
    first = sync.begin(_local(1.0), step=3)
    assert first.weight == 5000
    sync.plan([], wall_now=0.0)
    run = sync.matched(_formed(ME, "b"))
    assert isinstance(run, fs.RunRound)
    assert run.weight == 100.0 and run.spec.weight_cap == 100.0
    assert fs.weight_cap(30, 1024) == (fs.MAX_STALENESS + 1) * 30 * 1024
    assert fs.weight_cap(30, 0) == float("inf")


# --------------------------------------------------------------------------------------
# falling back from a state nobody can certify
# --------------------------------------------------------------------------------------
def _applied_pair_round(engine: OuterEngine, value: float) -> None:
    sync = _sync(engine)
    sync.begin(_local(value), 3)
    sync.plan([], wall_now=0.0)
    sync.matched(_formed("leader", ME))
    assert isinstance(sync.reduced(ar.Done(np.full(N, value, np.float32))), fs.SyncDone)


def test_fall_back_restores_the_state_before_the_round_only_while_it_is_held() -> None:
    engine = _engine()
    before = engine.export_fragment(0)
    start = (engine.version(0), engine.digest(0))
    _applied_pair_round(engine, 0.5)
    committed = (engine.version(0), engine.digest(0))
    assert committed[0] == 1
    assert not fs.fall_back(engine, 0, before, (1, "another digest"))  # not what is held
    assert (engine.version(0), engine.digest(0)) == committed
    assert fs.fall_back(engine, 0, before, committed)
    assert (engine.version(0), engine.digest(0)) == start
    np.testing.assert_array_equal(engine.global_params(0), before.global_params)
    _applied_pair_round(engine, 0.25)  # the next round starts from the old slot again
    assert engine.version(0) == 1 and engine.digest(0) != committed[1]


def test_rebase_target_names_the_leading_believed_state_and_its_holders_in_order() -> None:
    """The rule a sync's rebase follows, asked on its own (a driver copying ahead): the
    highest believed version, its holders in the order given (each once, this peer left
    out); None when this peer holds the leading state or only unbelieved ones lead."""
    mine = (3, "aa")
    held = [("p2", 4, "bb"), ("me", 3, "aa"), ("p1", 4, "bb"), ("p2", 4, "bb"), ("p3", 9, "zz")]
    believed = {(3, "aa"), (4, "bb")}
    target = fs.rebase_target("me", mine, held, believes=lambda v, d: (v, d) in believed)
    assert target == ((4, "bb"), ["p2", "p1"])
    assert fs.rebase_target("me", (4, "bb"), held, believes=lambda v, d: (v, d) in believed) is None
    assert fs.rebase_target("me", mine, [("me", 3, "aa")]) is None
    # without beliefs every declared state counts
    assert fs.rebase_target("me", mine, held) == ((9, "zz"), ["p3"])

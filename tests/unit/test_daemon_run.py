"""The trainer's run bookkeeping (:class:`atoll.node.daemon._Run`): which sync outcomes
still speak of the steps the trainer is on after it jumped or moved."""

from __future__ import annotations

from atoll.node.daemon import _Run


def test_a_sync_started_before_the_trainer_moved_does_not_move_it_again() -> None:
    """A node refused as out of step moves to its peers' step; the outcomes of syncs it
    started before the move arrive afterwards and also say "out of step" (about a step
    it has left): moving again on them would take it back, or on past its peers."""
    run = _Run(start=137, end=400)
    run.step = 144
    assert run.since_move(140) and run.since_move(137) and not run.since_move(136)
    run.realign(17, extend=False)  # back, to its peers' step
    assert run.step == run.moved_to == 17 and run.realigned == 1
    run.step = 24
    assert not run.since_move(143)  # started at its old step, ahead of where it is now
    assert run.since_move(20) and run.since_move(24) and not run.since_move(25)
    run.jump(60, extend=False)  # forth, to meet the swarm
    assert run.moved_to == 60
    assert not run.since_move(23) and run.since_move(60)


def test_a_landing_behind_the_swarm_goes_on_to_its_step() -> None:
    """A jump lands on the sync start the swarm began a few steps ago; once the trainer
    has started that sync it goes on to the swarm's step (never past the last step, and
    the run's end moves with it when steps count as trained)."""
    run = _Run(start=100, end=400)
    run.jump(804, extend=True, land=799)
    assert run.step == run.moved_to == 799 and run.end == 400 + 699
    run.step = 800  # the sync at 799 started
    run.go_on(804, extend=True)
    assert run.step == 804 and run.end == 400 + 699 + 4
    assert run.jumped == 699 + 4
    assert run.since_move(799)  # that sync began after the move, at its landing
    run.go_on(802, extend=True)  # already past: nothing
    assert run.step == 804
    short = _Run(start=0, end=802)
    short.jump(804, extend=False, land=799)
    short.step = 800
    short.go_on(804, extend=False)
    assert short.step == 801  # the last step

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

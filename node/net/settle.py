"""The end-of-run settle rule: when a node that finished training may stop following the
swarm's copy of its fragments and report.

A node that finished keeps rebasing onto the copy the rebase rule leads to and publishes
each change; it decides from what its peers' records say (:class:`SettleView`) after every
pass. The rule, every node computing it alike:

- it agrees once every peer that answers holds its copy and none of them still trains;
- while an answering peer still trains, it waits: that peer's last sync may still move a
  copy, and a node that left before it would end on the older one. Only when the settle
  window runs out does it agree with the peers that finished (if they hold its copy), and
  it says that some peers still train on;
- when no peer answers any more, the peers that finished first may have settled and
  left: their last records (published as they finished) decide;
- it never agrees while a fragment's state it holds is pending: not certified yet (its
  last round's members may still sign it, or it falls back), or its own attestation of
  that state not yet published (a peer of that round needs it to certify the same
  state, and could not ask a node that left). Only the end of the settle window ends
  that wait.

Pure: :mod:`atoll.node.net.swarm` runs the loop, the rebases and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.node.net.bridge import Settled


@dataclass(frozen=True, slots=True)
class SettleView:
    """What one pass of the settle loop saw."""

    published: bool
    """this node's record with its current copy is in the DHT"""
    known: int
    """peers of the run this node has a record of"""
    answering: int
    """of them, the ones that answer"""
    differ: tuple[str, ...]
    """answering peers whose record shows another copy of some fragment"""
    training: tuple[str, ...]
    """answering peers still training"""
    gone_agree: int
    """peers that finished and stopped answering whose last record shows this copy (0
    when any of them shows another)"""
    rebased: int
    """fragments rebased so far in this settle"""
    pending: tuple[int, ...] = ()
    """fragments whose held state is not certified yet or whose attestation of it this
    node has not published yet"""


def settle_verdict(
    view: SettleView, *, waited_s: float, patience_s: float, at_end: bool
) -> Settled | None:
    """The verdict after one pass, or None to keep waiting.

    ``waited_s`` is the time since the settle began, ``patience_s`` one sync's time
    (matchmaking and a round), ``at_end`` whether the settle window ran out.
    """
    verdict = _verdict(view, waited_s=waited_s, patience_s=patience_s, at_end=at_end)
    if verdict is None or not view.pending:
        return verdict
    held = ", ".join(map(str, view.pending))
    detail = f"{verdict.detail}; fragments {held} still pending certification"
    return Settled(verdict.agreed, detail)


def _verdict(
    view: SettleView, *, waited_s: float, patience_s: float, at_end: bool
) -> Settled | None:
    v = view
    if v.known == 0:
        return Settled(True, "no other peer in the run")
    finished = [p for p in v.differ if p not in v.training]
    if v.pending and not at_end:
        return None
    if v.published and v.answering and not v.differ and not v.training:
        return Settled(
            True,
            f"{v.answering} peers hold this node's copy of every fragment"
            f" ({v.rebased} fragments rebased)",
        )
    if v.answering == 0 and (waited_s > patience_s or at_end):
        if v.published and v.gone_agree:
            return Settled(
                True,
                f"the {v.gone_agree} peers that finished before this node hold its copy by"
                f" their last records ({v.rebased} fragments rebased)",
            )
        return Settled(False, "no peer of the run answered: nothing to agree with")
    if not at_end:
        return None
    if v.published and v.answering and not finished:
        return Settled(
            True,
            f"the {v.answering - len(v.training)} peers that finished hold this node's copy"
            f" ({v.rebased} fragments rebased); {len(v.training)} peers still train on",
        )
    short = ", ".join(p[-6:] for p in v.differ) or "none"
    return Settled(False, f"peers on other copies: {short} ({v.rebased} rebased)")

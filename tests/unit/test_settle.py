"""The end-of-run settle rule (:func:`atoll.node.net.settle.settle_verdict`)."""

from __future__ import annotations

from atoll.node.net.settle import SettleView, settle_verdict


def view(**kw: object) -> SettleView:
    base: dict[str, object] = dict(
        published=True, known=3, answering=3, differ=(), training=(), gone_agree=0, rebased=0
    )
    base.update(kw)
    return SettleView(**base)  # type: ignore[arg-type]


def test_alone_in_the_run_agrees_at_once() -> None:
    v = settle_verdict(view(known=0, answering=0), waited_s=0, patience_s=20, at_end=False)
    assert v is not None and v.agreed


def test_agrees_once_every_answering_peer_finished_on_this_copy() -> None:
    v = settle_verdict(view(rebased=2), waited_s=1, patience_s=20, at_end=False)
    assert v is not None and v.agreed and "3 peers hold" in v.detail and "2 fragments" in v.detail


def test_waits_while_a_peer_differs() -> None:
    assert settle_verdict(view(differ=("peerA",)), waited_s=1, patience_s=20, at_end=False) is None


def test_an_unpublished_copy_is_not_agreement() -> None:
    assert settle_verdict(view(published=False), waited_s=1, patience_s=20, at_end=False) is None


def test_keeps_waiting_past_patience_while_a_peer_still_trains() -> None:
    """The finished peers hold this copy, but one still trains: its last sync may move a
    copy, so the node waits for it as long as the settle window lasts, not one sync."""
    still = view(training=("peerT",), differ=("peerT",))
    for waited in (1, 25, 60):
        assert settle_verdict(still, waited_s=waited, patience_s=20, at_end=False) is None
    v = settle_verdict(still, waited_s=60, patience_s=20, at_end=True)
    assert v is not None and v.agreed
    assert "2 peers that finished" in v.detail and "1 peers still train on" in v.detail


def test_at_the_end_a_finished_peer_on_another_copy_is_disagreement() -> None:
    v = settle_verdict(
        view(differ=("peerA", "peerT"), training=("peerT",)),
        waited_s=60,
        patience_s=20,
        at_end=True,
    )
    assert v is not None and not v.agreed and "peerA" in v.detail and "peerT" in v.detail


def test_nobody_answers_the_last_records_of_those_that_left_decide() -> None:
    gone = view(answering=0, gone_agree=3)
    assert settle_verdict(gone, waited_s=5, patience_s=20, at_end=False) is None
    v = settle_verdict(gone, waited_s=25, patience_s=20, at_end=False)
    assert v is not None and v.agreed and "3 peers that finished before" in v.detail
    v = settle_verdict(view(answering=0, gone_agree=0), waited_s=25, patience_s=20, at_end=False)
    assert v is not None and not v.agreed and "no peer" in v.detail


def test_a_pending_state_holds_back_agreement_until_the_window_ends() -> None:
    """A fragment whose held state is not certified yet (or whose attestation this node
    has not published yet) keeps the node from agreeing: a peer of that round may need
    its attestation, and this node's state may still fall back. Only the end of the
    settle window reports, saying which fragments were still pending."""
    held = view(pending=(1, 3))
    for waited in (1, 25):
        assert settle_verdict(held, waited_s=waited, patience_s=20, at_end=False) is None
    gone = view(answering=0, gone_agree=3, pending=(2,))
    assert settle_verdict(gone, waited_s=25, patience_s=20, at_end=False) is None
    v = settle_verdict(held, waited_s=60, patience_s=20, at_end=True)
    assert v is not None and v.agreed and "fragments 1, 3 still pending" in v.detail
    v = settle_verdict(view(pending=()), waited_s=1, patience_s=20, at_end=False)
    assert v is not None and v.agreed and "pending" not in v.detail

"""The multi-source state copy: piece messages, the index check and the download planner."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol import statefetch as sf
from atoll.protocol import statepieces as sp
from atoll.protocol import statesync as ss
from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.messages import decode_message, encode_message

RUN = "run"
ME = "joiner"


def _state(n: int, *, version: int = 4, step: int = 50, seed: int = 0) -> ss.FragmentState:
    rng = np.random.default_rng(seed)
    return ss.FragmentState(
        version,
        9,
        step,
        rng.standard_normal(n).astype(np.float32),
        rng.standard_normal(n).astype(np.float32),
    )


BIG = (5 * ss.PIECE_BYTES + 1234) // 8  # six pieces, the last one short


# --------------------------------------------------------------------------------------
# the two-level digest and the index
# --------------------------------------------------------------------------------------
def test_the_digest_is_the_hash_of_the_piece_hashes() -> None:
    s = _state(BIG)
    data = s.encode()
    hashes = ss.hashes_of(data)
    assert len(hashes) == ss.pieces_in(len(data)) == 6
    assert hashes == ss.piece_hashes(s.version, s.optimizer_steps, s.global_params, s.momentum)
    assert s.digest() == ss.digest_of_pieces(len(data), hashes)
    source = sp.PieceSource.of(s)
    assert source.digest == s.digest() and source.count == 6
    assert b"".join(source.piece(i) for i in range(6)) == data
    with pytest.raises(IndexError):
        source.piece(6)


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_pieces_cut_exactly_at_a_piece_boundary(extra: int) -> None:
    n = (2 * ss.PIECE_BYTES - 36) // 8 + extra  # the encoding ends just at a boundary
    s = _state(n)
    data = s.encode()
    assert len(ss.hashes_of(data)) == ss.pieces_in(len(data))
    assert ss.hashes_of(data) == ss.piece_hashes(
        s.version, s.optimizer_steps, s.global_params, s.momentum
    )


def _index(source: sp.PieceSource, **change: object) -> sp.StateIndex:
    index = sp.StateIndex(
        "d", RUN, 0, source.version, source.digest, 7, len(source.data), source.hashes
    )
    return dataclasses.replace(index, **change)  # type: ignore[arg-type]


def test_an_index_is_checked_against_the_certified_digest() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    target = (s.version, s.digest())
    assert len(sp.check_index(_index(source), target, BIG)) == 6
    flipped = bytes([source.hashes[0] ^ 1]) + source.hashes[1:]
    for bad in [
        _index(source, hashes=flipped),
        _index(source, hashes=source.hashes[:-32]),
        _index(source, total=len(source.data) + 8),
        _index(source, version=5),
        _index(source, total=0, hashes=b"", reason="not held"),
    ]:
        with pytest.raises(CodecError):
            sp.check_index(bad, target, BIG)
    with pytest.raises(CodecError):
        sp.check_index(_index(source), target, BIG + 1)


def test_piece_messages_round_trip_and_are_bounded() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    msgs = [
        sp.StateIndexRequest(ME, RUN, 1, 4, s.digest()),
        _index(source),
        sp.StatePieceRequest(ME, RUN, 1, 4, s.digest(), 2, 4),
        sp.StatePiece("d", RUN, 1, 4, s.digest(), 0, source.piece(0)),
        sp.StatePiece("d", RUN, 1, 4, s.digest(), 0, b"", "not held"),
    ]
    for msg in msgs:
        assert decode_message(encode_message(msg)) == msg
    with pytest.raises(CodecError):
        encode_message(sp.StatePiece("d", RUN, 1, 4, "x", 0, b"\0" * (ss.PIECE_BYTES + 1)))


# --------------------------------------------------------------------------------------
# the planner, over simulated donors
# --------------------------------------------------------------------------------------
Behaviour = Callable[[object], list[object] | None]
"""what a donor answers to a request (None: the send to it fails)"""


def _honest(name: str, source: sp.PieceSource, step: int = 50) -> Behaviour:
    def answer(msg: object) -> list[object]:
        if isinstance(msg, sp.StateIndexRequest):
            return [_index(source, sender=name, step=step)]
        assert isinstance(msg, sp.StatePieceRequest)
        return [
            sp.StatePiece(name, RUN, 0, source.version, source.digest, i, source.piece(i))
            for i in range(msg.first, msg.first + msg.count)
        ]

    return answer


def _run(
    fetch: sf.StateFetch, donors: dict[str, Behaviour], *, horizon_s: float = 60.0
) -> tuple[sf.Finished | sf.GaveUp, Counter[str]]:
    """Deliver every request's answers in order, ticking the clock when nothing is left
    to deliver; returns the outcome and how many requests each donor got. At
    ``horizon_s`` it gives up, as the driver's overall bound does (a last donor that is
    only slow is never dropped by the planner itself)."""
    now = 0.0
    asked: Counter[str] = Counter()
    queue: list[tuple[str, object]] = []  # (donor, reply) or (donor, None: lost)
    actions = fetch.start(now)
    while now < horizon_s:
        for a in actions:
            if isinstance(a, sf.Send):
                asked[a.to] += 1
                replies = donors[a.to](a.message)
                if replies is None:
                    queue.append((a.to, None))
                else:
                    queue.extend((a.to, r) for r in replies)
        if fetch.outcome is not None:
            return fetch.outcome, asked
        if queue:
            peer, reply = queue.pop(0)
            actions = (
                fetch.peer_lost(peer, now=now) if reply is None else fetch.receive(reply, now=now)
            )
        else:
            deadline = fetch.next_deadline
            assert deadline is not None, "stuck with nothing owed"
            now = deadline
            actions = fetch.tick(now)
    return sf.GaveUp("the overall bound"), asked


def _fetch(source: sp.PieceSource, donors: list[str], **kw: object) -> sf.StateFetch:
    args: dict[str, object] = {"timeout_s": 2.0, **kw}
    return sf.StateFetch(
        me=ME,
        run_id=RUN,
        fragment=0,
        target=(source.version, source.digest),
        numel=(len(source.data) - 36) // 8,
        donors=donors,
        **args,  # type: ignore[arg-type]
    )


def _same(a: ss.FragmentState, b: ss.FragmentState) -> None:
    assert (a.version, a.optimizer_steps) == (b.version, b.optimizer_steps)
    np.testing.assert_array_equal(a.global_params, b.global_params)
    np.testing.assert_array_equal(a.momentum, b.momentum)


def test_three_donors_share_the_pieces() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    donors = {f"d{i}": _honest(f"d{i}", source, step=10 * i) for i in range(5)}
    fetch = _fetch(source, list(donors), per_request=1, window=1)
    out, asked = _run(fetch, donors)
    assert isinstance(out, sf.Finished)
    _same(out.state, s)
    assert out.state.digest() == s.digest()
    assert len(asked) == 3 and len(out.donors) == 3  # three donors, each served pieces
    assert out.state.step in {10 * i for i in range(5)}  # the median of the three asked
    assert not fetch.dropped


def test_a_donor_that_sends_a_bad_piece_is_dropped_as_hostile_and_its_pieces_refetched() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    order = sf.donor_order(ME, ["a", "b", "c", "d"])
    liar = order[0]
    honest = _honest(liar, source)

    def lying(msg: object) -> list[object]:
        replies = honest(msg)
        if isinstance(msg, sp.StatePieceRequest):
            bad = replies[0]
            assert isinstance(bad, sp.StatePiece)
            flipped = bytes([bad.payload[0] ^ 1]) + bad.payload[1:]
            replies[0] = dataclasses.replace(bad, payload=flipped)
        return replies

    donors = {p: (lying if p == liar else _honest(p, source)) for p in order}
    fetch = _fetch(source, order)
    out, asked = _run(fetch, donors)
    assert isinstance(out, sf.Finished)
    _same(out.state, s)
    assert [(d.peer, d.hostile) for d in fetch.dropped] == [(liar, True)]
    assert "hash" in fetch.dropped[0].reason
    assert liar not in out.donors and order[3] in asked  # the spare took its place


def test_a_donor_with_a_forged_index_is_hostile() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    other = sp.PieceSource.of(_state(BIG, seed=1))
    order = sf.donor_order(ME, ["a", "b"])

    def forged(msg: object) -> list[object]:
        return [_index(other, sender=order[0], version=source.version, digest=source.digest)]

    donors = {order[0]: forged, order[1]: _honest(order[1], source)}
    fetch = _fetch(source, order)
    out, _ = _run(fetch, donors)
    assert isinstance(out, sf.Finished)
    assert fetch.dropped == [sf.Dropped(order[0], True, fetch.dropped[0].reason)]


def test_a_silent_and_a_refusing_donor_cost_nothing_but_their_turn() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    order = sf.donor_order(ME, ["a", "b", "c"])

    def refusing(msg: object) -> list[object]:
        return [_index(source, sender=order[1], total=0, hashes=b"", reason="moved on")]

    donors = {order[0]: lambda msg: [], order[1]: refusing, order[2]: _honest(order[2], source)}
    fetch = _fetch(source, order)
    out, _ = _run(fetch, donors)
    assert isinstance(out, sf.Finished)
    _same(out.state, s)
    # the refusal drops its donor at once; the silent one owes only its index, and the
    # copy ended before its answer bound
    assert [(d.peer, d.hostile) for d in fetch.dropped] == [(order[1], False)]


def test_a_donor_that_goes_silent_mid_copy_hands_its_pieces_on() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    order = sf.donor_order(ME, ["a", "b"])
    honest = _honest(order[0], source)
    served = [0]

    def quits(msg: object) -> list[object]:
        if isinstance(msg, sp.StatePieceRequest):
            served[0] += 1
            if served[0] > 1:
                return []  # silent from its second request on
        return honest(msg)

    donors = {order[0]: quits, order[1]: _honest(order[1], source)}
    fetch = _fetch(source, order, per_request=1)
    out, _ = _run(fetch, donors)
    assert isinstance(out, sf.Finished)
    _same(out.state, s)
    assert [(d.peer, d.hostile) for d in fetch.dropped] == [(order[0], False)]


def test_the_last_donor_is_kept_when_slow_and_the_copy_gives_up_when_none_is_left() -> None:
    s = _state(BIG)
    source = sp.PieceSource.of(s)
    fetch = _fetch(source, ["only"])
    assert fetch.start(0.0)
    assert fetch.tick(10.0) == [] and not fetch.dropped  # slow, but the only one
    assert fetch.next_deadline == 12.0
    out = fetch.peer_lost("only", now=11.0)
    assert isinstance(out[-1], sf.GaveUp) and fetch.outcome == out[-1]
    nobody = _fetch(source, [ME])  # itself only
    assert isinstance(nobody.start(0.0)[0], sf.GaveUp)


def test_bad_settings_are_refused() -> None:
    source = sp.PieceSource.of(_state(10))
    for kw in [{"max_donors": 0}, {"window": 0}, {"per_request": 5}, {"timeout_s": 0.0}]:
        with pytest.raises(ConfigError):
            _fetch(source, ["a"], **kw)


def test_many_joiners_spread_over_the_donors() -> None:
    donors = [f"donor-{i}" for i in range(6)]
    first = Counter(sf.donor_order(f"joiner-{j}", donors)[0] for j in range(600))
    assert set(first) == set(donors)
    assert max(first.values()) < 2 * 600 / len(donors)
    assert sf.donor_order("x", [*donors, "x", donors[0]]) == sf.donor_order("x", donors)


@settings(max_examples=30, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["honest", "liar", "silent", "dead", "refuse"]), max_size=6),
    per_request=st.integers(1, 4),
    window=st.integers(1, 3),
    max_donors=st.integers(1, 4),
)
def test_any_mix_of_donors_ends_with_the_state_or_gives_up(
    kinds: list[str], per_request: int, window: int, max_donors: int
) -> None:
    """Whatever the donors do, the copy ends; it ends with exactly the certified state
    whenever an honest donor is among them, and every liar that sent something is
    dropped as hostile, nobody else."""
    s = _state(2 * ss.PIECE_BYTES // 8, seed=3)  # three pieces
    source = sp.PieceSource.of(s)
    names = [f"{k}-{i}" for i, k in enumerate(kinds)]

    def behaviour(name: str, kind: str) -> Behaviour:
        honest = _honest(name, source)
        if kind == "honest":
            return honest
        if kind == "silent":
            return lambda msg: []
        if kind == "dead":
            return lambda msg: None
        if kind == "refuse":
            return lambda msg: [_index(source, sender=name, total=0, hashes=b"", reason="no")]

        def lie(msg: object) -> list[object]:
            replies = honest(msg)
            return [
                dataclasses.replace(r, payload=bytes(len(r.payload)))
                if isinstance(r, sp.StatePiece)
                else r
                for r in replies
            ]

        return lie

    donors = {n: behaviour(n, k) for n, k in zip(names, kinds, strict=True)}
    fetch = _fetch(source, names, per_request=per_request, window=window, max_donors=max_donors)
    out, _ = _run(fetch, donors)
    if "honest" in kinds:
        assert isinstance(out, sf.Finished)
        _same(out.state, s)
    else:
        assert isinstance(out, sf.GaveUp)
    assert all(d.peer.startswith("liar") for d in fetch.dropped if d.hostile)
    assert all(not d.peer.startswith("honest") for d in fetch.dropped)

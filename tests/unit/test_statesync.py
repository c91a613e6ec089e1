"""Fragment state transfer: encoding, digests, chunking, the leading-state rule, rebase."""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol import statesync as ss
from atoll.protocol.engine import EngineConfig, OuterEngine
from atoll.protocol.errors import CodecError, ConfigError, RoundAborted
from atoll.protocol.messages import decode_message, encode_message
from atoll.protocol.schedule import Schedule
from atoll.protocol.statesync import (
    FragmentState,
    StateAssembler,
    StateChunk,
    chunks_of,
    decode_state,
    leading_state,
    should_rebase,
)

HEADER = 36  # magic + four u64


def _state(n: int = 50, *, version: int = 3, steps: int = 7, step: int = 123, seed: int = 0):
    rng = np.random.default_rng(seed)
    return FragmentState(
        version=version,
        optimizer_steps=steps,
        step=step,
        global_params=rng.normal(size=n).astype(np.float32),
        momentum=rng.normal(size=n).astype(np.float32),
    )


def _same(a: FragmentState, b: FragmentState) -> None:
    assert (a.version, a.optimizer_steps, a.step) == (b.version, b.optimizer_steps, b.step)
    np.testing.assert_array_equal(a.global_params, b.global_params)
    np.testing.assert_array_equal(a.momentum, b.momentum)
    assert a.global_params.dtype == np.float32 and a.momentum.dtype == np.float32


# --------------------------------------------------------------------------------------
# encoding and digest
# --------------------------------------------------------------------------------------
def test_wire_round_trip_keeps_everything() -> None:
    s = _state()
    data = s.wire()
    assert len(data) == HEADER + 8 * 50
    _same(decode_state(data, 50), s)


def test_encode_round_trip_leaves_the_step_out() -> None:
    s = _state(step=999)
    back = decode_state(s.encode(), 50)
    assert back.step == 0
    _same(back, dataclasses.replace(s, step=0))


def test_digest_ignores_the_step_only() -> None:
    s = _state()
    d = s.digest()
    assert len(d) == ss.DIGEST_LEN and int(d, 16) >= 0
    assert dataclasses.replace(s, step=0).digest() == d
    assert dataclasses.replace(s, step=10**9).digest() == d
    assert decode_state(s.wire(), 50).digest() == d
    g = s.global_params.copy()
    g[17] = np.nextafter(g[17], np.float32(np.inf))
    m = s.momentum.copy()
    m[0] = -m[0]
    changed = [
        dataclasses.replace(s, version=s.version + 1),
        dataclasses.replace(s, optimizer_steps=s.optimizer_steps + 1),
        dataclasses.replace(s, global_params=g),
        dataclasses.replace(s, momentum=m),
    ]
    digests = {c.digest() for c in changed}
    assert d not in digests and len(digests) == len(changed)


def test_state_fields_are_checked() -> None:
    with pytest.raises(ConfigError):
        _state(version=-1)
    with pytest.raises(ConfigError):
        FragmentState(True, 0, 0, np.zeros(2), np.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="momentum"):
        FragmentState(0, 0, 0, np.zeros(3), np.zeros(2))


def test_decode_refuses_bad_magic() -> None:
    data = bytearray(_state().wire())
    data[:4] = b"XXXX"
    with pytest.raises(CodecError, match="magic"):
        decode_state(bytes(data), 50)


def test_decode_refuses_wrong_numel_and_truncation() -> None:
    data = _state().wire()
    with pytest.raises(CodecError):
        decode_state(data, 49)
    with pytest.raises(CodecError):
        decode_state(data, 51)
    with pytest.raises(CodecError):
        decode_state(data[:-1], 50)
    with pytest.raises(CodecError):
        decode_state(data + b"\0\0\0\0", 50)
    with pytest.raises(CodecError, match="header"):
        decode_state(data[: HEADER - 1], 50)
    with pytest.raises(CodecError):
        decode_state(b"", 50)
    # a header that announces 49 values over the bytes of 50
    lying = bytearray(data)
    struct.pack_into(">Q", lying, 28, 49)
    with pytest.raises(CodecError):
        decode_state(bytes(lying), 50)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 49, 50, 99])  # first/last of global, of momentum
def test_decode_refuses_non_finite_values(bad: float, where: int) -> None:
    data = bytearray(_state().wire())
    struct.pack_into("<f", data, HEADER + 4 * where, bad)
    with pytest.raises(CodecError, match="non-finite"):
        decode_state(bytes(data), 50)


# --------------------------------------------------------------------------------------
# chunks
# --------------------------------------------------------------------------------------
def _chunks(s: FragmentState) -> list[StateChunk]:
    return list(chunks_of(s, sender="peer-a", run_id="run", fragment=2))


def test_chunks_reassemble_a_state_larger_than_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ss, "CHUNK_BYTES", 100)
    s = _state(n=50)
    chunks = _chunks(s)
    total = HEADER + 8 * 50
    assert len(chunks) == math.ceil(total / 100) == 5
    assert all(len(c.payload) <= 100 for c in chunks)
    assert [c.offset for c in chunks] == list(range(0, total, 100))
    assert {(c.version, c.digest, c.total, c.fragment, c.sender) for c in chunks} == {
        (3, s.digest(), total, 2, "peer-a")
    }
    asm = StateAssembler(50)
    for c in chunks[:-1]:
        assert asm.feed(c) is None
    out = asm.feed(chunks[-1])
    assert out is not None
    _same(out, s)


def test_chunks_survive_the_wire_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ss, "CHUNK_BYTES", 64)
    s = _state(n=20)
    asm = StateAssembler(20)
    out = None
    for c in _chunks(s):
        back = decode_message(encode_message(c))
        assert back == c
        assert out is None
        out = asm.feed(back)  # type: ignore[arg-type]
    assert out is not None
    _same(out, s)


def test_a_small_state_is_one_chunk() -> None:
    s = _state(n=5)
    (chunk,) = _chunks(s)
    assert chunk.offset == 0 and chunk.payload == s.wire()
    out = StateAssembler(5).feed(chunk)
    assert out is not None
    _same(out, s)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> tuple[FragmentState, list[StateChunk]]:
    monkeypatch.setattr(ss, "CHUNK_BYTES", 100)
    s = _state(n=50)
    return s, _chunks(s)


def test_assembler_refuses_out_of_order_chunks(small_chunks) -> None:
    _, chunks = small_chunks
    with pytest.raises(CodecError, match="order"):
        StateAssembler(50).feed(chunks[1])  # does not start at 0
    asm = StateAssembler(50)
    asm.feed(chunks[0])
    with pytest.raises(CodecError, match="order"):
        asm.feed(chunks[2])  # a gap
    asm = StateAssembler(50)
    asm.feed(chunks[0])
    asm.feed(chunks[1])
    with pytest.raises(CodecError, match="order"):
        asm.feed(chunks[1])  # a repeat


def test_assembler_refuses_an_overlong_or_empty_chunk(small_chunks) -> None:
    _, chunks = small_chunks
    asm = StateAssembler(50)
    for c in chunks[:-1]:
        asm.feed(c)
    last = chunks[-1]
    with pytest.raises(CodecError):
        asm.feed(dataclasses.replace(last, payload=last.payload + b"\0"))
    with pytest.raises(CodecError, match="empty"):
        StateAssembler(50).feed(dataclasses.replace(chunks[0], payload=b""))


@pytest.mark.parametrize(
    "change",
    [{"version": 4}, {"digest": "0" * ss.DIGEST_LEN}, {"total": HEADER + 8 * 50 + 8}],
    ids=["version", "digest", "total"],
)
def test_assembler_refuses_a_chunk_that_disagrees_with_the_first(small_chunks, change) -> None:
    _, chunks = small_chunks
    asm = StateAssembler(50)
    asm.feed(chunks[0])
    with pytest.raises(CodecError, match="disagree"):
        asm.feed(dataclasses.replace(chunks[1], **change))


@pytest.mark.parametrize("total", [1, HEADER + 8 * 49, HEADER + 8 * 50 + 1, 10**12])
def test_assembler_refuses_a_size_that_is_not_a_state_of_numel(small_chunks, total) -> None:
    _, chunks = small_chunks
    with pytest.raises(CodecError, match="expected"):
        StateAssembler(50).feed(dataclasses.replace(chunks[0], total=total))


def test_assembler_refuses_a_refusal() -> None:
    refusal = StateChunk("peer-a", "run", 2, 0, "", 0, 0, b"", "no such fragment")
    with pytest.raises(CodecError, match="no such fragment"):
        StateAssembler(50).feed(refusal)
    with pytest.raises(CodecError, match="cannot serve"):
        StateAssembler(50).feed(dataclasses.replace(refusal, reason=""))


def test_assembler_refuses_tampered_values(small_chunks) -> None:
    _, chunks = small_chunks
    last = chunks[-1]
    payload = bytearray(last.payload)
    payload[-2] ^= 0x01  # a momentum value changes, still finite
    asm = StateAssembler(50)
    for c in chunks[:-1]:
        asm.feed(c)
    with pytest.raises(CodecError, match="digest"):
        asm.feed(dataclasses.replace(last, payload=bytes(payload)))


def test_assembler_refuses_a_state_announced_with_another_digest_or_version() -> None:
    s = _state(n=5)
    other = _state(n=5, seed=1)
    (chunk,) = _chunks(s)
    with pytest.raises(CodecError, match="digest"):
        StateAssembler(5).feed(dataclasses.replace(chunk, digest=other.digest()))
    # the header says version 3; the chunk claims 4 with the digest of a version-4 state
    v4 = dataclasses.replace(s, version=4)
    with pytest.raises(CodecError):
        StateAssembler(5).feed(dataclasses.replace(chunk, version=4, digest=v4.digest()))


# --------------------------------------------------------------------------------------
# leading state and rebase
# --------------------------------------------------------------------------------------
def test_leading_state_is_none_without_holdings() -> None:
    assert leading_state([]) is None
    assert leading_state(iter(())) is None


def test_leading_state_prefers_the_highest_version() -> None:
    holdings = [("a", 5, "aa"), ("b", 5, "aa"), ("c", 5, "aa"), ("d", 6, "ff")]
    assert leading_state(holdings) == (6, "ff")


def test_leading_state_then_prefers_most_holders() -> None:
    holdings = [("a", 5, "00"), ("b", 5, "ff"), ("c", 5, "ff"), ("d", 4, "00")]
    assert leading_state(holdings) == (5, "ff")


def test_leading_state_then_prefers_the_smallest_digest() -> None:
    holdings = [("a", 5, "bb"), ("b", 5, "aa"), ("c", 5, "cc")]
    assert leading_state(holdings) == (5, "aa")


def test_leading_state_counts_each_peer_once() -> None:
    # "a" repeats its declaration; it must not outvote the two holders of "bb"
    holdings = [("a", 5, "cc")] * 5 + [("b", 5, "bb"), ("c", 5, "bb")]
    assert leading_state(holdings) == (5, "bb")
    # ...and with a single holder each, the smaller digest wins
    assert leading_state([("a", 5, "cc")] * 5 + [("b", 5, "bb")]) == (5, "bb")
    assert leading_state([("a", 5, "aa")] + [("b", 5, "bb")] * 5) == (5, "aa")


def test_should_rebase() -> None:
    others = [("a", 5, "aa"), ("b", 5, "aa")]
    assert should_rebase("me", (4, "zz"), others)  # behind
    assert not should_rebase("me", (6, "zz"), others)  # ahead: I lead
    assert not should_rebase("me", (5, "aa"), others)  # I hold the leading state
    assert should_rebase("me", (5, "bb"), others)  # outvoted at the same version
    assert not should_rebase("me", (3, "aa"), [])  # alone
    # one holder each at the same version: the smaller digest leads
    assert should_rebase("me", (5, "bb"), [("a", 5, "aa")])
    assert not should_rebase("me", (5, "aa"), [("a", 5, "bb")])
    # my own stale declaration among the holdings does not make me rebase onto myself
    assert not should_rebase("me", (5, "aa"), [("me", 5, "aa"), ("a", 4, "00")])


_HOLDING = st.tuples(
    st.sampled_from("abcdefgh"),
    st.integers(0, 3),
    st.sampled_from(["00", "0f", "a1", "ff"]),
)


@settings(max_examples=150, deadline=None)
@given(holdings=st.lists(_HOLDING, max_size=20), data=st.data())
def test_every_peer_agrees_on_the_leading_state(holdings, data) -> None:
    lead = leading_state(holdings)
    shuffled = data.draw(st.permutations(holdings))
    assert leading_state(shuffled) == lead
    assert leading_state(holdings + holdings) == lead  # repeats change nothing
    if not holdings:
        assert lead is None
        return
    assert lead is not None
    assert lead[0] == max(v for _, v, _ in holdings)
    assert lead in {(v, d) for _, v, d in holdings}
    # a peer that holds the leading state never rebases; any other peer of its view does
    for peer, version, digest in holdings:
        rest = [h for h in shuffled if h[0] != peer]
        if leading_state([*rest, (peer, version, digest)]) == lead:
            assert should_rebase(peer, (version, digest), rest) == ((version, digest) != lead)


# --------------------------------------------------------------------------------------
# the engine: export / import
# --------------------------------------------------------------------------------------
def _engine(init: list[np.ndarray], **kw) -> OuterEngine:
    cfg = EngineConfig(H=4, tau=1, alpha=0.5, codec="fp32", **kw)
    return OuterEngine(cfg, Schedule(cfg.H, len(init)), init)


def _advance(eng: OuterEngine, p: int, rounds: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = eng.global_params(p).size
    for _ in range(rounds):
        eng.add_tokens(10)
        req = eng.begin(p, eng.global_params(p) - rng.normal(size=n).astype(np.float32), 3)
        eng.deliver(p, rng.normal(size=n).astype(np.float32), req.round)


def test_export_import_makes_two_engines_step_alike() -> None:
    rng = np.random.default_rng(0)
    src = _engine([rng.normal(size=8).astype(np.float32), rng.normal(size=12).astype(np.float32)])
    _advance(src, 1, 3, seed=1)  # Nesterov momentum now non-zero
    dst = _engine([np.zeros(8, np.float32), np.zeros(12, np.float32)])
    assert dst.digest(1) != src.digest(1)
    before_other = dst.digest(0)

    state = src.export_fragment(1, step=42)
    assert state.step == 42 and state.version == 3 and state.optimizer_steps == 3
    assert np.any(state.momentum != 0)
    dst.import_fragment(1, decode_state(state.wire(), 12))

    assert dst.digest(1) == src.digest(1) == state.digest()
    assert dst.version(1) == src.version(1) == 3
    np.testing.assert_array_equal(dst.global_params(1), src.global_params(1))
    assert dst.digest(0) == before_other  # the other fragment is untouched

    # the same averaged Δ, delivered to both, gives bit-identical copies (momentum carried)
    avg = rng.normal(size=12).astype(np.float32)
    local = rng.normal(size=12).astype(np.float32)
    for eng in (src, dst):
        req = eng.begin(1, local, 7)
        assert req.round == 3
        eng.deliver(1, avg, req.round)
    np.testing.assert_array_equal(dst.global_params(1), src.global_params(1))
    assert dst.digest(1) == src.digest(1)


def test_exported_state_is_a_copy() -> None:
    eng = _engine([np.ones(6, np.float32)])
    _advance(eng, 0, 1, seed=2)
    state = eng.export_fragment(0)
    d = state.digest()
    _advance(eng, 0, 1, seed=3)
    assert state.digest() == d and eng.digest(0) != d
    state.global_params[:] = 123.0
    state.momentum[:] = 5.0
    assert eng.export_fragment(0).global_params[0] != 123.0
    # and the imported copy does not alias the state it came from
    other = _engine([np.zeros(6, np.float32)])
    src = eng.export_fragment(0)
    other.import_fragment(0, src)
    want = other.digest(0)
    src.global_params[:] = 0.0
    src.momentum[:] = 0.0
    assert other.digest(0) == want


def test_import_skips_a_pending_sync() -> None:
    src = _engine([np.ones(5, np.float32)])
    _advance(src, 0, 2, seed=4)
    dst = _engine([np.zeros(5, np.float32)])
    dst.add_tokens(3)
    req = dst.begin(0, np.ones(5, np.float32), 3)
    skipped = dst.stats(0).skipped
    dst.import_fragment(0, src.export_fragment(0))
    assert dst.pending(0) is None
    assert dst.stats(0).skipped == skipped + 1
    assert dst.stats(0).last_skip_reason == "rebased"
    with pytest.raises(RoundAborted):
        dst.deliver(0, np.zeros(5, np.float32), req.round)
    assert dst.digest(0) == src.digest(0)
    # importing with nothing in flight skips nothing
    dst.import_fragment(0, src.export_fragment(0))
    assert dst.stats(0).skipped == skipped + 1


def test_import_refuses_a_state_of_the_wrong_size() -> None:
    eng = _engine([np.ones(5, np.float32)])
    _advance(eng, 0, 1, seed=5)
    eng.begin(0, np.zeros(5, np.float32), 3)
    digest, version, stats = eng.digest(0), eng.version(0), dataclasses.replace(eng.stats(0))
    for n in (4, 6):
        with pytest.raises(ConfigError):
            eng.import_fragment(0, _state(n=n))
    assert eng.digest(0) == digest and eng.version(0) == version
    assert eng.pending(0) is not None and eng.stats(0) == stats


def test_import_clears_the_error_feedback_residual() -> None:
    rng = np.random.default_rng(6)
    init = [rng.normal(size=64).astype(np.float32)]
    cfg = EngineConfig(H=4, tau=1, alpha=0.5, codec="int8", error_feedback=True)
    sched = Schedule(4, 1)
    a = OuterEngine(cfg, sched, init, seed=0)
    b = OuterEngine(cfg, sched, init, seed=0)
    # a builds up a residual (int8 loses something); b never sends anything
    a.add_tokens(5)
    req = a.begin(0, init[0] - rng.normal(size=64).astype(np.float32), 3)
    a.deliver(0, rng.normal(size=64).astype(np.float32), req.round)
    assert np.any(a._frags[0].residual != 0)  # precondition: there is a residual to clear
    state = a.export_fragment(0)
    a.import_fragment(0, state)
    b.import_fragment(0, state)
    # with the residual cleared, the next Δ is encoded exactly as by a peer that had none
    local = state.global_params - rng.normal(size=64).astype(np.float32)
    pa = a.begin(0, local, 7).payload
    pb = b.begin(0, local, 7).payload
    assert pa == pb

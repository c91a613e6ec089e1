"""The per-fragment outer engine: begin / deliver / skip / merge, with no network."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atoll.protocol.codecs import make_codec
from atoll.protocol.engine import EngineConfig, OuterEngine, average_requests
from atoll.protocol.errors import ConfigError, RoundAborted
from atoll.protocol.schedule import Schedule

# outer step = plain averaging
PLAIN: dict[str, Any] = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}


def _engines(n: int, cfg: EngineConfig, init: list[np.ndarray]) -> list[OuterEngine]:
    sched = Schedule(cfg.H, len(init))
    return [OuterEngine(cfg, sched, init, seed=i) for i in range(n)]


def test_plain_outer_step_is_token_weighted_average_of_locals() -> None:
    cfg = EngineConfig(H=4, tau=0, alpha=0.0, **PLAIN, codec="fp32")
    init = [np.zeros(10, np.float32)]
    engs = _engines(3, cfg, init)
    rng = np.random.default_rng(0)
    locals_ = [rng.normal(size=10).astype(np.float32) for _ in engs]
    tokens = [100, 200, 700]
    reqs = []
    for eng, loc, tok in zip(engs, locals_, tokens, strict=True):
        eng.add_tokens(tok)
        reqs.append(eng.begin(0, loc, step=3))
    avg, sent = average_requests(reqs, engs[0].codec)
    expected = np.average(np.stack(locals_), axis=0, weights=tokens)
    for eng in engs:
        new = eng.deliver(0, avg, reqs[0].round)
        np.testing.assert_allclose(new, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(eng.merge(0, locals_[0]), new)  # alpha 0: local = global
        assert eng.version(0) == 1 and eng.pending(0) is None
    assert sent == -(-2 * 2 * 40 // 3)  # 2·(M−1)/M of 40 bytes, rounded up


def test_nesterov_outer_step_moves_along_the_pseudo_gradient() -> None:
    cfg = EngineConfig(H=2, tau=0, alpha=0.0, codec="fp32")
    (eng,) = _engines(1, cfg, [np.ones(4, np.float32)])
    eng.add_tokens(10)
    req = eng.begin(0, np.full(4, 0.9, np.float32), 1)
    new = eng.deliver(0, np.full(4, 0.1, np.float32), req.round)
    # first Nesterov step: update = g + mu*g = 1.9 g; lr 0.7
    np.testing.assert_allclose(new, 1 - 0.7 * 1.9 * 0.1, rtol=1e-6)


def test_skip_applies_nothing_and_keeps_the_work() -> None:
    cfg = EngineConfig(H=5, tau=1, alpha=0.5, **PLAIN, codec="fp32")
    (eng,) = _engines(1, cfg, [np.zeros(3, np.float32)])
    eng.add_tokens(5)
    r1 = eng.begin(0, np.ones(3, np.float32), 4)
    eng.skip(0, "no group")
    assert eng.stats(0).skipped == 1 and eng.stats(0).applied == 0
    np.testing.assert_array_equal(eng.global_params(0), 0)
    assert eng.version(0) == 0
    with pytest.raises(RoundAborted):
        eng.deliver(0, np.ones(3, np.float32), r1.round)  # nothing pending any more
    eng.add_tokens(5)
    r2 = eng.begin(0, np.full(3, 2.0, np.float32), 9)
    assert r2.round == 0 and r2.weight == 10  # weight covers the skipped round's tokens too
    np.testing.assert_array_equal(make_codec("fp32").decode(r2.payload, 3), -2.0)


def test_wrong_round_and_double_begin_are_refused() -> None:
    cfg = EngineConfig(H=5, tau=1, codec="fp32")
    (eng,) = _engines(1, cfg, [np.zeros(3, np.float32)])
    eng.begin(0, np.ones(3, np.float32), 4)
    with pytest.raises(ConfigError, match="in flight"):
        eng.begin(0, np.ones(3, np.float32), 5)
    with pytest.raises(RoundAborted):
        eng.deliver(0, np.ones(3, np.float32), round=7)
    with pytest.raises(RoundAborted, match="non-finite"):
        eng.deliver(0, np.array([1, np.nan, 1], np.float32), round=0)
    assert eng.pending(0) is not None  # a refused result leaves the round open for skip()


def test_merge_alpha() -> None:
    cfg = EngineConfig(H=5, tau=1, alpha=0.25, **PLAIN, codec="fp32")
    (eng,) = _engines(1, cfg, [np.zeros(2, np.float32)])
    req = eng.begin(0, np.full(2, 4.0, np.float32), 4)
    eng.deliver(0, np.full(2, -4.0, np.float32), req.round)  # global becomes 4
    np.testing.assert_allclose(eng.merge(0, np.full(2, 8.0, np.float32)), 0.25 * 8 + 0.75 * 4)


def test_error_feedback_carries_what_quantization_lost() -> None:
    rng = np.random.default_rng(1)
    target = rng.normal(size=512).astype(np.float32) * 1e-3
    results = {}
    for ef in (False, True):
        cfg = EngineConfig(H=2, tau=0, alpha=0.0, **PLAIN, codec="e3m0", error_feedback=ef)
        (eng,) = _engines(1, cfg, [np.zeros(512, np.float32)])
        applied = np.zeros(512, np.float32)
        for _ in range(20):  # the same true pseudo-gradient every round
            eng.add_tokens(1)
            glob = eng.global_params(0).copy()
            req = eng.begin(0, glob - target, 1)
            avg, _ = average_requests([req], eng.codec)
            eng.deliver(0, avg, req.round)
            applied += avg
        results[ef] = float(np.abs(applied - 20 * target).max())
    assert results[True] < results[False] / 4


def test_rda_restores_the_mean_norm() -> None:
    cfg = EngineConfig(H=2, tau=0, alpha=0.0, **PLAIN, codec="fp32", aggregation="rda")
    d = np.array([3.0, 4.0], np.float32)  # norm 5
    engs = _engines(2, cfg, [np.zeros(2, np.float32)])
    reqs = []
    for eng, scale in zip(engs, (1.0, 3.0), strict=True):
        eng.add_tokens(1)
        reqs.append(eng.begin(0, -scale * d, 1))
    avg, _ = average_requests(reqs, engs[0].codec, "rda")
    np.testing.assert_allclose(avg, 2.0 * d, rtol=1e-6)  # mean norm 10, same direction


def test_group_members_must_agree() -> None:
    cfg = EngineConfig(H=4, tau=0, codec="fp32")
    a, b = _engines(2, cfg, [np.zeros(3, np.float32)])
    ra = a.begin(0, np.ones(3, np.float32), 3)
    b.begin(0, np.ones(3, np.float32), 3)
    b.deliver(0, np.zeros(3, np.float32), 0)
    rb = b.begin(0, np.ones(3, np.float32), 7)  # b is a version ahead
    with pytest.raises(RoundAborted, match="disagree"):
        average_requests([ra, rb], a.codec)


def test_engine_config_validation() -> None:
    with pytest.raises(ConfigError):
        EngineConfig(H=10, tau=10)
    with pytest.raises(ConfigError):
        EngineConfig(alpha=1.5)
    with pytest.raises(ConfigError):
        EngineConfig(codec="fp7")
    with pytest.raises(ConfigError):
        EngineConfig(aggregation="median")


def test_state_dict_round_trip_resumes_identically() -> None:
    cfg = EngineConfig(H=3, tau=0, alpha=0.0, codec="e3m0", error_feedback=True)
    init = [np.zeros(300, np.float32), np.ones(40, np.float32)]
    a, b = _engines(2, cfg, init)
    rng = np.random.default_rng(5)
    for p in (0, 1):
        a.add_tokens(7)
        req = a.begin(p, rng.normal(size=init[p].size).astype(np.float32), 2)
        avg, _ = average_requests([req], a.codec)
        a.deliver(p, avg, req.round)
    b.load_state_dict(a.state_dict())
    local = rng.normal(size=300).astype(np.float32)
    for eng in (a, b):
        eng.add_tokens(3)
    ra, rb = a.begin(0, local, 5), b.begin(0, local, 5)
    assert ra.payload == rb.payload and ra.weight == rb.weight and ra.round == rb.round == 1
    avg, _ = average_requests([ra], a.codec)
    np.testing.assert_array_equal(a.deliver(0, avg, 1), b.deliver(0, avg, 1))


def test_load_state_dict_refuses_a_misfit_and_changes_nothing() -> None:
    cfg = EngineConfig(H=3, tau=0, codec="fp32")
    (a,) = _engines(1, cfg, [np.zeros(5, np.float32)])
    (b,) = _engines(1, cfg, [np.zeros(6, np.float32)])
    with pytest.raises(ConfigError, match="wrong shape"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="malformed"):
        b.load_state_dict({"fragments": []})
    state = a.state_dict()
    state["fragments"][0]["global"] = np.full(5, np.nan, np.float32)
    with pytest.raises(ConfigError, match="non-finite"):
        a.load_state_dict(state)
    np.testing.assert_array_equal(a.global_params(0), 0)

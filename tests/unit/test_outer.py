"""Tests of the outer optimizer against torch.optim.SGD and the DiLoCo identities."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
import torch

from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import OuterLoop
from atoll.protocol.outer import OuterSGD


def torch_reference(
    init: np.ndarray, grads: list[np.ndarray], lr: float, momentum: float, nesterov: bool
) -> np.ndarray:
    p = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, nesterov=nesterov)
    for g in grads:
        p.grad = torch.from_numpy(g.astype(np.float32))
        opt.step()
    return p.detach().numpy().copy()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (0.3, 0.5)])
def test_matches_torch_sgd(lr: float, momentum: float, nesterov: bool) -> None:
    rng = np.random.default_rng(0)
    n = 1000
    init = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * 0.1 for _ in range(6)]
    params = init.copy()
    opt = OuterSGD(n, OuterLoop(outer_lr=lr, outer_momentum=momentum, nesterov=nesterov))
    for g in grads:
        opt.step(params, g)
    assert opt.steps == 6
    expected = torch_reference(init, grads, lr, momentum, nesterov)
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-6)
    assert params.dtype == np.float32


def test_default_config_is_diloco() -> None:
    cfg = OuterSGD(3).config
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.nesterov) == (0.7, 0.9, True)


def test_lr1_momentum0_is_plain_average() -> None:
    rng = np.random.default_rng(1)
    n, m = 257, 4
    global_ = rng.standard_normal(n).astype(np.float32)
    locals_ = [global_ + rng.standard_normal(n).astype(np.float32) for _ in range(m)]
    delta = np.mean([global_ - loc for loc in locals_], axis=0)  # float64 mean: cast
    opt = OuterSGD(n, OuterLoop(outer_lr=1.0, outer_momentum=0.0))
    params = global_.copy()
    opt.step(params, delta)
    np.testing.assert_allclose(params, np.mean(locals_, axis=0), rtol=1e-6, atol=1e-6)
    # With no momentum, every later step is again a plain average.
    locals2 = [params + rng.standard_normal(n).astype(np.float32) for _ in range(m)]
    delta2 = np.mean([params - loc for loc in locals2], axis=0)
    opt.step(params, delta2)
    np.testing.assert_allclose(params, np.mean(locals2, axis=0), rtol=1e-6, atol=1e-6)


def test_state_dict_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(2)
    n = 64
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(6)]
    a_params = rng.standard_normal(n).astype(np.float32)
    a = OuterSGD(n)
    for g in grads[:3]:
        a.step(a_params, g)
    state = a.state_dict()
    b = OuterSGD(n)
    b.load_state_dict(state)
    b_params = a_params.copy()
    assert b.steps == 3
    for g in grads[3:]:
        a.step(a_params, g)
        b.step(b_params, g)
    np.testing.assert_array_equal(a_params, b_params)
    # The state is a copy: later steps did not change it.
    assert state["steps"] == 3


def test_fresh_state_then_load_first_step_behaviour() -> None:
    a = OuterSGD(4)
    b = OuterSGD(4)
    b.load_state_dict(a.state_dict())
    pa = np.ones(4, np.float32)
    pb = pa.copy()
    g = np.arange(4, dtype=np.float32)
    a.step(pa, g)
    b.step(pb, g)
    np.testing.assert_array_equal(pa, pb)


def test_load_state_dict_rejects_mismatch() -> None:
    opt = OuterSGD(8)
    good = opt.state_dict()
    bad_states: list[dict[str, object]] = [
        {**good, "numel": 9},
        {**good, "momentum_buffer": np.zeros(9, np.float32)},
        {**good, "momentum_buffer": np.zeros(8, np.float64)},
        {**good, "momentum_buffer": [0.0] * 8},
        {**good, "steps": -1},
        {**good, "steps": 1.5},
        {k: v for k, v in good.items() if k != "steps"},
        {**good, "extra": 1},
    ]
    for state in bad_states:
        with pytest.raises(ConfigError):
            opt.load_state_dict(state)
    assert opt.steps == 0


def test_step_rejects_mismatch() -> None:
    opt = OuterSGD(4)
    p = np.zeros(4, np.float32)
    g = np.zeros(4, np.float32)
    with pytest.raises(ConfigError):
        opt.step(cast(Any, np.zeros(4, np.float64)), g)
    with pytest.raises(ConfigError):
        opt.step(np.zeros(5, np.float32), g)
    with pytest.raises(ConfigError):
        opt.step(np.zeros((2, 2), np.float32), g)
    with pytest.raises(ConfigError):
        opt.step(p, np.zeros(5, np.float32))
    with pytest.raises(ConfigError):
        opt.step(p, np.zeros(4, np.int32))
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ConfigError):
        opt.step(ro, g)
    assert opt.steps == 0
    opt.step(p, np.ones(4, np.float64))  # float64 grad is cast
    np.testing.assert_allclose(p, -0.7 * (1 + 0.9) * np.ones(4), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"outer_lr": 0.0},
        {"outer_lr": -1.0},
        {"outer_lr": float("nan")},
        {"outer_lr": float("inf")},
        {"outer_momentum": 1.0},
        {"outer_momentum": -0.1},
        {"nesterov": 1},
    ],
)
def test_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        OuterLoop(**kwargs)


def test_numel_validation() -> None:
    with pytest.raises(ConfigError):
        OuterSGD(0)
    with pytest.raises(ConfigError):
        OuterSGD(4, config=cast(Any, "fast"))
